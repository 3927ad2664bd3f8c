"""moe_route and moe_experts: hand-constructed routing cases and a tiny expert computation."""

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
I32 = torch.int32


def route(*args, **kw):
    return glm5.get_op("moe_route").reference(*args, **kw)


def experts(*args):
    return glm5.get_op("moe_experts").reference(*args)


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# --------------------------------------------------------------------------- moe_route
def test_weights_sum_to_routed_scaling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.1
    w, ids = route(logits, bias, 4, 1, 1, True, 2.5)
    assert w.dtype == torch.float32 and ids.dtype == I32
    assert w.shape == ids.shape == (6, 4)
    torch.testing.assert_close(w.sum(-1), torch.full((6,), 2.5), rtol=1e-6, atol=1e-6)
    w2, ids2 = ops.moe_route(logits, bias, 4, 1, 1, True, 2.5)
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(w2, w, rtol=0, atol=0)
    # grouped routing normalises too
    w3, _ = route(logits, bias, 4, 4, 2, True, 1.5)
    torch.testing.assert_close(w3.sum(-1), torch.full((6,), 1.5), rtol=1e-6, atol=1e-6)


def test_ids_topk_of_sigmoid_plus_bias_ties_to_smaller_id():
    logits = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0],
                           [0.0] * 8], dtype=torch.float32)
    bias = torch.zeros(8)
    _, ids = route(logits, bias, 3, 1, 1, False, 1.0)
    assert ids.tolist() == [[2, 5, 0], [0, 1, 2]]
    # bias shifts selection: +0.3 on expert 7 puts it between the 1-logits and the 0-logits
    # (sigmoid(1) - sigmoid(0) = 0.231 < 0.3)
    bias[7] = 0.3
    _, ids = route(logits, bias, 3, 1, 1, False, 1.0)
    assert ids.tolist() == [[7, 2, 5], [7, 0, 1]]


def test_weights_are_sigmoid_of_logits_bias_selects_only():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=F64)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0], dtype=F64)
    w, ids = route(logits, bias, 2, 1, 1, False, 1.0)
    assert ids.tolist() == [[0, 3]]
    assert w.dtype == F64
    assert w[0].tolist() == pytest.approx([0.5, sig(3.0)], abs=1e-15)
    # scaling multiplies, normalisation divides by the sum of the picked sigmoids
    w, _ = route(logits, bias, 2, 1, 1, True, 3.0)
    tot = 0.5 + sig(3.0)
    assert w[0].tolist() == pytest.approx([3.0 * 0.5 / tot, 3.0 * sig(3.0) / tot], abs=1e-14)
    w, _ = route(logits, bias, 2, 1, 1, False, 2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0 * sig(3.0)], abs=1e-14)


def _group_logits():
    # E = 8 in 4 groups of 2: g0 = {0, 1}, g1 = {2, 3}, g2 = {4, 5}, g3 = {6, 7}
    # group score (sum of the top-2 sigmoid+bias) with zero bias:
    #   g0: s(5) + s(-5) = 1.0   (expert 0 is the best single expert)
    #   g1: 2 s(2) = 1.762,  g2: 2 s(1) = 1.462,  g3: 2 s(-1) = 0.538
    return torch.tensor([[5.0, -5.0, 2.0, 2.0, 1.0, 1.0, -1.0, -1.0]], dtype=F64)


def test_group_limit_excludes_dropped_groups():
    logits = _group_logits()
    bias = torch.zeros(8, dtype=F64)
    _, ids = route(logits, bias, 3, 1, 1, False, 1.0)
    assert ids.tolist() == [[0, 2, 3]]  # no group limit: expert 0 wins
    w, ids = route(logits, bias, 3, 4, 2, False, 1.0)
    assert ids.tolist() == [[2, 3, 4]]  # groups 1 and 2 kept; expert 0's group dropped
    assert w[0].tolist() == pytest.approx([sig(2.0), sig(2.0), sig(1.0)], abs=1e-15)
    _, ids = route(logits, bias, 4, 4, 2, False, 1.0)
    assert ids.tolist() == [[2, 3, 4, 5]]
    _, ids = route(logits, bias, 2, 4, 1, False, 1.0)
    assert ids.tolist() == [[2, 3]]


def test_group_score_uses_biased_scores():
    logits = _group_logits()
    bias = torch.zeros(8, dtype=F64)
    bias[6] = 1.0  # g3 score: s(-1) + 1 + s(-1) = 1.538 > g2 (1.462), < g1 (1.762)
    w, ids = route(logits, bias, 3, 4, 2, False, 1.0)
    assert ids.tolist() == [[6, 2, 3]]
    assert w[0].tolist() == pytest.approx([sig(-1.0), sig(2.0), sig(2.0)], abs=1e-15)


