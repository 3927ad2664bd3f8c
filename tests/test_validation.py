"""Boundary errors of glm5.ops: each names the op and the argument and uses the house error
classes (glm5.OpInputError is a ValueError, glm5.OpTypeError a TypeError)."""

from __future__ import annotations

import pytest
import torch

import glm5
from glm5 import ops
from glm5.ir import quant_formats as qf

I32 = torch.int32


def _raises(exc, fn, *args, must=(), **kw):
    with pytest.raises(exc) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    for m in must:
        assert m in msg, f"{m!r} not in {msg!r}"
    return msg


def test_error_classes():
    assert issubclass(glm5.OpInputError, ValueError)
    assert issubclass(glm5.OpTypeError, TypeError)
    assert not issubclass(glm5.OpInputError, TypeError)


# --------------------------------------------------------------------------- fixtures
def _attn(T=2, H=4, Hk=2, S=5, D=8, Dv=4, K=3):
    return (torch.randn(T, H, D), torch.randn(S, Hk, D), torch.randn(S, Hk, Dv),
            torch.zeros(T, K, dtype=I32))


def _moe(T=2, D=4, I=3, E=3, k=2):
    return (torch.randn(T, D), torch.zeros(T, k, dtype=I32), torch.rand(T, k),
            torch.randn(E, 2 * I, D), torch.randn(E, D, I))


def _tlp(T=3, D=4, V=10):
    return torch.randn(T, D), torch.randn(V, D), torch.zeros(T, dtype=I32)


# --------------------------------------------------------------------------- rank / shape
def test_wrong_rank():
    q, k, v, idx = _attn()
    _raises(glm5.OpInputError, ops.sparse_attention, q[0], k, v, idx, 1.0,
            must=("glm5.sparse_attention", "'q'", "3 dims"))
    _raises(glm5.OpInputError, ops.sparse_attention, q, k, v, idx[0], 1.0,
            must=("glm5.sparse_attention", "'idx'"))
    _raises(glm5.OpInputError, ops.rms_norm, torch.tensor(1.0), torch.ones(1), 1e-6,
            must=("glm5.rms_norm", "'x'"))
    _raises(glm5.OpInputError, ops.rope, torch.randn(4), torch.randn(4, 2), torch.randn(4, 2),
            True, must=("glm5.rope", "'x'"))


def test_shape_symbol_mismatch():
    _raises(glm5.OpInputError, ops.rms_norm, torch.randn(2, 4), torch.ones(3), 1e-6,
            must=("glm5.rms_norm", "'weight'", "D=4"))
    q, k, v, idx = _attn()
    _raises(glm5.OpInputError, ops.sparse_attention, q, k, v[:4], idx, 1.0,
            must=("glm5.sparse_attention", "'v'", "S=5"))
    _raises(glm5.OpInputError, ops.sparse_attention, q, k, v, idx[:1], 1.0,
            must=("glm5.sparse_attention", "'idx'", "T=2"))
    _raises(glm5.OpInputError, ops.rope, torch.randn(3, 2, 8), torch.randn(3, 3),
            torch.randn(3, 3), False, must=("glm5.rope", "'cos'"))
    x, ids, w, w13, w2 = _moe()
    _raises(glm5.OpInputError, ops.moe_experts, x, ids, w, w13, w2[:, :3],
            must=("glm5.moe_experts", "'w2'", "D=4"))
    # I is bound from w2; a w13 whose rows are not 2*I is reported on w13
    _raises(glm5.OpInputError, ops.moe_experts, x, ids, w, w13[:, :5], w2,
            must=("glm5.moe_experts", "'w13'", "2*I"))


def test_gqa_heads_must_divide():
    q, k, v, idx = _attn(H=4, Hk=3)
    _raises(glm5.OpInputError, ops.sparse_attention, q, k, v, idx, 1.0,
            must=("glm5.sparse_attention", "'k'"))


