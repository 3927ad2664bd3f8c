"""Bench: the TVM (llvm, host CPU) kernels for sparse_attention / attention against the torch
reference, with achieved GFLOP/s and the fraction of a roofline measured in the same run.

    python bench/tvm_attention.py [--quick] [--rounds N] [--dtypes float32,bfloat16]
                                  [--only NAME] [--json F] [--cache DIR]

Machine rates are measured here, not assumed: the fp32 peak is the best ``torch.matmul``
rate (2048², all threads) seen in the run; it is timed at the start, before every row and at
the end, and the best of all is used for every row, so a busy moment (the machine may be
shared) lowers a kernel's fraction rather than raising it. Memory bandwidth is a large tensor
copy (read + write bytes / time, DRAM-sized) and a cache-sized copy (working set that fits the
last-level cache). FLOPs and bytes come from ``glm5.get_op(op).flops_bytes(...)``.

roofline = min(peak, bandwidth × FLOPs/bytes). "%roof" uses the DRAM bandwidth; "%roof$" the
cache-resident one (relevant where the rows a query gathers stay in cache: small S).

The reference materialises [T, K, D] gathers (sparse) or [T, H, S] scores (dense), so at the
larger shapes it runs on the first ``ref_T`` queries only; its GFLOP/s is per work done, so it
compares directly (the ms column is scaled to the full T and marked with *).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# TVM sizes its thread pool from TVM_NUM_THREADS, else hardware_concurrency / 2 on x86 (it
# assumes SMT siblings): on a VM whose vCPUs are single-threaded cores that is half the machine.
# torch uses every CPU for the matmul/copy roofline, so give TVM every CPU too (before import).
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count()))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import glm5  # noqa: E402  (before torch: it sets OMP_WAIT_POLICY for torch's pool)
import torch  # noqa: E402

from glm5.kernels.tvm.build import TVMContext, default_cache_dir  # noqa: E402

# name, op, T, S, K (sparse) | range kind (dense), H, Hk, Dqk, Dv, absorbed-MLA v view, ref_T
SHAPES = [
    ("decode GLM-5 MQA", "sparse_attention", 64, 32768, 2048, 64, 1, 576, 512, True, 16),
    ("prefill small MHA", "sparse_attention", 1024, 1024, 256, 8, 8, 96, 64, False, 256),
    ("prefill GLM-5 MQA", "sparse_attention", 1024, 4096, 2048, 64, 1, 576, 512, True, 16),
    ("dense decode MQA", "attention", 64, 4096, "full", 64, 1, 576, 512, True, 64),
    ("dense prefill MHA", "attention", 1024, 1024, "causal", 8, 8, 96, 64, False, 1024),
]
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best_time(fn, budget_s: float = 8.0, max_reps: int = 20) -> float:
    """Best wall time of up to ``max_reps`` calls after one warm-up, within ``budget_s``."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    best = first
    spent = first
    for _ in range(max_reps - 1):
        if spent + best > budget_s:
            break
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        spent += dt
    return best


def matmul_gflops(n: int = 2048, reps: int = 6) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2.0 * n ** 3 / best_time(lambda: a @ b, budget_s=4.0, max_reps=reps) / 1e9


