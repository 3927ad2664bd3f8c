"""`quant_linear` (all four schemes of docs/ops.md) and `moe_experts_quant` for the cpu backend.

One TVM kernel per scheme reads the canonical packed weight ``w[N, P]`` directly (no repacking,
no dequantized copy) and unpacks in registers:

* the packed row is walked in *units*: 1 byte = 1 value (int8), 1 byte = 2 values (int4, low
  nibble = even k), 3 bytes = 4 values (int6, 24-bit little-endian word, value j in bits
  6j..6j+5); values are sign-extended with ``(v ^ 2^(b-1)) - 2^(b-1)``;
* the activation goes in split into the unit's V value streams, ``xs[M, V, U]`` (value j of unit
  u is ``x[4u + j]`` for int6), so every load in the inner loop is a contiguous VL-lane vector
  along the units (VL = 16 fp32 / int32 lanes: one AVX-512 register, two AVX2 registers;
  the 1-row build keeps 4 such vectors (2 for int6) of accumulators as independent FMA chains);
* ``T.parallel`` over the output features n; each weight vector is unpacked once and used for a
  block of MB activation rows (x is zero padded to a multiple of MB rows).

w8a16 (float activation): ``y[m, n] = s_w[n] · Σ_k x[m, k] · w_q[n, k]`` in fp32 (the scale
factored out of the sum: one multiply per output instead of per weight; the reordering is far
inside the fp32 tolerance). Activation schemes: the activation is
quantized per token on the host with the reference's own function (same codes, bit for bit),
the kernel accumulates ``Σ_{k∈g} x_q · w_q`` per group of 128 in int32 (exact: |sum| < 2^31
for every scheme at these group sizes; w8a8 is one group of K, K·127² < 2^31 is required by
the supports check) and then
``y = s_x[m] · Σ_g s_w[n, g] · float(isum_g)`` in fp32.

The kernel is a GEMV with 4-row register blocks, written for any LLVM target ("portable").
Which path serves a call is chosen per CPU tier (`cpu_tier`: AMX, AVX-512 VNNI or neither,
read from the CPU at run time), scheme and row count from the table `PATHS`: the VNNI GEMV of
`quant_vnni` (few rows), the AMX tile GEMM of `quant_amx` (more rows), on VNNI without AMX the
register-tiled GEMM of `quant_vgemm` (more rows; w8a16 with fp32 FMAs on fp32 x and
vdpbf16ps on bf16 x), this
module's GEMV, or `gemm_torch` (w8a16: sgemms over blocks of rows widened to fp32; w8a8:
exact fp32 sgemms over K-chunks of codes). The crossovers are measured by
bench/cpu_quant_linear.py (--paths) and listed in docs/performance.md, "CPU quantized
linears". Only M, N and K are runtime values: one build
per (scheme, row block).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from glm5.ir.quant_formats import (
    GROUP,
    SCHEMES,
    get_scheme,
    quantize_per_token_ref,
    unpack,
)
from glm5.kernels.tvm import (
    moe,
    quant_amx,
    quant_onednn,
    quant_vgemm,
    quant_vnni,
    tirlib,
)
from glm5.kernels.tvm.tirlib import UNITS, cached, unpack_code

REV = 2
VL = 16  # lanes (AVX-512: 16 fp32 / int32)
MB = 4  # activation rows per weight-vector unpack (fewer rows than MB: a 1-row build)
DTYPES = (torch.float32, torch.bfloat16)
# The path per CPU tier (`cpu_tier`), scheme and row count M: the first (max rows, path) entry
# with M <= max rows (None: any) whose path serves the call (`serves`: x's dtype, this CPU's
# features) wins; an entry (max rows, path, dtype name) applies to x of that dtype only;
# entries after the first catch-all are fallbacks for calls it does not serve.
# Paths: "vnni" the VNNI GEMV (`quant_vnni`, MB = 1 row at M = 1, else 4-row blocks), "vgemm"
# the VNNI register-tiled GEMM (`quant_vgemm`: the activation schemes; w8a16 on fp32 x, and on
# bf16 x where the CPU has AVX-512 BF16), "amx" the AMX tile GEMM (`quant_amx`), "onednn" w8a16
# on bf16 x by torch's bf16 GEMM over weight blocks TVM dequantizes (`quant_onednn`; AVX-512
# BF16), "tvm" the portable GEMV of this module, "torch:gemm" `gemm_torch`. Crossovers
# measured side by side with bench/cpu_quant_linear.py at K = N = 4096 (docs/performance.md,
# "CPU quantized linears"; the "vnni" row on an AVX-512 VNNI host without AMX, AMD Zen 5);
# "portable" is what any other host runs (the earlier measurements of an AVX2 host).
PATHS: dict[str, dict[str, tuple[tuple[Any, ...], ...]]] = {
    "amx": {"w8a16": ((4, "vnni"), (None, "amx")),
            "w8a8": ((1, "vnni"), (None, "amx")),
            "w4a8": ((1, "vnni"), (None, "amx")),
            "w6a12": ((2, "vnni"), (None, "amx"))},
    "vnni": {"w8a16": ((16, "vnni"), (32, "vnni", "float32"), (128, "vgemm"),
                       (None, "onednn", "bfloat16"), (None, "vgemm"), (None, "vnni")),
             "w8a8": ((16, "vnni"), (None, "vgemm")),
             "w4a8": ((16, "vnni"), (None, "vgemm")),
             "w6a12": ((16, "vnni"), (None, "vgemm"))},
    "portable": {"w8a16": ((384, "tvm"), (None, "torch:gemm")),
                 "w8a8": ((384, "tvm"), (None, "torch:gemm")),
                 "w4a8": ((None, "tvm"),),
                 "w6a12": ((None, "tvm"),)},
}
LABELS = {"tvm": "tvm", "vnni": "tvm:vnni", "vgemm": "tvm:vgemm", "amx": "tvm:amx",
          "onednn": "tvm+onednn", "torch:gemm": "torch:gemm"}
_tier: list[str] = []


def cpu_tier() -> str:
    """The CPU's tier for `PATHS`, from its features read at run time (once): "amx" (AMX-INT8
    and AMX-BF16 usable, and AVX-512 VNNI), "vnni" (AVX-512 VNNI, BW, VBMI), else
    "portable"."""
    if not _tier:
        vnni = quant_vnni.vnni_available()[0]
        _tier.append("amx" if vnni and quant_amx.amx_available()[0] else "vnni" if vnni
                     else "portable")
    return _tier[0]


def serves(p: str, scheme: str, dtype: torch.dtype | None = None) -> bool:
    """Whether path ``p`` computes ``scheme`` for x of ``dtype`` (None: of some dtype) on this
    CPU. The VNNI GEMM: the activation schemes, and w8a16 on fp32 x (fp32 FMAs) and, where the
    CPU has AVX-512 BF16, on bf16 x (``vdpbf16ps``); "onednn" (`quant_onednn`): w8a16 on bf16
    x where the CPU has AVX-512 BF16."""
    if p == "onednn":
        return (scheme == "w8a16" and dtype in (None, torch.bfloat16)
                and quant_vgemm.bf16_available()[0])
    if p != "vgemm" or SCHEMES[scheme].act_bits is not None or dtype in (None, torch.float32):
        return True
    return dtype == torch.bfloat16 and quant_vgemm.bf16_available()[0]


# Crossovers measured on this CPU (`glm5 tune --backend cpu`, applied by the cpu backend from
# the tuning cache): crossover_key -> the most rows each path of the `chain` but the last takes
# (a list, one per switch; an int: the first switch only).
_crossovers: dict[str, int | list[int]] = {}


def crossover_key(tier: str, scheme: str, dtype: torch.dtype) -> str:
    return f"{tier}/{scheme}/{str(dtype).removeprefix('torch.')}"


def _rows_ok(v: Any) -> bool:
    def one(r: Any) -> bool:
        return isinstance(r, int) and not isinstance(r, bool) and r >= 0

    if isinstance(v, list):
        return bool(v) and all(one(r) for r in v) and v == sorted(v)
    return one(v)


def use_crossovers(table: dict[str, int | list[int]]) -> None:
    """Replace the crossovers in force (``{crossover_key: rows}``, rows an int or a
    non-decreasing list of ints, one per switch of the `chain`; {} restores `PATHS`'). A key
    naming no tier, scheme or dtype, or other rows, raises ValueError."""
    for k, v in table.items():
        parts = k.split("/")
        ok = (len(parts) == 3 and parts[0] in PATHS and parts[1] in SCHEMES
              and parts[2] in ("float32", "bfloat16"))
        if not ok or not _rows_ok(v):
            raise ValueError(f"glm5 quant_linear crossovers: expected 'tier/scheme/dtype' -> "
                             f"rows >= 0 (an int, or a non-decreasing list of them), got "
                             f"{k!r}: {v!r}")
    _crossovers.clear()
    _crossovers.update(table)
    chain.cache_clear()  # PATHS or the CPU's features may have changed since (tests patch them)


@functools.lru_cache(maxsize=None)
def chain(scheme: str, tier: str, dtype: torch.dtype) -> tuple[tuple[str, int | None], ...]:
    """The paths `PATHS` gives x of ``dtype`` on ``tier`` as M grows, each with the most rows
    it takes (None: the last, every row above), e.g. (("vnni", 16), ("vgemm", 128), ("onednn",
    None)); one entry where one path serves every row count."""
    bounds = sorted({e[0] for e in PATHS[tier][scheme] if e[0] is not None})
    out: list[tuple[str, int | None]] = []
    cur = _table_path(scheme, 1, tier, dtype)
    for b in bounds:
        nxt = _table_path(scheme, b + 1, tier, dtype)
        if nxt != cur:
            out.append((cur, b))
            cur = nxt
    return (*out, (cur, None))


def path(scheme: str, M: int, tier: str | None = None, dtype: torch.dtype | None = None
         ) -> str:
    """The path `quant_linear` takes for ``M`` rows of ``scheme`` on ``tier`` (default: this
    CPU's), from `PATHS`, or from the crossovers measured on this CPU where they are in force
    (`use_crossovers`: they replace the `chain`'s first switches, the table keeps the rest; a
    switch below the one before it skips the path between); with ``dtype`` (x's), the first
    entry that `serves` it (without, the entries for one dtype are skipped)."""
    tier = tier or cpu_tier()
    rows = _crossovers.get(crossover_key(tier, scheme, dtype)) if dtype is not None else None
    if rows is None:
        return _table_path(scheme, M, tier, dtype)
    ch = chain(scheme, tier, dtype)
    measured = rows if isinstance(rows, list) else [rows]
    for i, (p, bound) in enumerate(ch[:-1]):
        if M <= (measured[i] if i < len(measured) else bound):
            return p
    return ch[-1][0]


def _table_path(scheme: str, M: int, tier: str, dtype: torch.dtype | None) -> str:
    for rows, p, *only in PATHS[tier][scheme]:
        if only and (dtype is None or str(dtype).removeprefix("torch.") != only[0]):
            continue
        if (rows is None or M <= rows) and (dtype is None or serves(p, scheme, dtype)):
            return p
    raise AssertionError(f"glm5 quant_linear: PATHS[{tier!r}][{scheme!r}] has no catch-all "
                         f"for {dtype}")


def build(scheme: str, MB: int = MB) -> Any:
    """``qgemv(xs[Mp, V, U], w[N, P], sw[N, G], sx[Mp], y[Mp, N], gu)``: gu = units per group.

    w8a16: xs fp32, sx unused (ones); activation schemes: xs int32 codes."""
    from tvm.script import tirx as T

    sc = SCHEMES[scheme]
    bits = sc.weight_bits
    B, V = UNITS[bits]
    wdt = "int8" if bits == 8 else "uint8"
    FLOAT = sc.act_bits is None
    adt = "float32" if FLOAT else "int32"

    def zero():
        return T.float32(0) if FLOAT else T.int32(0)

    # Lanes per accumulator: with one activation row the accumulators are the only
    # independent FMA chains, so a 1-row build keeps several vectors of them in flight.
    L = VL if MB > 1 else {8: 4 * VL, 4: 4 * VL, 6: 2 * VL}[bits]

    def term(X, W, S, m, en, g, u, j):
        e, n = en
        wv = unpack_code(T, lambda i: W[e, n, i], u, j, bits)
        if FLOAT:
            return X[m, j, u] * T.Cast("float32", wv)
        return X[m, j, u] * wv

    @T.prim_func
    def qgemv(x_h: T.handle, w_h: T.handle, s_h: T.handle, sx_h: T.handle, y_h: T.handle,
              off_h: T.handle, gu: T.int32):
        T.func_attr({"global_symbol": "qgemv", "tirx.noalias": True})
        Mp = T.int32()
        U = T.int32()
        E = T.int32()
        N = T.int32()
        P = T.int32()
        G = T.int32()
        X = T.match_buffer(x_h, (Mp, V, U), adt)
        WE = T.match_buffer(w_h, (E, N, P), wdt)
        SE = T.match_buffer(s_h, (E, N, G), "float32")
        SX = T.match_buffer(sx_h, (Mp,), "float32")
        Y = T.match_buffer(y_h, (Mp, N), "float32")
        OFF = T.match_buffer(off_h, (E + 1,), "int32")
        for p in T.parallel(E * N):
            e = p // N
            n = p % N
            acc = T.alloc_buffer((MB, L), adt, scope="local")
            red = T.alloc_buffer((MB,), adt, scope="local")
            fac = T.alloc_buffer((MB,), "float32", scope="local")
            for mb in range(OFF[e], OFF[e + 1]):
                for mi in T.unroll(MB):
                    fac[mi] = T.float32(0)
                for g in range(G):
                    for mi in T.unroll(MB):
                        for ll in T.vectorized(L):
                            acc[mi, ll] = zero()
                    cnt = T.min(gu, U - g * gu)
                    for c in range(cnt // L):
                        for mi in T.unroll(MB):
                            for j in T.unroll(V):
                                for ll in T.vectorized(L):
                                    acc[mi, ll] = acc[mi, ll] + term(
                                        X, WE, SE, mb * MB + mi, (e, n), g,
                                        g * gu + c * L + ll, j)
                    for mi in T.unroll(MB):
                        # fold the L lanes to 8 with vector adds, then 8 scalar adds
                        for f in T.unroll(L // 8 - 1):
                            for ll in T.vectorized(8):
                                acc[mi, ll] = acc[mi, ll] + acc[mi, (f + 1) * 8 + ll]
                        red[mi] = zero()
                        for ll in T.unroll(8):
                            red[mi] = red[mi] + acc[mi, ll]
                    for r in range(cnt // L * L, cnt):
                        for mi in T.unroll(MB):
                            for j in T.unroll(V):
                                red[mi] = red[mi] + term(X, WE, SE, mb * MB + mi, (e, n), g,
                                                         g * gu + r, j)
                    for mi in T.unroll(MB):
                        if FLOAT:  # one group: s_w[n] · Σ x · w_q
                            fac[mi] = fac[mi] + SE[e, n, g] * red[mi]
                        else:
                            fac[mi] = fac[mi] + SE[e, n, g] * T.Cast("float32", red[mi])
                for mi in T.unroll(MB):
                    if FLOAT:
                        Y[mb * MB + mi, n] = fac[mi]
                    else:
                        Y[mb * MB + mi, n] = SX[mb * MB + mi] * fac[mi]

    return qgemv


def _fn(context: Callable[[], Any], scheme: str, mb: int) -> Callable[..., Any]:
    ctx = context()
    key = {"scheme": scheme, "vl": VL, "mb": mb, "rev": REV}
    return cached(ctx, ("quant_linear", scheme, mb),
                  lambda: ctx.kernel("quant_linear", key, lambda: build(scheme, mb), "qgemv"))


def _streams(xv: torch.Tensor, V: int, U: int, mb: int) -> torch.Tensor:
    """[M, K] -> [Mp, V, U] (rows zero padded to a multiple of mb, K to V·U): value j of
    unit u is column V·u + j."""
    M, K = xv.shape
    Mp = -(-M // mb) * mb
    if Mp == M and V * U == K:  # nothing to pad: no copy for V = 1
        return xv.contiguous().view(M, U, V).transpose(1, 2).contiguous()
    out = torch.zeros(Mp, V * U, dtype=xv.dtype)
    out[:M, :K] = xv
    return out.view(Mp, U, V).transpose(1, 2).contiguous()


def _grouped(context: Callable[[], Any], xv: torch.Tensor, sx: torch.Tensor | None,
             w3: torch.Tensor, s3: torch.Tensor, blocks: torch.Tensor, scheme: str,
             mb: int) -> torch.Tensor:
    """The kernel over experts: rows ``blocks[e]·mb .. blocks[e+1]·mb`` of ``xv`` (fp32
    activations or int codes, ``[Mp, K]``, Mp a multiple of mb) times ``w3[e]`` -> fp32
    ``[Mp, N]`` (rows outside every expert's range are left unwritten)."""
    sc = SCHEMES[scheme]
    E, N, P = w3.shape
    B, V = UNITS[sc.weight_bits]
    U = P // B
    xs = _streams(xv, V, U, mb)
    Mp = xs.shape[0]
    sxp = torch.ones(Mp, dtype=torch.float32) if sx is None else sx.to(torch.float32)
    gu = GROUP // V if sc.grouped else max(U, 1)
    y = torch.empty(Mp, N, dtype=torch.float32)
    _fn(context, scheme, mb)(xs, w3.contiguous(), s3.to(torch.float32).reshape(E, N, -1)
                             .contiguous(), sxp.contiguous(), y, blocks, gu)
    return y


def _activation(x: torch.Tensor, sc: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 rows (w8a16) or (int32 codes, fp32 scales) quantized by the reference's function."""
    if sc.act_bits is None:
        return x.to(torch.float32), None
    xq, sx = quantize_per_token_ref(x, sc.act_bits)
    return xq.to(torch.int32), sx


def gemv(context: Callable[[], Any], x: torch.Tensor, w_packed: torch.Tensor,
         w_scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """The TVM path: fp32 ``[M, N]`` without bias."""
    sc = SCHEMES[scheme]
    M = x.shape[0]
    mb = MB if M >= MB else 1
    Mp = -(-M // mb) * mb
    xv, sx = _activation(x, sc)
    if Mp != M:
        xv = torch.cat((xv, xv.new_zeros(Mp - M, xv.shape[1])))
        sx = None if sx is None else torch.cat((sx, sx.new_ones(Mp - M)))
    blocks = torch.tensor([0, Mp // mb], dtype=torch.int32)
    return _grouped(context, xv, sx, w_packed[None], w_scale[None], blocks, scheme, mb)[:M]


def exact_chunk(sc: Any) -> int:
    """Longest K-chunk whose integer sums an fp32 GEMM holds exactly: every partial sum of
    products of codes is an integer below 2^24 in magnitude (then the summation order of the
    GEMM cannot matter). Grouped schemes: a group of 128 already is (w6a12: 2047·31·128 < 2^24)."""
    bound = 2**24 // (sc.act_qmax * sc.weight_qmax)
    if sc.grouped:
        assert GROUP <= bound
        return GROUP
    return bound // VL * VL


def gemm_torch(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
               scheme: str) -> torch.Tensor:
    """The torch path (many rows: compute-bound): fp32 ``[M, N]`` without bias.

    w8a16: `_w8a16_blocks` (sgemms over blocks of weight rows widened to fp32, the scale
    after the sum). Activation schemes: the codes
    as fp32 and one sgemm per K-chunk of `exact_chunk` (exact integer sums, see there), then
    the scale products of the reference: grouped ``Σ_g s_w[n, g] · isum_g``, per channel the
    exact chunk sums added in float64 before the single rounding to fp32."""
    import torch.nn.functional as F

    sc = SCHEMES[scheme]
    K = x.shape[1]
    f32 = torch.float32
    if sc.act_bits is None:
        return _w8a16_blocks(x.to(f32), w_packed, w_scale.to(f32))
    wq = unpack(w_packed, sc, K).to(f32)
    xq, sx = quantize_per_token_ref(x, sc.act_bits)
    xf = xq.to(f32)
    ch = exact_chunk(sc)
    if sc.grouped:
        y = torch.zeros(x.shape[0], w_packed.shape[0], dtype=f32)
        sw = w_scale.to(f32)
        for g, k0 in enumerate(range(0, K, ch)):
            y += F.linear(xf[:, k0: k0 + ch], wq[:, k0: k0 + ch]) * sw[None, :, g]
        return sx[:, None] * y
    isum = torch.zeros(x.shape[0], w_packed.shape[0], dtype=torch.float64)
    for k0 in range(0, K, ch):
        isum += F.linear(xf[:, k0: k0 + ch], wq[:, k0: k0 + ch])
    return sx[:, None] * (isum.to(f32) * w_scale.to(f32)[None])


W8A16_BLOCK = 2**20  # weight codes per block of `_w8a16_blocks` (a 4 MiB fp32 scratch)


def _w8a16_blocks(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor
                  ) -> torch.Tensor:
    """w8a16 through MKL's sgemm, the weight widened to fp32 a block of rows at a time into a
    reused scratch (a whole fp32 copy is 4x the packed bytes and, freshly allocated per call,
    page-faults on every call): ``y[:, block] = (x @ w_q[block]ᵀ) · s_w[block]`` — the scale
    factored out of the sum, as every cpu kernel of w8a16 does. fp32 [M, N]."""
    M, K = x.shape
    N = w_packed.shape[0]
    rows = max(1, min(N, W8A16_BLOCK // max(K, 1)))
    y = tirlib.fresh((M, N), torch.float32)
    wf = tirlib.scratch("w8a16_rows", (rows, K), torch.float32)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        blk = wf[: n1 - n0]
        blk.copy_(w_packed[n0:n1, :K])
        y[:, n0:n1] = torch.mm(x, blk.T).mul_(w_scale.reshape(1, N)[:, n0:n1])
    return y


def run_path(p: str, context: Callable[[], Any], x: torch.Tensor, w_packed: torch.Tensor,
             w_scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """Path ``p`` of `PATHS` on a non-empty product: ``[M, N]`` without bias, fp32 (the
    "onednn" path: bf16, x's dtype, rounded by its GEMM)."""
    if p == "onednn":
        return quant_onednn.gemm(context, x, w_packed, w_scale)
    if p == "vnni":
        return quant_vnni.gemv_vnni(context, x, w_packed, w_scale, scheme,
                                    1 if x.shape[0] == 1 else MB)
    if p == "vgemm":
        return quant_vgemm.gemm_vnni(context, x, w_packed, w_scale, scheme)
    if p == "amx":
        return quant_amx.gemm_amx(context, x, w_packed, w_scale, scheme)
    if p == "tvm":
        return gemv(context, x, w_packed, w_scale, scheme)
    if p == "torch:gemm":
        return gemm_torch(x, w_packed, w_scale, scheme)
    raise ValueError(f"glm5 quant_linear: path expected one of {sorted(LABELS)}, got {p!r}")




def quant_linear(context: Callable[[], Any], x: torch.Tensor, w_packed: torch.Tensor,
                 w_scale: torch.Tensor, scheme: str, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x [M, K] fp32/bf16, canonical packed weight [N, P] with scales -> [M, N] in x's dtype."""
    get_scheme(scheme, "quant_linear")
    M, K = x.shape
    N = w_packed.shape[0]
    if M == 0 or N == 0 or K == 0:
        y = torch.zeros(M, N, dtype=torch.float32)
    else:
        y = run_path(path(scheme, M, dtype=x.dtype), context, x, w_packed, w_scale, scheme)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def moe_experts_quant(context: Callable[[], Any], x, ids, weights, w13_packed, w13_scale,
                      w2_packed, w2_scale, scheme: str) -> torch.Tensor:
    """`moe_experts` with quantized experts: the routed rows sorted by expert (as
    `moe.moe_experts`). On a VNNI or AMX tier each expert's rows run quant_linear's path for
    their count (`_moe_by_expert`: the VNNI GEMV for a few rows, the VNNI / AMX GEMM for
    many); on the portable tier each expert's run is padded to whole blocks of MB rows, so ONE
    portable GEMV call per projection serves all experts (parallel over expert x output
    feature). TVM silu_mul; the TVM j-ordered weighted combine. Roundings follow the
    reference: each projection's output in x's dtype, silu_mul in fp32 rounded to x's
    dtype."""
    sc = SCHEMES[scheme]
    T_, D = x.shape
    E = w13_packed.shape[0]
    I = w13_packed.shape[1] // 2
    y = torch.empty(T_, D, dtype=x.dtype)
    if T_ == 0 or D == 0:
        return y
    combine, silu = moe._fns(context, x.dtype)
    tok, pos, counts = moe.route_rows(ids, E)
    if cpu_tier() != "portable" and tok.shape[0] and I:
        # each expert's rows through quant_linear's own path for its row count (VNNI GEMV /
        # GEMM, AMX): sorted rows, no padding; the combine reads them by slot
        o = _moe_by_expert(context, x, tok, counts, w13_packed, w13_scale, w2_packed,
                           w2_scale, scheme, silu)
        combine(o, pos.contiguous(), weights.to(torch.float32).contiguous(), moe.bits(y))
        return y
    cnt = torch.tensor(counts, dtype=torch.int64)
    nblk = (cnt + MB - 1) // MB
    blocks = torch.zeros(E + 1, dtype=torch.int64)
    blocks[1:] = torch.cumsum(nblk, 0)
    Mp = int(blocks[-1]) * MB
    # padded row of each sorted row: its expert's block start + its rank within the expert
    start = torch.zeros(E + 1, dtype=torch.int64)
    start[1:] = torch.cumsum(cnt, 0)
    expert = x.new_empty(0, dtype=torch.int64).new_tensor(
        [e for e, c in enumerate(counts) for _ in range(c)])  # expert of each sorted row
    prow = blocks[:-1][expert] * MB + (torch.arange(tok.shape[0]) - start[:-1][expert])
    xs = torch.zeros(Mp, D, dtype=x.dtype)
    xs[prow] = x[tok]
    b32 = blocks.to(torch.int32)
    o = torch.zeros(Mp, D, dtype=torch.float32) if not (Mp and I) else None
    if Mp and I:
        xv, sx = _activation(xs, sc)
        h13 = _grouped(context, xv, sx, w13_packed, w13_scale, b32, scheme, MB)
        h13 = h13.to(x.dtype).to(torch.float32)  # quant_linear's output dtype
        hs = torch.empty(Mp, I, dtype=torch.float32)
        silu(h13, hs)
        xv, sx = _activation(hs.to(x.dtype), sc)
        o = _grouped(context, xv, sx, w2_packed, w2_scale, b32, scheme, MB)
        o = o.to(x.dtype).to(torch.float32)
    # padded row of each slot; a skipped slot (-1) picks the appended -1
    ppos = torch.cat((prow.to(torch.int32), pos.new_full((1,), -1)))[pos.long()]
    combine(o, ppos.contiguous(), weights.to(torch.float32).contiguous(), moe.bits(y))
    return y


def _moe_by_expert(context: Callable[[], Any], x: torch.Tensor, tok: torch.Tensor,
                   counts: list[int], w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                   w2_packed: torch.Tensor, w2_scale: torch.Tensor, scheme: str,
                   silu: Callable) -> torch.Tensor:
    """fp32 ``[R, D]``: the routed rows (sorted by expert, ``tok`` their tokens) through each
    expert's gate/up projection, silu_mul and down projection, every projection on the path
    `PATHS` names for that expert's row count and rounded to x's dtype like the op's
    reference."""
    f32 = torch.float32
    I = w13_packed.shape[1] // 2
    xs = x[tok]
    o = torch.empty(tok.shape[0], x.shape[1], dtype=f32)
    a = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        p = path(scheme, n, dtype=x.dtype)
        h13 = run_path(p, context, xs[a: a + n], w13_packed[e], w13_scale[e], scheme)
        hs = torch.empty(n, I, dtype=f32)
        silu(h13.to(x.dtype).to(f32), hs)
        o[a: a + n] = run_path(p, context, hs.to(x.dtype), w2_packed[e], w2_scale[e],
                               scheme).to(x.dtype)
        a += n
    return o


def _cpu(*ts: Any) -> bool:
    return all(t.device.type == "cpu" for t in ts if isinstance(t, torch.Tensor))


def _int32_exact(scheme: str, K: int) -> bool:
    """The GEMV's int32 group sums cannot overflow (w8a8's one group is all of K)."""
    sc = SCHEMES[scheme]
    if sc.act_bits is None:
        return True
    n = GROUP if sc.grouped else K
    return n * sc.act_qmax * sc.weight_qmax < 2**31


def _int32_indexed(M: int, K: int, N: int) -> bool:
    """Every buffer of every path indexes with int32: x and its laid-out copies (up to three
    planes, rows padded to 16, K to 128), y [M, N]."""
    return 3 * (-(-M // 16) * 16) * (-(-K // 128) * 128) < 2**31 and M * N < 2**31


def _ql_supports(x, w_packed, w_scale, scheme, bias=None) -> bool:
    return (x.dtype in DTYPES and scheme in SCHEMES and _cpu(x, w_packed, w_scale, bias)
            and x.dim() == 2 and _int32_exact(scheme, x.shape[1]) and w_packed.numel() < 2**31
            and w_packed.dim() == 2
            and _int32_indexed(x.shape[0], x.shape[1], w_packed.shape[0]))


def _meq_supports(x, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, scheme) -> bool:
    return (x.dtype in DTYPES and scheme in SCHEMES
            and _cpu(x, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale)
            and x.numel() < 2**31 and w13_packed.shape[1] % 2 == 0
            and _int32_exact(scheme, max(x.shape[1], w13_packed.shape[1] // 2)))


def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    """Rows for the cpu backend: (op, fn, dtypes, supports)."""
    def _ql(x, w_packed, w_scale, scheme, bias=None):
        return quant_linear(context, x, w_packed, w_scale, scheme, bias)

    def _meq(x, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, scheme):
        return moe_experts_quant(context, x, ids, weights, w13_packed, w13_scale, w2_packed,
                                 w2_scale, scheme)

    return [("quant_linear", _ql, DTYPES, _ql_supports),
            ("moe_experts_quant", _meq, DTYPES, _meq_supports)]