def test_silu_mul_odd_last_dim():
    _raises(glm5.OpInputError, ops.silu_mul, torch.randn(2, 5), must=("glm5.silu_mul", "'x'"))
    assert ops.silu_mul(torch.randn(2, 6)).shape == (2, 3)


def test_rope_odd_rotary_dim():
    _raises(glm5.OpInputError, ops.rope, torch.randn(2, 5), torch.randn(2, 2), torch.randn(2, 2),
            True, must=("glm5.rope",))


# --------------------------------------------------------------------------- dtype
def test_int64_index_rejected():
    q, k, v, idx = _attn()
    msg = _raises(glm5.OpTypeError, ops.sparse_attention, q, k, v, idx.long(), 1.0,
                  must=("glm5.sparse_attention", "'idx'", "int32", "int64"))
    assert isinstance(glm5.OpTypeError(msg), TypeError)
    x, ids, w, w13, w2 = _moe()
    _raises(glm5.OpTypeError, ops.moe_experts, x, ids.long(), w, w13, w2,
            must=("glm5.moe_experts", "'ids'", "int32"))
    h, wv, t = _tlp()
    _raises(glm5.OpTypeError, ops.token_logprobs, h, wv, t.long(), 1.0,
            must=("glm5.token_logprobs", "'targets'", "int32"))
    _raises(glm5.OpTypeError, ops.attention, q, k, v, torch.zeros(2, dtype=torch.int64),
            torch.full((2,), 5, dtype=I32), 1.0, must=("glm5.attention", "'k_start'", "int32"))


def test_wrong_float_dtypes():
    _raises(glm5.OpTypeError, ops.rms_norm, torch.zeros(2, 4, dtype=torch.int32),
            torch.ones(4), 1e-6, must=("glm5.rms_norm", "'x'"))
    _raises(glm5.OpTypeError, ops.moe_route, torch.randn(2, 8).bfloat16(), torch.zeros(8), 2, 1,
            1, True, 1.0, must=("glm5.moe_route", "'logits'", "float32"))
    q, k, v, idx = _attn()
    _raises(glm5.OpInputError, ops.sparse_attention, q, k.double(), v, idx, 1.0,
            must=("glm5.sparse_attention",))


def test_not_a_tensor():
    _raises(glm5.OpTypeError, ops.rms_norm, [[1.0, 2.0]], torch.ones(2), 1e-6,
            must=("glm5.rms_norm", "'x'", "torch.Tensor"))
    _raises(glm5.OpTypeError, ops.rms_norm, torch.ones(2, 2), torch.ones(2), "1e-6",
            must=("glm5.rms_norm", "'eps'"))
    _raises(glm5.OpTypeError, ops.topk_indices, torch.randn(2, 4), 2.0,
            must=("glm5.topk_indices", "'k'"))


def test_device_mismatch():
    # The meta device stands in for a second device: the check is on torch.device equality.
    q, k, v, idx = _attn()
    _raises(glm5.OpInputError, ops.sparse_attention, q, k.to("meta"), v, idx, 1.0,
            must=("glm5.sparse_attention", "'k'", "meta"))


# --------------------------------------------------------------------------- value ranges
def test_sparse_attention_idx_out_of_range():
    q, k, v, idx = _attn(S=5)
    bad = idx.clone()
    bad[1, 2] = 5
    _raises(glm5.OpInputError, ops.sparse_attention, q, k, v, bad, 1.0,
            must=("glm5.sparse_attention", "'idx'", "5"))
    bad[1, 2] = -2
    _raises(glm5.OpInputError, ops.sparse_attention, q, k, v, bad, 1.0,
            must=("glm5.sparse_attention", "'idx'"))
    ok = idx.clone()
    ok[1, 2] = -1
    ok[0, 0] = 4
    out, lse = ops.sparse_attention(q, k, v, ok, 1.0)
    assert out.shape == (2, 4, 4)


def test_moe_ids_out_of_range():
    x, ids, w, w13, w2 = _moe(E=3)
    bad = ids.clone()
    bad[0, 1] = 3
    _raises(glm5.OpInputError, ops.moe_experts, x, bad, w, w13, w2,
            must=("glm5.moe_experts", "'ids'"))


