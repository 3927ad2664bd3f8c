"""Per-query cost of the cpu backend's TVM sparse_attention as the key cache grows.

    python bench/sparse_attention_scaling.py [--contexts 8192,16384,32768] [--reps 12]

The work per query is constant (T queries × H heads × K selected rows, absorbed-MLA dims of the
`small` preset: H 8, Dqk 160, Dv 128, K 256), only the cache the rows are gathered from grows.
Two ways of running the same kernel are timed interleaved in one process (this VM's timings
swing by ~20% from minute to minute, so only side-by-side numbers are comparable):

* ``one pass``: every query gathers its rows from the whole cache (BLOCK_BYTES unlimited);
* ``key-block passes``: the default, one pass per cache-sized block of rows (``block_rows``).

Reported per context: min and median µs per query over ``--reps`` calls, and the ratio to the
first context (1.0 = flat). Random indices (each query K distinct rows of the whole cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    from glm5.backends.cpu import context  # sets TVM's thread pool up as the backend does
    from glm5.kernels.tvm import sparse_attention as sa

    fn = sa.make_sparse_attention(context)
    default_bytes = sa.BLOCK_BYTES
    modes = {"one pass": 1 << 62, "key-block passes": default_bytes}
    T, H, Dqk, Dv, K = a.queries, 8, 160, 128, 256
    g = torch.Generator().manual_seed(0)
    data = {}
    for S in [int(x) for x in a.contexts.split(",")]:
        q = torch.randn(T, H, Dqk, generator=g)
        k = torch.randn(S, 1, Dqk, generator=g)
        idx = torch.argsort(torch.rand(T, S, generator=g), dim=1)[:, :K].to(torch.int32)
        data[S] = (q, k, k[..., :Dv], idx)
    times: dict[tuple[str, int], list[float]] = {}
    passes: dict[tuple[str, int], int] = {}
    for _ in range(a.reps):
        for mode, nbytes in modes.items():
            sa.BLOCK_BYTES = nbytes
            for S, (q, k, v, idx) in data.items():
                passes[(mode, S)] = sa.block_rows(idx, q, k, v)[1]
                fn(q, k, v, idx, 0.1)  # this mode's pass layout, warm
                t0 = time.perf_counter()
                fn(q, k, v, idx, 0.1)
                times.setdefault((mode, S), []).append((time.perf_counter() - t0) / T * 1e6)
    sa.BLOCK_BYTES = default_bytes
    rows = []
    print(f"T={T} H={H} Dqk={Dqk} Dv={Dv} K={K}, {a.reps} interleaved calls each, "
          f"BLOCK_BYTES={default_bytes >> 20} MiB")
    print("| mode | context | passes | latent MiB | min µs/query | median µs/query | "
          "ratio (min) | ratio (median) |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        first = None
        for S in data:
            ts = times[(mode, S)]
            mn, md = min(ts), statistics.median(ts)
            first = first or (mn, md)
            rows.append({"mode": mode, "context": S, "passes": passes[(mode, S)],
                         "min_us_per_query": mn, "median_us_per_query": md, "runs": ts})
            print(f"| {mode} | {S} | {passes[(mode, S)]} | {S * Dqk * 4 / 2**20:.1f} | {mn:.1f} | "
                  f"{md:.1f} | {mn / first[0]:.2f} | {md / first[1]:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": {"T": T, "H": H, "Dqk": Dqk, "Dv": Dv, "K": K},
                       "block_bytes": default_bytes, "rows": rows,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=2)


if __name__ == "__main__":
    main()
