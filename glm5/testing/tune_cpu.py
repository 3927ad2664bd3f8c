"""`glm5 tune --backend cpu`: where `quant_linear`'s paths cross over on this CPU.

The cpu backend serves a quantized linear by a GEMV for few rows and a GEMM for many (per CPU
tier: `glm5.kernels.tvm.quant.PATHS`); the row counts where one overtakes the other were
measured on one AVX-512 VNNI host (AMD Zen 5, two threads) and one AVX2 host, and they move
with the core, its caches and the thread count. This search times both paths side by side on
this CPU, with this process's thread count, at a ladder of row counts (`LADDER`; the portable
tier's GEMV and sgemm cross near 384 rows: `PORTABLE_LADDER`), per scheme and x dtype, after
checking each path against the float64 oracle; the crossover is the last rung where the GEMV
is not slower (3% counts as a tie) with the GEMM faster at every rung above it. The result goes to the tuning cache
(`glm5.backends.tuning_cache`, backend ``cpu``, key: CPU model, tier and thread count), which
the cpu backend applies when it starts (`glm5.kernels.tvm.quant.use_crossovers`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PORTABLE_LADDER = (64, 128, 192, 256, 384, 512, 768)
DTYPES = (torch.float32, torch.bfloat16)
OP = "quant_linear"
ROUNDS = 3  # sweeps of the ladder, apart in time: a burst of load spoils one sweep's rung
TIE = 0.03  # within 3% the paths are tied (run-to-run noise here): the GEMV keeps the rung


def crossover(times: dict[int, dict[str, float]], small: str, large: str,
              margin: float = TIE) -> int:
    """The last rung M where ``small`` is not slower than ``large`` by more than ``margin``
    (a tie within the noise keeps the GEMV) with ``large`` faster at every rung above it (0:
    ``large`` wins from the first rung; the top rung: ``small`` never lost)."""
    rungs = sorted(times)
    c = 0
    for m in reversed(rungs):
        if times[m][small] <= times[m][large] * (1 + margin):
            c = m
            break
    return c


def best_of(fn: Callable[[], Any], reps: int) -> float:
    """The fastest call (seconds) over at least ``reps`` calls and 20 ms each way
    (`glm5.testing.measure.best_time`: a descheduled call spoils itself only)."""
    from glm5.testing.measure import best_time

    return best_time(fn, repeat=reps, min_time=0.02)


def measure(context: Callable[[], Any], scheme: str, dtype: torch.dtype, small: str,
            large: str, ladder: tuple[int, ...], K: int, N: int, reps: int, deadline: float,
            clock: Callable[[Callable[[], Any], int], float] = best_of, rounds: int = ROUNDS
            ) -> dict[str, Any]:
    """Both paths at each rung of ``ladder`` (alternating which runs first), ``rounds`` sweeps
    of the ladder apart in time, each path's best kept, after judging each path against the
    oracle at the first rung: {"times": {M: {path: s}}, "error"?}."""
    from glm5.ir.quant_formats import quantize_weight
    from glm5.kernels.tvm.quant import _run
    from glm5.testing.compare import judge

    g = torch.Generator().manual_seed(0)
    wp, ws = quantize_weight(torch.randn(N, K, generator=g) * K ** -0.5, scheme)
    xs = {m: torch.randn(m, K, generator=g).to(dtype) for m in ladder}
    x = xs[ladder[0]]
    for p in (small, large):
        y = _run(p, context, x, wp, ws, scheme).to(dtype)
        v = judge(OP, y, {"x": x, "w_packed": wp, "w_scale": ws, "scheme": scheme, "bias": None})
        if not v.ok:
            return {"times": {}, "error": f"{p}: verdict: {v.message[:200]}"}
    times: dict[int, dict[str, float]] = {}
    for r in range(rounds):
        for i, m in enumerate(ladder):
            if time.monotonic() > deadline:
                return {"times": times, "error": "time budget"}
            for p in ((small, large) if (i + r) % 2 == 0 else (large, small)):
                t = clock(lambda p=p, x=xs[m]: _run(p, context, x, wp, ws, scheme), reps)
                times.setdefault(m, {})[p] = min(t, times.get(m, {}).get(p, float("inf")))
    return {"times": times}


def run(context: Callable[[], Any], *, budget_s: float = 600.0, K: int = 4096, N: int = 4096,
        reps: int = 3, ladder: tuple[int, ...] | None = None, write_cache: bool = True,
        clock: Callable[[Callable[[], Any], int], float] = best_of,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every (scheme, x dtype) whose paths differ on this CPU's tier; returns the
    report and writes the crossovers to the tuning cache."""
    from glm5.backends import tuning_cache as tc
    from glm5.ir.quant_formats import SCHEMES
    from glm5.kernels.tvm.quant import cpu_tier, crossover_key, pair
    from glm5.testing.tune import save, utc_now

    tier = cpu_tier()
    key, name = tc.cpu_key(tier, torch.get_num_threads())
    rungs = ladder or (PORTABLE_LADDER if tier == "portable" else LADDER)
    deadline = time.monotonic() + budget_s
    results, keep = [], {}
    for scheme in SCHEMES:
        for dt in DTYPES:
            pr = pair(scheme, tier, dt)
            if pr is None:
                continue
            small, large, documented = pr
            m = measure(context, scheme, dt, small, large, rungs, K, N, reps, deadline, clock)
            r = {"scheme": scheme, "dtype": str(dt).removeprefix("torch."), "small": small,
                 "large": large, "table": documented, **m}
            if "error" not in m:
                r["crossover"] = crossover(m["times"], small, large)
                keep[crossover_key(tier, scheme, dt)] = r["crossover"]
            results.append(r)
            say(_line(r))
    report = {"backend": "cpu", "device": name, "device_key": key, "tier": tier,
              "threads": torch.get_num_threads(), "K": K, "N": N, "ladder": list(rungs),
              "results": results, "kept": {OP: keep} if keep else {}, "cache": None}
    meta = lambda: {  # noqa: E731
        "backend": "cpu", "device": name, "device_key": key, "kernels": tc.kernels_hash("tvm"),
        "torch": torch.__version__, "date": utc_now(),
        "results": {OP: {"K": K, "N": N, "ladder": list(rungs),
                         "measured": [{k: v for k, v in r.items() if k != "times"}
                                      for r in results]}}}
    report["cache"] = save(tc.path_for("cpu", key), report["kept"], meta, write_cache, say)
    return report


def _line(r: dict[str, Any]) -> str:
    head = f"{r['scheme']:6} {r['dtype']:9} {r['small']} -> {r['large']}"
    if "error" in r:
        return f"{head}: {r['error']}"
    t = r["times"]
    ms = " ".join(f"{m}:{1e3 * t[m][r['small']]:.2f}/{1e3 * t[m][r['large']]:.2f}" for m in t)
    return (f"{head}: up to {r['crossover']} rows (table: {r['table']}); ms GEMV/GEMM by "
            f"rows {ms}")
