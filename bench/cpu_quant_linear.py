"""cpu backend `quant_linear` against torch's dense CPU matmuls, side by side in one run.

    python bench/cpu_quant_linear.py [--ms 1,8,64,512] [--k 4096] [--n 4096]
                                     [--schemes w8a16,w8a8,w4a8,w6a12] [--dtypes float32]
                                     [--rounds 5] [--threads N] [--paths]
                                     [--out bench/results/cpu_quant_linear.json]

For every M: torch's dense paths on a weight of the same shape — fp32 `F.linear`, bf16
`F.linear` (oneDNN: AMX / AVX-512 BF16 where the CPU has them) and `torch._int_mm` (int8 x
int8 -> int32, oneDNN VNNI/AMX; the bare product, no quantization or scales) — then glm5's
`quant_linear` for every scheme as the cpu backend serves it (`glm5.ops.quant_linear` under
`glm5.use_backend("cpu")`, strict: a reference fallback would raise), with the path it took.
All candidates of one M are timed interleaved (one call of each per round, at least `--rounds`
rounds and more while they fit in `--budget` seconds, after a warm-up that builds or loads the
TVM kernels); the table gives the least time of each.

Columns: ms of glm5; ``x fp32`` = fp32 F.linear ms / glm5 ms (> 1: glm5 faster);
``x best`` = the fastest dense path's ms / glm5 ms; for M = 1, GB/s of the packed weight
(codes + scales) read per call. The CPU model and the features torch can use are printed
first and written to the JSON, with the load average before and after (the machine may be
shared: under load, a 2-thread parallel region waits for its slower thread, so compare
ratios from one run, or use ``--threads 1``).

``--paths`` also times every path `glm5.kernels.tvm.quant.PATHS` can take on this CPU's tier
(VNNI GEMV, VNNI GEMM, AMX GEMM, oneDNN over dequantized weight blocks, portable GEMV,
torch), called directly, next to the one the table
chooses: the data the table's crossovers come from. The default run takes well under a
minute once the kernels are built (the first run builds them: a few seconds each).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import glm5  # noqa: F401,I001  (before torch: it sets OMP_WAIT_POLICY for torch's pool)

import torch
import torch.nn.functional as F

from glm5.perf.measure import cpu_features, cpu_model

SCHEMES = ("w8a16", "w8a8", "w4a8", "w6a12")
DENSE = ("fp32", "bf16", "int8")


def _dense(M: int, K: int, N: int, g: torch.Generator) -> dict[str, Callable[[], Any]]:
    """torch's dense paths for [M, K] x [N, K]^T (int8: `torch._int_mm` if this torch has a
    CPU kernel for the shape)."""
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    xb, wb = x.bfloat16(), w.bfloat16()
    out: dict[str, Callable[[], Any]] = {"fp32": lambda: F.linear(x, w),
                                         "bf16": lambda: F.linear(xb, wb)}
    xi = torch.randint(-127, 128, (M, K), dtype=torch.int8, generator=g)
    wi = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    try:
        torch._int_mm(xi, wi.T)
        out["int8"] = lambda: torch._int_mm(xi, wi.T)
    except RuntimeError:
        pass  # no CPU int8 GEMM for this shape in this torch: not a candidate
    return out


def _glm5(M: int, K: int, N: int, scheme: str, dtype: torch.dtype,
          g: torch.Generator) -> tuple[Callable[[], Any], int, str, tuple]:
    """(call, packed bytes, path label, args) for glm5's served `quant_linear`."""
    import glm5
    from glm5.backends.api import run_recorded
    from glm5.ir.quant_formats import quantize_weight

    x = torch.randn(M, K, generator=g).to(dtype)
    wp, ws = quantize_weight(torch.randn(N, K, generator=g) * K ** -0.5, scheme)
    entry = glm5.get_registry().get("cpu").kernels["quant_linear"]
    _, labels = run_recorded(entry, (x, wp, ws, scheme, None))
    nbytes = wp.numel() * wp.element_size() + ws.numel() * ws.element_size()
    return ((lambda: glm5.ops.quant_linear(x, wp, ws, scheme)), nbytes, "+".join(labels),
            (x, wp, ws))


