"""`glm5 bench`: per op and shape, the backend's kernel vs the reference (and a torch baseline
where one exists), side by side in one run, with achieved GFLOP/s and GB/s against the roofline
from `OpDef.cost` and the machine's ceilings measured in the same run.

Roofline time = max(flops / matmul rate of the dtype, bytes / memory bandwidth); "% roofline" is
roofline time / measured time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from glm5.backends.api import Backend
from glm5.ir.catalog import OPS
from glm5.ir.quant_formats import quantize_weight
from glm5.testing.measure import PeakRSS, matmul_rate, memory_bandwidth, time_it

BF16, F32 = torch.bfloat16, torch.float32


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype=F32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_g(sum(shape))) * scale).to(dtype)


def _causal(T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    end = (torch.arange(T) + S - T + 1).clamp(1, S).to(torch.int32)
    return torch.zeros(T, dtype=torch.int32), end


def _idx(T: int, S: int, K: int) -> torch.Tensor:
    g = _g(1)
    return torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)]).to(torch.int32)


@dataclass
class Shape:
    label: str
    build: Callable[[torch.dtype], dict[str, Any]]
    dtypes: tuple[torch.dtype, ...] = (F32, BF16)
    baseline: Callable[[dict[str, Any]], Any] | None = None  # a torch-native equivalent
    baseline_name: str = ""


def _sparse(T, S, K, H, Hk, Dqk, Dv):
    def build(dt):
        k = _randn(S, Hk, Dqk, dtype=dt)
        v = k[..., :Dv] if Hk == 1 and Dv < Dqk else _randn(S, Hk, Dv, dtype=dt)
        return {"q": _randn(T, H, Dqk, dtype=dt), "k": k, "v": v, "idx": _idx(T, S, K),
                "scale": Dqk ** -0.5}
    return build


def _moe(T, k, E, D, I):
    def build(dt):
        ids = torch.stack([torch.randperm(E, generator=_g(t))[:k] for t in range(T)])
        return {"x": _randn(T, D, dtype=dt), "ids": ids.to(torch.int32),
                "weights": torch.rand(T, k, generator=_g(2)),
                "w13": _randn(E, 2 * I, D, dtype=dt, scale=D ** -0.5),
                "w2": _randn(E, D, I, dtype=dt, scale=I ** -0.5)}
    return build


def _ql(M, K, N, scheme):
    def build(dt):
        wp, ws = quantize_weight(_randn(N, K, scale=K ** -0.5), scheme)
        return {"x": _randn(M, K, dtype=dt), "w_packed": wp, "w_scale": ws, "scheme": scheme,
                "bias": None}
    return build


def _ql_baseline(a: dict[str, Any]) -> Callable[[], Any]:
    from glm5.ir.quant_formats import dequantize_weight

    w = dequantize_weight(a["w_packed"], a["w_scale"], a["scheme"], a["x"].shape[1])
    x = a["x"].float()
    return lambda: F.linear(x, w)


def _moe_baseline(a: dict[str, Any]) -> Callable[[], Any]:
    """A good torch composition: slots sorted by expert, per-expert F.linear on contiguous
    slices, one index_add_ per expert (fp32, as the reference)."""
    x, ids, wts, w13, w2 = (a[n] for n in ("x", "ids", "weights", "w13", "w2"))
    E, k = w13.shape[0], ids.shape[1]

    def run() -> torch.Tensor:
        flat = ids.reshape(-1).long()
        key = torch.where(flat >= 0, flat, E)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=E + 1).tolist()
        xs = x.float()[order[: len(flat) - counts[E]] // k]
        y = torch.zeros(x.shape, dtype=torch.float32)
        a0 = 0
        for e in range(E):
            n = counts[e]
            if n:
                sl = order[a0: a0 + n]
                h = F.linear(xs[a0: a0 + n], w13[e].float())
                i = h.shape[1] // 2
                o = F.linear(F.silu(h[:, :i]) * h[:, i:], w2[e].float())
                y.index_add_(0, sl // k, o * wts.reshape(-1)[sl, None])
                a0 += n
        return y.to(x.dtype)

    return run


def _moeq(T, k, E, D, I, scheme):
    def build(dt):
        a = _moe(T, k, E, D, I)(F32)
        packs = [[quantize_weight(w[e], scheme) for e in range(E)] for w in (a["w13"], a["w2"])]
        return {"x": a["x"].to(dt), "ids": a["ids"], "weights": a["weights"],
                "w13_packed": torch.stack([p for p, _ in packs[0]]),
                "w13_scale": torch.stack([s for _, s in packs[0]]),
                "w2_packed": torch.stack([p for p, _ in packs[1]]),
                "w2_scale": torch.stack([s for _, s in packs[1]]), "scheme": scheme}
    return build


def _attn_baseline(a: dict[str, Any]) -> Callable[[], Any]:
    q, k, v = (a[n].permute(1, 0, 2)[None] for n in ("q", "k", "v"))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T, S = q.shape[2], k.shape[2]
    s = torch.arange(S)[None, :]
    mask = (s >= a["k_start"][:, None].long()) & (s < a["k_end"][:, None].long())
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a["scale"])


SHAPES: dict[str, list[Shape]] = {
    "rms_norm": [Shape("T=2048 D=6144", lambda dt: {"x": _randn(2048, 6144, dtype=dt),
                                                    "weight": _randn(6144, dtype=dt),
                                                    "eps": 1e-5}),
                 Shape("decode T=4 D=6144", lambda dt: {"x": _randn(4, 6144, dtype=dt),
                                                        "weight": _randn(6144, dtype=dt),
                                                        "eps": 1e-5})],
    "rope": [Shape("T=2048 H=64 R=64", lambda dt: {
        "x": _randn(2048, 64, 64, dtype=dt), "cos": _randn(2048, 32, dtype=dt),
        "sin": _randn(2048, 32, dtype=dt), "interleaved": True}),
        Shape("NeoX T=2048 H=64 R=64", lambda dt: {
            "x": _randn(2048, 64, 64, dtype=dt), "cos": _randn(2048, 32, dtype=dt),
            "sin": _randn(2048, 32, dtype=dt), "interleaved": False}),
        Shape("decode T=4 H=64 R=64", lambda dt: {
            "x": _randn(4, 64, 64, dtype=dt), "cos": _randn(4, 32, dtype=dt),
            "sin": _randn(4, 32, dtype=dt), "interleaved": True})],
    "silu_mul": [Shape("T=2048 I=2048", lambda dt: {"x": _randn(2048, 4096, dtype=dt)})],
    "lightning_indexer": [Shape("T=512 S=4096 Hi=32 Di=128", lambda dt: {
        "q": _randn(512, 32, 128, dtype=dt), "k": _randn(4096, 128, dtype=dt),
        "w": _randn(512, 32), "k_start": _causal(512, 4096)[0],
        "k_end": _causal(512, 4096)[1]})],
    "indexer_topk": [Shape("T=1024 S=8192 Hi=32 Di=128 topk=2048", lambda dt: {
        "q": _randn(1024, 32, 128, dtype=dt), "k": _randn(8192, 128, dtype=dt),
        "w": _randn(1024, 32), "k_start": _causal(1024, 8192)[0],
        "k_end": _causal(1024, 8192)[1], "topk": 2048})],
    "sparse_attention": [
        Shape("decode T=64 K=2048 H=64 MQA 576/512", _sparse(64, 8192, 2048, 64, 1, 576, 512)),
        Shape("prefill T=256 K=2048 H=64 MQA 576/512",
              _sparse(256, 8192, 2048, 64, 1, 576, 512)),
        Shape("prefill T=1024 K=256 H=8 MHA 96/64", _sparse(1024, 4096, 256, 8, 8, 96, 64)),
    ],
    "attention": [Shape("T=1024 S=4096 H=8 96/64", lambda dt: {
        "q": _randn(1024, 8, 96, dtype=dt), "k": _randn(4096, 8, 96, dtype=dt),
        "v": _randn(4096, 8, 64, dtype=dt), "k_start": _causal(1024, 4096)[0],
        "k_end": _causal(1024, 4096)[1], "scale": 96 ** -0.5},
        baseline=_attn_baseline, baseline_name="torch sdpa")],
    "moe_route": [Shape("T=4096 E=256 k=8", lambda dt: {
        "logits": _randn(4096, 256), "bias": _randn(256, scale=0.1), "top_k": 8, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "routed_scaling": 2.5}, dtypes=(F32,))],
    "moe_experts": [
        Shape("T=256 k=8 E=64 D=1024 I=512", _moe(256, 8, 64, 1024, 512),
              baseline=_moe_baseline, baseline_name="torch sorted"),
        # the `small` preset at 8K context (prefill) and its decode steps
        Shape("small 8K T=8192 k=4 E=16 D=512 I=256", _moe(8192, 4, 16, 512, 256), (F32,),
              baseline=_moe_baseline, baseline_name="torch sorted"),
        Shape("small decode T=64 k=4 E=16 D=512 I=256", _moe(64, 4, 16, 512, 256), (F32,),
              baseline=_moe_baseline, baseline_name="torch sorted"),
        Shape("small decode T=1 k=4 E=16 D=512 I=256", _moe(1, 4, 16, 512, 256), (F32,),
              baseline=_moe_baseline, baseline_name="torch sorted"),
    ],
    "moe_experts_quant": [
        Shape(f"{s} T=64 k=4 E=16 D=512 I=256", _moeq(64, 4, 16, 512, 256, s), (F32,))
        for s in ("w8a16", "w4a8")],
    "quant_linear": [
        Shape("w8a16 M=1 K=N=4096", _ql(1, 4096, 4096, "w8a16"), baseline=_ql_baseline,
              baseline_name="fp32 linear"),
        Shape("w8a8 M=64 K=N=4096", _ql(64, 4096, 4096, "w8a8"), baseline=_ql_baseline,
              baseline_name="fp32 linear"),
        *[Shape(f"{s} M=1 K=N=4096", _ql(1, 4096, 4096, s), (F32,), baseline=_ql_baseline,
                baseline_name="fp32 linear") for s in ("w8a8", "w4a8", "w6a12")],
        *[Shape(f"{s} M={m} K=N=4096", _ql(m, 4096, 4096, s), (F32,), baseline=_ql_baseline,
                baseline_name="fp32 linear")
          for s, m in (("w8a16", 16), ("w8a16", 64), ("w8a16", 512), ("w8a8", 512),
                       ("w4a8", 64), ("w6a12", 64))],
    ],
    "token_logprobs": [Shape("T=256 D=1024 V=32768", lambda dt: {
        "h": _randn(256, 1024, dtype=dt), "w_vocab": _randn(32768, 1024, dtype=dt, scale=0.03),
        "targets": torch.randint(0, 32768, (256,), generator=_g()).to(torch.int32),
        "temperature": 1.0})],
}


@dataclass
class BenchRow:
    backend: str
    op: str
    shape: str
    dtype: str
    ms: float
    reference_ms: float | None
    speedup_vs_reference: float | None
    baseline: str
    baseline_ms: float | None
    gflops: float
    gbps: float
    roofline_pct: float
    peak_mb: float
    reference_peak_mb: float | None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def ceilings(quick: bool = False) -> dict[str, float]:
    n = 512 if quick else 1024
    return {"fp32_flops": matmul_rate(F32, n), "bf16_flops": matmul_rate(BF16, n),
            "bandwidth": memory_bandwidth((64 if quick else 256) * 2**20)}


def run_bench(backend: Backend, ops: list[str] | None, with_reference: bool = True,
              repeat: int = 3, quick: bool = False) -> tuple[dict[str, float], list[BenchRow]]:
    ceil = ceilings(quick)
    rows: list[BenchRow] = []
    names = [o for o in (ops or list(SHAPES)) if o in SHAPES]
    for name in names:
        entry = backend.kernels.get(name)
        if entry is None:
            continue
        op = OPS[name]
        ref = OPS[name].reference
        for shape in SHAPES[name]:
            for dt in shape.dtypes:
                if entry.dtypes is not None and dt not in entry.dtypes:
                    continue
                values, _ = op.validate((), shape.build(dt))
                args = tuple(values[n] for n in op.param_names)
                if not entry.accepts(args):
                    continue
                flops, nbytes = op.cost(values, op.symbols(values))
                with torch.inference_mode():
                    with PeakRSS() as pk:
                        t = time_it(lambda: entry.fn(*args), repeat=repeat)
                    rt = rpk = None
                    if with_reference and entry.backend.name != "reference":
                        with PeakRSS() as rp:
                            rt = time_it(lambda: ref(*args), repeat=max(1, repeat // 2))
                        rpk = rp.peak / 2**20
                    bt = None
                    if shape.baseline is not None:
                        bt = time_it(shape.baseline(values), repeat=repeat)
                # A bf16 kernel may compute in fp32: its ceiling is the faster of the two rates.
                rate = ceil["fp32_flops"] if dt != BF16 else max(ceil["bf16_flops"],
                                                                 ceil["fp32_flops"])
                roof = max(flops / rate, nbytes / ceil["bandwidth"])
                rows.append(BenchRow(
                    backend.name, name, shape.label, str(dt).replace("torch.", ""), t * 1e3,
                    rt * 1e3 if rt else None, rt / t if rt else None, shape.baseline_name,
                    bt * 1e3 if bt else None, flops / t / 1e9, nbytes / t / 1e9,
                    100.0 * roof / t, pk.peak / 2**20, rpk))
    return ceil, rows


def format_rows(ceil: dict[str, float], rows: list[BenchRow]) -> str:
    out = [f"ceilings measured in this run: fp32 matmul {ceil['fp32_flops'] / 1e9:.0f} GFLOP/s, "
           f"bf16 matmul {ceil['bf16_flops'] / 1e9:.0f} GFLOP/s, memory "
           f"{ceil['bandwidth'] / 1e9:.1f} GB/s", ""]
    head = ("op", "shape", "dtype", "ms", "ref ms", "x ref", "baseline ms", "GFLOP/s", "GB/s",
            "% roof", "peak MB", "ref peak MB")
    body = []
    for r in rows:
        body.append((r.op, r.shape, r.dtype, f"{r.ms:.2f}",
                     f"{r.reference_ms:.1f}" if r.reference_ms else "-",
                     f"{r.speedup_vs_reference:.1f}" if r.speedup_vs_reference else "-",
                     f"{r.baseline_ms:.2f} ({r.baseline})" if r.baseline_ms else "-",
                     f"{r.gflops:.1f}", f"{r.gbps:.1f}", f"{r.roofline_pct:.0f}",
                     f"{r.peak_mb:.0f}",
                     f"{r.reference_peak_mb:.0f}" if r.reference_peak_mb is not None else "-"))
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    out.append("  ".join(h.ljust(x) for h, x in zip(head, w)))
    out.append("  ".join("-" * x for x in w))
    out += ["  ".join(c.ljust(x) for c, x in zip(b, w)) for b in body]
    return "\n".join(out)
