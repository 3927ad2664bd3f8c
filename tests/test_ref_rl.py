"""RL references: token_logprobs (chunked over V), grpo_advantages, policy_loss (incl. autograd
through glm5.ops)."""

from __future__ import annotations

import math

import pytest
import torch

import glm5
from glm5 import ops
from glm5.ir import ops_rl

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
    logp, ent = ref("token_logprobs")(h, w, torch.tensor([1], dtype=I32), 1.0)
    assert logp.item() == pytest.approx(math.log(0.75), abs=1e-15)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-15)
    # temperature 0.5 doubles the logits: [0, 2 ln 3] -> p = [1/10, 9/10]
    logp, ent = ref("token_logprobs")(h, w, torch.tensor([0], dtype=I32), 0.5)
    assert logp.item() == pytest.approx(math.log(0.1), abs=1e-14)
    assert ent.item() == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)), abs=1e-14)


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
    torch.testing.assert_close(logp, want_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=1e-12, atol=1e-12)
    lp2, ent2 = ops.token_logprobs(h, w, targets, temperature)
    torch.testing.assert_close(lp2, logp, rtol=0, atol=0)
    torch.testing.assert_close(ent2, ent, rtol=0, atol=0)
    # fp32 in -> fp32 out, close to the float64 result
    lp32, ent32 = ref("token_logprobs")(h.float(), w.float(), targets, temperature)
    assert lp32.dtype == torch.float32 and ent32.dtype == torch.float32
    torch.testing.assert_close(lp32.double(), logp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent32.double(), ent, rtol=1e-4, atol=1e-4)


def test_token_logprobs_bf16_output_is_fp32():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 8, generator=g).bfloat16()
    w = torch.randn(50, 8, generator=g).bfloat16()
    t = torch.tensor([0, 10, 49], dtype=I32)
    logp, ent = ref("token_logprobs")(h, w, t, 1.0)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    full = torch.log_softmax(h.double() @ w.double().T, -1)
    torch.testing.assert_close(logp.double(), full.gather(1, t.long()[:, None]).squeeze(1),
                               rtol=1e-4, atol=1e-4)
    assert bool((ent >= 0).all()) and bool((ent <= math.log(50) + 1e-5).all())


# --------------------------------------------------------------------------- grpo_advantages
def test_grpo_constant_group_is_zero():
    r = torch.tensor([3.0, 3.0, 3.0, -1.0, -1.0, -1.0], dtype=F64)
    for std in (True, False):
        a = ref("grpo_advantages")(r, 3, std)
        assert torch.equal(a, torch.zeros(6, dtype=F64))


def test_grpo_hand_case_group2():
    r = torch.tensor([1.0, 3.0, 0.0, 0.0], dtype=F64)
    # group 0: mean 2, unbiased std sqrt(((-1)^2 + 1^2) / 1) = sqrt(2)
    a = ref("grpo_advantages")(r, 2, True)
    d = math.sqrt(2.0) + 1e-6
    assert a.tolist() == pytest.approx([-1 / d, 1 / d, 0.0, 0.0], abs=1e-15)
    a = ref("grpo_advantages")(r, 2, True, 0.5)
    d = math.sqrt(2.0) + 0.5
    assert a.tolist() == pytest.approx([-1 / d, 1 / d, 0.0, 0.0], abs=1e-15)
    a = ref("grpo_advantages")(r, 2, False)
    assert a.tolist() == [-1.0, 1.0, 0.0, 0.0]
    assert ops.grpo_advantages(r, 2, False).tolist() == [-1.0, 1.0, 0.0, 0.0]


def test_grpo_hand_case_group4_and_groups_are_consecutive():
    r = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 14.0], dtype=F64)
    std0 = math.sqrt(5.0 / 3.0)  # unbiased std of 0..3
    std1 = math.sqrt((1 + 1 + 1 + 9) / 3.0)  # mean 11
    a = ref("grpo_advantages")(r, 4, True, 0.0)
    want = [(v - 1.5) / std0 for v in (0, 1, 2, 3)] + [(v - 11) / std1 for v in (10, 10, 10, 14)]
    assert a.tolist() == pytest.approx(want, abs=1e-14)
    a = ref("grpo_advantages")(r, 4, False)
    assert a.tolist() == [-1.5, -0.5, 0.5, 1.5, -1.0, -1.0, -1.0, 3.0]
    # one group of 8 differs
    assert ref("grpo_advantages")(r, 8, False).tolist() != a.tolist()
    assert ref("grpo_advantages")(r.float(), 4, True).dtype == torch.float32


# --------------------------------------------------------------------------- policy_loss
def _pl(*args, **kw):
    return ref("policy_loss")(*args, **kw)


def test_stats_order_constant():
    assert ops_rl.POLICY_STATS == ("clip_frac", "mean_ratio", "approx_kl")


