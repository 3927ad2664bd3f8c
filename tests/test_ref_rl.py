"""RL references: token_logprobs (chunked over V), grpo_advantages, policy_loss (incl. autograd
through glm5.ops)."""

from __future__ import annotations

import math

import pytest
import torch

import glm5
from glm5 import ops
from glm5.ir import ops_rl
from glm5.testing.compare import assert_matches
from kit_bounds import output_bound

# These tests pin the reference: the default backend (e.g. cpu) may round differently.
pytestmark = pytest.mark.usefixtures("reference_only")

F64 = torch.float64
I32 = torch.int32


def ref(name):
    return glm5.get_op(name).reference


# --------------------------------------------------------------------------- token_logprobs
def test_token_logprobs_hand_case():
    # logits [0, ln 3] -> p = [1/4, 3/4]
    h = torch.tensor([[1.0]], dtype=F64)
    w = torch.tensor([[0.0], [math.log(3.0)]], dtype=F64)

    def hand(lp, en):
        return torch.tensor([lp], dtype=F64), torch.tensor([en], dtype=F64)

    assert_matches("token_logprobs",
                   hand(math.log(0.75), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))),
                   {"h": h, "w_vocab": w, "targets": torch.tensor([1], dtype=I32),
                    "temperature": 1.0}, dtype=F64)
    # temperature 0.5 doubles the logits: [0, 2 ln 3] -> p = [1/10, 9/10]
    assert_matches("token_logprobs",
                   hand(math.log(0.1), -(0.1 * math.log(0.1) + 0.9 * math.log(0.9))),
                   {"h": h, "w_vocab": w, "targets": torch.tensor([0], dtype=I32),
                    "temperature": 0.5}, dtype=F64)


def test_vocab_chunk_constant():
    assert ops_rl.VOCAB_CHUNK == 4096


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_across_chunks(temperature):
    C = ops_rl.VOCAB_CHUNK
    V, D = 2 * C + 7, 4
    g = torch.Generator().manual_seed(0)
    targets = torch.tensor([0, C - 1, C, 2 * C - 1, 2 * C, V - 1], dtype=I32)
    T = targets.numel()
    h = torch.randn(T, D, generator=g, dtype=F64)
    w = torch.randn(V, D, generator=g, dtype=F64) * 2
    # make the row max sit in different chunks for different tokens
    w[5] = 3 * h[0] / h[0].norm()
    w[C + 11] = 3 * h[1] / h[1].norm()
    w[V - 2] = 3 * h[2] / h[2].norm()
    logp, ent = ref("token_logprobs")(h, w, targets, temperature)
    assert logp.dtype == F64 and ent.dtype == F64 and logp.shape == ent.shape == (T,)
    full = torch.log_softmax(h @ w.T / temperature, dim=-1)
    want_lp = full.gather(1, targets.long()[:, None]).squeeze(1)
    want_ent = -(full.exp() * full).sum(-1)
    vals = {"h": h, "w_vocab": w, "targets": targets, "temperature": temperature}
    # one unchunked log_softmax: an implementation, judged against the chunked oracle
    assert_matches("token_logprobs", (want_lp, want_ent), vals, dtype=F64)
    lp2, ent2 = ops.token_logprobs(h, w, targets, temperature)
    assert torch.equal(lp2, logp) and torch.equal(ent2, ent)
    # fp32 in -> fp32 out, within the kit's bound of the float64 oracle
    vals32 = {**vals, "h": h.float(), "w_vocab": w.float()}
    lp32, ent32 = ref("token_logprobs")(*vals32.values())
    assert lp32.dtype == torch.float32 and ent32.dtype == torch.float32
    assert_matches("token_logprobs", (lp32, ent32), vals32)


def test_token_logprobs_bf16_output_is_fp32():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 8, generator=g).bfloat16()
    w = torch.randn(50, 8, generator=g).bfloat16()
    t = torch.tensor([0, 10, 49], dtype=I32)
    vals = {"h": h, "w_vocab": w, "targets": t, "temperature": 1.0}
    logp, ent = ref("token_logprobs")(h, w, t, 1.0)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert_matches("token_logprobs", (logp, ent), vals)
    # 0 <= entropy <= log V, up to the kit's bound on the entropy
    _, b_ent = output_bound("token_logprobs", vals, "entropy")
    assert bool((ent >= 0).all()) and bool((ent.double() <= math.log(50) + b_ent).all())


# --------------------------------------------------------------------------- grpo_advantages
def test_grpo_constant_group_is_zero():
    r = torch.tensor([3.0, 3.0, 3.0, -1.0, -1.0, -1.0], dtype=F64)
    for std in (True, False):
        a = ref("grpo_advantages")(r, 3, std)
        assert torch.equal(a, torch.zeros(6, dtype=F64))