def _paths(tier: str, scheme: str, dtype: torch.dtype | None = None) -> list[str]:
    """The paths compared on ``tier`` for ``scheme`` and x of ``dtype`` (the AMX and VNNI
    kernels need the CPU's instructions; on an AMX host the torch path, 10-100x slower than
    AMX at every M, is left out; the VNNI GEMM serves what `quant.serves` says)."""
    from glm5.kernels.tvm.quant import serves

    return [p for p in {"amx": ["vnni", "amx", "onednn", "tvm"],
                        "vnni": ["vnni", "vgemm", "onednn", "tvm", "torch:gemm"],
                        "portable": ["tvm", "torch:gemm"]}[tier] if serves(p, scheme, dtype)]


def _interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Least seconds per call of each function, one call of each per round."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def run(ms: list[int], K: int, N: int, schemes: list[str], dtypes: list[torch.dtype],
        rounds: int, paths: bool, budget: float = 3.0) -> dict[str, Any]:
    import glm5

    with glm5.use_backend("cpu"):
        return _run_all(ms, K, N, schemes, dtypes, rounds, paths, budget)


def _run_all(ms: list[int], K: int, N: int, schemes: list[str], dtypes: list[torch.dtype],
             rounds: int, paths: bool, budget: float) -> dict[str, Any]:
    from glm5.backends.cpu import context
    from glm5.kernels.tvm import quant

    tier = quant.cpu_tier()
    g = torch.Generator().manual_seed(0)
    rows, path_rows = [], []
    for M in ms:
        fns = {f"dense:{k}": f for k, f in _dense(M, K, N, g).items()}
        info: dict[str, tuple[int, str]] = {}
        for dt in dtypes:
            for s in schemes:
                fn, nbytes, label, args = _glm5(M, K, N, s, dt, g)
                name = f"{s}:{str(dt).removeprefix('torch.')}"
                fns[name], info[name] = fn, (nbytes, label)
                if paths:  # every path this CPU has, called directly
                    for p in _paths(tier, s, dt):
                        fns[f"path:{p}:{name}"] = (lambda p=p, a=args, s=s: quant.run_path(
                            p, context, a[0], a[1], a[2], s))
        with torch.inference_mode():
            for f in fns.values():  # warm-up: builds / loads kernels, first-touch pages
                f()
            t0 = time.perf_counter()
            best = _interleaved(fns, 1)
            # at least `rounds` rounds; more where rounds are short, up to `budget` seconds
            more = int(budget / max(time.perf_counter() - t0, 1e-6))
            rest = _interleaved(fns, max(rounds - 1, min(more, 200)))
            best = {k: min(v, rest[k]) for k, v in best.items()}
        dense = {k.split(":", 1)[1]: v * 1e3 for k, v in best.items() if k.startswith("dense:")}
        fastest = min(dense, key=dense.get)
        for name, (nbytes, label) in info.items():
            s, dt = name.split(":")
            ms_ = best[name] * 1e3
            rows.append({"M": M, "K": K, "N": N, "scheme": s, "dtype": dt, "path": label,
                         "ms": ms_, "dense_ms": dense, "fastest_dense": fastest,
                         "x_fp32": dense["fp32"] / ms_, "x_bf16": dense["bf16"] / ms_,
                         "x_best": dense[fastest] / ms_,
                         "packed_bytes": nbytes,
                         "gbps": nbytes / (ms_ * 1e-3) / 1e9 if M == 1 else None})
            if paths:
                per = {p: best[f"path:{p}:{name}"] * 1e3
                       for p in _paths(tier, s, getattr(torch, dt))}
                path_rows.append({"M": M, "scheme": s, "dtype": dt, "ms": per,
                                  "fastest": min(per, key=per.get),
                                  "chosen": quant.path(s, M, tier, getattr(torch, dt))})
    return {"tier": tier, "rows": rows, "paths": path_rows}


