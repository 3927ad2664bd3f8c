#!/usr/bin/env python
"""Tile search for the cuda backend's tuning table on one GPU (issue 16): for each op below, a
coordinate descent over its launch parameters (every power-of-two ``BLOCK_*`` tile of the op's
entry as half / same / double, ``num_warps`` 4 / 8, ``num_stages`` 1-4, the split targets
``TARGET_PROGRAMS`` / ``GEMV_TARGET_PROGRAMS`` / ``SPLIT_MIN_KEYS`` as half / same / double, and
boolean path switches both ways, e.g. sparse_attention's ``RESIDENT_Q``), each candidate first
judged by the conformance kit's float64 verdict (glm5.testing.compare.judge) at a small shape of
the same regime, then timed at the GLM-5 shape of bench/gpu_suite.py. Regime-prefixed keys
(``MHA_BLOCK_N``, ``decode_num_warps``) are searched like the plain ones. A candidate that fails to
compile (e.g. out of shared memory), or fails the verdict, is recorded and skipped.

Prints one table per op (default vs best, ms and the parameters) and writes JSON to --out; with
--write PATH the best entries are merged into that tuning table (e.g.
glm5/backends/cuda/tuning.json) -- only entries that beat the defaults by more than --min-gain.

    python bench/gpu_tune.py [--ops sparse_attention,attention] [--budget-s 240]
                             [--write glm5/backends/cuda/tuning.json]

Without a CUDA device it says so and exits 0; ``--device cpu`` runs the search on tiny shapes
through the Triton interpreter (TRITON_INTERPRET=1) as a smoke test of the procedure only (CPU
times say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

import gpu_suite as gs  # noqa: E402

BF = torch.bfloat16

# op -> (timing shape label, timing builder, check builder): builders from bench/gpu_suite.py;
# the check shape keeps the timing shape's regime (head counts, head dims, decode vs prefill)
# at a size the float64 oracle handles quickly.
SPECS: dict[str, list[tuple[str, Callable[[], Callable], Callable[[], Callable]]]] = {
    "sparse_attention": [
        ("prefill T=4096 S=8192 K=2048 H=64 576/512",
         lambda: gs.b_sparse(4096, 8192, 2048, 64, 1, 576, 512),
         lambda: gs.b_sparse(8, 512, 256, 64, 1, 576, 512)),
        ("decode T=64 S=8192 K=2048 H=64 576/512",
         lambda: gs.b_sparse(64, 8192, 2048, 64, 1, 576, 512),
         lambda: gs.b_sparse(2, 512, 256, 64, 1, 576, 512))],
    "attention": [
        ("prefill T=S=4096 H=64 256/256", lambda: gs.b_attention(4096, 4096, 64, 64, 256, 256),
         lambda: gs.b_attention(256, 256, 4, 4, 256, 256))],
    "lightning_indexer": [
        ("T=S=8192 Hi=32 Di=128", lambda: gs.b_indexer(8192, 8192, 32, 128),
         lambda: gs.b_indexer(128, 512, 32, 128))],
    "indexer_topk": [
        ("T=S=8192 Hi=32 Di=128 top-2048", lambda: gs.b_indexer(8192, 8192, 32, 128, 2048),
         lambda: gs.b_indexer(64, 4096, 32, 128, 2048))],
    "moe_experts": [
        ("T=2048 k=8 E=64 D=6144 I=2048", lambda: gs.b_moe(2048, 8, 64, 6144, 2048),
         lambda: gs.b_moe(64, 8, 16, 512, 256))],
    "quant_linear": [
        (f"{s} M={m} K=N=6144", (lambda s=s, m=m: gs.b_quant_linear(m, 6144, 6144, s)),
         (lambda s=s, m=m: gs.b_quant_linear(m, 512, 384, s)))
        for s in ("w4a8", "w8a8", "w8a16", "w6a12") for m in (1, 512)],
}

# The same searches at sizes the interpreter runs in seconds (--device cpu).
TINY: dict[str, list[tuple[str, Callable[[], Callable], Callable[[], Callable]]]] = {
    "sparse_attention": [("tiny", lambda: gs.b_sparse(2, 64, 16, 4, 1, 32, 16),
                          lambda: gs.b_sparse(2, 64, 16, 4, 1, 32, 16))],
    "rms_norm": [("tiny", lambda: gs.b_norm(4, 64), lambda: gs.b_norm(4, 64))],
}

WARPS = (4, 8)
STAGES = (1, 2, 3, 4)
# How far decode work is split across programs (sparse_attention's keys, token_logprobs'
# vocabulary, the quant GEMV's K): halved and doubled like a tile.
SPLIT_KEYS = ("TARGET_PROGRAMS", "GEMV_TARGET_PROGRAMS", "SPLIT_MIN_KEYS")


def candidates(key: str, value: Any) -> list[Any]:
    """The values the search tries for one launch parameter (its current value first)."""
    if key.endswith("num_warps"):  # also regime-prefixed: MHA_num_warps, decode_num_warps
        return [value] + [w for w in WARPS if w != value]
    if key.endswith("num_stages"):
        return [value] + [s for s in STAGES if s != value]
    if isinstance(value, bool):  # a path switch (sparse_attention's RESIDENT_Q, V_FROM_K)
        return [value, not value]
    if key in SPLIT_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return [value, value // 2, value * 2] if value > 1 else [value, 2]
    if "BLOCK" in key and isinstance(value, int) and not isinstance(value, bool) and \
            value >= 16 and value & (value - 1) == 0:
        return [value, value // 2, value * 2] if value >= 32 else [value, value * 2]
    return [value]


def searchable(entry: dict[str, Any]) -> list[str]:
    """The entry's searchable keys; the plain launch options only where the entry sets no
    regime-prefixed ones (a plain num_warps would pin every regime of such an entry)."""
    keys = [k for k, v in entry.items() if len(candidates(k, v)) > 1]
    return keys + [k for k in ("num_warps", "num_stages")
                   if not any(e.endswith(k) for e in entry)]


def _op_fn(op: str, entry: dict[str, Any]) -> Callable[..., Any]:
    from glm5.kernels.triton import registry

    rows = registry.kernels(lambda name: entry if name == op else {})
    return {r[0]: r[1] for r in rows}[op]


def _call(op: str, build: Callable, dt: torch.dtype) -> tuple[tuple, dict[str, Any]]:
    from glm5.ir.catalog import OPS

    values, _ = OPS[op].validate((), build(dt))
    return tuple(values[n] for n in OPS[op].param_names), values


class Clock:
    """Median seconds of fn(): CUDA events with the L2 flushed on a GPU, perf_counter on CPU."""

    def __init__(self, device: str) -> None:
        self.timer = gs.Timer() if device == "cuda" else None

    def __call__(self, fn: Callable[[], Any], budget_s: float) -> float:
        if self.timer is not None:
            return self.timer(fn, budget_s=budget_s)
        fn()
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)


def trial(op: str, entry: dict[str, Any], check: tuple, timed: tuple, clock: Clock,
          per_measure_s: float) -> dict[str, Any]:
    """Judge the entry at the check shape, then time it at the timing shape."""
    from glm5.testing.compare import judge

    fn = _op_fn(op, entry)
    out: dict[str, Any] = {"params": dict(entry)}
    try:
        call, values = check
        with torch.inference_mode():
            got = fn(*call)
        v = judge(op, got, values)
        if not v.ok:
            out["error"] = f"verdict: {v.message[:200]}"
            return out
        with torch.inference_mode():
            out["ms"] = 1e3 * clock(lambda: fn(*timed[0]), per_measure_s)
    except Exception as e:  # a tile that does not compile or fit: skipped, recorded
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def search(op: str, label: str, timed_b: Callable, check_b: Callable, base: dict[str, Any],
           clock: Clock, deadline: float, per_measure_s: float) -> dict[str, Any]:
    """One pass of coordinate descent from the op's current entry."""
    dt = BF
    check, timed = _call(op, check_b(), dt), _call(op, timed_b(), dt)
    first = trial(op, base, check, timed, clock, per_measure_s)
    trials = [first]
    if "ms" not in first:
        return {"op": op, "shape": label, "default": first, "best": first, "trials": trials}
    best = first
    for key in searchable(base):
        for value in candidates(key, best["params"].get(key, base.get(key)))[1:]:
            if time.monotonic() > deadline:
                break
            t = trial(op, {**best["params"], key: value}, check, timed, clock, per_measure_s)
            trials.append(t)
            if "ms" in t and t["ms"] < best["ms"]:
                best = t
    return {"op": op, "shape": label, "default": first, "best": best, "trials": trials}