def test_token_logprobs_targets_out_of_range():
    h, wv, t = _tlp(V=10)
    bad = t.clone()
    bad[2] = 10
    _raises(glm5.OpInputError, ops.token_logprobs, h, wv, bad, 1.0,
            must=("glm5.token_logprobs", "'targets'"))
    bad[2] = -1
    _raises(glm5.OpInputError, ops.token_logprobs, h, wv, bad, 1.0,
            must=("glm5.token_logprobs", "'targets'"))
    _raises(glm5.OpInputError, ops.token_logprobs, h, wv, t, 0.0,
            must=("glm5.token_logprobs", "'temperature'"))


def test_k_start_after_k_end():
    q, k, v, _ = _attn(S=5)
    ks, ke = torch.tensor([0, 3], dtype=I32), torch.tensor([5, 2], dtype=I32)
    _raises(glm5.OpInputError, ops.attention, q, k, v, ks, ke, 1.0,
            must=("glm5.attention", "k_start", "'k_end'"))
    qi, ki, wi = torch.randn(2, 2, 4), torch.randn(5, 4), torch.rand(2, 2)
    _raises(glm5.OpInputError, ops.lightning_indexer, qi, ki, wi, ks, ke,
            must=("glm5.lightning_indexer", "k_start"))
    _raises(glm5.OpInputError, ops.indexer_topk, qi, ki, wi, ks, ke, 2,
            must=("glm5.indexer_topk", "k_start"))
    _raises(glm5.OpInputError, ops.attention, q, k, v, torch.tensor([0, 0], dtype=I32),
            torch.tensor([5, 6], dtype=I32), 1.0, must=("glm5.attention", "'k_end'"))
    _raises(glm5.OpInputError, ops.attention, q, k, v, torch.tensor([-1, 0], dtype=I32),
            torch.tensor([5, 5], dtype=I32), 1.0, must=("glm5.attention", "'k_start'"))


def test_scalar_constraints():
    _raises(glm5.OpInputError, ops.rms_norm, torch.ones(2, 2), torch.ones(2), -1.0,
            must=("glm5.rms_norm", "'eps'"))
    _raises(glm5.OpInputError, ops.topk_indices, torch.randn(2, 4), 0,
            must=("glm5.topk_indices", "'k'"))
    _raises(glm5.OpInputError, ops.grpo_advantages, torch.randn(6), 4, False,
            must=("glm5.grpo_advantages", "'group_size'"))
    _raises(glm5.OpInputError, ops.grpo_advantages, torch.randn(6), 1, True,
            must=("glm5.grpo_advantages", "'group_size'"))
    _raises(glm5.OpInputError, ops.quantize_per_token, torch.randn(2, 4), 4,
            must=("glm5.quantize_per_token", "'bits'"))
    lp = torch.zeros(3)
    _raises(glm5.OpInputError, ops.policy_loss, lp, lp, lp, torch.ones(3), clip_low=1.0,
            must=("glm5.policy_loss", "'clip_low'"))


def test_moe_route_limits():
    logits, bias = torch.randn(2, 8), torch.zeros(8)
    _raises(glm5.OpInputError, ops.moe_route, logits, bias, 2, 3, 1, True, 1.0,
            must=("glm5.moe_route", "'n_group'"))
    _raises(glm5.OpInputError, ops.moe_route, logits, bias, 5, 4, 2, True, 1.0,
            must=("glm5.moe_route", "'top_k'"))
    _raises(glm5.OpInputError, ops.moe_route, logits, bias, 2, 4, 5, True, 1.0,
            must=("glm5.moe_route", "'topk_group'"))


# --------------------------------------------------------------------------- quant
def test_unknown_scheme():
    x = torch.randn(2, 8)
    p, s = qf.quantize_weight(torch.randn(3, 8), "w8a8")
    msg = _raises(glm5.OpInputError, ops.quant_linear, x, p, s, "w3a3",
                  must=("glm5.quant_linear", "'scheme'", "w3a3"))
    assert "w8a8" in msg  # lists the choices
    with pytest.raises(ValueError, match="scheme"):
        qf.quantize_weight(torch.randn(3, 8), "int5")


