"""mla_prolog: the reference against a hand composition, shapes, the in-place cache write, the
decomposition served by glm5.ops, and autograd through it."""

from __future__ import annotations

import pytest
import torch

import glm5
from glm5 import ops
from glm5.ir.numerics import ErrorTerms, sqrt_n
from glm5.testing.compare import assert_matches
from glm5.testing.tolerances import bound

# These tests pin the reference: the default backend (e.g. cpu) may round differently.
pytestmark = pytest.mark.usefixtures("reference_only")

F64 = torch.float64
I32 = torch.int32

T, D, Rq, H, Dn, Dr, Rkv, N = 3, 16, 8, 2, 4, 6, 5, 6
EPS = 1e-6
SENTINEL = 7.25


def _inputs(seed=0, dtype=F64, slots=(3, -1, 0)):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * s).to(dtype)

    ang = torch.randn(T, Dr // 2, generator=g, dtype=F64)
    return dict(
        x=r(T, D),
        w_qa=r(Rq, D, s=0.3),
        g_qa=(torch.rand(Rq, generator=g, dtype=F64) + 0.5).to(dtype),
        w_qb=r(H * (Dn + Dr), Rq, s=0.3),
        w_kva=r(Rkv + Dr, D, s=0.3),
        g_kva=(torch.rand(Rkv, generator=g, dtype=F64) + 0.5).to(dtype),
        w_uk=r(H, Dn, Rkv, s=0.3),
        cos=torch.cos(ang).to(dtype),
        sin=torch.sin(ang).to(dtype),
        eps=EPS,
        kv_cache=torch.full((N, Rkv + Dr), SENTINEL, dtype=dtype),
        slots=torch.tensor(slots, dtype=I32),
    )


def _args(a, absorb):
    return (a["x"], a["w_qa"], a["g_qa"], a["w_qb"], a["w_kva"], a["g_kva"], a["w_uk"], a["cos"],
            a["sin"], a["eps"], a["kv_cache"], a["slots"], absorb)


def _vals(a, absorb, **changes):
    """The op's arguments by name (for the kit)."""
    return {**a, "absorb": absorb, **changes}


def _snapshot(a):
    """The arguments as they are now: the cache (written in place by the op) copied."""
    return {**a, "kv_cache": a["kv_cache"].clone()}


def _hand_cache(before, slots, rows):
    """The cache after writing the hand rows: row t at slot slots[t], none for -1."""
    cache = before.clone()
    for t, sl in enumerate(slots):
        if sl >= 0:
            cache[sl] = rows[t].to(cache.dtype)
    return cache


# Independent hand formulation (no glm5 code): rms_norm and interleaved rope as complex product.
def _rms(x, g, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def _rope_interleaved(x, cos, sin):
    shp = x.shape
    z = torch.view_as_complex(x.reshape(*shp[:-1], shp[-1] // 2, 2).contiguous())
    rot = torch.complex(cos, sin)
    rot = rot.reshape(rot.shape[0], *([1] * (x.dim() - 2)), rot.shape[-1])
    return torch.view_as_real(z * rot).reshape(shp)


def _hand(a, absorb):
    x = a["x"]
    c_q = _rms(x @ a["w_qa"].T, a["g_qa"], a["eps"])
    q = (c_q @ a["w_qb"].T).reshape(T, H, Dn + Dr)
    q_nope, q_pe = q[..., :Dn], q[..., Dn:]
    q_pe = _rope_interleaved(q_pe, a["cos"], a["sin"])
    if absorb:
        q_main = torch.stack([q_nope[:, h] @ a["w_uk"][h] for h in range(H)], dim=1)
    else:
        q_main = q_nope
    kv = x @ a["w_kva"].T
    ckv = _rms(kv[:, :Rkv], a["g_kva"], a["eps"])
    k_pe = _rope_interleaved(kv[:, Rkv:], a["cos"], a["sin"])
    rows = torch.cat((ckv, k_pe), -1)
    return q_main, q_pe, c_q, rows


@pytest.mark.parametrize("absorb", [True, False])
def test_reference_matches_hand_composition(absorb):
    a = _inputs()
    before = _snapshot(a)
    outs = glm5.get_op("mla_prolog").reference(*_args(a, absorb))
    q_main, q_pe, c_q = outs
    hq, hpe, hcq, rows = _hand(a, absorb)
    assert q_main.shape == ((T, H, Rkv) if absorb else (T, H, Dn))
    assert q_pe.shape == (T, H, Dr) and c_q.shape == (T, Rq)
    assert q_main.dtype == q_pe.dtype == c_q.dtype == F64
    # the hand composition, its rows written at slots (3, -1, 0), against the float64 oracle
    hand_cache = _hand_cache(before["kv_cache"], (3, -1, 0), rows)
    assert_matches("mla_prolog", (hq, hpe, hcq), _vals(before, absorb, kv_cache=hand_cache),
                   before=_vals(before, absorb), dtype=F64)
    # and the reference's own call: its outputs and the cache it wrote in place
    assert_matches("mla_prolog", outs, _vals(a, absorb), before=_vals(before, absorb), dtype=F64)


def test_cache_write_slots_and_skip():
    a = _inputs(seed=1, slots=(5, -1, 2))
    snap = _snapshot(a)
    before = snap["kv_cache"]
    cache_ptr = a["kv_cache"].data_ptr()
    outs = glm5.get_op("mla_prolog").reference(*_args(a, True))
    cache = a["kv_cache"]
    assert cache.data_ptr() == cache_ptr  # written in place
    for r in (0, 1, 3, 4):  # untouched rows keep the sentinel
        assert torch.equal(cache[r], before[r])
    # the cache written in place is the oracle's: rows 5 and 2 written, the rest untouched
    assert_matches("mla_prolog", outs, _vals(a, True), before=_vals(snap, True), dtype=F64)
    # the hand rows at 5 and 2 and token 1's row (slot -1) nowhere: the whole cache is judged,
    # so a row of token 1 written anywhere fails
    _, _, _, rows = _hand(a, True)
    hand = _hand_cache(before, (5, -1, 2), rows)
    assert_matches("mla_prolog", outs, _vals(snap, True, kv_cache=hand),
                   before=_vals(snap, True), dtype=F64)


def test_all_slots_skipped_leaves_cache_untouched():
    a = _inputs(seed=2, slots=(-1, -1, -1))
    before = a["kv_cache"].clone()
    out = glm5.get_op("mla_prolog").reference(*_args(a, False))
    assert torch.equal(a["kv_cache"], before)
    assert out[0].shape == (T, H, Dn)


def test_cache_of_another_dtype_gets_cast_rows():
    a = _inputs(seed=3, slots=(0, 1, 2))
    a["kv_cache"] = torch.zeros(N, Rkv + Dr, dtype=torch.float32)
    snap = _snapshot(a)
    outs = glm5.get_op("mla_prolog").reference(*_args(a, True))
    _, _, _, rows = _hand(a, True)
    assert a["kv_cache"].dtype == torch.float32
    # float64 rows rounded once into the fp32 cache: the kit's bound for an fp32 output
    assert_matches("mla_prolog", outs, _vals(a, True), before=_vals(snap, True), dtype=F64)
    hand = _hand_cache(snap["kv_cache"], (0, 1, 2), rows)
    assert_matches("mla_prolog", outs, _vals(snap, True, kv_cache=hand),
                   before=_vals(snap, True), dtype=F64)
    assert torch.equal(a["kv_cache"][3:], torch.zeros(N - 3, Rkv + Dr))


@pytest.mark.parametrize("absorb", [True, False])
def test_ops_decomposition_matches_reference_float64(absorb):
    before = _vals(_inputs(seed=4), absorb)
    a2 = _inputs(seed=4)
    d_out = ops.mla_prolog(*_args(a2, absorb))
    for d in d_out:
        assert d.dtype == F64
    assert_matches("mla_prolog", d_out, _vals(a2, absorb), before=before, dtype=F64)
    assert a2["kv_cache"][1, 0].item() == SENTINEL
    # and the decomposition itself, called directly
    a3 = _inputs(seed=4)
    out3 = glm5.get_op("mla_prolog").decompose(glm5.ops, *_args(a3, absorb))
    assert_matches("mla_prolog", out3, _vals(a3, absorb), before=before, dtype=F64)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("absorb", [True, False])
def test_decomposition_outputs_have_the_strides_of_meta(absorb, dtype):
    # torch.compile (inductor) asserts each output's strides against the fake (`OpDef.meta`):
    # the absorbed einsum once returned q_main [T, H, R] with strides (R, T * R, 1).
    op = glm5.get_op("mla_prolog")
    a = _inputs(seed=8, dtype=dtype)
    outs = op.decompose(glm5.ops, *_args(a, absorb))
    metas = op.meta(*_args(_inputs(seed=8, dtype=dtype), absorb))
    ref = op.reference(*_args(_inputs(seed=8, dtype=dtype), absorb))
    for name, o, m, r in zip(("q_main", "q_pe", "c_q"), outs, metas, ref):
        assert (o.shape, o.stride()) == (m.shape, m.stride()), \
            f"mla_prolog_decompose: output {name} has strides {o.stride()}, meta {m.stride()}"
        assert r.stride() == m.stride(), f"mla_prolog reference: output {name}"


def test_bf16_shapes_and_dtypes():
    a = _inputs(seed=5, dtype=torch.bfloat16)
    snap = _snapshot(a)
    outs = ops.mla_prolog(*_args(a, True))
    assert [o.dtype for o in outs] == [torch.bfloat16] * 3
    assert outs[0].shape == (T, H, Rkv)
    # against the float64 oracle, within the kit's bf16 bound (outputs and the written cache)
    assert_matches("mla_prolog", outs, _vals(a, True), before=_vals(snap, True))


@pytest.mark.parametrize("absorb", [True, False])
def test_autograd_through_ops(absorb):
    names = ("x", "w_qa", "g_qa", "w_qb", "w_kva", "g_kva", "w_uk")
    a = _inputs(seed=6)
    for n in names:
        a[n] = a[n].clone().requires_grad_(True)
    outs = ops.mla_prolog(*_args(a, absorb))
    for o in outs:
        assert o.requires_grad and o.grad_fn is not None
    assert not a["kv_cache"].requires_grad  # the cache write is not part of the graph
    assert a["kv_cache"][3].ne(SENTINEL).any()
    g = torch.Generator().manual_seed(7)
    cot = [torch.randn(o.shape, generator=g, dtype=F64) for o in outs]
    torch.autograd.backward(outs, cot)
    # the outputs do not depend on the kv path (it only feeds the detached cache write), nor on
    # w_uk without absorb
    no_grad = {"w_kva", "g_kva"} | (set() if absorb else {"w_uk"})
    for n in no_grad:
        assert a[n].grad is None, n
    got = {n: a[n].grad.clone() for n in names if n not in no_grad}

    # the backward is the vjp of the reference: the same gradients, bit for bit
    c = _inputs(seed=6)
    for n in names:
        c[n] = c[n].clone().requires_grad_(True)
    torch.autograd.backward(glm5.get_op("mla_prolog").reference(*_args(c, absorb)), cot)
    for n, gr in got.items():
        assert torch.equal(gr, c[n].grad), n

    # the same gradients from autograd through the hand composition
    b = _inputs(seed=6)
    for n in names:
        b[n] = b[n].clone().requires_grad_(True)
    hq, hpe, hcq, _ = _hand(b, absorb)
    torch.autograd.backward([hq, hpe, hcq], cot)
    bounds = _vjp_bounds(_inputs(seed=6), absorb, cot, list(got))
    for n, gr in got.items():
        assert b[n].grad is not None
        assert torch.count_nonzero(gr) > 0, n
        err = (gr - b[n].grad).abs()
        assert bool((err <= bounds[n]).all()), (n, float((err / bounds[n]).max()))


def _vjp_bounds(a, absorb, cot, names):
    """The kit's float64 bound on a gradient g = J^T cot of the outputs (q_main, q_pe, c_q):
    a vjp is a sum over the n output elements of cot_j J_ji, held like a GEMM's fp sum
    (numerics.linear_error: acc sqrt(n) sum_j |cot_j J_ji|); |J| from the hand composition."""
    xs = tuple(a[n] for n in names)

    def f(*ts):
        return _hand({**a, **dict(zip(names, ts))}, absorb)[:3]

    jac = torch.autograd.functional.jacobian(f, xs)  # jac[output][input]
    n_out = sum(c.numel() for c in cot)
    out = {}
    for i, n in enumerate(names):
        mag = sum((cj.abs().reshape(-1, 1) * jac[j][i].abs().reshape(cj.numel(), -1)).sum(0)
                  for j, cj in enumerate(cot)).reshape(a[n].shape)
        ref_g = sum((cj.reshape(-1, 1) * jac[j][i].reshape(cj.numel(), -1)).sum(0)
                    for j, cj in enumerate(cot)).reshape(a[n].shape)
        out[n] = bound(ref_g, ErrorTerms(acc=sqrt_n(n_out) * mag), F64, F64)
    return out
