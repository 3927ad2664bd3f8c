"""glm5.engine.sampling: masks by hand, a float64 oracle for the processed distribution, the
sampler's and speculative verification's output distributions (chi-square on fixed seeds),
seed reproducibility whatever the batch, logprobs against float64, validation messages and
stop strings across stream chunks."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from glm5.engine.sampling import (
    SampleOutput, SamplingParams, _inverse_cdf, find_stop, make_generator, processed_logits,
    sample, speculative_verify, target_probs, token_logprobs,
)

F64 = torch.float64
NEG = float("-inf")
SP = SamplingParams


def gens(seeds) -> list[torch.Generator]:
    return [make_generator(s, "cpu") for s in seeds]


def log_probs(*probs: float) -> torch.Tensor:
    """Logits [1, V] whose softmax is ``probs`` (up to float32 rounding)."""
    return torch.tensor([[math.log(p) for p in probs]])


def kept(logits: torch.Tensor, params: SamplingParams) -> list[int]:
    return torch.isfinite(processed_logits(logits, [params])[0]).nonzero().flatten().tolist()


# ----------------------------------------------------------------------- float64 oracle
def oracle(row: list[float], p: SamplingParams) -> tuple[list[float], float]:
    """The processed distribution of one row, computed plainly in float64 from the module
    docstring's definition, and the smallest relative distance of any top-p / min-p decision
    from its threshold (float32 in the implementation may decide differently within it)."""
    v = len(row)
    if p.greedy:
        best = max(range(v), key=lambda i: (row[i], -i))
        return [1.0 if i == best else 0.0 for i in range(v)], math.inf
    z = [x / p.temperature for x in row]
    order = sorted(range(v), key=lambda i: (-z[i], i))
    keep = [True] * v
    margin = math.inf
    if p.top_k > 0:
        kth = z[order[min(p.top_k, v) - 1]]
        keep = [zi >= kth for zi in z]
    if p.top_p < 1:
        m = max(z)
        mass = {i: math.exp(z[i] - m) for i in order if keep[i]}
        total = sum(mass.values())
        before = 0.0
        for i in order:
            if not keep[i]:
                continue
            if i != order[0]:
                margin = min(margin, abs(before - p.top_p) / p.top_p)
            keep[i] = before < p.top_p
            before += mass[i] / total
    if p.min_p > 0:
        m = max(z)
        for i in range(v):
            ratio = math.exp(z[i] - m)
            if keep[i]:
                margin = min(margin, abs(ratio - p.min_p) / p.min_p)
            keep[i] = keep[i] and ratio >= p.min_p
    m = max(z[i] for i in range(v) if keep[i])
    w = [math.exp(z[i] - m) if keep[i] else 0.0 for i in range(v)]
    return [x / sum(w) for x in w], margin


# Quarter-integer logits and these temperatures keep distinct logits distinct after a float32
# division (gaps >= 0.25 / 2), so top-k ties are the same in float32 and float64.
LOGIT = st.integers(-32, 32).map(lambda i: i / 4)
TEMPS = [0.0, 0.5, 0.7, 1.0, 1.3, 2.0]
params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from(TEMPS),
    top_k=st.sampled_from([-1, 0, 1, 2, 3, 5, 100]),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.9)),
)


@st.composite
def batch_st(draw, max_rows: int = 4, max_v: int = 12):
    n = draw(st.integers(1, max_rows))
    v = draw(st.integers(1, max_v))
    rows = draw(st.lists(st.lists(LOGIT, min_size=v, max_size=v), min_size=n, max_size=n))
    params = draw(st.lists(params_st, min_size=n, max_size=n))
    return torch.tensor(rows), params


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` over the cells with probs > 0
    (regularised upper incomplete gamma: no scipy needed)."""
    cells = probs > 0
    n = counts.sum().double()
    expected = n * probs[cells].double()
    stat = ((counts[cells].double() - expected) ** 2 / expected).sum()
    df = torch.tensor(float(cells.sum() - 1), dtype=F64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


# ----------------------------------------------------------------------- golden masks
def test_temperature_divides_logits():
    z = processed_logits(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), [SP(temperature=0.5)])
    assert z.tolist() == [[0.0, 2.0, 4.0, 6.0]]
    assert z.dtype == torch.float32


