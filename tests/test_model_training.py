"""Training: forward/backward through the op IR, gradients equal a float64 run, the indexer can
be frozen and left out of optimiser groups."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from hf_oracle import randomize
from tolerances_model import GRAD_ATOL_REL, GRAD_RTOL


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("glm5").setLevel(logging.ERROR)


def _model(seed=0, **changes):
    cfg = preset("tiny").replace(index_n_heads=8, **changes)
    torch.manual_seed(seed)
    # the main model's loss: the MTP layer takes no part (it has its own, trained apart)
    return randomize(GLM5ForCausalLM(cfg, with_mtp=False), seed)


def _loss(m, ids):
    logits = m(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("T", [6, 20])  # dense range (T <= index_topk) and sparse selection
def test_gradients_match_float64(T):
    m32 = _model()
    m64 = copy.deepcopy(m32).double()
    ids = torch.randint(0, m32.config.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(1))
    _loss(m32, ids).backward()
    _loss(m64, ids).backward()
    checked = 0
    for (n, p32), (_, p64) in zip(m32.named_parameters(), m64.named_parameters()):
        if ".indexer." in n:
            assert p32.grad is None  # the selection carries no gradient
            continue
        assert p32.grad is not None, n
        scale = float(p64.grad.abs().max())
        assert scale > 0, n
        torch.testing.assert_close(p32.grad.double(), p64.grad, rtol=GRAD_RTOL,
                                   atol=GRAD_ATOL_REL * scale, msg=lambda s, n=n: f"{n}: {s}")
        checked += 1
    assert checked > 20
    # the latent projection learns through the keys (not only through the queries)
    assert float(m32.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.grad.abs().sum()) > 0


def test_training_step_reduces_loss():
    m = _model()
    ids = torch.randint(0, m.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(m.param_groups(weight_decay=0.01), lr=1e-2)
    first = float(_loss(m, ids).detach())
    for _ in range(5):
        opt.zero_grad()
        _loss(m, ids).backward()
        opt.step()
    assert float(_loss(m, ids).detach()) < first


def test_freeze_indexer():
    m = _model().freeze_indexer()
    idx_params = {id(p) for p in m.indexer_parameters()}
    assert idx_params and all(not p.requires_grad for p in m.indexer_parameters())
    grouped = {id(p) for g in m.param_groups() for p in g["params"]}
    assert not (grouped & idx_params)
    assert len(grouped) == sum(1 for p in m.parameters() if p.requires_grad)
    ids = torch.randint(0, m.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(3))
    _loss(m, ids).backward()
    assert all(p.grad is None for p in m.indexer_parameters())
