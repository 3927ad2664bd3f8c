"""Per-call overhead of `glm5.ops.<op>` (validation + cached kernel lookup) and of the
`torch.ops.glm5.<op>` binding, measured side by side against a direct call of the same kernel.

    python bench/dispatch_overhead.py [--calls 2000] [--rounds 15]

Batches of the three variants are interleaved and the median per-call time is reported, so
machine noise hits all three alike.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import glm5  # before torch: it sets OMP_WAIT_POLICY for torch's pool

import torch

from glm5 import ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    logging.getLogger("glm5").setLevel(logging.ERROR)
    glm5.use_backend("reference")  # the reference serves natively: no fallback bookkeeping
    ref = glm5.get_op("rms_norm").reference
    x, w = torch.randn(1, 64), torch.randn(64)
    variants = {
        "direct kernel": lambda: ref(x, w, 1e-5),
        "glm5.ops": lambda: ops.rms_norm(x, w, 1e-5),
        "torch.ops.glm5": lambda: torch.ops.glm5.rms_norm(x, w, 1e-5),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for _ in range(a.rounds):
            for name, f in variants.items():
                t = time.perf_counter()
                for _ in range(a.calls):
                    f()
                times[name].append((time.perf_counter() - t) / a.calls * 1e6)
    base = statistics.median(times["direct kernel"])
    print(f"rms_norm [1, 64] fp32, median of {a.rounds} interleaved rounds x {a.calls} calls")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:<15} {m:7.1f} us/call   overhead {m - base:+6.1f} us")


if __name__ == "__main__":
    main()
