#!/usr/bin/env python
"""GPU suite for the cuda backend (Triton kernels) on one NVIDIA GPU, in one run (< 8 minutes):

1. Parity: every op the "cuda" backend (glm5.get_registry()) claims, every claimed dtype, a few
   generated examples each, judged against the float64 oracle by glm5.testing.parity.run_parity
   (no emulation): the kit copies each example to the GPU as it was laid out (strides, offsets
   and aliasing such as v = k[..., :Dv] kept: `glm5.testing.compare.to_device`), runs the kernel
   there and judges its outputs and in-place updates (the mla_prolog cache) on the CPU.
2. Ceilings measured in the same run: a large bf16 matmul (TFLOP/s) and a device-to-device copy
   (GB/s), next to the H200 datasheet roofline (989 TFLOP/s dense bf16/fp16, 67 TFLOP/s fp32
   without tensor cores, 1979 TOP/s int8, 4.8 TB/s HBM3e).
3. Timing: each op the cuda backend serves, at GLM-5-sized shapes built directly on the GPU,
   against the op's torch reference on the GPU (and a plain torch baseline where one exists),
   with CUDA events around each call and the L2 cache flushed between calls; TFLOP/s and GB/s
   from glm5.get_op(name).flops_bytes(...), % of the datasheet roofline and of the measured one.

Prints a table, writes bench/results/gpu_suite_<timestamp>.json and exits 1 if any parity row
fails. Without a CUDA device it says "no CUDA device: nothing to time", then checks every GPU
shape below against its op's signature on the meta device (no data, no GPU) and exits 0 unless
a shape is malformed. ``--device cpu`` runs the whole sequence (parity, ceilings, timings,
table, JSON) on the CPU with the cuda backend's kernels through the Triton interpreter, at the
tiny shapes of ``SMOKE_SHAPES`` and the kit's smoke profile: a test of this script
(tests/test_bench_gpu_suite.py), so that a GPU session is not spent finding its bugs; its
numbers say nothing about a GPU.

    python bench/gpu_suite.py [--examples 3] [--ops rms_norm,quant_linear] [--skip-parity]
                              [--skip-reference] [--budget-s 450] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from glm5.perf import device_shapes as shp  # noqa: E402
from glm5.perf.tune import Clock  # noqa: E402
from glm5.perf.device_shapes import (  # noqa: E402
    _qweight,
    b_attention,
    b_indexer,
    b_layer_norm,
    b_logprobs,
    b_mla,
    b_moe,
    b_moe_quant,
    b_norm,
    b_paged,
    b_quant_linear,
    b_rope,
    b_sparse,
    rn,
)

# H200 SXM datasheet (dense, no sparsity).
PEAK_FLOPS = {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "int8": 1979e12,
              "fp8": 1979e12}
PEAK_HBM = 4.8e12


# --------------------------------------------------------------------------- helpers
def _dtname(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _empty_cache() -> None:
    if shp.DEV != "cpu":
        torch.cuda.empty_cache()


def measure_ceilings(timer: Clock, n: int = 8192, nbytes: int = 2**30) -> dict[str, float]:
    """A bf16 [n, n] matmul's FLOP rate and an nbytes device-to-device copy's bytes moved per
    second (read + write), in this run."""
    a = torch.randn(n, n, device=shp.DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=shp.DEV, dtype=torch.bfloat16)
    t_mm = timer(lambda: torch.matmul(a, b), budget_s=0.5, max_iters=20, flush=False)
    del a, b
    src = torch.empty(nbytes, dtype=torch.uint8, device=shp.DEV).fill_(1)
    dst = torch.empty_like(src)
    t_cp = timer(lambda: dst.copy_(src), budget_s=0.5, max_iters=20, flush=False)
    del src, dst
    _empty_cache()
    return {"bf16_matmul_flops": 2.0 * n**3 / t_mm, "copy_bytes_per_s": 2.0 * nbytes / t_cp,
            "bf16_matmul_shape": n, "copy_bytes": 2 * nbytes}


def bl_quant_linear(a: dict[str, Any]) -> tuple[str, Callable[[], Any]]:
    """What serving without a quant kernel does: bf16 linear on the dequantized weight."""
    from glm5.ir.quant_formats import dequantize_weight

    w = dequantize_weight(a["w_packed"], a["w_scale"], a["scheme"], a["x"].shape[1]).to(
        a["x"].dtype)
    x = a["x"]
    return "torch linear, dequantized W", lambda: torch.nn.functional.linear(x, w)


def bl_attention(a: dict[str, Any]) -> tuple[str, Callable[[], Any]]:
    q, k, v = (a[n].transpose(0, 1)[None] for n in ("q", "k", "v"))
    # the suite's ranges are the last T of S positions: one query sees every key (SDPA's
    # is_causal aligns a short query block to the first keys instead)
    causal = q.shape[2] > 1
    return "torch sdpa" + (" (causal)" if causal else ""), \
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=a["scale"], enable_gqa=q.shape[1] != k.shape[1])


BF, F32, F16 = torch.bfloat16, torch.float32, torch.float16

# op -> [(label, build(dtype) -> args dict, dtypes, baseline or None)]
SHAPES: dict[str, list[tuple[str, Callable, tuple, Callable | None]]] = {
    "rms_norm": [("T=4096 D=6144", b_norm(4096, 6144), (BF, F32), None),
                 ("T=4096 D=512 (kv latent)", b_norm(4096, 512), (BF,), None)],
    "layer_norm": [("T=4096 D=6144", b_layer_norm(4096, 6144), (BF,), None)],
    "rope": [("T=4096 H=64 R=64 interleaved", b_rope(4096, 64, 64, True), (BF,), None),
             ("T=4096 H=64 R=64 neox", b_rope(4096, 64, 64, False), (BF,), None)],
    "silu_mul": [("T=4096 I=12288 (dense MLP)", lambda dt: {"x": rn(4096, 24576, dt=dt)},
                  (BF,), None),
                 ("T=32768 I=2048 (routed)", lambda dt: {"x": rn(32768, 4096, dt=dt)},
                  (BF,), None)],
    "lightning_indexer": [("T=S=8192 Hi=32 Di=128 causal", b_indexer(8192, 8192, 32, 128),
                           (BF,), None)],
    "topk_indices": [("T=8192 S=8192 k=2048", lambda dt: {
        "scores": rn(8192, 8192, dt=dt), "k": 2048}, (F32,), None)],
    "indexer_topk": [("T=S=8192 Hi=32 Di=128 topk=2048 causal",
                      b_indexer(8192, 8192, 32, 128, 2048), (BF,), None),
                     # a decode step at 128K context: split top-k
                     ("decode T=1 S=131072 Hi=32 Di=128 topk=2048",
                      b_indexer(1, 131072, 32, 128, 2048), (BF,), None)],
    # the fp8 indexer (q, k quantized per row to e4m3 inside the op): the rows above in fp8
    "indexer_topk_fp8": [("T=S=8192 Hi=32 Di=128 topk=2048 causal",
                          b_indexer(8192, 8192, 32, 128, 2048), (BF,), None),
                         ("decode T=1 S=131072 Hi=32 Di=128 topk=2048",
                          b_indexer(1, 131072, 32, 128, 2048), (BF,), None)],
    # a decode step of the serving engine's paged indexer: bf16 pool vs the fp8 index cache
    # (half the bytes per key read)
    **{op: [("decode B=32 L=32768 page=64 Hi=32 Di=128 topk=2048",
             b_paged(32, 32768, 32, 128, 2048, 64, fp8), (BF,), None)]
       for op, fp8 in (("paged_indexer_topk", False), ("paged_indexer_topk_fp8", True))},
    "sparse_attention": [
        ("decode T=64 S=8192 K=2048 H=64 MQA 576/512",
         b_sparse(64, 8192, 2048, 64, 1, 576, 512), (BF,), None),
        ("decode T=1 S=8192 K=2048 H=64 MQA 576/512 (split-KV)",
         b_sparse(1, 8192, 2048, 64, 1, 576, 512), (BF,), None),
        ("prefill T=4096 S=8192 K=2048 H=64 MQA 576/512",
         b_sparse(4096, 8192, 2048, 64, 1, 576, 512), (BF,), None),
    ],
    "attention": [("prefill T=S=4096 H=64 256/256 causal",
                   b_attention(4096, 4096, 64, 64, 256, 256), (BF,), bl_attention),
                  # absorbed MLA decode over a context shorter than index_topk: split-KV
                  ("decode T=1 S=2048 H=64 MQA 576/512",
                   b_attention(1, 2048, 64, 1, 576, 512), (BF,), bl_attention)],
    "mla_prolog": [("prefill T=4096 (no absorb)", b_mla(4096, False), (BF,), None),
                   ("decode T=64 (absorb)", b_mla(64, True), (BF,), None)],
    "moe_route": [("T=4096 E=256 k=8", lambda dt: {
        "logits": rn(4096, 256, dt=F32), "bias": rn(256, dt=F32, scale=0.1, seed=1),
        "top_k": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling": 2.5}, (F32,), None)],
    "moe_experts": [("T=2048 k=8 E=64 (EP shard) D=6144 I=2048",
                     b_moe(2048, 8, 64, 6144, 2048), (BF,), None)],
    "quantize_per_token": [
        ("M=4096 K=6144 int8", lambda dt: {"x": rn(4096, 6144, dt=dt), "bits": 8}, (BF,), None),
        ("M=4096 K=6144 int12", lambda dt: {"x": rn(4096, 6144, dt=dt), "bits": 12}, (BF,),
         None),
    ],
    "quant_linear": [
        *[(f"{s} M=1 K=N=6144", b_quant_linear(1, 6144, 6144, s), (BF,), bl_quant_linear)
          for s in ("w4a8", "w8a8", "w8a16", "w6a12")],
        # the largest decode batch the GEMV serves (GEMV_M): where it meets the GEMM
        *[(f"{s} M=16 K=N=6144", b_quant_linear(16, 6144, 6144, s), (BF,), bl_quant_linear)
          for s in ("w4a8", "w8a8", "w8a16", "w6a12")],
        *[(f"{s} M=512 K=N=6144", b_quant_linear(512, 6144, 6144, s), (BF,), bl_quant_linear)
          for s in ("w4a8", "w8a8", "w8a16", "w6a12")],
    ],
    "moe_experts_quant": [("w4a8 T=256 k=8 E=64 D=6144 I=2048",
                           b_moe_quant(256, 8, 64, 6144, 2048, "w4a8"), (BF,), None)],
    "token_logprobs": [("T=2048 D=6144 V=154880", b_logprobs(2048, 6144, 154880), (BF,), None),
                       ("T=256 D=6144 V=154880", b_logprobs(256, 6144, 154880), (BF,), None)],
    "grpo_advantages": [("N=65536 group=16", lambda dt: {
        "rewards": rn(65536, dt=dt), "group_size": 16, "std_normalize": True, "eps": 1e-6},
        (F32,), None)],
    "policy_loss": [("T=1M", lambda dt: {
        "logp": -rn(2**20, dt=dt).abs(), "old_logp": -rn(2**20, dt=dt, seed=1).abs(),
        "adv": rn(2**20, dt=dt, seed=2), "mask": torch.ones(2**20, device=shp.DEV, dtype=dt),
        "clip_low": 0.2, "clip_high": 0.25, "rollout_logp": None, "tis_cap": 2.0},
        (F32,), None)],
}


# --device cpu: the same sequence through the Triton interpreter at tiny shapes (each regime the
# suite's rows reach: a baseline, the dequantized-linear baseline, decode and prefill, an
# in-place cache write, the MQA view v = k[..., :Dv])
SMOKE_SHAPES: dict[str, list[tuple[str, Callable, tuple, Callable | None]]] = {
    "rms_norm": [("T=4 D=64", b_norm(4, 64), (BF, F32), None)],
    "sparse_attention": [("decode T=2 S=64 K=16 H=4 MQA 64/32",
                          b_sparse(2, 64, 16, 4, 1, 64, 32), (BF,), None)],
    "attention": [("prefill T=S=16 H=2 32/32 causal", b_attention(16, 16, 2, 2, 32, 32), (BF,),
                   bl_attention)],
    "mla_prolog": [("decode T=2 (absorb)",
                    b_mla(2, True, D=64, Rq=32, H=2, Dn=16, Dr=16, Rkv=32), (BF,), None)],
    "quant_linear": [("w8a8 M=2 K=N=64", b_quant_linear(2, 64, 64, "w8a8"), (BF,),
                      bl_quant_linear)],
}


def peak_class(op: str, args: dict[str, Any], dt: torch.dtype) -> str:
    scheme = args.get("scheme")
    if op in ("quant_linear", "moe_experts_quant") and scheme in ("w8a8", "w4a8", "w6a12"):
        return "int8"
    if op in ("indexer_topk_fp8", "paged_indexer_topk_fp8"):  # e4m3 dots whatever q's dtype
        return "fp8"
    return {BF: "bf16", F16: "fp16"}.get(dt, "fp32")


# --------------------------------------------------------------------------- the suite
def run_parity_rows(backend: Any, ops: list[str] | None, examples: int, deadline: float,
                    emulate: bool = False, profile: str | None = None):
    """The kit's parity rows for every op ``backend`` serves (``ops``: only those), one op at a
    time until ``deadline``. On the device the kit copies each example there as it was laid
    out (`glm5.testing.compare.to_device`: views and aliasing kept) and the outputs and
    in-place updates back; ``emulate``: the kernels on CPU tensors (the interpreter)."""
    from glm5.ir.catalog import OPS
    from glm5.testing.parity import Row, run_parity

    kw = {} if profile is None else {"profile": profile}
    rows = []
    for name in [o for o in OPS if o in backend.kernels and (ops is None or o in ops)]:
        if time.time() > deadline:
            rows.append(Row(backend.name, name, "skip", "-", 0.0, 0.0, "", 0,
                            "time budget of the suite spent"))
            continue
        t0 = time.time()
        try:
            got = run_parity(backend, [name], examples=examples, seed=0, emulate=emulate, **kw)
        except Exception as e:  # the runner itself broke: count it as a failure
            got = [Row(backend.name, name, "fail", "-", 0.0, 0.0, "", 0,
                       f"run_parity raised {type(e).__name__}: {e}")]
        for r in got:
            print(f"  parity {name:20s} {r.dtype:9s} {r.status.upper():4s} "
                  f"n={r.examples} max_abs={r.max_abs_err:.2e} max_rel={r.max_rel_err:.2e} "
                  f"({time.time() - t0:.1f}s) {r.message}", flush=True)
        rows.extend(got)
    return rows


def time_op(timer: Clock, entry: Any, name: str, label: str, build: Callable,
            dt: torch.dtype, baseline: Callable | None, ceil: dict[str, float],
            with_reference: bool, budget_s: float) -> dict[str, Any]:
    import glm5
    from glm5.ir.catalog import OPS

    op = OPS[name]
    row: dict[str, Any] = {"op": name, "shape": label, "dtype": _dtname(dt), "ms": None,
                           "reference_ms": None, "speedup_vs_reference": None, "baseline": "",
                           "baseline_ms": None, "tflops": None, "gbps": None,
                           "roofline_pct": None, "measured_roofline_pct": None, "note": ""}
    args = build(dt)
    values, _ = op.validate((), args)
    call = tuple(values[n] for n in op.param_names)
    if not entry.accepts(call):
        row["note"] = "supports() declined this shape"
        return row
    flops, nbytes = glm5.get_op(name).flops_bytes(*call)
    with torch.inference_mode():
        t = timer(lambda: entry.fn(*call), budget_s=budget_s)
        row["ms"] = t * 1e3
        if with_reference:
            try:
                rt = timer(lambda: op.reference(*call), budget_s=budget_s, max_iters=10)
                row["reference_ms"] = rt * 1e3
                row["speedup_vs_reference"] = rt / t
            except torch.cuda.OutOfMemoryError:
                row["note"] = "reference: out of GPU memory"
            except Exception as e:
                row["note"] = f"reference raised {type(e).__name__}: {str(e)[:120]}"
            _empty_cache()
        if baseline is not None:
            try:
                bname, bfn = baseline(values)
                row["baseline"] = bname
                row["baseline_ms"] = timer(bfn, budget_s=budget_s) * 1e3
            except Exception as e:
                row["note"] += f" baseline raised {type(e).__name__}: {str(e)[:120]}"
    pc = peak_class(name, values, dt)
    roof = max(flops / PEAK_FLOPS[pc], nbytes / PEAK_HBM)
    mflops = ceil["bf16_matmul_flops"] * PEAK_FLOPS[pc] / PEAK_FLOPS["bf16"]
    mroof = max(flops / mflops, nbytes / ceil["copy_bytes_per_s"])
    row.update(tflops=flops / t / 1e12, gbps=nbytes / t / 1e9, roofline_pct=100.0 * roof / t,
               measured_roofline_pct=100.0 * mroof / t, flops=flops, bytes=nbytes,
               peak_class=pc, bound="compute" if flops / PEAK_FLOPS[pc] > nbytes / PEAK_HBM
               else "memory")
    return row


def format_timings(rows: list[dict[str, Any]]) -> str:
    head = ("op", "shape", "dtype", "ms", "ref ms", "x ref", "baseline ms", "TFLOP/s", "GB/s",
            "% roof", "% meas", "note")
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    body = [(r["op"], r["shape"], r["dtype"], f(r["ms"], ".3f"), f(r["reference_ms"], ".2f"),
             f(r["speedup_vs_reference"], ".1f"),
             f"{r['baseline_ms']:.3f} ({r['baseline']})" if r["baseline_ms"] else "-",
             f(r["tflops"], ".1f"), f(r["gbps"], ".0f"), f(r["roofline_pct"], ".0f"),
             f(r["measured_roofline_pct"], ".0f"), r["note"]) for r in rows]
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda c: "  ".join(x.ljust(y) for x, y in zip(c, w)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(tuple("-" * x for x in w))] + [line(b) for b in body])


def dry_run(ops: list[str] | None = None) -> int:
    """Without a GPU: build every shape on the meta device and check it against its op's
    signature and cost model (catches a wrong shape before a GPU session is spent on it)."""
    from glm5.ir.catalog import OPS

    shp.DEV, n, bad = "meta", 0, 0
    try:
        for name, shapes in SHAPES.items():
            if ops is not None and name not in ops:
                continue
            op = OPS[name]
            for label, build, dtypes, _ in shapes:
                for dt in dtypes:
                    try:
                        args = build(dt)
                        try:
                            values, _ = op.validate((), args)
                        except RuntimeError as e:
                            if "meta" not in str(e):
                                raise
                            # a check that reads values: shapes and cost only
                            values = op.bind((), args)
                            print(f"  shape {name} [{label}]: validate() reads tensor values "
                                  f"({e}); checked shapes and cost only")
                        op.cost(values, op.symbols(values))
                        n += 1
                    except Exception as e:
                        bad += 1
                        print(f"  shape {name} [{label}] {_dtname(dt)}: {type(e).__name__}: {e}")
    finally:
        shp.DEV = "cuda"
    print(f"dry run: {n} GPU shapes checked against their op signatures on the meta device, "
          f"{bad} bad")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=3, help="parity examples per op and dtype")
    ap.add_argument("--ops", default="", help="comma-separated ops (default: all served)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-reference", action="store_true",
                    help="do not time the torch references")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="wall-clock budget; work past it is skipped (default 450)")
    ap.add_argument("--per-measure-s", type=float, default=0.3,
                    help="timing budget of one measurement (default 0.3)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the whole sequence through the Triton interpreter at tiny shapes "
                         "(a test of this script; no GPU numbers)")
    a = ap.parse_args(argv)

    smoke = a.device == "cpu"
    if smoke:
        # the interpreter is chosen when the kernel modules are imported: before any is
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("--device cpu needs TRITON_INTERPRET=1 before Triton is imported")
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
        shp.DEV = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to time")
        return dry_run(ops=[o.strip() for o in a.ops.split(",") if o.strip()] or None)
    # Real kernels, not the interpreter (it is read when the kernel modules are imported).
    elif os.environ.pop("TRITON_INTERPRET", None) == "1":
        print("note: TRITON_INTERPRET=1 was set; unset for this run (compiled kernels)")

    start = time.time()
    deadline = start + a.budget_s
    import glm5
    from glm5.ir.catalog import OPS

    shapes_of = SMOKE_SHAPES if smoke else SHAPES
    ops = [o.strip() for o in a.ops.split(",") if o.strip()] or (
        list(SMOKE_SHAPES) if smoke else None)
    reg = glm5.get_registry()
    try:
        backend = reg.get("cuda")
    except KeyError as e:
        print(f"{e}; plugin errors: {[(p.name, p.message) for p in reg.errors()]}")
        return 1
    ok, reason = backend.can_emulate() if smoke else backend.is_available()
    dev_name = "cpu (Triton interpreter)" if smoke else torch.cuda.get_device_name(0)
    print(f"device: {dev_name} | torch {torch.__version__} | cuda backend "
          f"{'emulated' if smoke else 'available'}: {ok} ({reason})")
    print(f"cuda backend serves: {', '.join(o for o in OPS if o in backend.kernels)}")
    if not ok:
        print("the cuda backend is not available here: nothing to check")
        return 1
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover
        triton_version = "?"

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu_suite_{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    parity_rows: list[Any] = []
    timings: list[dict[str, Any]] = []
    ceil: dict[str, float] = {}

    def save() -> None:
        """The JSON so far: rewritten after each part and each timing row, so a run killed at
        its time limit keeps what it measured."""
        path.write_text(json.dumps({
            "device": dev_name, "host": platform.node(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version, "smoke": smoke,
            "datasheet": {"flops": PEAK_FLOPS, "hbm_bytes_per_s": PEAK_HBM},
            "measured": ceil, "parity_examples": a.examples,
            "parity": [r.as_dict() for r in parity_rows], "timings": timings,
            "elapsed_s": time.time() - start,
        }, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o)
            else str(o)))

    # ---- 1. parity
    if not a.skip_parity:
        print(f"\n== parity: {a.examples} examples per op and dtype (kernels on {shp.DEV}) ==",
              flush=True)
        parity_rows = run_parity_rows(backend, ops, a.examples, start + 0.45 * a.budget_s,
                                      emulate=smoke, profile="smoke" if smoke else None)
        from glm5.testing.parity import format_table

        print(format_table(parity_rows))
    n_fail = sum(r.status == "fail" for r in parity_rows)
    save()

    # ---- 2. ceilings
    timer = Clock(shp.DEV)
    ceil.update(measure_ceilings(timer, *((128, 2**20) if smoke else ())))
    save()
    print(f"\n== ceilings: bf16 matmul {ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s "
          f"(datasheet {PEAK_FLOPS['bf16'] / 1e12:.0f}), device copy "
          f"{ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s (datasheet {PEAK_HBM / 1e9:.0f}) ==",
          flush=True)

    # ---- 3. timings
    for name in OPS:
        entry = backend.kernels.get(name)
        if entry is None or (ops is not None and name not in ops):
            continue
        shapes = shapes_of.get(name)
        if not shapes:
            timings.append({"op": name, "shape": "-", "dtype": "-", "ms": None,
                            "reference_ms": None, "speedup_vs_reference": None, "baseline": "",
                            "baseline_ms": None, "tflops": None, "gbps": None,
                            "roofline_pct": None, "measured_roofline_pct": None,
                            "note": "no GPU shape defined in gpu_suite.py"})
            continue
        for label, build, dtypes, baseline in shapes:
            for dt in dtypes:
                if not entry.accepts_dtype(dt):
                    continue
                if time.time() > deadline:
                    timings.append({"op": name, "shape": label, "dtype": _dtname(dt),
                                    "ms": None, "reference_ms": None,
                                    "speedup_vs_reference": None, "baseline": "",
                                    "baseline_ms": None, "tflops": None, "gbps": None,
                                    "roofline_pct": None, "measured_roofline_pct": None,
                                    "note": "skipped: time budget spent"})
                    continue
                t0 = time.time()
                try:
                    r = time_op(timer, entry, name, label, build, dt, baseline, ceil,
                                not a.skip_reference, a.per_measure_s)
                except torch.cuda.OutOfMemoryError:
                    r = {"op": name, "shape": label, "dtype": _dtname(dt), "ms": None,
                         "reference_ms": None, "speedup_vs_reference": None, "baseline": "",
                         "baseline_ms": None, "tflops": None, "gbps": None,
                         "roofline_pct": None, "measured_roofline_pct": None,
                         "note": "kernel: out of GPU memory"}
                except Exception as e:
                    r = {"op": name, "shape": label, "dtype": _dtname(dt), "ms": None,
                         "reference_ms": None, "speedup_vs_reference": None, "baseline": "",
                         "baseline_ms": None, "tflops": None, "gbps": None,
                         "roofline_pct": None, "measured_roofline_pct": None,
                         "note": f"kernel raised {type(e).__name__}: {str(e)[:160]}",
                         "traceback": traceback.format_exc(limit=4)}
                _empty_cache()
                ms = "-" if r["ms"] is None else f"{r['ms']:.3f} ms"
                print(f"  time {name:18s} {label:45s} {_dtname(dt):9s} {ms} "
                      f"({time.time() - t0:.1f}s) {r['note']}", flush=True)
                timings.append(r)
                save()

    print("\n" + format_timings(timings))
    elapsed = time.time() - start
    print(f"\nparity: {sum(r.status == 'pass' for r in parity_rows)} passed, {n_fail} failed, "
          f"{sum(r.status == 'skip' for r in parity_rows)} skipped | {len(timings)} timing rows "
          f"| {elapsed:.0f} s")
    save()
    print(f"wrote {path}")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
