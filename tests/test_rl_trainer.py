"""The GRPO trainer: packing, ratio 1 and KL 0 at step 0 against the rollout engine's own
logprobs, hand-computed losses with clipping and TIS, gradient accumulation as a token mean,
Muon/AdamW split, the frozen indexer, KL to a reference, distillation and its teacher refresh."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from glm5 import ops
from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.rl.config import DistillConfig, TrainerConfig
from glm5.rl.rollout import PromptGroup, RolloutWorker
from glm5.rl.trainer import GRPOTrainer, build_optimizers, pack, token_logprobs
from glm5.rl.trajectory import Trajectory


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("glm5").setLevel(logging.ERROR)


def _cfg():
    return preset("tiny").replace(vocab_size=32, num_hidden_layers=2,
                                  indexer_types=["full", "shared"], index_topk=16)


def _model(seed=0):
    torch.manual_seed(seed)
    return GLM5ForCausalLM(_cfg(), with_mtp=False)


def _traj(i, prompt, comp, adv, lps=None, temp=1.0):
    return Trajectory(f"t{i}", "g", "copy", prompt, comp,
                      lps if lps is not None else [0.0] * len(comp), [0] * len(comp),
                      advantage=adv, temperature=temp)


def _rollouts(model, n_groups=2, size=4, temperature=1.0, max_tokens=5):
    eng_model = copy.deepcopy(model)
    w = RolloutWorker(LLMEngine(eng_model, EngineConfig(num_pages=64, page_size=16)))
    for g in range(n_groups):
        w.submit(PromptGroup(f"g{g}", "copy", [1, 2 + g, 3, 4], size, temperature=temperature,
                             max_tokens=max_tokens, seed=7))
    out = []
    while w.num_open():
        out += w.step()
    out.sort(key=lambda t: t.traj_id)
    adv = ops.grpo_advantages(torch.tensor([float(len(set(t.completion_ids))) for t in out]),
                              size, True)
    for t, a in zip(out, adv.tolist()):
        t.advantage = a
    return out


def test_pack_hand_case():
    b = pack([_traj(0, [1, 2, 3], [4, 5], 0.5, [-1.0, -2.0]),
              _traj(1, [6], [7, 8, 9], -1.0, [-0.5, -0.25, -0.125])], weights=[1.0, 2.0])
    # inputs are prompt + completion minus the last token, right-padded with 0
    assert b.input_ids.tolist() == [[1, 2, 3, 4], [6, 7, 8, 0]]
    # the hidden state at position P + j - 1 predicts completion token j
    assert b.rows.tolist() == [2, 3, 4, 5, 6]
    assert b.targets.tolist() == [4, 5, 7, 8, 9] and b.targets.dtype == torch.int32
    assert b.rollout_logp.tolist() == [-1.0, -2.0, -0.5, -0.25, -0.125]
    assert b.adv.tolist() == [0.5, 0.5, -2.0, -2.0, -2.0]  # advantage x staleness weight
    with pytest.raises(ValueError, match="one sampling temperature"):
        pack([_traj(0, [1], [2], 0.0, temp=1.0), _traj(1, [1], [2], 0.0, temp=0.7)])


def test_step0_ratio_one_kl_zero_and_engine_logprobs_match():
    m = _model()
    trajs = _rollouts(m, temperature=0.8)
    tr = GRPOTrainer(m, TrainerConfig(kl_coef=0.1, micro_batch_size=3))
    # the trainer's logprobs of the engine's tokens are the engine's (token in, token out)
    lp = torch.cat([token_logprobs(m, pack(trajs[i:i + 3]))[0] for i in range(0, 8, 3)])
    ref = torch.tensor([x for t in trajs for x in t.logprobs])
    torch.testing.assert_close(lp.detach(), ref, atol=2e-5, rtol=0)
    s = tr.train_step(trajs)
    assert s["mean_ratio"] == 1.0 and s["approx_kl"] == 0.0 and s["clip_frac"] == 0.0
    assert s["kl_ref"] == 0.0
    assert s["rollout_mismatch"] < 2e-5 and abs(s["tis_weight"] - 1.0) < 1e-4
    # after the step the policy moved away from the reference
    s2 = tr.train_step(trajs)
    assert s2["kl_ref"] > 0.0


def _manual_loss(lp, old, rollout, adv, clip_low, clip_high, cap):
    ratio = math.exp(lp - old)
    w = min(math.exp(old - rollout), cap)
    return max(-ratio * adv, -min(max(ratio, 1 - clip_low), 1 + clip_high) * adv) * w


def test_second_epoch_loss_matches_hand_computation_with_clipping_and_tis():
    m = _model(1)
    trajs = [_traj(0, [1, 2, 3], [4, 5, 6], 1.5, [-3.0, -2.5, -3.5]),
             _traj(1, [1, 7], [8, 9], -0.7, [-2.0, -4.0])]
    cfg = TrainerConfig(optimizer="adamw", lr=0.3, ppo_epochs=2, micro_batch_size=8,
                        grad_clip=0.0, tis_cap=1.5)
    tr = GRPOTrainer(m, cfg)
    b = pack(trajs)
    with torch.no_grad():
        old = token_logprobs(m, b)[0].tolist()
    seen = []
    orig = tr._micro

    def spy(batch, old_lp, share):
        if old_lp is not None:
            with torch.no_grad():
                seen.append((token_logprobs(m, batch)[0].tolist(), old_lp.tolist()))
        return orig(batch, old_lp, share)

    tr._micro = spy
    tr.train_step(trajs)
    (lp1, old1), (lp2, old2) = seen  # epoch 1 (ratio 1) and epoch 2 (after a big step)
    assert old1 == pytest.approx(old) and old2 == pytest.approx(old)
    ratios = [math.exp(a - o) for a, o in zip(lp2, old)]
    assert any(r > 1.25 or r < 0.8 for r in ratios), ratios  # the case exercises clipping
    rollout = b.rollout_logp.tolist()
    adv = b.adv.tolist()
    want = sum(_manual_loss(a, o, r, A, 0.2, 0.25, 1.5)
               for a, o, r, A in zip(lp2, old, rollout, adv)) / len(adv)
    got, _ = ops.policy_loss(torch.tensor(lp2), torch.tensor(old), b.adv, torch.ones(len(adv)),
                             clip_low=0.2, clip_high=0.25, rollout_logp=b.rollout_logp,
                             tis_cap=1.5)
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_gradient_accumulation_is_a_token_mean_over_the_batch():
    m1, m2 = _model(2), _model(2)
    trajs = _rollouts(m1, n_groups=2, size=3)
    g = []
    for m, mb in ((m1, 100), (m2, 1)):
        tr = GRPOTrainer(m, TrainerConfig(optimizer="adamw", lr=0.0, micro_batch_size=mb,
                                          grad_clip=0.0))
        tr.train_step(trajs)
        g.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert g[0].keys() == g[1].keys() and len(g[0]) > 10
    for n in g[0]:
        torch.testing.assert_close(g[0][n], g[1][n], atol=1e-6, rtol=1e-4, msg=n)


def test_muon_for_matrices_adamw_for_the_rest_and_indexer_frozen():
    m = _model(3)
    tr = GRPOTrainer(m, TrainerConfig())
    muon, adamw = tr.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in m.named_parameters()}
    in_muon = {names[id(p)] for grp in muon.param_groups for p in grp["params"]}
    in_adamw = {names[id(p)] for grp in adamw.param_groups for p in grp["params"]}
    assert all(m.get_parameter(n).dim() == 2 for n in in_muon)
    assert "model.embed_tokens.weight" in in_adamw and "lm_head.weight" in in_adamw
    assert not any(".indexer." in n for n in in_muon | in_adamw)
    before = {n: p.clone() for n, p in m.named_parameters() if ".indexer." in n}
    assert before
    tr.train_step(_rollouts(m))
    for n, p in m.named_parameters():
        if ".indexer." in n:
            assert torch.equal(p, before[n]), n
    # the optimizer choice is honoured
    assert all(isinstance(o, torch.optim.AdamW)
               for o in build_optimizers(_model(3), TrainerConfig(optimizer="adamw")))


def test_positive_advantage_raises_its_tokens_logprob():
    m = _model(4)
    trajs = _rollouts(m, n_groups=1, size=4)
    tr = GRPOTrainer(m, TrainerConfig(optimizer="adamw", lr=1e-2))
    best = max(trajs, key=lambda t: t.advantage)
    worst = min(trajs, key=lambda t: t.advantage)
    assert best.advantage > 0 > worst.advantage
    with torch.no_grad():
        b0 = float(token_logprobs(m, pack([best]))[0].sum())
        w0 = float(token_logprobs(m, pack([worst]))[0].sum())
    for _ in range(3):
        tr.train_step(trajs)
    with torch.no_grad():
        assert float(token_logprobs(m, pack([best]))[0].sum()) > b0
        assert float(token_logprobs(m, pack([worst]))[0].sum()) < w0


def test_distillation_kl_zero_against_itself_and_teacher_refresh():
    m = _model(5)
    trajs = _rollouts(m)
    cfg = TrainerConfig(optimizer="adamw", lr=1e-2,
                        distill=DistillConfig(enabled=True, refresh_every=2))
    tr = GRPOTrainer(m, cfg)
    assert cfg.distill.weight == 0.3 and cfg.distill.temperature == 0.7  # the seed's values
    s1 = tr.train_step(trajs)
    assert s1["distill_kl"] == pytest.approx(0.0, abs=1e-6)  # the teacher is the initial policy
    s2 = tr.train_step(trajs)
    assert s2["distill_kl"] > 1e-6  # the student moved; the teacher did not
    # refreshed after step 2: the teacher now equals the student
    for (n, a), (_, b) in zip(m.state_dict().items(), tr.teacher.state_dict().items()):
        assert torch.equal(a, b), n
    # hand check of the distillation term: KL(teacher_tau || student_tau)
    b = pack(trajs[:2])
    from glm5.rl.trainer import completion_hidden
    with torch.no_grad():
        # a perturbation that differs across the vocabulary (a constant one shifts every
        # logit alike: the softmax, and so the KL, would not move, leaving fp32 noise)
        w = tr.teacher.lm_head.weight
        w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
        h = completion_hidden(m, b)
        got = float(tr.distill_loss(h, b))
        t = torch.log_softmax(completion_hidden(tr.teacher, b) @ tr.teacher.lm_head.weight.T
                              / 0.7, -1).double()
        s = torch.log_softmax(h @ m.lm_head.weight.T / 0.7, -1).double()
        want = float((t.exp() * (t - s)).sum(-1).mean())
    assert got == pytest.approx(want, rel=1e-4) and want > 0


def test_state_dict_round_trip_continues_identically():
    trajs = _rollouts(_model(6))
    a = GRPOTrainer(_model(6), TrainerConfig())
    a.train_step(trajs)
    sd = copy.deepcopy(a.state_dict())
    b = GRPOTrainer(_model(9), TrainerConfig())
    b.load_state_dict(sd)
    a.train_step(trajs)
    b.train_step(trajs)
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), n
    assert b.step_count == 2


def test_a_requeued_member_joins_its_group_on_the_same_worker():
    m = _model(7)
    w = RolloutWorker(LLMEngine(copy.deepcopy(m), EngineConfig(num_pages=64, page_size=16)))
    g = PromptGroup("g", "copy", [1, 2, 3], 3, max_tokens=4, seed=1, pending=[0, 1])
    w.submit(g)
    with pytest.raises(ValueError, match="member 1 of group 'g' is already in flight"):
        w.submit(PromptGroup(**{**g.to_dict(), "pending": [1]}))
    w.submit(PromptGroup(**{**g.to_dict(), "pending": [2]}))
    out = []
    while w.num_open():
        out += w.step()
    assert sorted(t.traj_id for t in out) == ["g/0", "g/1", "g/2"]
    assert all(t.versions == [0] * len(t.completion_ids) for t in out)


def test_ratio_against_the_rollout_policy_is_clipped_by_hand():
    """ratio_base rollout: ratio = exp(logp - rollout_logp), clipped to [0.8, 1.25], no TIS."""
    m = _model(8)
    trajs = [_traj(0, [1, 2, 3], [4, 5, 6], 1.5, [-3.0, -2.5, -3.5]),
             _traj(1, [1, 7], [8, 9], -0.7, [-2.0, -4.0])]
    tr = GRPOTrainer(m, TrainerConfig(optimizer="adamw", lr=0.0, micro_batch_size=8,
                                      ratio_base="rollout"))
    b = pack(trajs)
    with torch.no_grad():
        lp = token_logprobs(m, b)[0].tolist()
    rollout, adv = b.rollout_logp.tolist(), b.adv.tolist()
    ratios = [math.exp(a - r) for a, r in zip(lp, rollout)]
    assert any(r > 1.25 or r < 0.8 for r in ratios), ratios  # the clip decides some tokens
    # the rollout logprob as the old policy, no TIS weight (cap irrelevant)
    want = sum(_manual_loss(a, r, r, A, 0.2, 0.25, 1e9)
               for a, r, A in zip(lp, rollout, adv)) / len(adv)
    s = tr.train_step(trajs)
    assert s["policy_loss"] == pytest.approx(want, rel=1e-5)
    assert s["mean_ratio"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    clipped = [(min(max(r, 0.8), 1.25) * -A > r * -A) for r, A in zip(ratios, adv)]
    assert s["clip_frac"] == pytest.approx(sum(clipped) / len(clipped))
