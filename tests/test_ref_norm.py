"""Hand-computed cases and invariants for the normalisation / position / activation references
(rms_norm, layer_norm, rope, silu_mul)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import glm5
from glm5 import ops
from glm5.testing.compare import assert_matches

# These tests pin the reference: the default backend (e.g. cpu) may round differently.
pytestmark = pytest.mark.usefixtures("reference_only")

F64 = torch.float64


def ref(name):
    return glm5.get_op(name).reference


# --------------------------------------------------------------------------- rms_norm
def test_rms_norm_hand_case_eps0():
    x = torch.tensor([3.0, 4.0], dtype=F64)
    w = torch.tensor([1.0, 2.0], dtype=F64)
    rms = math.sqrt(12.5)  # mean(9, 16)
    want = torch.tensor([3.0 / rms * 1.0, 4.0 / rms * 2.0], dtype=F64)
    vals = {"x": x, "weight": w, "eps": 0.0}
    # the hand formula and the printed digits, each judged against the float64 oracle (the
    # reference) within the float64 bound of rms_norm's error model
    assert_matches("rms_norm", want, vals, dtype=F64)
    assert_matches("rms_norm", torch.tensor([0.848528137423857, 2.262741699796952], dtype=F64),
                   vals, dtype=F64)
    assert torch.equal(ops.rms_norm(x, w, 0.0), ref("rms_norm")(x, w, 0.0))  # reference served


def test_rms_norm_eps_enters_inside_rsqrt():
    x = torch.tensor([[1.0, 1.0], [2.0, -2.0]], dtype=F64)
    w = torch.ones(2, dtype=F64)
    # row 0: mean(x^2) = 1 -> 1/sqrt(2); row 1: mean = 4 -> 1/sqrt(5)
    want = torch.tensor([[1 / math.sqrt(2)] * 2, [2 / math.sqrt(5), -2 / math.sqrt(5)]], dtype=F64)
    assert assert_matches("rms_norm", want, {"x": x, "weight": w, "eps": 1.0}, dtype=F64).ok


def test_rms_norm_leading_dims_and_scale_invariance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g, dtype=F64)
    w = torch.randn(8, generator=g, dtype=F64)
    y = ref("rms_norm")(x, w, 0.0)
    assert y.shape == x.shape
    # eps = 0: rms_norm(c x) = rms_norm(x) for c > 0: rms_norm(7.5 x) is a correct rms_norm(x)
    assert_matches("rms_norm", ref("rms_norm")(7.5 * x, w, 0.0), {"x": x, "weight": w, "eps": 0.0},
                   dtype=F64)
    # each row of n = y / w has mean square 1, i.e. normalising n again leaves it unchanged
    n = y / w
    assert_matches("rms_norm", n, {"x": n, "weight": torch.ones(8, dtype=F64), "eps": 0.0},
                   dtype=F64)


# --------------------------------------------------------------------------- layer_norm
@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 7)])
def test_layer_norm_matches_torch(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=F64) * 3 + 1
    D = shape[-1]
    w = torch.randn(D, generator=g, dtype=F64)
    b = torch.randn(D, generator=g, dtype=F64)
    want = F.layer_norm(x, (D,), w, b, 1e-5)  # torch's float64 LayerNorm: an implementation
    assert_matches("layer_norm", want, {"x": x, "weight": w, "bias": b, "eps": 1e-5}, dtype=F64)
    assert torch.equal(ops.layer_norm(x, w, b, 1e-5), ref("layer_norm")(x, w, b, 1e-5))


def test_layer_norm_hand_case():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    w = torch.tensor([1.0, 1.0, 2.0], dtype=F64)
    b = torch.tensor([0.0, 10.0, 0.0], dtype=F64)
    # mean 2, biased var 2/3
    s = math.sqrt(2.0 / 3.0)
    want = torch.tensor([-1 / s, 10.0, 2 * 1 / s], dtype=F64)
    assert assert_matches("layer_norm", want, {"x": x, "weight": w, "bias": b, "eps": 0.0}, dtype=F64).ok


# --------------------------------------------------------------------------- rope
def _cos_sin(angles):
    a = torch.tensor(angles, dtype=F64)
    return torch.cos(a), torch.sin(a)


def test_rope_interleaved_hand_case():
    # R = 4: pair 0 rotated by 90 degrees, pair 1 by 0
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    c, s = _cos_sin([[math.pi / 2, 0.0]])
    # interleaved pairs (x0, x1) = (1, 2) -> (-2, 1); (x2, x3) = (3, 4) unchanged (cos(pi/2) is
    # 6e-17 in float64: the reference is within rounding of the exact rotation, not equal to it)
    assert assert_matches("rope", torch.tensor([[-2.0, 1.0, 3.0, 4.0]], dtype=F64),
                   {"x": x, "cos": c, "sin": s, "interleaved": True}, dtype=F64).ok


def test_rope_half_split_hand_case():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    c, s = _cos_sin([[math.pi / 2, 0.0]])
    # NeoX pairs (x0, x2) = (1, 3) -> (-3, 1); (x1, x3) = (2, 4) unchanged
    assert assert_matches("rope", torch.tensor([[-3.0, 2.0, 1.0, 4.0]], dtype=F64),
                   {"x": x, "cos": c, "sin": s, "interleaved": False}, dtype=F64).ok


def test_rope_general_angle_formula():
    th = [0.3, -1.1, 2.0]
    x = torch.tensor([[0.5, -1.5, 2.0, 0.25, -3.0, 1.0]], dtype=F64)
    c, s = _cos_sin([th])
    want = torch.zeros(1, 6, dtype=F64)
    for i, t in enumerate(th):
        a, b = x[0, 2 * i].item(), x[0, 2 * i + 1].item()
        want[0, 2 * i] = a * math.cos(t) - b * math.sin(t)
        want[0, 2 * i + 1] = b * math.cos(t) + a * math.sin(t)
    assert assert_matches("rope", want, {"x": x, "cos": c, "sin": s, "interleaved": True}, dtype=F64).ok
    want2 = torch.zeros(1, 6, dtype=F64)
    for i, t in enumerate(th):
        a, b = x[0, i].item(), x[0, i + 3].item()
        want2[0, i] = a * math.cos(t) - b * math.sin(t)
        want2[0, i + 3] = b * math.cos(t) + a * math.sin(t)
    assert assert_matches("rope", want2, {"x": x, "cos": c, "sin": s, "interleaved": False}, dtype=F64).ok


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_middle_dims_and_per_token_angles(interleaved):
    g = torch.Generator().manual_seed(2)
    T, H, R = 3, 4, 8
    x = torch.randn(T, H, R, generator=g, dtype=F64)
    ang = torch.randn(T, R // 2, generator=g, dtype=F64)
    c, s = torch.cos(ang), torch.sin(ang)
    y = ref("rope")(x, c, s, interleaved)
    assert y.shape == (T, H, R)
    for h in range(H):  # each head gets the same per-token rotation as a [T, R] call
        assert torch.equal(y[:, h], ref("rope")(x[:, h].contiguous(), c, s, interleaved))
    for t in range(T):  # token t uses cos[t], sin[t]
        assert torch.equal(y[t], ref("rope")(x[t:t + 1], c[t:t + 1], s[t:t + 1], interleaved)[0])
    # a rotation: the opposite angle (sin -> -sin) takes y back to x, so each pair keeps its norm
    assert_matches("rope", x, {"x": y, "cos": c, "sin": -s, "interleaved": interleaved},
                   dtype=F64)
    # two middle dims
    x4 = x.reshape(T, 2, 2, R)
    assert torch.equal(ref("rope")(x4, c, s, interleaved).reshape(T, H, R), y)
    assert torch.equal(ops.rope(x, c, s, interleaved), y)


def test_rope_interleaved_equals_complex_multiplication():
    g = torch.Generator().manual_seed(3)
    T, H, R = 2, 3, 6
    x = torch.randn(T, H, R, generator=g, dtype=F64)
    ang = torch.randn(T, R // 2, generator=g, dtype=F64)
    z = torch.view_as_complex(x.reshape(T, H, R // 2, 2).contiguous())
    rot = torch.polar(torch.ones_like(ang), ang)[:, None, :]
    want = torch.view_as_real(z * rot).reshape(T, H, R)
    assert assert_matches("rope", want, {"x": x, "cos": torch.cos(ang), "sin": torch.sin(ang),
                                  "interleaved": True}, dtype=F64).ok


# --------------------------------------------------------------------------- silu_mul
def test_silu_mul_hand_values():
    x = torch.tensor([[1.0, 2.0], [0.0, 5.0], [2.0, 3.0]], dtype=F64)
    want = torch.tensor([[2 / (1 + math.exp(-1))], [0.0], [3 * 2 / (1 + math.exp(-2))]], dtype=F64)
    assert assert_matches("silu_mul", want, {"x": x}, dtype=F64).ok
    assert assert_matches("silu_mul", torch.tensor([[1.4621171572600098]], dtype=F64), {"x": x[:1]},
                   dtype=F64).ok


def test_silu_mul_halves_not_interleaved():
    # I = 2: gate = x[..., :2], up = x[..., 2:]
    x = torch.tensor([1.0, -1.0, 10.0, 100.0], dtype=F64)
    got = ref("silu_mul")(x)
    assert got.shape == (2,)
    want = torch.tensor([F.silu(torch.tensor(1.0, dtype=F64)) * 10,
                         F.silu(torch.tensor(-1.0, dtype=F64)) * 100])
    assert_matches("silu_mul", want, {"x": x}, dtype=F64)
    assert torch.equal(ops.silu_mul(x), got)


# --------------------------------------------------------------------------- dtypes
def _cases(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, 8, generator=g).to(dtype)
    w = (torch.rand(8, generator=g) + 0.5).to(dtype)
    b = torch.randn(8, generator=g).to(dtype)
    ang = torch.randn(3, 4, generator=g)
    c, s = torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)
    return [
        ("rms_norm", (x, w, 1e-6)),
        ("layer_norm", (x, w, b, 1e-5)),
        ("rope", (x, c, s, True)),
        ("rope", (x, c, s, False)),
        ("silu_mul", (x,)),
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, F64])
def test_output_keeps_input_dtype(dtype):
    for name, args in _cases(dtype):
        y = ref(name)(*args)
        assert y.dtype == dtype, name
        y2 = getattr(ops, name)(*args)
        assert y2.dtype == dtype, name
        assert torch.equal(y2, y), name


def test_bf16_computed_in_fp32_then_rounded_once():
    # the bf16 result is the fp32 computation on the same (bf16) inputs rounded to bf16, bit for
    # bit, and within the kit's bf16 bound of the float64 oracle
    for name, args in _cases(torch.bfloat16):
        up = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
        want = ref(name)(*up).to(torch.bfloat16)
        got = ref(name)(*args)
        assert torch.equal(got, want), name
        op = glm5.get_op(name)
        assert_matches(op, got, dict(zip(op.param_names, args)))


def test_float64_is_computed_in_float64():
    # an fp32 pipeline would be off by ~1e-7; float64 math must agree to ~1e-15
    x = torch.tensor([1.0 + 1e-12, 1.0, 1.0 - 3e-12, 1.0], dtype=F64)
    w = torch.ones(4, dtype=F64)
    y = ref("rms_norm")(x, w, 0.0)
    want = x / torch.sqrt((x * x).mean())
    assert y.dtype == F64
    assert_matches("rms_norm", want, {"x": x, "weight": w, "eps": 0.0}, dtype=F64)
    assert y[0].item() != y[1].item()  # fp32 would collapse these
    ang = torch.tensor([[0.1234567890123]], dtype=F64)
    xr = torch.tensor([[1.0 + 1e-12, 2.0]], dtype=F64)
    a, b = xr[0, 0].item(), xr[0, 1].item()
    t = ang.item()
    want_r = torch.tensor([[a * math.cos(t) - b * math.sin(t), b * math.cos(t) + a * math.sin(t)]],
                          dtype=F64)
    assert_matches("rope", want_r, {"x": xr, "cos": torch.cos(ang), "sin": torch.sin(ang),
                                    "interleaved": True}, dtype=F64)
    xs = torch.tensor([1.0 + 1e-12, 1.0], dtype=F64)
    assert_matches("silu_mul", torch.tensor([(1 + 1e-12) / (1 + math.exp(-(1 + 1e-12)))],
                                            dtype=F64), {"x": xs}, dtype=F64)
