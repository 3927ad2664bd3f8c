"""cpu backend `moe_experts_quant`: each expert on quant_linear's path for its row count (the
VNNI / AMX tiers) against the one grouped portable GEMV call over all experts (what every CPU
ran before, and what the portable tier runs), side by side in one run.

    python bench/cpu_moe_quant.py [--experts 16] [--d 2048] [--i 1024] [--topk 4]
                                  [--tokens 1,256] [--schemes w4a8,w8a8,w6a12,w8a16]
                                  [--dtype float32] [--rounds 5] [--out FILE.json]

Prints, per scheme and token count, the least ms of each form over ``--rounds`` calls (after
a warm-up that builds the kernels) and the largest difference between their outputs; x and the
routing weights in ``--dtype`` (float32 or bfloat16: w8a16 takes the bf16 GEMM). Needs a
CPU with AVX-512 VNNI (the by-expert form is the VNNI / AMX tiers').
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import glm5  # noqa: F401,I001  (before torch: it sets OMP_WAIT_POLICY for torch's pool)

import torch


def _best(f: Callable[[], Any], rounds: int) -> float:
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def run(E: int, D: int, I: int, k: int, tokens: list[int], schemes: list[str],
        rounds: int, dtype: torch.dtype = torch.float32) -> list[dict[str, Any]]:
    from glm5.backends.cpu import context
    from glm5.ir.quant_formats import quantize_weight
    from glm5.kernels.tvm import quant

    tier = quant.cpu_tier()
    if tier == "portable":
        raise SystemExit("cpu_moe_quant: this CPU has no AVX-512 VNNI: only the grouped "
                         "portable form runs here")
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for s in schemes:
            w13 = [quantize_weight(torch.randn(2 * I, D, generator=g) * D ** -0.5, s)
                   for _ in range(E)]
            w2 = [quantize_weight(torch.randn(D, I, generator=g) * I ** -0.5, s)
                  for _ in range(E)]
            w = (torch.stack([a for a, _ in w13]), torch.stack([b for _, b in w13]),
                 torch.stack([a for a, _ in w2]), torch.stack([b for _, b in w2]))
            for T in tokens:
                x = torch.randn(T, D, generator=g).to(dtype)
                ids = torch.stack([torch.randperm(E, generator=g)[:k]
                                   for _ in range(T)]).to(torch.int32)
                wts = torch.rand(T, k, generator=g).to(dtype)

                def call() -> torch.Tensor:
                    return quant.moe_experts_quant(context, x, ids, wts, *w, s)

                out = {}
                for form, t in (("grouped", "portable"), ("by_expert", tier)):
                    quant._tier[:] = [t]
                    out[form] = (_best(call, rounds), call())
                rows.append({"scheme": s, "tokens": T, "dtype": str(dtype).removeprefix("torch."),
                             "grouped_ms": out["grouped"][0],
                             "by_expert_ms": out["by_expert"][0],
                             "max_diff": (out["grouped"][1].float() - out["by_expert"][1]
                                          .float()).abs().max().item()})
    finally:
        quant._tier[:] = [tier]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--i", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tokens", default="1,256")
    ap.add_argument("--schemes", default="w4a8,w8a8,w6a12,w8a16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    glm5.cpu_threads.apply()
    rows = run(a.experts, a.d, a.i, a.topk, [int(t) for t in a.tokens.split(",")],
               a.schemes.split(","), a.rounds, getattr(torch, a.dtype))
    print("| scheme | tokens | grouped ms | by expert ms | speed-up | max diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scheme']} | {r['tokens']} | {r['grouped_ms']:.2f} | "
              f"{r['by_expert_ms']:.2f} | {r['grouped_ms'] / r['by_expert_ms']:.1f}x | "
              f"{r['max_diff']:.1e} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": "cpu_moe_quant.py " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv),
                       "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
