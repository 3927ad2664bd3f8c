"""The cpu backend serves every op the model calls on CPU: under GLM5_STRICT=1 (a reference
fallback is an error) the model's forward and generate run, in both DSA selection modes, and an
RL trainer step runs with the RL ops' backward kernels."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("tvm")  # the cpu backend's kernels (without it the backend is unavailable)

from glm5.core.config import preset  # noqa: E402
from glm5.core.model import GLM5ForCausalLM  # noqa: E402


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("GLM5_STRICT", "1")
    monkeypatch.delenv("GLM5_BACKEND", raising=False)


def _model(**changes) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(preset("tiny").replace(**changes)).eval()


def test_tiny_forward_and_generate_strict_on_cpu(strict):
    m = _model()
    # 20 tokens > index_topk (8): indexer_topk + sparse_attention, a shared-indexer layer, the
    # MoE (moe_route, moe_experts), the indexer's LayerNorm; decode steps take MLA's absorbed mode
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        logits = m(ids)  # a reference fallback would raise FallbackError
    assert bool(torch.isfinite(logits).all())
    out = m.generate(ids, 3)
    assert out.shape == (2, 23)
    assert torch.equal(m.generate(ids, 3, use_mtp=True), out)


def test_tiny_block_selection_strict_on_cpu(strict):
    # coarse-to-fine selection: lightning_indexer over pooled blocks, then topk_indices
    m = _model(dsa_selection="block", dsa_block_size=4, dsa_block_topk=2)
    with torch.no_grad():
        logits = m(torch.randint(0, 128, (1, 24)))
    assert bool(torch.isfinite(logits).all())


@pytest.mark.slow
def test_small_forward_and_generate_strict_on_cpu(strict):
    """The `small` preset (the benchmark model): 11 s on the loaded 2-core development machine,
    hence marked slow."""
    torch.manual_seed(0)
    m = GLM5ForCausalLM(preset("small")).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, 260))  # > index_topk (256): sparse path
    with torch.no_grad():
        assert bool(torch.isfinite(m(ids)).all())
    assert m.generate(ids[:, :16], 2).shape == (1, 18)


def _misaligned(*shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """A contiguous tensor starting 4 bytes past a 64-byte boundary, as a weight read from a
    checkpoint or a row view can (TVM assumes 64-byte aligned buffers by default)."""
    n = 1
    for s in shape:
        n *= s
    base = torch.randn(n + 16) * scale
    t = base[1: 1 + n].view(*shape).to(dtype)
    if dtype == torch.float32:
        assert t.data_ptr() % 64 != 0
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_take_misaligned_tensors(strict, dtype):
    """layer_norm / moe_route / topk_indices on buffers off TVM's 64-byte alignment (the
    layer_norm kernel faulted on an indexer norm weight loaded from a checkpoint)."""
    from glm5 import ops
    from glm5.testing.compare import assert_matches

    for D in (16, 64, 100):
        v = {"x": _misaligned(24, D, dtype=dtype), "weight": _misaligned(D),
             "bias": _misaligned(D), "eps": 1e-6}
        assert_matches("layer_norm", ops.layer_norm(**v), v)
    v = {"logits": _misaligned(24, 64), "bias": _misaligned(64, scale=0.1), "top_k": 8,
         "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling": 2.5}
    assert_matches("moe_route", ops.moe_route(**v), v)
    for S in (100, 2000):  # the torch.topk and the radix-select paths
        v = {"scores": _misaligned(30, S, dtype=dtype), "k": 40}
        assert_matches("topk_indices", ops.topk_indices(**v), v)


def test_rl_trainer_step_strict_on_cpu(strict, monkeypatch):
    """One GRPO step (two PPO epochs over two micro-batches, advantages from float64 rewards)
    on the tiny model: every op, the RL ones included, served by the cpu backend, and the
    gradients of token_logprobs and policy_loss from the cpu kernels' own backwards."""
    from glm5 import ops
    from glm5.kernels.tvm import rl
    from glm5.rl.config import TrainerConfig
    from glm5.rl.trainer import GRPOTrainer
    from glm5.rl.trajectory import Trajectory

    calls: dict[str, int] = {}
    for name in ("token_logprobs", "token_logprobs_backward", "policy_loss",
                 "policy_loss_backward", "grpo_advantages"):
        def counted(*args, _real=getattr(rl, name), _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args)

        monkeypatch.setattr(rl, name, counted)
    torch.manual_seed(0)
    cfg = preset("tiny").replace(vocab_size=32, num_hidden_layers=2,
                                 indexer_types=["full", "shared"], index_topk=16)
    m = GLM5ForCausalLM(cfg, with_mtp=False)
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    adv = ops.grpo_advantages(rewards, 4, True)  # a reference fallback would raise
    comps = [[4, 5, 6], [8, 9], [5, 5, 7, 3], [11]]
    trajs = [Trajectory(f"t{i}", "g", "copy", [1, 2, 3 + i], c,
                        [-2.0 - 0.1 * j for j in range(len(c))], [0] * len(c),
                        advantage=float(a), temperature=0.8)
             for i, (c, a) in enumerate(zip(comps, adv))]
    head = m.lm_head.weight.detach().clone()
    tr = GRPOTrainer(m, TrainerConfig(ppo_epochs=2, micro_batch_size=2))
    s = tr.train_step(trajs)
    assert all(math.isfinite(v) for v in s.values()), s
    assert not torch.equal(m.lm_head.weight.detach(), head), "the step did not move lm_head"
    # each of the 2 epochs x 2 micro-batches differentiates one policy_loss and the logprobs
    # under it through the cpu kernels' backwards (the old logprobs: forwards only)
    assert calls.get("grpo_advantages") == 1, calls
    assert calls.get("policy_loss", 0) >= 4 and calls.get("token_logprobs", 0) >= 4, calls
    assert calls.get("policy_loss_backward") == calls["policy_loss"], calls
    assert calls.get("token_logprobs_backward") == calls["policy_loss"], calls
