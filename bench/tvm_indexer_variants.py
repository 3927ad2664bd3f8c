"""The cpu indexer's kernel variants side by side (glm5/kernels/tvm/indexer.py):

1. register blocking, HB = 4 and HB = 8 heads per block (`heads_per_block`: 8 on AVX-512
   hosts): causal prefill T = S = 4096 in bf16 and fp32, one decode query over 65536 keys;
2. key source, packed once per call vs read in place (`keys_direct`: in place up to
   DIRECT_MAX_USES reads per key): T = 1 .. 32 queries each over all of S = 16384 keys (T
   reads per key), bf16, `indexer_topk`.

    python bench/tvm_indexer_variants.py [--rounds 3] [--json out.json]

GLM-5's indexer (Hi 32, Di 128, top-2048). Both variants are built (disk cache) and timed
alternately in this process with the cpu backend's thread settings; best of ``--rounds`` per
cell. GFLOP/s counts 2·Hi·Di per (query, key in its range).
"""

from __future__ import annotations

import glm5  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch starts its pool)

import argparse
import json
import time

import torch

from glm5 import cpu_threads

HI, DI, TOPK = 32, 128, 2048
SHAPES = ((4096, 4096, torch.bfloat16), (4096, 4096, torch.float32), (1, 65536, torch.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cpu_threads.apply()
    from glm5.kernels.tvm import indexer as ix
    from glm5.kernels.tvm.build import TVMContext

    ctx = TVMContext()
    c = lambda: ctx  # noqa: E731
    print(f"host chooses HB = {ix.heads_per_block()}")
    rows = []
    for T, S, dt in SHAPES:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(T, HI, DI, generator=g).to(dt)
        k = torch.randn(S, DI, generator=g).to(dt)
        w = torch.randn(T, HI, generator=g) * HI ** -0.5
        ks = torch.zeros(T, dtype=torch.int32)
        ke = (torch.arange(T) + (S - T) + 1).to(torch.int32)
        flops = 2 * HI * DI * float((ke - ks).sum())
        best: dict[tuple[str, int], float] = {}
        ops = (("lightning_indexer", lambda: ix.lightning_indexer(c, q, k, w, ks, ke)),
               ("indexer_topk", lambda: ix.indexer_topk(c, q, k, w, ks, ke, TOPK)))
        chosen = ix.heads_per_block
        try:
            for _ in range(a.rounds):
                for hb in (4, 8):
                    ix.heads_per_block = lambda hb=hb: hb
                    for name, f in ops:
                        f()
                        t = time.perf_counter()
                        f()
                        d = time.perf_counter() - t
                        best[name, hb] = min(best.get((name, hb), d), d)
        finally:
            ix.heads_per_block = chosen
        for (name, hb), d in sorted(best.items()):
            rows.append({"T": T, "S": S, "dtype": str(dt).split(".")[1], "op": name, "hb": hb,
                         "ms": d * 1e3, "gflops": flops / d / 1e9})
    print("| T | S | dtype | op | HB 4 ms | HB 8 ms | HB 4 / HB 8 | GFLOP/s HB 4 / 8 |")
    print("|---|---|---|---|---|---|---|---|")
    for r4 in (r for r in rows if r["hb"] == 4):
        r8 = next(r for r in rows if r["hb"] == 8 and all(r[x] == r4[x] for x in
                                                            ("T", "S", "dtype", "op")))
        print(f"| {r4['T']} | {r4['S']} | {r4['dtype']} | {r4['op']} | {r4['ms']:.1f} | "
              f"{r8['ms']:.1f} | {r4['ms'] / r8['ms']:.2f} | {r4['gflops']:.0f} / "
              f"{r8['gflops']:.0f} |")
    direct = []
    S = 16384
    print("\n| T (reads per key) | packed ms | in place ms | packed / in place | chosen |")
    print("|---|---|---|---|---|")
    limit = ix.DIRECT_MAX_USES
    for T in (1, 2, 4, 8, 16, 32):
        g = torch.Generator().manual_seed(T)
        q = torch.randn(T, HI, DI, generator=g).bfloat16()
        k = torch.randn(S, DI, generator=g).bfloat16()
        w = torch.randn(T, HI, generator=g) * HI ** -0.5
        ks = torch.zeros(T, dtype=torch.int32)
        ke = torch.full((T,), S, dtype=torch.int32)
        best2: dict[str, float] = {}
        try:
            for _ in range(a.rounds):
                for name, m in (("packed", -1), ("in place", 10**9)):
                    ix.DIRECT_MAX_USES = m
                    ix.indexer_topk(c, q, k, w, ks, ke, TOPK)
                    t = time.perf_counter()
                    ix.indexer_topk(c, q, k, w, ks, ke, TOPK)
                    d = time.perf_counter() - t
                    best2[name] = min(best2.get(name, d), d)
        finally:
            ix.DIRECT_MAX_USES = limit
        chosen = "in place" if ix.keys_direct(T * S, S) else "packed"
        direct.append({"T": T, "S": S, "packed_ms": best2["packed"] * 1e3,
                       "in_place_ms": best2["in place"] * 1e3, "chosen": chosen})
        print(f"| {T} | {best2['packed'] * 1e3:.2f} | {best2['in place'] * 1e3:.2f} | "
              f"{best2['packed'] / best2['in place']:.2f} | {chosen} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"blocking": rows, "key_source": direct}, f, indent=1)


if __name__ == "__main__":
    main()