def test_grpo_hand_case_group2():
    r = torch.tensor([1.0, 3.0, 0.0, 0.0], dtype=F64)
    # group 0: mean 2, unbiased std sqrt(((-1)^2 + 1^2) / 1) = sqrt(2)
    def vals(std, eps):
        return {"rewards": r, "group_size": 2, "std_normalize": std, "eps": eps}

    d = math.sqrt(2.0) + 1e-6  # the default eps
    assert_matches("grpo_advantages", torch.tensor([-1 / d, 1 / d, 0.0, 0.0], dtype=F64),
                   vals(True, 1e-6), dtype=F64)
    assert torch.equal(ref("grpo_advantages")(r, 2, True),
                       ref("grpo_advantages")(r, 2, True, 1e-6))
    d = math.sqrt(2.0) + 0.5
    assert_matches("grpo_advantages", torch.tensor([-1 / d, 1 / d, 0.0, 0.0], dtype=F64),
                   vals(True, 0.5), dtype=F64)
    a = ref("grpo_advantages")(r, 2, False)
    assert a.tolist() == [-1.0, 1.0, 0.0, 0.0]
    assert ops.grpo_advantages(r, 2, False).tolist() == [-1.0, 1.0, 0.0, 0.0]


def test_grpo_hand_case_group4_and_groups_are_consecutive():
    r = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 14.0], dtype=F64)
    std0 = math.sqrt(5.0 / 3.0)  # unbiased std of 0..3
    std1 = math.sqrt((1 + 1 + 1 + 9) / 3.0)  # mean 11
    want = [(v - 1.5) / std0 for v in (0, 1, 2, 3)] + [(v - 11) / std1 for v in (10, 10, 10, 14)]
    assert_matches("grpo_advantages", torch.tensor(want, dtype=F64),
                   {"rewards": r, "group_size": 4, "std_normalize": True, "eps": 0.0},
                   dtype=F64)
    a = ref("grpo_advantages")(r, 4, False)
    assert a.tolist() == [-1.5, -0.5, 0.5, 1.5, -1.0, -1.0, -1.0, 3.0]
    # one group of 8 differs
    assert ref("grpo_advantages")(r, 8, False).tolist() != a.tolist()
    assert ref("grpo_advantages")(r.float(), 4, True).dtype == torch.float32


# --------------------------------------------------------------------------- policy_loss
def _pl(*args, **kw):
    return ref("policy_loss")(*args, **kw)


def _pl_vals(*args, **kw):
    return glm5.get_op("policy_loss").bind(args, kw)


def _assert_pl(loss, stats, *args, **kw):
    """Hand loss (a number) and stats (three numbers, or None: the reference's own) judged
    against the float64 oracle."""
    if stats is None:
        stats = _pl(*args, **kw)[1]
    assert_matches("policy_loss", (torch.tensor(loss, dtype=F64),
                                   torch.as_tensor(stats, dtype=F64)),
                   _pl_vals(*args, **kw), dtype=F64)


def test_stats_order_constant():
    assert ops_rl.POLICY_STATS == ("clip_frac", "mean_ratio", "approx_kl")


def test_policy_loss_ratio_one():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=F64)
    adv = torch.tensor([1.0, 2.0, -3.0, 4.0], dtype=F64)
    loss, stats = _pl(lp, lp.clone(), adv, torch.ones(4, dtype=F64))
    assert loss.shape == () and stats.shape == (3,)
    assert loss.item() == -1.0 and stats.tolist() == [0.0, 1.0, 0.0]  # -mean(adv): exact


def test_policy_loss_clipping_hand_cases():
    old = torch.zeros(4, dtype=F64)
    # ratios 2, 2, 0.5, 0.5
    lp = torch.tensor([math.log(2.0), math.log(2.0), math.log(0.5), math.log(0.5)], dtype=F64)
    ones = torch.ones(1, dtype=F64)
    cases = [  # (token, adv, per-token loss, clipped?)
        (0, 1.0, -1.25, True),   # ratio 2 > 1 + 0.25, A > 0: clipped at 1.25
        (1, -1.0, 2.0, False),   # ratio 2, A < 0: the unclipped term is the min
        (2, 1.0, -0.5, False),   # ratio 0.5 < 0.8, A > 0: unclipped is the min
        (3, -1.0, 0.8, True),    # ratio 0.5, A < 0: clipped at 1 - 0.2
    ]
    for t, a, want, clipped in cases:
        args = (lp[t:t + 1], old[:1], torch.tensor([a], dtype=F64), ones)
        loss, stats = _pl(*args)
        assert stats[0].item() == (1.0 if clipped else 0.0), t
        # stats: clip_frac, mean ratio, mean(old - logp)
        _assert_pl(want, [1.0 if clipped else 0.0, math.exp(lp[t].item()), -lp[t].item()], *args)
    adv = torch.tensor([c[1] for c in cases], dtype=F64)
    _assert_pl((-1.25 + 2.0 - 0.5 + 0.8) / 4, [0.5, 1.25, 0.0], lp, old, adv,
               torch.ones(4, dtype=F64))
    # other clip bounds
    _assert_pl(-1.5, None, lp[:1], old[:1], torch.tensor([1.0], dtype=F64), ones, clip_high=0.5)
    _assert_pl(0.9, None, lp[3:], old[:1], torch.tensor([-1.0], dtype=F64), ones, clip_low=0.1)


