"""`glm5 tune --backend cpu`: where `quant_linear`'s paths cross over on this CPU.

The cpu backend serves a quantized linear by a GEMV for few rows and a GEMM for many, and on
some tiers a third path for more rows still (w8a16 on bf16 x on the VNNI tier: the VNNI GEMM,
then oneDNN): `glm5.kernels.tvm.quant.PATHS`, its `chain` of paths per scheme and x dtype. The
row counts where one overtakes the next were measured on one AVX-512 VNNI host (AMD Zen 5,
two threads) and one AVX2 host, and they move with the core, its caches and the thread count.
This search times every path of a chain side by side on this CPU, with this process's thread
count, at a ladder of row counts (`LADDER`, extended to twice the chain's last table switch
by `EXTRA`; the portable tier's GEMV and sgemm cross near 384 rows: `PORTABLE_LADDER`), per
scheme and x dtype, after checking each path against the float64 oracle. The switches are
those under which the ladder's rungs cost least in all, each rung its path's time over the
fastest's (3% counts as a tie, kept by the lower paths; `switches`). The result goes to the
tuning cache (`glm5.backends.tuning_cache`, backend ``cpu``, key: CPU model, tier and thread
count), which the cpu backend applies when it starts (`glm5.kernels.tvm.quant.use_crossovers`).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable

import torch

from glm5.backends import tuning_cache as tc
from glm5.ir.quant_formats import SCHEMES, quantize_weight
from glm5.kernels.tvm import quant
from glm5.perf import measure as perf_measure
from glm5.perf.tune import save, utc_now
from glm5.testing.compare import judge

LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
EXTRA = (192, 256, 384, 512)  # rungs for a chain whose last table switch is near LADDER's top
PORTABLE_LADDER = (64, 128, 192, 256, 384, 512, 768)
DTYPES = (torch.float32, torch.bfloat16)
OP = "quant_linear"
ROUNDS = 3  # sweeps of the ladder, apart in time: a burst of load spoils one sweep's rung
TIE = 0.03  # within 3% the paths are tied (run-to-run noise here): the lower paths keep the rung


def switches(times: dict[int, dict[str, float]], paths: list[str], margin: float = TIE
             ) -> list[int]:
    """One row count per switch of ``paths`` (the chain, smallest-M path first; path i takes
    the rows above switch i - 1 up to switch i): the non-decreasing switches, each 0 or a
    rung, under which the measured rungs cost least in all, a rung costing its path's time
    over the fastest path's (1 within ``margin``: a tie). Among equal costs the larger
    switches win (the lower paths keep a tie). Two paths: the GEMV keeps the rungs up to the
    switch; a middle path whose rungs another path serves as well gets none."""
    rungs = sorted(times)

    def cost(sw: tuple[int, ...]) -> float:
        total = 0.0
        for m in rungs:
            p = paths[next((i for i, s in enumerate(sw) if m <= s), len(sw))]
            total += max(1.0, times[m][p] / (min(times[m][q] for q in paths) * (1 + margin)))
        return total

    best = min(itertools.combinations_with_replacement([0, *rungs], len(paths) - 1),
               key=lambda sw: (round(cost(sw), 9), [-s for s in sw]))
    return list(best)


def rungs_for(ch: tuple[tuple[str, int | None], ...], ladder: tuple[int, ...]
              ) -> tuple[int, ...]:
    """``ladder`` and the `EXTRA` rungs up to twice the chain's last table switch."""
    last = max(b for _, b in ch if b is not None)
    return tuple(sorted({*ladder, *(r for r in EXTRA if r <= 2 * last)}))


def best_of(fn: Callable[[], Any], reps: int) -> float:
    """The fastest call (seconds) over at least ``reps`` calls and 20 ms each way
    (`glm5.perf.measure.best_time`: a descheduled call spoils itself only)."""
    return perf_measure.best_time(fn, repeat=reps, min_time=0.02)


def measure(context: Callable[[], Any], scheme: str, dtype: torch.dtype, paths: list[str],
            ladder: tuple[int, ...], K: int, N: int, reps: int, deadline: float,
            clock: Callable[[Callable[[], Any], int], float] = best_of, rounds: int = ROUNDS
            ) -> dict[str, Any]:
    """Every path of ``paths`` at each rung of ``ladder`` (the order rotating from rung to rung
    and round to round), ``rounds`` sweeps of the ladder apart in time, each path's best kept,
    after judging each path against the oracle at the first rung: {"times": {M: {path: s}},
    "error"?}."""
    g = torch.Generator().manual_seed(0)
    wp, ws = quantize_weight(torch.randn(N, K, generator=g) * K ** -0.5, scheme)
    xs = {m: torch.randn(m, K, generator=g).to(dtype) for m in ladder}
    x = xs[ladder[0]]
    for p in paths:
        y = quant.run_path(p, context, x, wp, ws, scheme).to(dtype)
        v = judge(OP, y, {"x": x, "w_packed": wp, "w_scale": ws, "scheme": scheme, "bias": None})
        if not v.ok:
            return {"times": {}, "error": f"{p}: verdict: {v.message[:200]}"}
    times: dict[int, dict[str, float]] = {}
    for r in range(rounds):
        for i, m in enumerate(ladder):
            if time.monotonic() > deadline:
                return {"times": times, "error": "time budget"}
            k = (i + r) % len(paths)
            for p in paths[k:] + paths[:k]:
                t = clock(lambda p=p, x=xs[m]: quant.run_path(p, context, x, wp, ws, scheme),
                          reps)
                times.setdefault(m, {})[p] = min(t, times.get(m, {}).get(p, float("inf")))
    return {"times": times}


def run(context: Callable[[], Any], *, budget_s: float = 600.0, K: int = 4096, N: int = 4096,
        reps: int = 3, ladder: tuple[int, ...] | None = None, write_cache: bool = True,
        clock: Callable[[Callable[[], Any], int], float] = best_of,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every (scheme, x dtype) whose paths differ on this CPU's tier; returns the
    report and writes the crossovers to the tuning cache."""
    tier = quant.cpu_tier()
    key, name = tc.cpu_key(tier, torch.get_num_threads())
    rungs = ladder or (PORTABLE_LADDER if tier == "portable" else LADDER)
    deadline = time.monotonic() + budget_s
    results, keep = [], {}
    for scheme in SCHEMES:
        for dt in DTYPES:
            ch = quant.chain(scheme, tier, dt)
            if len(ch) < 2:
                continue
            paths = [p for p, _ in ch]
            table = [b for _, b in ch[:-1]]
            lad = rungs if ladder else rungs_for(ch, rungs)
            m = measure(context, scheme, dt, paths, lad, K, N, reps, deadline, clock)
            r = {"scheme": scheme, "dtype": str(dt).removeprefix("torch."), "paths": paths,
                 "table": table, **m}
            if "error" not in m:
                r["switches"] = switches(m["times"], paths)
                keep[quant.crossover_key(tier, scheme, dt)] = (
                    r["switches"][0] if len(r["switches"]) == 1 else r["switches"])
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
    head = f"{r['scheme']:6} {r['dtype']:9} {' -> '.join(r['paths'])}"
    if "error" in r:
        return f"{head}: {r['error']}"
    t = r["times"]
    ms = " ".join(f"{m}:" + "/".join(f"{1e3 * t[m][p]:.2f}" for p in r["paths"]) for m in t)
    sw = ", ".join(map(str, r["switches"]))
    tb = ", ".join(map(str, r["table"]))
    return (f"{head}: switches at {sw} rows (table: {tb}); ms {'/'.join(r['paths'])} by rows "
            f"{ms}")
