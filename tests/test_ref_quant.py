"""Quantization formats and references: int4/int6 packing, quantize_weight, quantize_per_token,
quant_linear against exact integer group sums, moe_experts_quant."""

from __future__ import annotations

import pytest
import torch

import glm5
from glm5 import ops
from glm5.ir import quant_formats as qf
from glm5.ir.numerics import ErrorTerms, linear_error, no_error, unit_roundoff
from glm5.ir.ops_moe import expert_chain_error, moe_experts_ref
from glm5.testing.compare import assert_matches
from glm5.testing.tolerances import bound as kit_bound
from kit_bounds import output_bound

# These tests pin the reference: the default backend (e.g. cpu) may round differently.
pytestmark = pytest.mark.usefixtures("reference_only")

F64 = torch.float64
I32 = torch.int32
W4, W6, W8 = qf.SCHEMES["w4a8"], qf.SCHEMES["w6a12"], qf.SCHEMES["w8a16"]
QMAX = {"w8a16": 127, "w8a8": 127, "w4a8": 7, "w6a12": 31}
U32 = unit_roundoff(torch.float32)  # one fp32 rounding, relative
ACT = {"w8a16": None, "w8a8": 8, "w4a8": 8, "w6a12": 12}


# --------------------------------------------------------------------------- packing
@pytest.mark.parametrize("sc,lo,hi", [(W4, -8, 7), (W6, -32, 31)])
@pytest.mark.parametrize("K", [1, 2, 3, 5, 7, 8, 15, 64, 65, 66, 67])
def test_pack_unpack_round_trip_all_codes(sc, lo, hi, K):
    vals = torch.arange(lo, hi + 1, dtype=I32)
    n = vals.numel()
    # every code value appears at every position modulo the packing unit
    rows = max(1, (n + K - 1) // K) + 4
    q = torch.stack([vals.roll(r)[torch.arange(K) % n] for r in range(rows)])
    packed = qf.pack(q, sc)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, sc.packed_k(K))
    out = qf.unpack(packed, sc, K)
    assert out.dtype == I32 and torch.equal(out, q)
    # zero padding: unpacking the full packed width gives 0 past K
    unit = 2 if sc is W4 else 4
    full = qf.unpack(packed, sc, sc.unpacked_k(packed.shape[-1]))
    assert full.shape[-1] == -(-K // unit) * unit
    assert torch.equal(full[:, :K], q)
    assert torch.equal(full[:, K:], torch.zeros_like(full[:, K:]))


def test_packed_width():
    assert [W4.packed_k(k) for k in (1, 2, 3, 200, 201)] == [1, 1, 2, 100, 101]
    assert [W6.packed_k(k) for k in (1, 4, 5, 8, 13, 200)] == [3, 3, 6, 6, 12, 150]
    assert W8.packed_k(200) == 200


def test_int4_hand_byte():
    # low nibble = even k (1 -> 0x1), high nibble = odd k (-2 -> 0xE)
    p = qf.pack(torch.tensor([[1, -2]], dtype=I32), W4)
    assert p.tolist() == [[0xE1]]
    p = qf.pack(torch.tensor([[-7, 7, 3]], dtype=I32), W4)
    assert p.tolist() == [[0x79, 0x03]]  # (-7 & 0xF) = 9, 7 << 4; 3 then a zero pad nibble
    assert qf.unpack(torch.tensor([[0xE1, 0x8F]], dtype=torch.uint8), W4, 4).tolist() == \
        [[1, -2, -1, -8]]


def test_int6_hand_group():
    # codes [1, -1, 31, -31] -> 6-bit fields [1, 63, 31, 33]
    # word = 1 | 63 << 6 | 31 << 12 | 33 << 18 = 0x85FFC1, little-endian bytes C1 FF 85
    p = qf.pack(torch.tensor([[1, -1, 31, -31]], dtype=I32), W6)
    assert p.tolist() == [[0xC1, 0xFF, 0x85]]
    # K = 5: the second group holds [-2] and three zero pads -> 0x3E, 0x00, 0x00
    p = qf.pack(torch.tensor([[1, -1, 31, -31, -2]], dtype=I32), W6)
    assert p.tolist() == [[0xC1, 0xFF, 0x85, 0x3E, 0x00, 0x00]]
    assert qf.unpack(p, W6, 5).tolist() == [[1, -1, 31, -31, -2]]


def test_int8_pack_is_plain_int8():
    q = torch.tensor([[-127, 0, 5, 127]], dtype=I32)
    p = qf.pack(q, qf.SCHEMES["w8a8"])
    assert p.dtype == torch.int8 and p.tolist() == q.tolist()


# --------------------------------------------------------------------------- quantize_weight
def _manual_weight_codes(w: torch.Tensor, scheme: str):
    """Independent per-channel / per-group-of-128 symmetric quantization (fp32, Python round)."""
    qmax = QMAX[scheme]
    grouped = scheme in ("w4a8", "w6a12")
    N, K = w.shape
    bounds = [(g, min(g + 128, K)) for g in range(0, K, 128)] if grouped else [(0, K)]
    codes = torch.zeros(N, K, dtype=I32)
    scales = torch.zeros(N, len(bounds), dtype=torch.float32)
    for n in range(N):
        for gi, (a, b) in enumerate(bounds):
            seg = w[n, a:b].float()
            amax = seg.abs().max()
            s = amax / qmax if amax > 0 else torch.tensor(1.0)
            s = s.float()
            scales[n, gi] = s
            quot = (seg / s).tolist()  # fp32 quotients
            codes[n, a:b] = torch.tensor([max(-qmax, min(qmax, round(v))) for v in quot])
    return codes, (scales if grouped else scales[:, 0])


@pytest.mark.parametrize("scheme", list(QMAX))
@pytest.mark.parametrize("K", [200, 131])
def test_quantize_weight_matches_manual(scheme, K):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, K, generator=g) * torch.tensor([1.0, 0.01, 100.0, 1.0, 3.0])[:, None]
    packed, scale = qf.quantize_weight(w, scheme)
    sc = qf.SCHEMES[scheme]
    assert packed.dtype == sc.weight_dtype() and packed.shape == (5, sc.packed_k(K))
    assert scale.dtype == torch.float32
    assert scale.shape == ((5, 2) if sc.grouped else (5,))
    codes, scales = _manual_weight_codes(w, scheme)
    assert torch.equal(scale, scales)
    got = qf.unpack(packed, sc, K)
    assert torch.equal(got, codes)
    assert int(got.abs().max()) == QMAX[scheme]  # the amax element maps to +-qmax
    # dequantized error at most half a step, plus the fp32 roundings of the quotient w / s
    # (u |w| in w) and of the product code * s (u |deq|)
    deq = qf.dequantize_weight(packed, scale, scheme, K)
    step = scale.repeat_interleave(128, -1)[:, :K] if sc.grouped else scale[:, None]
    assert bool(((deq - w).abs() <= step / 2 + U32 * (w.abs() + deq.abs())).all())