def test_quant_linear_packed_shape_and_scales():
    x = torch.randn(2, 200)
    p, s = qf.quantize_weight(torch.randn(3, 200), "w4a8")
    assert ops.quant_linear(x, p, s, "w4a8").shape == (2, 3)
    _raises(glm5.OpInputError, ops.quant_linear, x, p[:, :99], s, "w4a8",
            must=("glm5.quant_linear", "'w_packed'"))
    _raises(glm5.OpInputError, ops.quant_linear, x, p, s[:, :1], "w4a8",
            must=("glm5.quant_linear", "'w_scale'"))
    # a w4a8 weight is not a w8a8 weight (dtype uint8 vs int8)
    _raises(glm5.OpInputError, ops.quant_linear, x, p, s, "w8a8",
            must=("glm5.quant_linear", "'w_packed'"))
    _raises(glm5.OpTypeError, ops.quant_linear, x, p, s.double(), "w4a8",
            must=("glm5.quant_linear", "'w_scale'"))


# --------------------------------------------------------------------------- binding
def test_missing_argument():
    _raises(glm5.OpTypeError, ops.rms_norm, torch.ones(2, 2), torch.ones(2),
            must=("glm5.rms_norm", "missing", "'eps'"))
    q, k, v, idx = _attn()
    _raises(glm5.OpTypeError, ops.sparse_attention, q, k, v, scale=1.0,
            must=("glm5.sparse_attention", "'idx'"))
    _raises(glm5.OpTypeError, ops.sparse_attention, q, k, v, None, 1.0,
            must=("glm5.sparse_attention", "'idx'"))


def test_unexpected_keyword_and_extra_args():
    _raises(glm5.OpTypeError, ops.rms_norm, torch.ones(2, 2), torch.ones(2), eps=1e-6, foo=1,
            must=("glm5.rms_norm", "'foo'"))
    _raises(glm5.OpTypeError, ops.silu_mul, torch.ones(2, 2), torch.ones(2),
            must=("glm5.silu_mul",))
    _raises(glm5.OpTypeError, ops.rms_norm, torch.ones(2, 2), torch.ones(2), 1e-6, eps=1e-6,
            must=("glm5.rms_norm", "'eps'", "twice"))


def test_mla_prolog_slots():
    T, D, Rq, H, Dn, Dr, Rkv, N = 2, 8, 4, 2, 2, 4, 3, 4
    args = dict(
        x=torch.randn(T, D), w_qa=torch.randn(Rq, D), g_qa=torch.ones(Rq),
        w_qb=torch.randn(H * (Dn + Dr), Rq), w_kva=torch.randn(Rkv + Dr, D),
        g_kva=torch.ones(Rkv), w_uk=torch.randn(H, Dn, Rkv), cos=torch.ones(T, Dr // 2),
        sin=torch.zeros(T, Dr // 2), eps=1e-6, kv_cache=torch.zeros(N, Rkv + Dr),
        slots=torch.tensor([0, 1], dtype=I32), absorb=True,
    )
    outs = ops.mla_prolog(**args)
    assert outs[0].shape == (T, H, Rkv)
    for bad in ([0, 0], [0, N]):
        a = dict(args, slots=torch.tensor(bad, dtype=I32), kv_cache=torch.zeros(N, Rkv + Dr))
        _raises(glm5.OpInputError, ops.mla_prolog, must=("glm5.mla_prolog", "'slots'"), **a)
        assert torch.equal(a["kv_cache"], torch.zeros(N, Rkv + Dr))  # nothing written
    a = dict(args, kv_cache=torch.zeros(N, Rkv + Dr + 1))
    _raises(glm5.OpInputError, ops.mla_prolog, must=("glm5.mla_prolog", "'kv_cache'"), **a)