def merge_into(path: Path, results: list[dict[str, Any]], base: dict[str, dict[str, Any]],
               min_gain: float) -> dict[str, dict[str, Any]]:
    """The tuning table at ``path`` with each op's best entry (its differences from the
    defaults) where it beats the default by more than ``min_gain``; an op tuned at several
    shapes takes the entry of its first (the prefill / largest) shape only."""
    table = json.loads(path.read_text()) if path.exists() else {}
    done: set[str] = set()
    for r in results:
        op = r["op"]
        if op in done or "ms" not in r["best"] or "ms" not in r["default"]:
            continue
        done.add(op)
        if r["default"]["ms"] / r["best"]["ms"] < 1 + min_gain:
            continue
        diff = {k: v for k, v in r["best"]["params"].items() if base[op].get(k) != v}
        if diff:
            table[op] = {**table.get(op, {}), **diff}
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ops", default="", help="comma-separated (default: all searched ops)")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--per-measure-s", type=float, default=0.15)
    ap.add_argument("--min-gain", type=float, default=0.05)
    ap.add_argument("--write", default=None, help="merge the winners into this tuning table")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to tune")
        return 0
    gs.DEV = a.device
    specs = SPECS if a.device == "cuda" else TINY
    ops = [o.strip() for o in a.ops.split(",") if o.strip()] or list(specs)
    unknown = [o for o in ops if o not in specs]
    if unknown:
        raise SystemExit(f"gpu_tune: --ops {unknown} not searched here; known: {list(specs)}")
    from glm5.kernels.triton import registry

    table = registry.load_table(ROOT / "glm5" / "backends" / "cuda" / "tuning.json")
    base = {op: table(op) for op in ops}
    clock = Clock(a.device)
    deadline = time.monotonic() + a.budget_s
    results = []
    for op in ops:
        for label, timed_b, check_b in specs[op]:
            if time.monotonic() > deadline:
                print(f"{op} [{label}]: skipped (time budget)")
                continue
            r = search(op, label, timed_b, check_b, base[op], clock, deadline, a.per_measure_s)
            results.append(r)
            d, b = r["default"], r["best"]
            gain = (d["ms"] / b["ms"]) if "ms" in d and "ms" in b else None
            print(f"{op:18} {label:42} default {d['ms']:.3f} ms  best {b['ms']:.3f} ms  "
                  f"x{gain:.2f}  {len(r['trials'])} trials"
                  if gain else f"{op:18} {label:42} {d.get('error')}", flush=True)
            if gain:
                print("    best:", {k: v for k, v in b["params"].items()
                                    if base[op].get(k) != v} or "the default")
    out = Path(a.out) if a.out else (ROOT / "bench" / "results" /
                                    f"gpu_tune_{datetime.now():%Y%m%d_%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": a.device, "results": results}, indent=1, default=str))
    print(f"wrote {out}")
    if a.write:
        path = Path(a.write)
        path.write_text(json.dumps(merge_into(path, results, base, a.min_gain), indent=1) + "\n")
        print(f"merged the winners into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
