"""`glm5 bench`: per op and shape, the backend's kernel vs the reference (and a torch baseline
where one exists), side by side in one run, with achieved GFLOP/s and GB/s against the roofline
from `OpDef.cost` and the machine's ceilings measured in the same run.

Roofline time = max(flops / matmul rate of the dtype, bytes / memory bandwidth); "% roofline" is
roofline time / measured time. The ceilings are true ceilings: the best of several runs of the
fastest path torch has on this CPU (matmul: `torch.mm` and `F.linear` over sizes, oneDNN/AMX for
bf16 where present, MKL for fp32; bandwidth: copy and sum over sizes from in-cache to DRAM), so
no kernel should pass 100%. Should one still do (a kernel faster than anything torch reached),
the ceilings are measured once more, and if it still passes them the ceiling is raised to what
the kernel reached and that row says so (`BenchRow.note`, `ceilings["raised"]`).
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from glm5.backends.api import Backend
from glm5.ir.catalog import OPS
from glm5.ir.fp8 import quantize_rows_e4m3
from glm5.ir.quant_formats import dequantize_weight, quantize_weight
from glm5.progress import progress_bar
from glm5.perf.measure import (
    PeakRSS,
    cpu_features,
    fmt_bytes,
    fmt_time,
    matmul_path,
    matmul_rate,
    memory_bandwidth,
    peak_allocated,
    time_it,
)

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


def _paged(lens: list[int], seq: list[int], k_len: list[int], ps: int = 64, fp8: bool = False):
    """paged_indexer_topk at GLM-5's indexer sizes over a shuffled pool of ``ps``-row pages
    (sequence b of length lens[b]; query t of sequence seq[t] sees k_len[t] keys); ``fp8``:
    paged_indexer_topk_fp8's pool (e4m3 codes and a scale per row)."""
    def build(dt):
        used = [-(-n // ps) for n in lens]
        n_pages = sum(used) + 8
        perm = torch.randperm(n_pages, generator=_g(3)).tolist()
        table = torch.full((len(lens), max(used) + 1), -1, dtype=torch.int32)
        for b, n in enumerate(used):
            table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
            perm = perm[n:]
        T = len(seq)
        k = _randn(n_pages * ps, 128, dtype=dt)
        pool = dict(zip(("k", "k_scale"), quantize_rows_e4m3(k))) if fp8 else {"k": k}
        return {"q": _randn(T, 32, 128, dtype=dt), **pool,
                "w": _randn(T, 32, scale=32 ** -0.5), "block_table": table,
                "seq": torch.tensor(seq, dtype=torch.int32),
                "k_len": torch.tensor(k_len, dtype=torch.int32), "page_size": ps, "topk": 2048}
    return build


def _ql(M, K, N, scheme):
    def build(dt):
        wp, ws = quantize_weight(_randn(N, K, scale=K ** -0.5), scheme)
        return {"x": _randn(M, K, dtype=dt), "w_packed": wp, "w_scale": ws, "scheme": scheme,
                "bias": None}
    return build


def _ql_baseline(a: dict[str, Any]) -> Callable[[], Any]:
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
    **{op: [
        Shape("decode B=32 L=4096 page=64 Hi=32 Di=128 topk=2048",
              _paged([4096] * 32, list(range(31, -1, -1)), [4096] * 32, fp8=fp8)),
        Shape("prefill T=512 L=8192 page=64 Hi=32 Di=128 topk=2048",
              _paged([8192], [0] * 512, list(range(8192 - 511, 8193)), fp8=fp8)),
    ] for op, fp8 in (("paged_indexer_topk", False), ("paged_indexer_topk_fp8", True))},
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
    """One (op, shape, dtype) measurement. Times are seconds-derived milliseconds (``ms``:
    median of ``repeat`` rounds); ``peak_mb`` is what torch allocates at the highest point of one
    call (outputs and temporaries), ``rss_mb`` the process's resident-set growth over the timed
    calls (also memory a compiled kernel allocates itself, but 0 when freed pages are reused);
    ``flops_ceiling`` / ``bandwidth_ceiling`` the FLOP/s and bytes/s the row's roofline used,
    ``bound`` which of the two terms decided it."""

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
    peak_mb: float | None
    reference_peak_mb: float | None
    rss_mb: float = 0.0
    bound: str = ""
    flops_ceiling: float = 0.0
    bandwidth_ceiling: float = 0.0
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# How the ceilings are measured: (matmul_rate kwargs, memory_bandwidth kwargs). Matmuls from
# 256 (where one thread's AVX-512 peak shows) up; buffers from 256 KiB (in L2) to 256 MiB (DRAM).
CEILING_RUNS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "quick": (dict(sizes=(256, 512, 1024), repeat=3, min_time=0.02),
              dict(sizes=tuple(2**k for k in range(18, 27, 2)), repeat=3, min_time=0.02)),
    "full": (dict(sizes=(256, 512, 1024, 2048), repeat=5, min_time=0.05),
             dict(sizes=tuple(2**k for k in range(18, 29, 2)), repeat=5, min_time=0.05)),
}


def ceilings(quick: bool = False) -> dict[str, Any]:
    """The roofline ceilings of this machine, measured now: ``fp32_flops``, ``bf16_flops``
    (FLOP/s), ``bandwidth`` (bytes/s, the best at any size: in cache) and ``dram_bandwidth``
    (the best at the largest size), how each was reached (``paths``), the CPU features torch
    uses (``cpu``) and ``raised`` (filled by run_bench when a kernel passes a ceiling)."""
    feats = cpu_features()
    mm, bw = CEILING_RUNS["quick" if quick else "full"]
    f32, f32_how = matmul_rate(F32, **mm)
    b16, b16_how = matmul_rate(BF16, **mm)
    band, band_how, by_size = memory_bandwidth(**bw)
    big = max(by_size)
    return {"fp32_flops": f32, "bf16_flops": b16, "bandwidth": band,
            "dram_bandwidth": by_size[big],
            "paths": {"fp32_flops": f"{matmul_path(F32, feats)}: {f32_how}",
                      "bf16_flops": f"{matmul_path(BF16, feats)}: {b16_how}",
                      "bandwidth": band_how, "dram_bandwidth": f"best of copy/sum of {fmt_bytes(big)}"},
            "bandwidth_by_size": {str(k): v for k, v in by_size.items()},
            "cpu": feats, "raised": []}


def flops_ceiling(ceil: dict[str, Any], dtype: torch.dtype) -> float:
    """The matmul rate a kernel in ``dtype`` can reach: a bf16 kernel may compute in fp32, so
    its ceiling is the faster of the two rates; everything else is held to fp32."""
    if dtype == BF16:
        return max(ceil["bf16_flops"], ceil["fp32_flops"])
    return ceil["fp32_flops"]


@dataclass
class _Raw:
    """What a row's roofline is computed from (kept until the ceilings are final)."""

    row: BenchRow
    dtype: torch.dtype
    flops: float
    nbytes: float
    seconds: float


def _finish(raw: list[_Raw], ceil: dict[str, Any]) -> None:
    """Fill each row's roofline from the final ceilings."""
    for r in raw:
        rate, band = flops_ceiling(ceil, r.dtype), ceil["bandwidth"]
        compute, memory = r.flops / rate, r.nbytes / band
        r.row.flops_ceiling, r.row.bandwidth_ceiling = rate, band
        r.row.bound = "compute" if compute >= memory else "memory"
        r.row.roofline_pct = 100.0 * max(compute, memory) / r.seconds


def _passing(raw: list[_Raw], ceil: dict[str, Any]) -> list[tuple[_Raw, str, float]]:
    """(row, ceiling key, reached) for every row that beats a ceiling."""
    out = []
    for r in raw:
        key = "bf16_flops" if r.dtype == BF16 else "fp32_flops"
        if r.flops / r.seconds > flops_ceiling(ceil, r.dtype):
            out.append((r, key, r.flops / r.seconds))
        if r.nbytes / r.seconds > ceil["bandwidth"]:
            out.append((r, "bandwidth", r.nbytes / r.seconds))
    return out


def _raise_ceilings(raw: list[_Raw], ceil: dict[str, Any],
                    remeasure: Callable[[], dict[str, Any]] | None) -> None:
    """Make the ceilings hold every row: measure them again when a row passes one (a busy
    moment may have held the first measurement down), keep the higher of the two, and raise a
    ceiling a row still passes to what that row reached, saying so in the row and in
    ``ceil["raised"]``."""
    if not _passing(raw, ceil):
        return
    if remeasure is not None:
        again = remeasure()
        for key in ("fp32_flops", "bf16_flops", "bandwidth", "dram_bandwidth"):
            if again[key] > ceil[key]:
                ceil[key] = again[key]
                ceil["paths"][key] = again["paths"][key] + " (second measurement)"
    for r, key, reached in _passing(raw, ceil):
        if reached <= ceil[key]:
            continue  # an earlier row already raised it further
        unit, scale = ("GB/s", 1e9) if key == "bandwidth" else ("GFLOP/s", 1e9)
        what = {"fp32_flops": "fp32 matmul", "bf16_flops": "bf16 matmul",
                "bandwidth": "memory bandwidth"}[key]
        note = (f"reached {reached / scale:.1f} {unit}, above the measured {what} ceiling "
                f"({ceil[key] / scale:.1f} {unit}): ceiling raised to it")
        r.row.note = "; ".join(x for x in (r.row.note, note) if x)
        ceil["raised"].append(f"{what}: {ceil[key] / scale:.1f} -> {reached / scale:.1f} {unit} "
                              f"by {r.row.op} {r.row.shape} {r.row.dtype}")
        ceil[key] = reached
        ceil["paths"][key] = f"observed: {r.row.op} {r.row.shape} {r.row.dtype}"


def run_bench(backend: Backend, ops: list[str] | None, with_reference: bool = True,
              repeat: int = 3, quick: bool = False, *,
              shapes: dict[str, list[Shape]] | None = None,
              ceil: dict[str, Any] | None = None,
              remeasure: bool = True) -> tuple[dict[str, Any], list[BenchRow]]:
    """Time ``backend``'s kernels for ``ops`` (default: every op with shapes) at ``shapes``
    (default: SHAPES), with the reference and a torch baseline beside them, against the
    ceilings ``ceil`` (default: measured now, `ceilings(quick)`). Draws a progress bar on a
    terminal. Returns (ceilings, rows); no row's ``roofline_pct`` exceeds 100 (see
    `_raise_ceilings`; ``remeasure=False`` skips the second measurement)."""
    table = SHAPES if shapes is None else shapes
    names = [o for o in (ops or list(table)) if o in table]
    todo = []
    for name in names:
        entry = backend.kernels.get(name)
        if entry is None:
            continue
        for shape in table[name]:
            for dt in shape.dtypes:
                if entry.dtypes is None or dt in entry.dtypes:
                    todo.append((name, entry, shape, dt))
    raw: list[_Raw] = []
    with progress_bar(len(todo) + (ceil is None), "glm5 bench", unit="row") as bar:
        if ceil is None:
            bar.set_description_str("glm5 bench: measuring the machine's ceilings")
            ceil = ceilings(quick)
            bar.update()
        for name, entry, shape, dt in todo:
            op = OPS[name]
            dname = str(dt).replace("torch.", "")
            bar.set_description_str(f"glm5 bench: {name} {shape.label} {dname}")
            values, _ = op.validate((), shape.build(dt))
            args = tuple(values[n] for n in op.param_names)
            if not entry.accepts(args):
                bar.update()
                continue
            flops, nbytes = op.cost(values, op.symbols(values))
            with torch.inference_mode():
                with PeakRSS() as pk:
                    t = time_it(lambda: entry.fn(*args), repeat=repeat)
                peak = peak_allocated(lambda: entry.fn(*args))
                rt = rpeak = None
                if with_reference and entry.backend.name != "reference":
                    rt = time_it(lambda: op.reference(*args), repeat=max(1, repeat // 2))
                    rpeak = peak_allocated(lambda: op.reference(*args))
                bt = None
                if shape.baseline is not None:
                    bt = time_it(shape.baseline(values), repeat=repeat)
            row = BenchRow(
                backend.name, name, shape.label, dname, t * 1e3,
                rt * 1e3 if rt is not None else None, rt / t if rt is not None else None,
                shape.baseline_name, bt * 1e3 if bt is not None else None, flops / t / 1e9,
                nbytes / t / 1e9, 0.0, peak / 2**20 if peak is not None else None,
                rpeak / 2**20 if rpeak is not None else None, pk.peak / 2**20)
            raw.append(_Raw(row, dt, flops, nbytes, t))
            bar.update()
    _raise_ceilings(raw, ceil, (lambda: ceilings(quick)) if remeasure else None)
    _finish(raw, ceil)
    return ceil, [r.row for r in raw]


def _ms(ms: float | None) -> str:
    return fmt_time(ms / 1e3) if ms is not None else "-"


def _mb(mb: float | None) -> str:
    return fmt_bytes(mb * 2**20) if mb is not None else "-"


def _num(v: float) -> str:
    """A rate or percentage that stays readable when small: 2 significant digits under 10."""
    return f"{v:.0f}" if v >= 9.5 else f"{v:.2g}"


def format_rows(ceil: dict[str, Any], rows: list[BenchRow]) -> str:
    """The table `glm5 bench` prints: the ceilings, one line per row, notes as footnotes."""
    paths = ceil.get("paths", {})
    out = [f"ceilings measured in this run (best of several runs of torch's fastest path): "
           f"fp32 matmul {ceil['fp32_flops'] / 1e9:.0f} GFLOP/s "
           f"({paths.get('fp32_flops', '')}), bf16 matmul {ceil['bf16_flops'] / 1e9:.0f} "
           f"GFLOP/s ({paths.get('bf16_flops', '')}), memory {ceil['bandwidth'] / 1e9:.1f} GB/s "
           f"({paths.get('bandwidth', '')}; DRAM-sized: "
           f"{ceil.get('dram_bandwidth', 0.0) / 1e9:.1f} GB/s)"]
    out += [f"ceiling raised: {r}" for r in ceil.get("raised", [])]
    out.append("")
    head = ("op", "shape", "dtype", "time", "ref time", "x ref", "baseline", "GFLOP/s", "GB/s",
            "% roof", "bound", "peak mem", "ref peak mem")
    body, notes = [], []
    for r in rows:
        mark = ""
        if r.note:
            notes.append(r.note)
            mark = f" [{len(notes)}]"
        body.append((r.op, r.shape, r.dtype, _ms(r.ms), _ms(r.reference_ms),
                     f"{r.speedup_vs_reference:.1f}" if r.speedup_vs_reference is not None
                     else "-",
                     f"{_ms(r.baseline_ms)} ({r.baseline})" if r.baseline_ms is not None
                     else "-",
                     _num(r.gflops), _num(r.gbps), f"{_num(r.roofline_pct)}{mark}", r.bound,
                     _mb(r.peak_mb), _mb(r.reference_peak_mb)))
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    out.append("  ".join(h.ljust(x) for h, x in zip(head, w)).rstrip())
    out.append("  ".join("-" * x for x in w))
    out += ["  ".join(c.ljust(x) for c, x in zip(b, w)).rstrip() for b in body]
    if notes:
        out.append("")
        out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(out)


def write_csv(path: str | Path, rows: list[BenchRow]) -> None:
    """One line per row, every BenchRow field (times in ms, memory in MiB, ceilings in FLOP/s
    and bytes/s), for a spreadsheet or pandas."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(BenchRow)])
        w.writeheader()
        for r in rows:
            w.writerow(r.as_dict())


def plot_rows(path: str | Path, rows: list[BenchRow], title: str = "") -> None:
    """A PNG of % of roofline per op and shape, one bar per dtype side by side (grouped
    horizontal bars, 0-100%). matplotlib is imported here, not at module import."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("glm5 bench --plot needs matplotlib: pip install matplotlib "
                          "(or glm5[bench])") from None
    groups: list[tuple[str, str]] = []
    for r in rows:
        if (r.op, r.shape) not in groups:
            groups.append((r.op, r.shape))
    dtypes = sorted({r.dtype for r in rows})
    pct = {(r.op, r.shape, r.dtype): r.roofline_pct for r in rows}
    height = 0.8 / max(1, len(dtypes))
    fig = Figure(figsize=(10, 1.2 + 0.32 * len(groups) * max(1, len(dtypes)) ** 0.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for j, dt in enumerate(dtypes):
        ys = [i + (j - (len(dtypes) - 1) / 2) * height for i, g in enumerate(groups)
              if (*g, dt) in pct]
        xs = [pct[(*g, dt)] for g in groups if (*g, dt) in pct]
        bars = ax.barh(ys, xs, height=height, label=dt)
        ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=2)
    ax.set_yticks(range(len(groups)), [f"{op}: {shape}" for op, shape in groups], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of roofline (measured ceilings)")
    ax.legend(title="dtype", loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
