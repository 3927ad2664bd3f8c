"""The error model's formulas (glm5/ir/numerics.py), on small cases computed by hand."""

from __future__ import annotations

import torch

from glm5.ir import numerics
from glm5.ir.numerics import ErrorTerms
from glm5.ir.ops_quant import act_codes

F64 = torch.float64


def test_unit_roundoffs_are_half_an_ulp_at_one():
    assert numerics.unit_roundoff(torch.bfloat16) == 2.0**-8
    assert numerics.unit_roundoff(torch.float16) == 2.0**-11
    assert numerics.unit_roundoff(torch.float32) == 2.0**-24
    assert numerics.unit_roundoff(torch.float64) == 2.0**-53
    assert numerics.acc_dtype(torch.bfloat16) == torch.float32
    assert numerics.acc_dtype(torch.float64) == torch.float64


def test_bound_adds_the_terms_with_their_unit_roundoffs():
    ref = torch.tensor([2.0, -4.0], dtype=F64)
    terms = ErrorTerms(mid=torch.tensor([1.0, 0.0], dtype=F64), acc=4.0, step=0.5)
    b = numerics.bound(ref, terms, torch.float32, torch.bfloat16)
    # every term is a short dyadic number: the sums are exact (the floor, 4 * 2^-133 + 2^-126,
    # is far below an ulp of 0.5 and rounds away)
    want0 = 1.25 * (2.0**-24 * 2.0 + 2.0**-8 * 1.0) + 6.0 * 2.0**-24 * 4.0 + 0.5
    want1 = 1.25 * (2.0**-24 * 4.0) + 6.0 * 2.0**-24 * 4.0 + 0.5
    assert b.tolist() == [want0, want1]
    # nothing to round: the floor alone, four subnormal spacings of the coarser dtype
    zero = numerics.bound(torch.zeros(1, dtype=F64), ErrorTerms(), torch.float32,
                          torch.float16)
    assert zero.tolist() == [4.0 * 2.0**-24 + 2.0**-126]  # fp16's smallest subnormal, fp32 FTZ
    # a rounding that may land among fp16 subnormals, times 3 afterwards: 3/2 spacings
    sub = numerics.bound(torch.zeros(1, dtype=F64), ErrorTerms(tiny=3.0), torch.float32,
                         torch.float16)
    assert sub.tolist() == [1.25 * 2.0**-25 * 3.0 + 4.0 * 2.0**-24 + 2.0**-126]


def test_terms_are_linear():
    a = ErrorTerms(mid=1.0, acc=torch.tensor([2.0]), step=0.0)
    b = ErrorTerms(mid=torch.tensor([3.0]), acc=1.0, step=0.25, tiny=1.0)
    c = (a + b).scale(2.0)
    assert float(c.mid) == 8.0 and float(c.acc) == 6.0 and c.step == 0.5 and c.tiny == 2.0
    m = a.map(lambda e: e * 10)
    assert float(m.mid) == 10.0 and float(m.acc) == 20.0 and m.step == 0.0  # zero stays zero


def test_linear_error_carries_the_input_error_through_abs_w():
    x = torch.tensor([[1.0, -2.0]], dtype=F64)
    w = torch.tensor([[3.0, 1.0], [-1.0, 1.0]], dtype=F64)
    y = x @ w.T  # [[1, -3]]
    e = numerics.linear_error(x, ErrorTerms(mid=torch.tensor([[0.5, 0.25]], dtype=F64)), w, y)
    # carried: [0.5, 0.25] @ |w|^T = [1.75, 0.75]; own rounding: |y| = [1, 3]
    assert torch.equal(e.mid, torch.tensor([[2.75, 3.75]], dtype=F64))
    # fp32 sum over K = 2: sqrt(2) * |x| @ |w|^T = sqrt(2) * [5, 3]
    assert torch.equal(e.acc, 2**0.5 * torch.tensor([[5.0, 3.0]], dtype=F64))


def test_fragile_codes_near_a_half_and_exact_halves():
    q = torch.tensor([2.5, 2.4999, 3.0, -1.5000001, 0.5], dtype=F64)
    assert numerics.fragile_codes(q, 1e-6).tolist() == [True, False, False, True, True]
    # over a power-of-two scale an exact half is computed exactly: it must round to even
    det = torch.tensor([True, True, True, True, False])
    assert numerics.fragile_codes(q, 1e-6, det).tolist() == [False, False, False, True, True]
    assert numerics.power_of_two(torch.tensor([0.125, 0.3, 4.0, 0.0], dtype=F64)).tolist() == \
        [True, False, True, False]


def test_act_codes_round_exact_halves_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5]], dtype=F64) * 2.0**-3  # s = 2^-3 exactly
    q, s, deq, err = act_codes(x, 8)
    assert q.tolist() == [[127.0, 0.0, 2.0, 2.0, -2.0]]
    assert float(s) == 2.0**-3
    assert torch.equal(err, torch.zeros_like(x))  # no code may move
    # the same row known only to within 1e-3: halves may move a step (s) and s itself moves
    q2, s2, _, err2 = act_codes(x, 8, 1e-3)
    assert bool((err2[0, 1:] >= 2.0**-3).all())


def test_near_ties_ignore_equal_inputs():
    s = torch.tensor([[1.0, 1.0, 2.0], [1.0, 1.0005, 2.0]], dtype=F64)
    b = torch.full_like(s, 1e-3)
    keys = torch.tensor([[1.0, 1.0, 2.0], [1.0, 1.5, 2.0]], dtype=F64)
    # row 0: the tie is between identical inputs (the smaller index wins in any kernel);
    # row 1: two different inputs within the bound of each other
    assert numerics.near_ties(s, b, keys).tolist() == [False, True]