def test_top_k_golden():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]])
    assert kept(x, SP(top_k=3)) == [1, 2, 3]
    assert kept(x, SP(top_k=2)) == [1, 3]
    # a tie with the k-th largest is kept whole
    assert kept(x, SP(top_k=1, temperature=0.0)) == [0, 1, 2, 3, 4]  # greedy: unchanged
    assert kept(torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]]), SP(top_k=2)) == [1, 2, 3]
    assert kept(x, SP(top_k=9)) == [0, 1, 2, 3, 4]
    assert kept(x, SP(top_k=-1)) == [0, 1, 2, 3, 4]


def test_top_p_golden():
    # descending: 0.4 (id 1), 0.3 (id 3), 0.2 (id 2), 0.1 (id 0); mass before: 0, .4, .7, .9
    x = log_probs(0.1, 0.4, 0.2, 0.3)
    assert kept(x, SP(top_p=0.35)) == [1]
    assert kept(x, SP(top_p=0.5)) == [1, 3]
    assert kept(x, SP(top_p=0.75)) == [1, 2, 3]
    assert kept(x, SP(top_p=0.95)) == [0, 1, 2, 3]
    # equal probabilities: the smaller ids first; the smallest prefix whose mass reaches top_p
    # (0.25 + 0.25 = 0.5 exactly in float32)
    u = torch.zeros(1, 4)
    assert kept(u, SP(top_p=0.5)) == [0, 1]
    assert kept(u, SP(top_p=0.6)) == [0, 1, 2]


def test_min_p_golden():
    x = log_probs(0.05, 0.5, 0.3, 0.15)  # max 0.5
    assert kept(x, SP(min_p=0.25)) == [1, 2, 3]  # >= 0.125
    assert kept(x, SP(min_p=0.35)) == [1, 2]  # >= 0.175
    assert kept(x, SP(min_p=0.0)) == [0, 1, 2, 3]


def test_mask_order_top_k_then_top_p_then_min_p():
    x = log_probs(0.4, 0.3, 0.2, 0.1)
    # top-k 3 first renormalises to (.444, .333, .222): mass before id 2 is .778 >= .75. Had
    # top-p seen the untruncated (.4, .3, .2, .1), id 2 (before .7) would stay.
    assert kept(x, SP(top_k=3, top_p=0.75)) == [0, 1]
    # min-p after top-p: top-p .75 keeps ids 0-2 and min-p .3 (>= .12) keeps them. Had min-p
    # gone first, top-p would see (.444, .333, .222) and drop id 2.
    assert kept(x, SP(top_p=0.75, min_p=0.3)) == [0, 1, 2]


def test_processed_values_and_greedy_rows():
    x = torch.tensor([[2.0, -1.0, 0.5, 2.0], [0.0, 1.0, 1.0, -3.0]], dtype=torch.bfloat16)
    params = [SP(temperature=0.0), SP(temperature=0.5, top_k=2)]
    z = processed_logits(x, params)
    assert z.dtype == torch.float32
    assert z[0].tolist() == x[0].float().tolist()  # greedy rows: logits unchanged
    assert z[1].tolist() == [NEG, 2.0, 2.0, NEG]
    probs = target_probs(x, params)
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]  # one-hot at the FIRST maximum
    assert probs[1].tolist() == [0.0, 0.5, 0.5, 0.0]


def test_greedy_property():
    assert SP(temperature=0).greedy and SP(temperature=1e-6).greedy
    assert SP(temperature=0.7, top_k=1).greedy
    assert not SP(temperature=1e-5).greedy and not SP(top_k=2).greedy