@pytest.mark.parametrize("scheme", list(QMAX))
def test_quantize_weight_zero_row_and_group(scheme):
    K = 200
    w = torch.zeros(3, K)
    w[1, :5] = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0])
    w[2] = 1.0
    packed, scale = qf.quantize_weight(w, scheme)
    sc = qf.SCHEMES[scheme]
    codes = qf.unpack(packed, sc, K)
    qmax = QMAX[scheme]
    assert torch.equal(codes[0], torch.zeros(K, dtype=I32))
    if sc.grouped:
        assert scale[0].tolist() == [1.0, 1.0]
        assert scale[1, 1].item() == 1.0  # row 1's second group is all zero
        assert torch.equal(codes[1, 128:], torch.zeros(72, dtype=I32))
        assert scale[1, 0].item() == (torch.tensor(3.0) / qmax).item()  # one fp32 division
    else:
        assert scale[0].item() == 1.0
        assert scale[1].item() == (torch.tensor(3.0) / qmax).item()
    assert int(codes[1, 4]) == qmax
    assert torch.equal(codes[2], torch.full((K,), qmax, dtype=I32))


def test_round_half_to_even():
    # amax 127 -> s = 1: x / s is exactly the half values
    w = torch.tensor([[127.0, 2.5, 3.5, -2.5, 0.5, -1.5, 1.5, 4.5]])
    packed, scale = qf.quantize_weight(w, "w8a16")
    assert scale.tolist() == [1.0]
    assert packed.tolist() == [[127, 2, 4, -2, 0, -2, 2, 4]]
    # amax 7 -> s = 1 for int4
    w = torch.tensor([[7.0, 2.5, 1.5, -0.5, -3.5, 5.5]])
    packed, scale = qf.quantize_weight(w, "w4a8")
    assert scale.tolist() == [[1.0]]
    assert qf.unpack(packed, W4, 6).tolist() == [[7, 2, 2, 0, -4, 6]]


