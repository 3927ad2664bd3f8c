"""moe_route and moe_experts: hand-constructed routing cases and a tiny expert computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import glm5
from glm5 import ops
from glm5.testing.compare import assert_matches
from kit_bounds import output_bound

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


def route_vals(logits, bias, top_k, n_group, topk_group, norm, scaling):
    return {"logits": logits, "bias": bias, "top_k": top_k, "n_group": n_group,
            "topk_group": topk_group, "norm_topk_prob": norm, "routed_scaling": scaling}


def assert_sums_to(w, vals, total):
    """Normalised weights sum to routed_scaling: the exact sum of the oracle's weights is
    ``total``, so |sum_j w_j - total| is at most the sum of the kit's bounds on the k weights
    (the float64 sum of k fp32 values is exact)."""
    _, b = output_bound("moe_route", vals, "weights", w.dtype)
    err = (w.double().sum(-1) - total).abs()
    assert bool((err <= b.sum(-1)).all()), (err, b.sum(-1))


# --------------------------------------------------------------------------- moe_route
def test_weights_sum_to_routed_scaling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.1
    w, ids = route(logits, bias, 4, 1, 1, True, 2.5)
    assert w.dtype == torch.float32 and ids.dtype == I32
    assert w.shape == ids.shape == (6, 4)
    vals = route_vals(logits, bias, 4, 1, 1, True, 2.5)
    assert_matches("moe_route", (w, ids), vals)  # the fp32 reference against the oracle
    assert_sums_to(w, vals, 2.5)
    w2, ids2 = ops.moe_route(logits, bias, 4, 1, 1, True, 2.5)
    assert torch.equal(ids2, ids)
    assert torch.equal(w2, w)
    # grouped routing normalises too
    w3, ids3 = route(logits, bias, 4, 4, 2, True, 1.5)
    vals3 = route_vals(logits, bias, 4, 4, 2, True, 1.5)
    assert_matches("moe_route", (w3, ids3), vals3)
    assert_sums_to(w3, vals3, 1.5)


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

    def hand(*ws):
        return torch.tensor([ws], dtype=F64), ids

    assert_matches("moe_route", hand(0.5, sig(3.0)),
                   route_vals(logits, bias, 2, 1, 1, False, 1.0), dtype=F64)
    # scaling multiplies, normalisation divides by the sum of the picked sigmoids
    tot = 0.5 + sig(3.0)
    assert_matches("moe_route", hand(3.0 * 0.5 / tot, 3.0 * sig(3.0) / tot),
                   route_vals(logits, bias, 2, 1, 1, True, 3.0), dtype=F64)
    assert_matches("moe_route", hand(1.0, 2.0 * sig(3.0)),
                   route_vals(logits, bias, 2, 1, 1, False, 2.0), dtype=F64)


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
    assert_matches("moe_route", (torch.tensor([[sig(2.0), sig(2.0), sig(1.0)]], dtype=F64), ids),
                   route_vals(logits, bias, 3, 4, 2, False, 1.0), dtype=F64)
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
    assert_matches("moe_route", (torch.tensor([[sig(-1.0), sig(2.0), sig(2.0)]], dtype=F64), ids),
                   route_vals(logits, bias, 3, 4, 2, False, 1.0), dtype=F64)


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


def _experts_vals(x, ids, weights, w13, w2):
    return {"x": x, "ids": torch.tensor(ids, dtype=I32),
            "weights": torch.tensor(weights, dtype=F64), "w13": w13, "w2": w2}


def test_experts_hand_case():
    x, w13, w2, e0, e1 = _tiny_experts()
    vals = _experts_vals(x, [[0, 1]], [[0.5, 2.0]], w13, w2)
    y = experts(*vals.values())
    assert y.dtype == F64 and y.shape == (1, 2)
    assert_matches("moe_experts", (0.5 * e0 + 2.0 * e1)[None], vals, dtype=F64)
    printed = [0.5 * 1.4621171572600098 + 2 * 5.284782467867288,
               2 * 0.5 * 1.4621171572600098 - 2 * 5.284782467867288]
    assert_matches("moe_experts", torch.tensor([printed], dtype=F64), vals, dtype=F64)


def test_experts_minus_one_skipped():
    x, w13, w2, e0, e1 = _tiny_experts()
    assert_matches("moe_experts", (0.5 * e0)[None],
                   _experts_vals(x, [[0, -1]], [[0.5, 100.0]], w13, w2), dtype=F64)
    y = experts(x, torch.tensor([[-1, -1]], dtype=I32), torch.tensor([[1.0, 1.0]], dtype=F64),
                w13, w2)
    assert torch.equal(y, torch.zeros(1, 2, dtype=F64))
    vals = _experts_vals(x, [[-1, 1]], [[9.0, 1.0]], w13, w2)
    assert_matches("moe_experts", e1[None], vals, dtype=F64)
    assert torch.equal(ops.moe_experts(*vals.values()), experts(*vals.values()))


def test_experts_duplicate_slot_adds_twice():
    x, w13, w2, e0, e1 = _tiny_experts()
    assert assert_matches("moe_experts", (0.75 * e1)[None],
                   _experts_vals(x, [[1, 1]], [[0.5, 0.25]], w13, w2), dtype=F64).ok


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
    vals = {"x": x, "ids": ids, "weights": weights, "w13": w13, "w2": w2}
    assert_matches("moe_experts", _manual_moe(x, ids, weights, w13, w2), vals, dtype=F64)
    assert torch.equal(y[2], torch.zeros(D, dtype=F64))
    # bf16 in -> bf16 out, fp32 weights allowed; against the float64 oracle on the same inputs
    bvals = {"x": x.bfloat16(), "ids": ids, "weights": weights.float(), "w13": w13.bfloat16(),
             "w2": w2.bfloat16()}
    yb = experts(*bvals.values())
    assert yb.dtype == torch.bfloat16
    assert_matches("moe_experts", yb, bvals)