@given(batch_st())
def test_processed_distribution_matches_float64_oracle(batch):
    logits, params = batch
    expected = [oracle(row, p) for row, p in zip(logits.tolist(), params)]
    assume(all(m > 1e-4 for _, m in expected))  # float32 cumsum / exp decide the same way
    probs = target_probs(logits, params)
    ref = torch.tensor([e for e, _ in expected], dtype=F64)
    assert ((probs > 0) == (ref > 0)).all(), (probs, ref)
    torch.testing.assert_close(probs.double(), ref, rtol=1e-5, atol=1e-6)
    z = processed_logits(logits, params)
    for i, p in enumerate(params):
        scaled = logits[i] if p.greedy else logits[i] / p.temperature
        live = torch.isfinite(z[i])
        assert torch.equal(z[i][live], scaled[live])


def test_top_p_one_keeps_a_tiny_tail_in_any_batch():
    # Row 0's last entry has probability ~e^-40: a float32 "mass before" rounds to 1.0 there. A
    # top_p = 1 row keeps it whether or not another row in the batch uses top-p.
    x = torch.tensor([[0.0, 0.0, -40.0], [0.0, 1.0, 2.0]])
    assert torch.isfinite(processed_logits(x[:1], [SP()])).all()
    assert torch.isfinite(processed_logits(x, [SP(), SP(top_p=0.5)])[0]).all()


# ----------------------------------------------------------------------- sampling
def test_inverse_cdf_skips_zero_weights_at_both_ends():
    # id i owns the half-open interval [cdf[i-1], cdf[i]) of u * total
    w = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 4)
    u = torch.tensor([0.0, 0.25 - 2.0**-53, 0.25, 1.0 - 2.0**-53], dtype=F64)
    assert _inverse_cdf(w, u).tolist() == [1, 1, 3, 3]
    # unnormalised weights sample the same as normalised ones
    assert _inverse_cdf(w * 4, u).tolist() == [1, 1, 3, 3]


@pytest.mark.parametrize("params", [
    SP(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
    SP(temperature=1.3),
    SP(temperature=0.6, top_p=0.7),
])
def test_sample_draws_from_the_processed_distribution(params):
    # 4000 rows x 3 steps = 12000 draws, each row its own seed. The seeds are fixed, so the test
    # is deterministic; the 1e-3 threshold is the rate at which a correct sampler would fail
    # over random seed choices, while the bugs this guards (a token too many or too few, the
    # wrong temperature) move some cell by >= 0.02 and give chi-square statistics in the
    # hundreds at this sample size.
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 2.5]])
    ref = torch.tensor(oracle(logits[0].tolist(), params)[0], dtype=F64)
    rows = 4000
    g = gens(range(rows))
    batch = logits.expand(rows, -1)
    counts = torch.zeros(8, dtype=torch.int64)
    for _ in range(3):
        out = sample(batch, [params] * rows, g)
        counts += torch.bincount(out.tokens, minlength=8)
    assert (counts[ref == 0] == 0).all(), (counts, ref)
    assert chi2_pvalue(counts, ref) > 1e-3, (counts, ref * counts.sum())


def test_greedy_takes_the_first_maximum():
    x = torch.tensor([[0.0, 5.0, 5.0, 1.0], [9.0, 1.0, 9.0, 9.0]])
    out = sample(x, [SP(temperature=0.0), SP(temperature=0.9, top_k=1)], gens([0, 1]))
    assert out.tokens.tolist() == [1, 0]
    assert out.tokens.dtype == torch.int64 and isinstance(out, SampleOutput)