def test_group_score_is_top2_sum_not_max():
    # g0 has the single best expert but a weak second; g1's two good experts win the group
    logits = torch.tensor([[4.0, -4.0, 1.5, 1.5]], dtype=F64)
    bias = torch.zeros(4, dtype=F64)
    _, ids = route(logits, bias, 1, 2, 1, False, 1.0)
    assert ids.tolist() == [[2]]
    _, ids = route(logits, bias, 1, 1, 1, False, 1.0)
    assert ids.tolist() == [[0]]


# --------------------------------------------------------------------------- moe_experts
def _tiny_experts():
    # E = 2, D = 2, I = 1
    w13 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]],
                        [[0.0, 1.0], [1.0, 1.0]]], dtype=F64)  # [E, 2I, D]
    w2 = torch.tensor([[[1.0], [2.0]],
                       [[1.0], [-1.0]]], dtype=F64)  # [E, D, I]
    x = torch.tensor([[1.0, 2.0]], dtype=F64)
    # expert 0: h = [1, 2] -> silu(1) * 2 -> w2 -> [a, 2a]
    a = 2.0 * sig(1.0)
    e0 = torch.tensor([a, 2 * a], dtype=F64)
    # expert 1: h = [2, 3] -> silu(2) * 3 -> w2 -> [b, -b]
    b = 3.0 * 2.0 * sig(2.0)
    e1 = torch.tensor([b, -b], dtype=F64)
    return x, w13, w2, e0, e1


def test_experts_hand_case():
    x, w13, w2, e0, e1 = _tiny_experts()
    y = experts(x, torch.tensor([[0, 1]], dtype=I32), torch.tensor([[0.5, 2.0]], dtype=F64),
                w13, w2)
    assert y.dtype == F64 and y.shape == (1, 2)
    torch.testing.assert_close(y[0], 0.5 * e0 + 2.0 * e1, rtol=0, atol=1e-14)
    assert y[0].tolist() == pytest.approx([0.5 * 1.4621171572600098 + 2 * 5.284782467867288,
                                           2 * 0.5 * 1.4621171572600098 - 2 * 5.284782467867288],
                                          abs=1e-13)


def test_experts_minus_one_skipped():
    x, w13, w2, e0, e1 = _tiny_experts()
    y = experts(x, torch.tensor([[0, -1]], dtype=I32), torch.tensor([[0.5, 100.0]], dtype=F64),
                w13, w2)
    torch.testing.assert_close(y[0], 0.5 * e0, rtol=0, atol=1e-14)
    y = experts(x, torch.tensor([[-1, -1]], dtype=I32), torch.tensor([[1.0, 1.0]], dtype=F64),
                w13, w2)
    assert torch.equal(y, torch.zeros(1, 2, dtype=F64))
    y = ops.moe_experts(x, torch.tensor([[-1, 1]], dtype=I32),
                        torch.tensor([[9.0, 1.0]], dtype=F64), w13, w2)
    torch.testing.assert_close(y[0], e1, rtol=0, atol=1e-14)


def test_experts_duplicate_slot_adds_twice():
    x, w13, w2, e0, e1 = _tiny_experts()
    y = experts(x, torch.tensor([[1, 1]], dtype=I32), torch.tensor([[0.5, 0.25]], dtype=F64),
                w13, w2)
    torch.testing.assert_close(y[0], 0.75 * e1, rtol=0, atol=1e-14)


def _manual_moe(x, ids, weights, w13, w2):
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = w13[e] @ x[t]
            i = h.shape[0] // 2
            y[t] += weights[t, j] * (w2[e] @ (F.silu(h[:i]) * h[i:]))
    return y


def test_experts_random_matches_loop():
    g = torch.Generator().manual_seed(1)
    T, D, I, E, k = 5, 6, 3, 4, 3
    x = torch.randn(T, D, generator=g, dtype=F64)
    w13 = torch.randn(E, 2 * I, D, generator=g, dtype=F64)
    w2 = torch.randn(E, D, I, generator=g, dtype=F64)
    ids = torch.tensor([[0, 3, -1], [2, 2, 1], [-1, -1, -1], [3, 0, 1], [1, -1, 1]], dtype=I32)
    weights = torch.rand(T, k, generator=g, dtype=F64)
    y = experts(x, ids, weights, w13, w2)
    torch.testing.assert_close(y, _manual_moe(x, ids, weights, w13, w2), rtol=1e-12, atol=1e-12)
    assert torch.equal(y[2], torch.zeros(D, dtype=F64))
    # bf16 in -> bf16 out, fp32 weights allowed
    yb = experts(x.bfloat16(), ids, weights.float(), w13.bfloat16(), w2.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), y, rtol=5e-2, atol=1e-1)