# --------------------------------------------------------------------------- quantize_per_token
def test_quantize_per_token_bits8_hand():
    qpt = glm5.get_op("quantize_per_token").reference
    x = torch.tensor([[127.0, 2.5, -1.5, 0.4], [0.0, 0.0, 0.0, 0.0], [-254.0, 1.0, 3.0, 2.0]])
    q, s = qpt(x, 8)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert s.tolist() == [1.0, 1.0, 2.0]
    assert q.tolist() == [[127, 2, -2, 0], [0, 0, 0, 0], [-127, 0, 2, 1]]
    q2, s2 = ops.quantize_per_token(x, 8)
    assert torch.equal(q2, q) and torch.equal(s2, s)


def test_quantize_per_token_bits12_hand():
    qpt = glm5.get_op("quantize_per_token").reference
    x = torch.tensor([[2047.0, 0.5, -2047.0, 1.5, -2.5]], dtype=F64)
    q, s = qpt(x, 12)
    assert q.dtype == torch.int16 and s.dtype == torch.float32
    assert s.tolist() == [1.0]
    assert q.tolist() == [[2047, 0, -2047, 2, -2]]


@pytest.mark.parametrize("bits,qmax,dt", [(8, 127, torch.int8), (12, 2047, torch.int16)])
def test_quantize_per_token_random(bits, qmax, dt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 37, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    q, s = glm5.get_op("quantize_per_token").reference(x, bits)
    assert q.dtype == dt and q.shape == x.shape and s.shape == (6,)
    assert int(q.abs().max(-1).values.min()) == qmax  # every row reaches +-qmax
    assert int(q.abs().max()) <= qmax
    assert torch.equal(s, x.abs().amax(-1) / qmax)  # the same fp32 division
    assert_matches("quantize_per_token", (q, s), {"x": x, "bits": bits})
    # q s - x is exact in float64; the code is off x / s by half a step plus the fp32 rounding of
    # the quotient (u |x / s|)
    err = (q.double() * s.double()[:, None] - x.double()).abs()
    assert bool((err <= s.double()[:, None] / 2 + U32 * x.double().abs()).all())


# --------------------------------------------------------------------------- quant_linear
def _manual_act(x: torch.Tensor, bits: int):
    qmax = 127 if bits == 8 else 2047
    xs = x.float()
    codes, scales = [], []
    for row in xs:
        amax = row.abs().max()
        s = (amax / qmax).float() if amax > 0 else torch.tensor(1.0)
        codes.append([max(-qmax, min(qmax, round(v))) for v in (row / s).tolist()])
        scales.append(s.item())
    return torch.tensor(codes, dtype=torch.int64), torch.tensor(scales, dtype=F64)


def _manual_quant_linear(x, w, scheme):
    """y from independently computed codes with exact int64 group sums, in float64."""
    codes, scales = _manual_weight_codes(w, scheme)
    codes = codes.long()
    K = x.shape[1]
    if ACT[scheme] is None:
        return x.double() @ (codes.double() * scales.double()[:, None]).T
    xq, sx = _manual_act(x, ACT[scheme])
    grouped = scheme in ("w4a8", "w6a12")
    bounds = [(g, min(g + 128, K)) for g in range(0, K, 128)] if grouped else [(0, K)]
    sw = scales.double() if grouped else scales.double()[:, None]
    M, N = x.shape[0], w.shape[0]
    y = torch.zeros(M, N, dtype=F64)
    for gi, (a, b) in enumerate(bounds):
        isum = (xq[:, None, a:b] * codes[None, :, a:b]).sum(-1)  # exact int64
        y += isum.double() * sw[None, :, gi]
    return sx[:, None] * y


@pytest.mark.parametrize("scheme", list(QMAX))
@pytest.mark.parametrize("K", [200, 131])
def test_quant_linear_matches_manual(scheme, K):
    g = torch.Generator().manual_seed(2)
    M, N = 3, 4
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.2
    packed, scale = qf.quantize_weight(w, scheme)
    if qf.SCHEMES[scheme].grouped:
        assert scale.shape == (N, 2)
    want = _manual_quant_linear(x, w, scheme)
    ql = glm5.get_op("quant_linear").reference
    vals = {"x": x, "w_packed": packed, "w_scale": scale, "scheme": scheme, "bias": None}
    vals64 = {**vals, "x": x.double()}
    # float64 activations (fp32-representable, so the same codes): the float64 bound
    y64 = ql(x.double(), packed, scale, scheme)
    assert y64.dtype == F64 and y64.shape == (M, N)
    assert_matches("quant_linear", want, vals64, dtype=F64)
    y32 = ql(x, packed, scale, scheme)
    assert y32.dtype == torch.float32
    assert_matches("quant_linear", y32, vals)
    assert torch.equal(ops.quant_linear(x, packed, scale, scheme), y32)
    # the quantized product approximates the dense one within the rigorous worst case
    # sum_k |x_k| s_w/2 + sum_k |wd_k| s_x/2 (half a step of each rounding), plus the float64
    # rounding of both products (the kit's bounds: quant_linear's, and a linear's)
    dense = x.double() @ w.double().T
    sc = qf.SCHEMES[scheme]
    step_w = (scale.repeat_interleave(128, -1)[:, :K] if sc.grouped
              else scale[:, None].expand(-1, K)).double()
    bound = x.double().abs() @ (step_w / 2).T
    if ACT[scheme] is not None:
        sx = x.abs().amax(-1).double() / (127 if ACT[scheme] == 8 else 2047)
        wd = qf.dequantize_weight(packed, scale, scheme, K).double()
        bound = bound + (sx / 2)[:, None] * wd.abs().sum(-1)[None, :]
    _, b64 = output_bound("quant_linear", vals64, "y", F64)
    b_dense = linear_error(x.double(), no_error(), w.double(), dense, rounded=False).absolute(F64)
    assert bool(((y64 - dense).abs() <= bound + b64 + b_dense).all())
    assert float((y64 - dense).abs().max()) > 0  # it is quantized


def test_w8a16_equals_x_times_dequantized_and_bias():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 50, generator=g)
    w = torch.randn(6, 50, generator=g)
    bias = torch.randn(6, generator=g)
    packed, scale = qf.quantize_weight(w, "w8a16")
    deq = qf.dequantize_weight(packed, scale, "w8a16", 50)
    ql = glm5.get_op("quant_linear").reference
    vals = {"x": x, "w_packed": packed, "w_scale": scale, "scheme": "w8a16", "bias": None}
    bvals = {**vals, "bias": bias}
    y = ql(x, packed, scale, "w8a16")
    assert_matches("quant_linear", y, vals)
    assert_matches("quant_linear", x @ deq.T, vals)  # x times the dequantized weight
    yb = ql(x, packed, scale, "w8a16", bias)
    assert_matches("quant_linear", yb, bvals)
    assert_matches("quant_linear", x @ deq.T + bias, bvals)
    assert_matches("quant_linear", y + bias, bvals)  # the bias is added, once
    assert torch.equal(ops.quant_linear(x, packed, scale, "w8a16", bias=bias), yb)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "w6a12"])