@given(st.data())
def test_seeded_row_same_alone_or_in_any_batch(data):
    # The row of interest and its seed; the other rows: any params, seeds (or OS entropy),
    # logits; the row's position anywhere in the batch.
    v = data.draw(st.integers(2, 16))
    logits_st = st.lists(st.floats(-30, 30, width=32), min_size=v, max_size=v)
    row = torch.tensor([data.draw(logits_st)])
    params = data.draw(params_st.filter(lambda p: not p.greedy))
    seed = data.draw(st.integers(0, 2**63 - 1))
    others = data.draw(st.lists(st.tuples(logits_st, params_st,
                                          st.one_of(st.none(), st.integers(0, 2**32))),
                                min_size=1, max_size=4))
    pos = data.draw(st.integers(0, len(others)))
    steps = 4
    alone_g = gens([seed])
    alone = [sample(row, [params], alone_g) for _ in range(steps)]
    batch = torch.tensor([o[0] for o in others])
    batch = torch.cat((batch[:pos], row, batch[pos:]))
    batch_params = [o[1] for o in others]
    batch_params.insert(pos, params)
    batch_g = gens([o[2] for o in others])
    batch_g.insert(pos, make_generator(seed))
    for step in range(steps):
        out = sample(batch, batch_params, batch_g)
        assert out.tokens[pos] == alone[step].tokens[0]
        torch.testing.assert_close(out.logprobs[pos], alone[step].logprobs[0])


def test_make_generator():
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    fresh = [torch.rand(1, generator=make_generator(None)) for _ in range(2)]
    # two OS-entropy seeds drawing the same float64 has probability ~2^-53
    assert not torch.equal(*fresh)
    assert make_generator(2**63 - 1).initial_seed() == 2**63 - 1
    for bad in (-1, 2**63, 2**64, 1.5, True):
        with pytest.raises(ValueError, match=re.escape(
                "glm5 make_generator: argument 'seed' expected None or an int in [0, 2**63)")):
            make_generator(bad)


# ----------------------------------------------------------------------- logprobs
def test_logprob_hand_case_is_untruncated():
    # logits [0, ln 3] -> p = [1/4, 3/4]; top_p 0.5 keeps id 1 only, yet its logprob is ln .75
    x = torch.tensor([[0.0, math.log(3.0)]])
    out = sample(x, [SP(top_p=0.5, logprobs=1)], gens([0]))
    assert out.tokens.tolist() == [1]
    assert out.logprobs.item() == pytest.approx(math.log(0.75), abs=1e-6)
    # temperature 0.5 doubles the logits: p = [1/10, 9/10]
    out = sample(x, [SP(temperature=0.5, top_p=0.5)], gens([0]))
    assert out.logprobs.item() == pytest.approx(math.log(0.9), abs=1e-6)
    assert out.top_ids is None and out.top_logprobs is None
    # a temperature below 1e-5 is greedy and its logprobs are those at temperature 1
    out = sample(x, [SP(temperature=1e-6)], gens([0]))
    assert out.tokens.tolist() == [1]
    assert out.logprobs.item() == pytest.approx(math.log(0.75), abs=1e-6)