def test_policy_loss_ratio_one():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=F64)
    adv = torch.tensor([1.0, 2.0, -3.0, 4.0], dtype=F64)
    loss, stats = _pl(lp, lp.clone(), adv, torch.ones(4, dtype=F64))
    assert loss.shape == () and stats.shape == (3,)
    assert loss.item() == pytest.approx(-1.0, abs=1e-15)  # -mean(adv)
    assert stats.tolist() == pytest.approx([0.0, 1.0, 0.0], abs=1e-15)


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
        loss, stats = _pl(lp[t:t + 1], old[:1], torch.tensor([a], dtype=F64), ones)
        assert loss.item() == pytest.approx(want, abs=1e-14), t
        assert stats[0].item() == (1.0 if clipped else 0.0), t
        assert stats[1].item() == pytest.approx(math.exp(lp[t].item()), abs=1e-14)
        assert stats[2].item() == pytest.approx(-lp[t].item(), abs=1e-14)  # mean(old - logp)
    adv = torch.tensor([c[1] for c in cases], dtype=F64)
    loss, stats = _pl(lp, old, adv, torch.ones(4, dtype=F64))
    assert loss.item() == pytest.approx((-1.25 + 2.0 - 0.5 + 0.8) / 4, abs=1e-14)
    assert stats.tolist() == pytest.approx([0.5, 1.25, 0.0], abs=1e-14)
    # other clip bounds
    loss, _ = _pl(lp[:1], old[:1], torch.tensor([1.0], dtype=F64), ones, clip_high=0.5)
    assert loss.item() == pytest.approx(-1.5, abs=1e-14)
    loss, _ = _pl(lp[3:], old[:1], torch.tensor([-1.0], dtype=F64), ones, clip_low=0.1)
    assert loss.item() == pytest.approx(0.9, abs=1e-14)


def test_policy_loss_mask():
    lp = torch.tensor([0.0, 0.0, 0.0], dtype=F64)
    old = torch.tensor([0.0, -5.0, 0.0], dtype=F64)
    adv = torch.tensor([1.0, 1000.0, 3.0], dtype=F64)
    for mask in (torch.tensor([1.0, 0.0, 1.0], dtype=F64), torch.tensor([True, False, True])):
        loss, stats = _pl(lp, old, adv, mask)
        assert loss.item() == pytest.approx(-2.0, abs=1e-14)  # -(1 + 3) / 2
        assert stats.tolist() == pytest.approx([0.0, 1.0, 0.0], abs=1e-14)
    loss, stats = _pl(lp, old, adv, torch.zeros(3, dtype=F64))
    assert loss.item() == 0.0 and stats.tolist() == [0.0, 0.0, 0.0]


def test_policy_loss_tis_weighting_with_cap():
    lp = torch.zeros(3, dtype=F64)
    old = torch.zeros(3, dtype=F64)
    adv = torch.tensor([1.0, 2.0, 4.0], dtype=F64)
    # exp(old - rollout): 3 (capped at 2), 0.5, 1
    roll = torch.tensor([-math.log(3.0), math.log(2.0), 0.0], dtype=F64)
    loss, stats = _pl(lp, old, adv, torch.ones(3, dtype=F64), rollout_logp=roll)
    assert loss.item() == pytest.approx(-(1.0 * 2.0 + 2.0 * 0.5 + 4.0 * 1.0) / 3, abs=1e-14)
    assert stats.tolist() == pytest.approx([0.0, 1.0, 0.0], abs=1e-14)
    loss, _ = _pl(lp, old, adv, torch.ones(3, dtype=F64), rollout_logp=roll, tis_cap=10.0)
    assert loss.item() == pytest.approx(-(3.0 + 1.0 + 4.0) / 3, abs=1e-14)
    loss2, _ = ops.policy_loss(lp, old, adv, torch.ones(3, dtype=F64), rollout_logp=roll,
                               tis_cap=10.0)
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-15)


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
    torch.testing.assert_close(loss.detach(), loss_r.detach(), rtol=0, atol=1e-15)
    torch.testing.assert_close(stats, stats_r, rtol=0, atol=1e-15)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
    # and by hand: d/dlogp = -ratio * A * w * mask / sum(mask) on unclipped tokens, else 0
    ratio = torch.exp(lp - old)
    clipped = (-torch.clamp(ratio, 0.8, 1.25) * adv) > (-ratio * adv)
    w = torch.exp(old - roll).clamp(max=2.0) if with_rollout else torch.ones_like(lp)
    want = torch.where(clipped, torch.zeros_like(lp), -ratio * adv) * w * mask / mask.sum()
    assert bool(clipped.any()) and bool((~clipped).any())
    torch.testing.assert_close(a.grad, want, rtol=1e-12, atol=1e-14)
    assert stats[0].item() == pytest.approx(float((clipped.to(F64) * mask).sum() / mask.sum()))
