"""The prefill token budget (glm5.engine.step_budget): a feedback loop on measured step times
keeps steps that carry prefill within ``max_slowdown`` x a decode-only step, follows a cost per
token that grows with the context, and the scheduler / engine obey it without changing tokens."""

from __future__ import annotations

import random

import pytest
import torch

from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.engine.sampling import SamplingParams
from glm5.engine.step_budget import PrefillBudget


def simulate(budget: PrefillBudget, prompt: int, d: float, fixed: float, per_token: float,
             per_token_ctx: float, noise: float, seed: int, warm: int = 12
             ) -> tuple[list[float], list[int]]:
    """Decodes run (decode-only steps of ``d`` s, ``warm`` of them first); a ``prompt``-token
    prompt then prefills with the budget's allowance per step, a step costing d + fixed +
    n * (per_token + per_token_ctx * context) (times 1 +- noise). Returns each prefill step's
    seconds and tokens."""
    rng = random.Random(seed)

    def jitter(t: float) -> float:
        return t * (1 + noise * (2 * rng.random() - 1))

    for _ in range(warm):
        budget.observe(8, 0, jitter(d))
    done, steps, sizes = 0, [], []
    while done < prompt:
        allow = budget.allowance(True)
        n = min(prompt - done, allow if allow is not None else prompt)
        t = jitter(d + fixed + n * (per_token + per_token_ctx * (done + n / 2)))
        budget.observe(8, n, t)
        steps.append(t)
        sizes.append(n)
        done += n
    return steps, sizes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_stay_within_the_bound_as_the_context_grows(seed):
    d, slow = 0.035, 2.5
    b = PrefillBudget(slow, 16, 8192)
    steps, sizes = simulate(b, 16384, d, fixed=0.004, per_token=2e-4, per_token_ctx=4e-8,
                            noise=0.05, seed=seed)
    settled = steps[8:]  # the allowance starts at min_tokens and doubles at most per step
    assert max(settled) <= slow * d * 1.2, max(settled) / d
    # and it uses the room: the median step is close to the bound, not far under it
    med = sorted(settled)[len(settled) // 2]
    assert med >= 0.8 * slow * d, med / d
    # the cost per token grows with the context: later chunks are smaller
    assert sum(sizes[-10:]) < sum(sizes[8:18])


def test_no_bound_without_decodes_or_before_a_decode_step():
    b = PrefillBudget(2.5, 16, 512)
    assert b.allowance(True) is None  # no decode-only step measured yet
    b.observe(4, 0, 0.01)
    assert b.allowance(False) is None  # nothing decoding: a lone prompt prefills at full speed
    assert b.allowance(True) == 16
    assert b.decode_seconds() == pytest.approx(0.01)


def test_one_noisy_step_moves_the_allowance_by_at_most_2x():
    b = PrefillBudget(3.0, 8, 4096)
    for _ in range(8):
        b.observe(2, 0, 0.010)
    for _ in range(10):  # grow: each step far under the bound
        b.observe(2, b.allowance(True), 0.011)
    big = b.allowance(True)
    b.observe(2, big, 10.0)  # a hiccup: 1000x the decode step
    assert b.target == big // 2
    b.observe(2, b.target, 0.0101)
    assert b.target == 2 * (big // 2)
    # the allowance itself is dithered 10% around the target on alternate steps
    assert {b.allowance(True)} <= {round(0.9 * b.target), round(1.1 * b.target)}


@pytest.mark.parametrize("kwargs,arg", [
    (dict(max_slowdown=1.0, min_tokens=1, max_tokens=4), "max_slowdown"),
    (dict(max_slowdown=float("inf"), min_tokens=1, max_tokens=4), "max_slowdown"),
    (dict(max_slowdown=2, min_tokens=0, max_tokens=4), "min_tokens"),
    (dict(max_slowdown=2, min_tokens=8, max_tokens=4), "min_tokens"),
    (dict(max_slowdown=2, min_tokens=1, max_tokens=4, window=0), "window"),
])
def test_bad_arguments_are_named(kwargs, arg):
    with pytest.raises(ValueError, match=f"PrefillBudget: argument '{arg}'"):
        PrefillBudget(**kwargs)
    with pytest.raises(ValueError, match="observe: argument 'seconds'"):
        PrefillBudget(2, 1, 4).observe(1, 0, 0.0)


def test_engine_config_names_a_bad_slowdown():
    with pytest.raises(ValueError, match="'max_decode_slowdown' expected None or a finite"):
        EngineConfig(max_decode_slowdown=0.5)
    with pytest.raises(ValueError, match="'min_prefill_tokens' expected an int >= 1"):
        EngineConfig(min_prefill_tokens=0)


@pytest.fixture(scope="module")
def model() -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(preset("tiny")).float().eval()


def _run(model, allowance: int | None, slowdown: float | None) -> tuple[dict, list]:
    """Two requests decode; then two 96-token prompts arrive. Returns the tokens of every request
    and the prefill tokens of each step while decodes ran (with a budget whose allowance is
    pinned to ``allowance``)."""
    eng = LLMEngine(model, EngineConfig(chunk_size=32, page_size=4, num_pages=128,
                                        max_decode_slowdown=slowdown, min_prefill_tokens=4))
    if allowance is not None:
        eng.scheduler.budget.allowance = lambda decoding: allowance if decoding else None
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(2):
        eng.add_request(f"d{i}", torch.randint(2, 128, (6,), generator=g).tolist(), params)
    for _ in range(4):
        eng.step()
    for i in range(2):  # two prefills at once: they share one allowance
        eng.add_request(f"long{i}", torch.randint(2, 128, (96,), generator=g).tolist(),
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    schedule, seen = eng.scheduler.schedule, []

    def spy():
        items = schedule()
        if any(it.decode for it in items):
            seen.append(sum(len(it.tokens) for it in items if not it.decode))
        return items

    eng.scheduler.schedule = spy
    tokens = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                tokens[o.request_id] = o.token_ids
    return tokens, seen


def test_scheduler_obeys_the_allowance_and_tokens_do_not_change(model):
    ref, fixed = _run(model, None, None)
    got, seen = _run(model, 8, 2.5)
    assert got == ref
    assert max(fixed) == 64  # without a budget: chunk_size per request and step
    assert max(seen) == 8 and seen.count(8) >= 2 * 96 // 8 - 2


def test_the_floor_keeps_a_prompt_efficient_when_its_fixed_cost_alone_breaks_the_bound():
    """A step that carries any prefill pays 60 ms (the indexer over a long context, the MoE
    over more rows) against a 30 ms decode step and a 2.5x bound: no allowance meets the bound.
    The allowance must not collapse to min_tokens (the prompt would then pay the fixed cost
    every 16 tokens): it settles near F / c = 120 tokens, where the tokens' own time equals the
    fixed part."""
    d, fixed, per_token = 0.030, 0.060, 5e-4
    b = PrefillBudget(2.5, 16, 8192)
    steps, sizes = simulate(b, 8192, d, fixed=fixed, per_token=per_token, per_token_ctx=0.0,
                            noise=0.03, seed=0)
    settled = sizes[10:-1]
    assert min(settled) >= 0.6 * fixed / per_token, settled  # the dither takes 10% off
    F, c = b.fit()
    assert F == pytest.approx(fixed, rel=0.3) and c == pytest.approx(per_token, rel=0.3)


def test_the_floor_follows_a_fixed_cost_that_grows_with_the_context():
    """F grows from 10 to ~90 ms over a 16K prompt (the indexer over a longer context) while
    the bound stays infeasible: the dithered allowance keeps the fit current, so the chunks
    grow with F / c instead of staying where an early fit left them."""
    rng = random.Random(0)
    d, c = 0.030, 5e-4
    b = PrefillBudget(2.5, 16, 8192)
    for _ in range(12):
        b.observe(8, 0, d * (1 + 0.03 * (2 * rng.random() - 1)))
    done, late = 0, []
    while done < 16384:
        n = min(16384 - done, b.allowance(True))
        fixed = 0.010 + 5e-6 * done
        b.observe(8, n, (d + fixed + c * n) * (1 + 0.03 * (2 * rng.random() - 1)))
        if done > 12000:
            late.append(n / (fixed / c))
        done += n
    late.sort()
    assert late[len(late) // 2] >= 0.6, late