@given(st.data())
def test_logprobs_match_float64(data):
    n = data.draw(st.integers(1, 4))
    v = data.draw(st.integers(1, 40))
    x = torch.tensor(data.draw(st.lists(st.lists(st.floats(-20, 20, width=32), min_size=v,
                                                 max_size=v), min_size=n, max_size=n)))
    params = data.draw(st.lists(st.builds(SP, temperature=st.sampled_from(TEMPS),
                                          top_p=st.floats(0.1, 1.0),
                                          logprobs=st.one_of(st.none(), st.integers(0, 20))),
                                min_size=n, max_size=n))
    out = sample(x, params, gens(range(n)))
    t = torch.tensor([p.temperature or 1.0 for p in params], dtype=F64)[:, None]
    ref = torch.log_softmax(x.double() / t, -1)
    torch.testing.assert_close(out.logprobs.double(), ref.gather(1, out.tokens[:, None])[:, 0],
                               rtol=0, atol=1e-5)
    again = token_logprobs(x, params, out.tokens)
    assert torch.equal(again[0], out.logprobs)
    asked = max(p.logprobs or 0 for p in params)
    if asked == 0:
        assert out.top_ids is None and again[1] is None
        return
    assert out.top_ids.shape == (n, min(asked, v)) and out.top_ids.dtype == torch.int64
    torch.testing.assert_close(out.top_logprobs.double(), ref.gather(1, out.top_ids),
                               rtol=0, atol=1e-5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    # nothing left out ranks above the last one taken
    assert (out.top_logprobs[:, -1:] >= ref.float().scatter(1, out.top_ids, NEG).max(-1,
            keepdim=True).values - 1e-5).all()


@given(st.data())
def test_top_n_order_with_ties(data):
    # Integer logits: exact ties, and distinct values at least 1 / 2 apart after a temperature.
    v = data.draw(st.integers(1, 30))
    x = torch.tensor([data.draw(st.lists(st.integers(-3, 3), min_size=v, max_size=v))],
                     dtype=torch.float32)
    temperature = data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    k = data.draw(st.integers(1, 20))
    tokens = torch.tensor([data.draw(st.integers(0, v - 1))])
    lp, ids, vals = token_logprobs(x, [SP(temperature=temperature, logprobs=k)], tokens)
    ref = torch.log_softmax(x.double() / (temperature or 1.0), -1)
    order = sorted(range(v), key=lambda i: (-x[0, i].item(), i))[:k]
    assert ids[0].tolist() == order
    torch.testing.assert_close(vals.double(), ref[:, order], rtol=0, atol=1e-5)
    torch.testing.assert_close(lp.double(), ref[0, tokens], rtol=0, atol=1e-5)


def test_top_n_columns_are_the_largest_request():
    x = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    out = sample(x, [SP(temperature=0, logprobs=2), SP(temperature=0)], gens([0, 1]))
    assert out.top_ids.tolist() == [[2, 1], [0, 1]]
    assert out.top_logprobs.shape == (2, 2)


# ----------------------------------------------------------------------- speculative decoding
@pytest.mark.parametrize("target_params", [SP(top_k=4), SP(temperature=0.7, top_p=0.8)])
def test_speculative_verify_keeps_the_target_distribution(target_params):
    # Drafts from q (which puts mass where p has none), then verification: the output token must
    # follow p. 12000 rows with fixed seeds (deterministic); chi-square threshold as in
    # test_sample_draws_from_the_processed_distribution. The acceptance rate must be
    # sum(min(p, q)); its binomial sd at 12000 draws is <= 0.0046 and the bound is 4.5 sd.
    v, rows = 6, 12000
    logits = torch.tensor([[1.5, 0.2, 1.0, -0.5, 0.7, -1.0]])
    p = torch.tensor(oracle(logits[0].tolist(), target_params)[0], dtype=F64)
    q = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.05, 0.25])
    drafts = torch.multinomial(q, rows, replacement=True, generator=make_generator(123))
    accepted, tokens = speculative_verify(logits.expand(rows, -1), drafts,
                                          q.expand(rows, -1), [target_params] * rows,
                                          gens(range(1000, 1000 + rows)))
    assert accepted.dtype == torch.bool and tokens.dtype == torch.int64
    assert torch.equal(tokens[accepted], drafts[accepted])
    counts = torch.bincount(tokens, minlength=v)
    assert (counts[p == 0] == 0).all(), (counts, p)
    assert chi2_pvalue(counts, p) > 1e-3, (counts, p * rows)
    alpha = float(torch.minimum(p, q.double()).sum())
    sd = math.sqrt(alpha * (1 - alpha) / rows)
    assert abs(accepted.double().mean().item() - alpha) < 4.5 * sd


def test_speculative_verify_accepts_every_draft_from_the_target_itself():
    x = torch.tensor([[0.3, -1.0, 2.0, 0.0]] * 50)
    params = [SP(temperature=0.9)] * 50
    p = target_probs(x, params)
    drafts = torch.multinomial(p, 1, generator=make_generator(5))[:, 0]
    accepted, tokens = speculative_verify(x, drafts, p, params, gens(range(50)))
    assert accepted.all() and torch.equal(tokens, drafts)