def path_table(prow: list[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(p for r in prow for p in r["ms"]))  # every path, in order
    out = ["| scheme | x dtype | M | " + " | ".join(f"{p} ms" for p in names)
           + " | fastest | PATHS chooses |", "|" + "---|" * (len(names) + 5)]
    for r in prow:
        out.append(f"| {r['scheme']} | {r['dtype']} | {r['M']} | "
                   + " | ".join(f"{r['ms'][p]:.3f}" if p in r["ms"] else "-" for p in names)
                   + f" | {r['fastest']} | {r['chosen']} |")
    return "\n".join(out)


def table(rows: list[dict[str, Any]]) -> str:
    cols = ("scheme", "x dtype", "M", "path", "glm5 ms", "fp32 ms", "bf16 ms", "int8 ms",
            "x fp32", "x bf16", "x best (fastest)", "GB/s packed")
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        d = r["dense_ms"]
        cells = [r["scheme"], r["dtype"], str(r["M"]), r["path"], f"{r['ms']:.3f}",
                 *(f"{d[k]:.3f}" if k in d else "-" for k in DENSE),
                 f"{r['x_fp32']:.2f}", f"{r['x_bf16']:.2f}",
                 f"{r['x_best']:.2f} ({r['fastest_dense']})",
                 f"{r['gbps']:.1f}" if r["gbps"] is not None else "-"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8,64,512", help="row counts M, comma separated")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--dtypes", default="float32", help="x dtypes: float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=5, help="least rounds per M")
    ap.add_argument("--budget", type=float, default=3.0,
                    help="seconds of rounds per M (short calls get up to 200 rounds)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for torch and TVM (default: the CPUs this process may use)")
    ap.add_argument("--paths", action="store_true",
                    help="also time every path this CPU has (vnni, amx, tvm, torch:gemm) called "
                         "directly: the data `quant.PATHS` is chosen from")
    ap.add_argument("--out", default=None, help="write the rows and the CPU's features here")
    a = ap.parse_args(argv)
    logging.getLogger("glm5").setLevel(logging.ERROR)
    os.environ.setdefault("GLM5_STRICT", "1")
    if a.threads is not None:  # before TVM's runtime starts its pool
        if a.threads < 1:
            ap.error(f"--threads: expected a positive count, got {a.threads}")
        os.environ["TVM_NUM_THREADS"] = str(a.threads)
        torch.set_num_threads(a.threads)
    ms = [int(v) for v in a.ms.split(",")]
    schemes = a.schemes.split(",")
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        ap.error(f"--schemes: expected names from {SCHEMES}, got {bad}")
    dtypes = []
    for d in a.dtypes.split(","):
        if d not in ("float32", "bfloat16"):
            ap.error(f"--dtypes: expected float32 or bfloat16, got {d!r}")
        dtypes.append(getattr(torch, d))
    feats = cpu_features()
    load0 = os.getloadavg()
    print(f"CPU: {cpu_model()}; features: {', '.join(feats['flags'])}; torch ISA "
          f"{feats['torch_isa']}, {feats['threads']} threads, AMX {feats['amx']}, "
          f"AVX-512 BF16 {feats['avx512_bf16']}, VNNI {feats['vnni']}", flush=True)
    t0 = time.perf_counter()
    res = run(ms, a.k, a.n, schemes, dtypes, a.rounds, a.paths, a.budget)
    res.update({"cpu": cpu_model(), "features": feats, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "loadavg_before_after": [load0[0],
                                                                            os.getloadavg()[0]],
                "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                "seconds": time.perf_counter() - t0, "date": time.strftime("%Y-%m-%d %H:%M")})
    print(f"tier: {res['tier']}")
    print(table(res["rows"]))
    if res["paths"]:
        print()
        print(path_table(res["paths"]))
    print(f"({res['seconds']:.1f} s; {res['threads']} threads; load average "
          f"{load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