def test_bias_added_activation_schemes(scheme):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 140, generator=g, dtype=F64)
    w = torch.randn(3, 140, generator=g)
    bias = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    packed, scale = qf.quantize_weight(w, scheme)
    ql = glm5.get_op("quant_linear").reference
    # without the bias, plus the bias: a correct biased result (the bias is added, once)
    assert assert_matches("quant_linear", ql(x, packed, scale, scheme) + bias,
                   {"x": x, "w_packed": packed, "w_scale": scale, "scheme": scheme,
                    "bias": bias}, dtype=F64).ok


def test_zero_activation_row():
    w = torch.randn(3, 10, generator=torch.Generator().manual_seed(5))
    packed, scale = qf.quantize_weight(w, "w8a8")
    y = glm5.get_op("quant_linear").reference(torch.zeros(2, 10), packed, scale, "w8a8")
    assert torch.equal(y, torch.zeros(2, 3))


# --------------------------------------------------------------------------- moe_experts_quant
def _quant_experts(w13, w2, scheme):
    p13, s13, p2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        a, b = qf.quantize_weight(w13[e], scheme)
        c, d = qf.quantize_weight(w2[e], scheme)
        p13.append(a), s13.append(b), p2.append(c), s2.append(d)
    return torch.stack(p13), torch.stack(s13), torch.stack(p2), torch.stack(s2)