def test_speculative_verify_greedy_rows():
    x = torch.tensor([[0.0, 3.0, 3.0, 1.0]] * 4)
    drafts = torch.tensor([1, 2, 0, 3])
    params = [SP(temperature=0.0)] * 4
    accepted, tokens = speculative_verify(x, drafts, None, params, gens([0, 1, 2, 3]))
    assert accepted.tolist() == [True, False, False, False]  # the first maximum is id 1
    assert tokens.tolist() == [1, 1, 1, 1]
    # greedy and sampled rows together: the greedy row ignores draft_probs
    mixed = [SP(temperature=0.0), SP(temperature=1.0)]
    q = torch.full((2, 4), 0.25)
    accepted, tokens = speculative_verify(x[:2], torch.tensor([1, 3]), q, mixed, gens([0, 1]))
    assert accepted[0] and tokens[0] == 1
    with pytest.raises(ValueError, match=re.escape(
            "glm5 speculative_verify: argument 'draft_probs' is None but rows [1] sample")):
        speculative_verify(x[:2], torch.tensor([1, 3]), None, mixed, gens([0, 1]))


def test_speculative_verify_seeded_row_independent_of_batch():
    x = torch.tensor([[0.5, 0.1, -0.3, 0.9, 0.0]])
    q = torch.tensor([[0.4, 0.1, 0.1, 0.1, 0.3]])
    d = torch.tensor([0])
    ps = SP(temperature=0.8)
    g_alone = gens([42])
    alone = [speculative_verify(x, d, q, [ps], g_alone) for _ in range(6)]
    other = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    g_batch = gens([7, 42])
    for step in range(6):
        acc, tok = speculative_verify(torch.cat((other, x)), torch.cat((d, d)),
                                      torch.cat((q, q)), [SP(temperature=1.3), ps], g_batch)
        assert (acc[1], tok[1]) == (alone[step][0][0], alone[step][1][0])