def copy_gbs(nbytes: int, reps: int = 6) -> float:
    """Read + write bytes per second of a copy, the better of all threads and one thread (a
    multi-threaded copy of a small tensor on a busy machine can lose to a single thread)."""
    x = torch.empty(nbytes // 4).uniform_()
    y = torch.empty_like(x)
    t = best_time(lambda: y.copy_(x), budget_s=3.0, max_reps=reps)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = min(t, best_time(lambda: y.copy_(x), budget_s=3.0, max_reps=reps))
    finally:
        torch.set_num_threads(n)
    return 2.0 * nbytes / t / 1e9


def make_inputs(op, T, S, K, H, Hk, Dqk, Dv, mqa, dtype, g):
    q = torch.randn(T, H, Dqk, generator=g).to(dtype)
    k = (torch.randn(S, Hk, Dqk, generator=g) * 0.5).to(dtype)
    v = k[..., :Dv] if mqa else torch.randn(S, Hk, Dv, generator=g).to(dtype)
    scale = Dqk ** -0.5
    if op == "sparse_attention":
        # K distinct valid rows per query (every slot is work: the cost model counts K)
        idx = torch.rand(T, S, generator=g).topk(K, dim=1).indices.to(torch.int32)
        return (q, k, v, idx, scale)
    if K == "causal":  # query t is the last of T new tokens at the end of S keys
        ke = (torch.arange(T) + (S - T) + 1).to(torch.int32)
    else:
        ke = torch.full((T,), S, dtype=torch.int32)
    ks = torch.zeros(T, dtype=torch.int32)
    return (q, k, v, ks, ke, scale)


def head(args, n):
    """The first n queries of an argument tuple (q, k, v, idx | ks, ke, scale)."""
    if len(args) == 5:
        q, k, v, idx, s = args
        return (q[:n], k, v, idx[:n], s)
    q, k, v, ks, ke, s = args
    return (q[:n], k, v, ks[:n], ke[:n], s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T / 8 at every shape")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--only", default="", help="substring of the shape names to run")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--cache", default="", help="TVM build cache (default: glm5's)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every row this many times, keep each row's best (a shared "
                         "machine's busy moments then cost less)")
    a = ap.parse_args()

    import tvm  # noqa: F401  (import time is not part of any timing)
    from glm5.kernels.tvm import sparse_attention as sa

    ctx = TVMContext(cache_dir=Path(a.cache) if a.cache else default_cache_dir())
    fns = {op: fn for op, fn, _, _ in sa.kernels(lambda: ctx)}
    threads = sa.threads()

    peaks = [matmul_gflops()]
    dram = copy_gbs(512 << 20, reps=4)
    cache = copy_gbs(4 << 20, reps=200)
    print(f"machine: {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}, TVM threads "
          f"{threads}; fp32 matmul {peaks[0]:.1f} GFLOP/s, copy {dram:.1f} GB/s (512 MiB), "
          f"{cache:.1f} GB/s (4 MiB)", flush=True)

    rows, cases = [], []
    g = torch.Generator().manual_seed(0)
    for rnd in range(a.rounds):
        if rnd:
            print(f"round {rnd + 1}/{a.rounds}", flush=True)
        i = 0
        for name, op, T, S, K, H, Hk, Dqk, Dv, mqa, ref_T in SHAPES:
            if a.only and a.only not in name:
                continue
            if a.quick:
                T, ref_T = max(1, T // 8), max(1, min(ref_T, T // 8))
            for dn in a.dtypes.split(","):
                opdef = glm5.get_op(op)
                if rnd == 0:
                    cases.append(make_inputs(op, T, S, K, H, Hk, Dqk, Dv, mqa, DT[dn], g))
                args = cases[i]
                peaks.append(matmul_gflops(reps=3))  # the machine right now (it is shared)
                flops, nbytes = opdef.flops_bytes(*args)
                if rnd == 0:
                    nb = len(ctx.builds)
                    t_build = time.perf_counter()
                    fns[op](*head(args, 1))  # build or load the variant outside the timing
                    t_build = time.perf_counter() - t_build
                    how = ctx.builds[-1]["how"] if len(ctx.builds) > nb else "cached"
                t_k = best_time(lambda: fns[op](*args), budget_s=20.0)
                if rnd == 0:
                    rargs = head(args, min(T, ref_T))
                    rflops, _ = opdef.flops_bytes(*rargs)
                    t_r = best_time(lambda: opdef.reference(*rargs), budget_s=10.0, max_reps=3)
                    # agreement on the reference's queries (fp32 reference math for both)
                    out, lse = fns[op](*rargs)
                    rout, rlse = opdef.reference(*rargs)
                    err = float((out.float() - rout.float()).abs().max())
                    rows.append({
                        "shape": name, "op": op, "dtype": dn, "T": T, "S": S, "K": K, "H": H,
                        "Hk": Hk, "Dqk": Dqk, "Dv": Dv, "kernel_ms": t_k * 1e3,
                        "ref_ms_full_T": t_r * 1e3 * T / rargs[0].shape[0],
                        "ref_T": rargs[0].shape[0], "ref_gflops": rflops / t_r / 1e9,
                        "flop_per_byte": flops / nbytes, "gflop": flops / 1e9,
                        "max_abs_err": err, "build": how, "build_s": t_build,
                    })
                row = rows[i]
                row["kernel_ms"] = min(row["kernel_ms"], t_k * 1e3)
                gf = flops / t_k / 1e9
                print(f"  {name:18s} {dn:8s} kernel {t_k * 1e3:9.1f} ms  {gf:6.1f} GFLOP/s  "
                      f"(matmul now {peaks[-1]:.1f}; ref {row['ref_gflops']:.2f} GFLOP/s, err "
                      f"{row['max_abs_err']:.1e}, {row['build']} {row['build_s']:.1f}s)",
                      flush=True)
                i += 1

    peaks.append(matmul_gflops())
    peak = max(peaks)
    for r in rows:  # the best peak measured in the run: a busy moment lowers the kernel's %
        r["gflops"] = r["gflop"] / r["kernel_ms"] * 1e3
        r["speedup"] = r["gflops"] / r["ref_gflops"]
        r["roof_dram"] = min(peak, dram * r["flop_per_byte"])
        r["roof_cache"] = min(peak, cache * r["flop_per_byte"])
        r["pct_roof_dram"] = 100 * r["gflops"] / r["roof_dram"]
        r["pct_roof_cache"] = 100 * r["gflops"] / r["roof_cache"]

    print(f"\nfp32 matmul peak {peak:.1f} GFLOP/s (best of {len(peaks)} measurements, "
          f"{min(peaks):.1f}..{max(peaks):.1f}); "
          f"DRAM copy {dram:.1f} GB/s; cache copy {cache:.1f} GB/s\n")
    hdr = ("shape", "op", "dtype", "T", "S", "K", "kernel ms", "ref ms", "speedup", "GFLOP/s",
           "flop/B", "roof", "%roof", "roof$", "%roof$")
    body = []
    for r in rows:
        star = "*" if r["ref_T"] < r["T"] else ""
        body.append((r["shape"], r["op"], r["dtype"], str(r["T"]), str(r["S"]), str(r["K"]),
                     f"{r['kernel_ms']:.1f}", f"{r['ref_ms_full_T']:.0f}{star}",
                     f"{r['speedup']:.1f}x", f"{r['gflops']:.1f}", f"{r['flop_per_byte']:.1f}",
                     f"{r['roof_dram']:.1f}", f"{r['pct_roof_dram']:.0f}%",
                     f"{r['roof_cache']:.1f}", f"{r['pct_roof_cache']:.0f}%"))
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(hdr)]
    print("  ".join(h.ljust(x) for h, x in zip(hdr, w)))
    print("  ".join("-" * x for x in w))
    for b in body:
        print("  ".join(c.ljust(x) for c, x in zip(b, w)))
    print("\n* reference run on the first ref_T queries, time scaled to T. roof = min(peak, "
          "DRAM BW x flop/B); roof$ uses the cache-sized copy bandwidth.")
    if a.json:
        Path(a.json).write_text(json.dumps({"peak_gflops": peak, "dram_gbs": dram,
                                            "cache_gbs": cache, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
