"""Hand-computed cases and invariants for the normalisation / position / activation references
(rms_norm, layer_norm, rope, silu_mul)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import glm5
from glm5 import ops

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
    got = ref("rms_norm")(x, w, 0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    torch.testing.assert_close(got, torch.tensor([0.848528137423857, 2.262741699796952], dtype=F64),
                               rtol=0, atol=1e-14)
    torch.testing.assert_close(ops.rms_norm(x, w, 0.0), want, rtol=0, atol=1e-15)


def test_rms_norm_eps_enters_inside_rsqrt():
    x = torch.tensor([[1.0, 1.0], [2.0, -2.0]], dtype=F64)
    w = torch.ones(2, dtype=F64)
    got = ref("rms_norm")(x, w, 1.0)
    # row 0: mean(x^2) = 1 -> 1/sqrt(2); row 1: mean = 4 -> 1/sqrt(5)
    want = torch.tensor([[1 / math.sqrt(2)] * 2, [2 / math.sqrt(5), -2 / math.sqrt(5)]], dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


def test_rms_norm_leading_dims_and_scale_invariance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g, dtype=F64)
    w = torch.randn(8, generator=g, dtype=F64)
    y = ref("rms_norm")(x, w, 0.0)
    assert y.shape == x.shape
    # eps = 0: rms_norm(c x) = rms_norm(x) for c > 0, and each row of y / w has mean square 1
    torch.testing.assert_close(ref("rms_norm")(7.5 * x, w, 0.0), y, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close((y / w).pow(2).mean(-1), torch.ones(2, 3, dtype=F64),
                               rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------- layer_norm
@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 7)])
def test_layer_norm_matches_torch(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=F64) * 3 + 1
    D = shape[-1]
    w = torch.randn(D, generator=g, dtype=F64)
    b = torch.randn(D, generator=g, dtype=F64)
    want = F.layer_norm(x, (D,), w, b, 1e-5)
    torch.testing.assert_close(ref("layer_norm")(x, w, b, 1e-5), want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), want, rtol=1e-13, atol=1e-13)


def test_layer_norm_hand_case():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    w = torch.tensor([1.0, 1.0, 2.0], dtype=F64)
    b = torch.tensor([0.0, 10.0, 0.0], dtype=F64)
    # mean 2, biased var 2/3
    s = math.sqrt(2.0 / 3.0)
    want = torch.tensor([-1 / s, 10.0, 2 * 1 / s], dtype=F64)
    torch.testing.assert_close(ref("layer_norm")(x, w, b, 0.0), want, rtol=0, atol=1e-14)


# --------------------------------------------------------------------------- rope
def _cos_sin(angles):
    a = torch.tensor(angles, dtype=F64)
    return torch.cos(a), torch.sin(a)


def test_rope_interleaved_hand_case():
    # R = 4: pair 0 rotated by 90 degrees, pair 1 by 0
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    c, s = _cos_sin([[math.pi / 2, 0.0]])
    got = ref("rope")(x, c, s, True)
    # interleaved pairs (x0, x1) = (1, 2) -> (-2, 1); (x2, x3) = (3, 4) unchanged
    torch.testing.assert_close(got, torch.tensor([[-2.0, 1.0, 3.0, 4.0]], dtype=F64),
                               rtol=0, atol=1e-15)


def test_rope_half_split_hand_case():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    c, s = _cos_sin([[math.pi / 2, 0.0]])
    got = ref("rope")(x, c, s, False)
    # NeoX pairs (x0, x2) = (1, 3) -> (-3, 1); (x1, x3) = (2, 4) unchanged
    torch.testing.assert_close(got, torch.tensor([[-3.0, 2.0, 1.0, 4.0]], dtype=F64),
                               rtol=0, atol=1e-15)


def test_rope_general_angle_formula():
    th = [0.3, -1.1, 2.0]
    x = torch.tensor([[0.5, -1.5, 2.0, 0.25, -3.0, 1.0]], dtype=F64)
    c, s = _cos_sin([th])
    y = ref("rope")(x, c, s, True)
    for i, t in enumerate(th):
        a, b = x[0, 2 * i].item(), x[0, 2 * i + 1].item()
        assert y[0, 2 * i].item() == pytest.approx(a * math.cos(t) - b * math.sin(t), abs=1e-14)
        assert y[0, 2 * i + 1].item() == pytest.approx(b * math.cos(t) + a * math.sin(t), abs=1e-14)
    y2 = ref("rope")(x, c, s, False)
    for i, t in enumerate(th):
        a, b = x[0, i].item(), x[0, i + 3].item()
        assert y2[0, i].item() == pytest.approx(a * math.cos(t) - b * math.sin(t), abs=1e-14)
        assert y2[0, i + 3].item() == pytest.approx(b * math.cos(t) + a * math.sin(t), abs=1e-14)


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
        torch.testing.assert_close(y[:, h], ref("rope")(x[:, h].contiguous(), c, s, interleaved),
                                   rtol=0, atol=0)
    for t in range(T):  # token t uses cos[t], sin[t]
        torch.testing.assert_close(
            y[t], ref("rope")(x[t:t + 1], c[t:t + 1], s[t:t + 1], interleaved)[0], rtol=0, atol=0)
    # rotations preserve each pair's norm
    if interleaved:
        pn_in = x[..., 0::2] ** 2 + x[..., 1::2] ** 2
        pn_out = y[..., 0::2] ** 2 + y[..., 1::2] ** 2
    else:
        pn_in = x[..., : R // 2] ** 2 + x[..., R // 2:] ** 2
        pn_out = y[..., : R // 2] ** 2 + y[..., R // 2:] ** 2
    torch.testing.assert_close(pn_out, pn_in, rtol=1e-13, atol=1e-13)
    # two middle dims
    x4 = x.reshape(T, 2, 2, R)
    torch.testing.assert_close(ref("rope")(x4, c, s, interleaved).reshape(T, H, R), y,
                               rtol=0, atol=0)
    torch.testing.assert_close(ops.rope(x, c, s, interleaved), y, rtol=0, atol=0)


def test_rope_interleaved_equals_complex_multiplication():
    g = torch.Generator().manual_seed(3)
    T, H, R = 2, 3, 6
    x = torch.randn(T, H, R, generator=g, dtype=F64)
    ang = torch.randn(T, R // 2, generator=g, dtype=F64)
    z = torch.view_as_complex(x.reshape(T, H, R // 2, 2).contiguous())
    rot = torch.polar(torch.ones_like(ang), ang)[:, None, :]
    want = torch.view_as_real(z * rot).reshape(T, H, R)
    got = ref("rope")(x, torch.cos(ang), torch.sin(ang), True)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------- silu_mul
def test_silu_mul_hand_values():
    x = torch.tensor([[1.0, 2.0], [0.0, 5.0], [2.0, 3.0]], dtype=F64)
    got = ref("silu_mul")(x)
    want = torch.tensor([[2 / (1 + math.exp(-1))], [0.0], [3 * 2 / (1 + math.exp(-2))]], dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    assert got[0, 0].item() == pytest.approx(1.4621171572600098, abs=1e-14)


def test_silu_mul_halves_not_interleaved():
    # I = 2: gate = x[..., :2], up = x[..., 2:]
    x = torch.tensor([1.0, -1.0, 10.0, 100.0], dtype=F64)
    got = ref("silu_mul")(x)
    assert got.shape == (2,)
    want = torch.tensor([F.silu(torch.tensor(1.0, dtype=F64)) * 10,
                         F.silu(torch.tensor(-1.0, dtype=F64)) * 100])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(ops.silu_mul(x), want, rtol=0, atol=1e-13)


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
        torch.testing.assert_close(y2, y, rtol=0, atol=0)


def test_bf16_computed_in_fp32_then_rounded_once():
    # the bf16 result equals the fp32 computation on the same (bf16) inputs rounded to bf16
    for name, args in _cases(torch.bfloat16):
        up = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
        want = ref(name)(*up).to(torch.bfloat16)
        got = ref(name)(*args)
        torch.testing.assert_close(got, want, rtol=0.01, atol=0.01)
        # and mostly bit-identical
        assert (got == want).float().mean().item() > 0.95, name


def test_float64_is_computed_in_float64():
    # an fp32 pipeline would be off by ~1e-7; float64 math must agree to ~1e-15
    x = torch.tensor([1.0 + 1e-12, 1.0, 1.0 - 3e-12, 1.0], dtype=F64)
    w = torch.ones(4, dtype=F64)
    y = ref("rms_norm")(x, w, 0.0)
    want = x / torch.sqrt((x * x).mean())
    assert y.dtype == F64
    torch.testing.assert_close(y, want, rtol=0, atol=1e-15)
    assert y[0].item() != y[1].item()  # fp32 would collapse these
    ang = torch.tensor([[0.1234567890123]], dtype=F64)
    xr = torch.tensor([[1.0 + 1e-12, 2.0]], dtype=F64)
    yr = ref("rope")(xr, torch.cos(ang), torch.sin(ang), True)
    a, b = xr[0, 0].item(), xr[0, 1].item()
    t = ang.item()
    assert yr[0, 0].item() == pytest.approx(a * math.cos(t) - b * math.sin(t), abs=1e-15)
    xs = torch.tensor([1.0 + 1e-12, 1.0], dtype=F64)
    assert ref("silu_mul")(xs).item() == pytest.approx(
        (1 + 1e-12) / (1 + math.exp(-(1 + 1e-12))), abs=1e-15)