# ----------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "argument 'max_tokens' expected an int >= 1, got 0"),
    ({"max_tokens": True}, "argument 'max_tokens' expected an int >= 1, got True"),
    ({"max_tokens": 2.0}, "argument 'max_tokens' expected an int >= 1, got 2.0"),
    ({"temperature": -0.1}, "argument 'temperature' expected a finite number >= 0, got -0.1"),
    ({"temperature": float("nan")}, "argument 'temperature' expected a finite number >= 0, "
                                    "got nan"),
    ({"temperature": float("inf")}, "argument 'temperature' expected a finite number >= 0, "
                                    "got inf"),
    ({"temperature": "1"}, "argument 'temperature' expected a finite number >= 0, got '1'"),
    ({"top_p": 1.5}, "argument 'top_p' expected in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "argument 'top_p' expected in (0, 1], got 0.0"),
    ({"top_p": float("nan")}, "argument 'top_p' expected in (0, 1], got nan"),
    ({"top_k": -2}, "argument 'top_k' expected 0 or -1 (off) or an int >= 1, got -2"),
    ({"top_k": 2.5}, "argument 'top_k' expected 0 or -1 (off) or an int >= 1, got 2.5"),
    ({"min_p": 1.0}, "argument 'min_p' expected in [0, 1), got 1.0"),
    ({"min_p": -0.1}, "argument 'min_p' expected in [0, 1), got -0.1"),
    ({"seed": -1}, "argument 'seed' expected None or an int in [0, 2**63), got -1"),
    ({"seed": 2**63}, f"argument 'seed' expected None or an int in [0, 2**63), got {2**63}"),
    ({"seed": "1"}, "argument 'seed' expected None or an int in [0, 2**63), got '1'"),
    ({"stop": ""}, "argument 'stop' expected a non-empty string or a sequence of non-empty "
                   "strings, got ''"),
    ({"stop": ["a", ""]}, "argument 'stop' expected a non-empty string or a sequence of "
                          "non-empty strings, got ['a', '']"),
    ({"stop": ["a", 3]}, "argument 'stop' expected a non-empty string or a sequence of "
                         "non-empty strings, got ['a', 3]"),
    ({"stop_token_ids": [1, -1]}, "argument 'stop_token_ids' expected a sequence of ints "
                                  ">= 0, got [1, -1]"),
    ({"stop_token_ids": 5}, "argument 'stop_token_ids' expected a sequence of ints >= 0, got 5"),
    ({"stop_token_ids": [True]}, "argument 'stop_token_ids' expected a sequence of ints >= 0, "
                                 "got [True]"),
    ({"ignore_eos": 1}, "argument 'ignore_eos' expected a bool, got 1"),
    ({"include_stop_str_in_output": "yes"}, "argument 'include_stop_str_in_output' expected a "
                                            "bool, got 'yes'"),
    ({"logprobs": 21}, "argument 'logprobs' expected None or an int in [0, 20], got 21"),
    ({"logprobs": -1}, "argument 'logprobs' expected None or an int in [0, 20], got -1"),
    ({"logprobs": False}, "argument 'logprobs' expected None or an int in [0, 20], got False"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=re.escape("glm5 SamplingParams: " + message)):
        SamplingParams(**kwargs)


def test_sampling_params_normalises():
    p = SamplingParams(temperature=1, top_p=1, stop="</s>", stop_token_ids=[2, 3], logprobs=0)
    assert p.stop == ("</s>",) and p.stop_token_ids == (2, 3)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert hash(p) == hash(SamplingParams(temperature=1.0, stop=("</s>",),
                                          stop_token_ids=(2, 3), logprobs=0))
    with pytest.raises(AttributeError):
        p.top_p = 0.5  # frozen


def test_sample_and_verify_argument_errors():
    x = torch.zeros(2, 3)
    two = [SP(), SP()]
    with pytest.raises(ValueError, match=re.escape(
            "glm5 sample: argument 'params' expected 2 SamplingParams (one per row of "
            "'logits'), got 1")):
        sample(x, [SP()], gens([0, 1]))
    with pytest.raises(ValueError, match=re.escape(
            "glm5 sample: argument 'params' expected SamplingParams, item 1 is a dict")):
        sample(x, [SP(), {}], gens([0, 1]))
    with pytest.raises(ValueError, match=re.escape(
            "glm5 sample: argument 'generators' expected 2 torch.Generator (one per row), "
            "got 1")):
        sample(x, two, gens([0]))
    with pytest.raises(ValueError, match=re.escape(
            "glm5 sample: argument 'logits' expected a floating tensor [N, V], got (3,)")):
        sample(torch.zeros(3), two, gens([0, 1]))
    with pytest.raises(ValueError, match=re.escape(
            "glm5 sample: argument 'logits' expected a floating tensor [N, V], got (2, 3) "
            "torch.int64")):
        sample(torch.zeros(2, 3, dtype=torch.int64), two, gens([0, 1]))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 2] = bad
        with pytest.raises(ValueError, match=re.escape(
                "glm5 target_probs: argument 'logits' expected finite values (-inf allowed, "
                "not a whole row), rows [1] hold NaN / +inf or are all -inf")):
            target_probs(y, two)
    with pytest.raises(ValueError, match=re.escape("rows [0] hold NaN / +inf or are all -inf")):
        processed_logits(torch.tensor([[NEG, NEG], [0.0, NEG]]), two)
    with pytest.raises(ValueError, match=re.escape(
            "glm5 token_logprobs: argument 'tokens' expected token ids in [0, 3), got min 0 "
            "max 3")):
        token_logprobs(x, two, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=re.escape(
            "glm5 speculative_verify: argument 'draft_tokens' expected an int64 or int32 "
            "tensor [2], got (2,) torch.float32")):
        speculative_verify(x, torch.zeros(2), torch.full((2, 3), 1 / 3), two, gens([0, 1]))
    with pytest.raises(ValueError, match=re.escape(
            "glm5 speculative_verify: argument 'draft_probs' expected a floating tensor "
            "[2, 3], got (2, 4) torch.float32")):
        speculative_verify(x, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 4), two,
                           gens([0, 1]))
    with pytest.raises(ValueError, match=re.escape(
            "glm5 speculative_verify: argument 'draft_probs' expected probabilities >= 0")):
        speculative_verify(x, torch.zeros(2, dtype=torch.int64),
                           torch.tensor([[1.0, 0.0, 0.0], [1.1, -0.1, 0.0]]), two, gens([0, 1]))