def test_policy_loss_mask():
    lp = torch.tensor([0.0, 0.0, 0.0], dtype=F64)
    old = torch.tensor([0.0, -5.0, 0.0], dtype=F64)
    adv = torch.tensor([1.0, 1000.0, 3.0], dtype=F64)
    for mask in (torch.tensor([1.0, 0.0, 1.0], dtype=F64), torch.tensor([True, False, True])):
        _assert_pl(-2.0, [0.0, 1.0, 0.0], lp, old, adv, mask)  # -(1 + 3) / 2
    loss, stats = _pl(lp, old, adv, torch.zeros(3, dtype=F64))
    assert loss.item() == 0.0 and stats.tolist() == [0.0, 0.0, 0.0]


def test_policy_loss_tis_weighting_with_cap():
    lp = torch.zeros(3, dtype=F64)
    old = torch.zeros(3, dtype=F64)
    adv = torch.tensor([1.0, 2.0, 4.0], dtype=F64)
    # exp(old - rollout): 3 (capped at 2), 0.5, 1
    roll = torch.tensor([-math.log(3.0), math.log(2.0), 0.0], dtype=F64)
    ones = torch.ones(3, dtype=F64)
    _assert_pl(-(1.0 * 2.0 + 2.0 * 0.5 + 4.0 * 1.0) / 3, [0.0, 1.0, 0.0], lp, old, adv, ones,
               rollout_logp=roll)
    _assert_pl(-(3.0 + 1.0 + 4.0) / 3, None, lp, old, adv, ones, rollout_logp=roll, tis_cap=10.0)
    loss, _ = _pl(lp, old, adv, ones, rollout_logp=roll, tis_cap=10.0)
    loss2, _ = ops.policy_loss(lp, old, adv, ones, rollout_logp=roll, tis_cap=10.0)
    assert torch.equal(loss2, loss)


def _grad_case(seed):
    g = torch.Generator().manual_seed(seed)
    T = 12
    old = torch.randn(T, generator=g, dtype=F64) * 0.5 - 2
    lp = old + torch.randn(T, generator=g, dtype=F64) * 0.4  # some tokens get clipped
    adv = torch.randn(T, generator=g, dtype=F64)
    mask = (torch.rand(T, generator=g) > 0.25).to(F64)
    roll = old + torch.randn(T, generator=g, dtype=F64) * 0.5
    return lp, old, adv, mask, roll


@pytest.mark.parametrize("with_rollout", [False, True])
def test_policy_loss_gradient_through_ops(with_rollout):
    lp, old, adv, mask, roll = _grad_case(3)
    kw = dict(rollout_logp=roll) if with_rollout else {}
    a = lp.clone().requires_grad_(True)
    loss, stats = ops.policy_loss(a, old, adv, mask, **kw)
    assert loss.grad_fn is not None
    loss.backward()
    b = lp.clone().requires_grad_(True)
    loss_r, stats_r = _pl(b, old, adv, mask, **kw)
    loss_r.backward()
    # the reference served, and its vjp: bit for bit
    assert torch.equal(loss.detach(), loss_r.detach()) and torch.equal(stats, stats_r)
    assert torch.equal(a.grad, b.grad)
    # and by hand: d/dlogp = -ratio * A * w * mask / sum(mask) on unclipped tokens, else 0
    ratio = torch.exp(lp - old)
    clipped = (-torch.clamp(ratio, 0.8, 1.25) * adv) > (-ratio * adv)
    w = torch.exp(old - roll).clamp(max=2.0) if with_rollout else torch.ones_like(lp)
    want = torch.where(clipped, torch.zeros_like(lp), -ratio * adv) * w * mask / mask.sum()
    assert bool(clipped.any()) and bool((~clipped).any())
    # each gradient entry is one term of the loss's masked mean (d(-ratio A w)/dlogp =
    # -ratio A w): it may be off by no more than the kit's float64 bound on the loss
    _, b_loss = output_bound("policy_loss", _pl_vals(lp, old, adv, mask, **kw), "loss", F64)
    assert bool(((a.grad - want).abs() <= b_loss).all())
    assert stats[0].item() == float((clipped.to(F64) * mask).sum() / mask.sum())  # exact counts