def _moe_inputs():
    g = torch.Generator().manual_seed(6)
    T, D, I, E = 5, 136, 20, 3
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * I, D, generator=g) * 0.1
    w2 = torch.randn(E, D, I, generator=g) * 0.1
    ids = torch.tensor([[0, 2], [1, -1], [2, 2], [-1, -1], [0, 1]], dtype=I32)
    weights = torch.rand(T, 2, generator=g)
    return x, ids, weights, w13, w2


@pytest.mark.parametrize("scheme", list(QMAX))
def test_moe_experts_quant_ops_matches_reference(scheme):
    x, ids, weights, w13, w2 = _moe_inputs()
    packed = _quant_experts(w13, w2, scheme)
    r = glm5.get_op("moe_experts_quant").reference(x, ids, weights, *packed, scheme)
    assert r.dtype == torch.float32 and r.shape == x.shape
    assert torch.equal(r[3], torch.zeros(x.shape[1]))
    vals = dict(zip(glm5.get_op("moe_experts_quant").param_names,
                    (x, ids, weights, *packed, scheme)))
    assert_matches("moe_experts_quant", r, vals)
    d = ops.moe_experts_quant(x, ids, weights, *packed, scheme)
    assert_matches("moe_experts_quant", d, vals)
    # the reference is moe_experts with quant_linear inside (per-token loop)
    ql = glm5.get_op("quant_linear").reference
    p13, s13, p2, s2 = packed
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = ql(x[t:t + 1], p13[e], s13[e], scheme)
            h = glm5.get_op("silu_mul").reference(h)
            want[t] += weights[t, j] * ql(h, p2[e], s2[e], scheme)[0]
    assert_matches("moe_experts_quant", want, vals)


def test_moe_experts_quant_w8a16_vs_unquantized_on_dequantized_weights():
    x, ids, weights, w13, w2 = _moe_inputs()
    p13, s13, p2, s2 = _quant_experts(w13, w2, "w8a16")
    D, I2 = w13.shape[2], w13.shape[1]
    dq13 = torch.stack([qf.dequantize_weight(p13[e], s13[e], "w8a16", D) for e in range(3)])
    dq2 = torch.stack([qf.dequantize_weight(p2[e], s2[e], "w8a16", I2 // 2) for e in range(3)])
    q = glm5.get_op("moe_experts_quant").reference(x, ids, weights, p13, s13, p2, s2, "w8a16")
    u = glm5.get_op("moe_experts").reference(x, ids, weights, dq13, dq2)
    # moe_experts on the dequantized weights is a w8a16 moe_experts_quant
    vals = dict(zip(glm5.get_op("moe_experts_quant").param_names,
                    (x, ids, weights, p13, s13, p2, s2, "w8a16")))
    assert_matches("moe_experts_quant", q, vals)
    assert_matches("moe_experts_quant", u, vals)
    # and close to the unquantized weights: within each result's own bound of its oracle plus
    # the weight rounding (half a step per weight) carried through the expert chain
    u0 = glm5.get_op("moe_experts").reference(x, ids, weights, w13, w2)
    _, b_q = output_bound("moe_experts_quant", vals, "y")
    b_w = _weight_rounding_bound(x, ids, weights, w13, w2, s13 / 2, s2 / 2)
    assert bool(((q - u0).abs() <= b_q + b_w).all())
    assert float((q - u0).abs().max()) > 0  # it is quantized


def _weight_rounding_bound(x, ids, weights, w13, w2, d13, d2):
    """The kit's fp32 bound on moe_experts(x, ids, weights, w13, w2) (numerics'
    expert_chain_error) with each weight off by up to its half step (d13 [E, 2I], d2 [E, D]
    per output channel) as an absolute input error of its projection (first order: |x| |dW|
    through the chain)."""
    x, weights, w13, w2 = x.double(), weights.double(), w13.double(), w2.double()
    d13, d2 = d13.double(), d2.double()

    def up(xr, e):
        h = torch.nn.functional.linear(xr, w13[e])
        return h, (linear_error(xr, no_error(), w13[e], h)
                   + ErrorTerms(step=xr.abs() @ d13[e][:, None].expand_as(w13[e]).T))

    def down(g, eg, e):
        out = torch.nn.functional.linear(g, w2[e])
        return out, (linear_error(g, eg, w2[e], out)
                     + ErrorTerms(step=g.abs() @ d2[e][:, None].expand_as(w2[e]).T))

    terms = expert_chain_error(x, ids, weights, up, down)
    return kit_bound(moe_experts_ref(x, ids, weights, w13, w2), terms, torch.float32,
                     torch.float32)