# ----------------------------------------------------------------------- stop strings
def test_find_stop_across_chunk_boundaries():
    # "</s>" split between the old text and the new chunk (which begins at 7) is found
    assert find_stop("hello </s> more", ["</s>"], 8) == (6, "</s>")
    assert find_stop("hello </", ["</s>"], 6) is None
    assert find_stop("hello </s>", ["</s>"], 8) == (6, "</s>")
    # a stop entirely inside text already checked is not reported again
    assert find_stop("a</s>b", ["</s>"], 5) is None
    assert find_stop("a</s>b</s>", ["</s>"], 6) == (6, "</s>")
    # the stop ending exactly at `start` was in the old text; one ending just after is new
    assert find_stop("ab", ["ab"], 2) is None
    assert find_stop("ab", ["ab"], 1) == (0, "ab")
    assert find_stop("", ["x"], 0) is None


def test_find_stop_picks_the_stop_that_ends_first():
    # "bc" ends at 3, "abcd" at 4: a check after every character would stop at "bc"
    assert find_stop("abcd", ["abcd", "bc"], 0) == (1, "bc")
    # same end: the one that begins first
    assert find_stop("xabc", ["bc", "abc"], 0) == (1, "abc")
    assert find_stop("xabc", ["abc", "bc"], 0) == (1, "abc")


@given(st.text("ab</>", max_size=30), st.lists(st.text("ab</>", min_size=1, max_size=4),
                                               min_size=1, max_size=3),
       st.lists(st.integers(1, 6), max_size=30))
def test_find_stop_streamed_equals_character_by_character(text, stops, cuts):
    def char_by_char():
        for end in range(1, len(text) + 1):
            hits = [(end - len(s), s) for s in stops if text[:end].endswith(s)]
            if hits:
                return min(hits)
        return None

    expected = char_by_char()
    seen, got = 0, None
    for size in [*cuts, len(text)]:  # chunks of the given sizes, then the rest
        new_end = min(len(text), seen + size)
        got = find_stop(text[:new_end], stops, seen)
        seen = new_end
        if got is not None or seen == len(text):
            break
    assert got == expected


def test_find_stop_argument_errors():
    with pytest.raises(ValueError, match=re.escape(
            "glm5 find_stop: argument 'start' expected an int in [0, 3] (len(text)), got 4")):
        find_stop("abc", ["a"], 4)
    with pytest.raises(ValueError, match=re.escape(
            "glm5 find_stop: argument 'stops' expected a sequence of non-empty strings, "
            "got ['']")):
        find_stop("abc", [""], 0)
    with pytest.raises(ValueError, match=re.escape(
            "glm5 find_stop: argument 'stops' expected a sequence of non-empty strings, "
            "got 'a'")):
        find_stop("abc", "a", 0)
    with pytest.raises(ValueError, match=re.escape(
            "glm5 find_stop: argument 'text' expected a str, got bytes")):
        find_stop(b"abc", ["a"], 0)


# ----------------------------------------------------------------------- on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gen_device", ["cpu", "cuda"])
def test_cuda_matches_cpu_and_is_batch_independent(gen_device):
    # Same logits on the GPU with the same seeds: the same tokens as on the CPU when the
    # generators are CPU ones (the recommended setup); with CUDA generators, reproducible
    # whatever the batch.
    torch.manual_seed(0)
    x = torch.randn(8, 1000) * 3
    params = [SP(temperature=0.9, top_p=0.9, top_k=50, logprobs=5)] * 8
    ref = sample(x, params, gens(range(8)))
    out = sample(x.cuda(), params, [make_generator(s, gen_device) for s in range(8)])
    alone = sample(x[3:4].cuda(), params[:1], [make_generator(3, gen_device)])
    assert out.tokens[3] == alone.tokens[0]
    if gen_device == "cpu":
        assert torch.equal(out.tokens.cpu(), ref.tokens)
    torch.testing.assert_close(out.logprobs.cpu(), token_logprobs(x, params, out.tokens.cpu())[0],
                               rtol=0, atol=1e-5)
