"""Coarse-to-fine block selection (glm5 option beyond the published model)."""

from __future__ import annotations

import logging

import pytest
import torch

from glm5.core.block_select import block_select, pooled_keys
from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from tolerances_model import LOGIT_TOL, assert_logits_close


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("glm5").setLevel(logging.ERROR)


def _model(**ch):
    opts = dict(index_n_heads=8, dsa_selection="block", dsa_block_size=4, dsa_block_topk=3)
    cfg = preset("tiny").replace(**{**opts, **ch})
    torch.manual_seed(0)
    m = GLM5ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.fill_(1.0)
    return m.eval()


def test_pooled_keys_are_block_means():
    keys = torch.arange(2 * 10 * 3, dtype=torch.float32).reshape(20, 3)
    pk = pooled_keys(keys, max_len=10, block=4)  # 3 blocks per sequence, last one padded
    assert pk.shape == (6, 3)
    assert torch.equal(pk[0], keys[0:4].mean(0))  # small integers: exact
    assert torch.equal(pk[4], keys[14:18].mean(0))


def test_selection_is_causal_and_inside_kept_blocks():
    g = torch.Generator().manual_seed(0)
    N, Hi, Di, max_len, block, nbk, topk = 12, 2, 8, 12, 3, 2, 4
    keys = torch.randn(max_len, Di, generator=g)
    q = torch.randn(N, Hi, Di, generator=g)
    w = torch.rand(N, Hi, generator=g)
    ks = torch.zeros(N, dtype=torch.int32)
    ke = torch.arange(1, N + 1, dtype=torch.int32)
    idx = block_select(q, w, keys, ks, ke, max_len, block, nbk, topk)
    for t in range(N):
        sel = [i for i in idx[t].tolist() if i >= 0]
        assert sel and all(i <= t for i in sel)  # causal
        blocks = {i // block for i in sel}
        assert len(blocks) <= nbk and t // block in blocks | {t // block}
        assert len(sel) == min(topk, len(set(range(t + 1)) & {
            r for b in blocks | {t // block} for r in range(b * block, b * block + block)}))


def test_block_mode_incremental_equals_full():
    m = _model()
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(ids)
        cache = m.new_cache(2, 30)
        inc = torch.cat([m(ids[:, :13], cache)] + [m(ids[:, t:t + 1], cache)
                                                    for t in range(13, 30)], 1)
    # decoding over the cache and the prefill are two implementations: model-level
    assert assert_logits_close(inc, full, what="incremental vs full forward") <= 2 * LOGIT_TOL


def test_all_blocks_kept_equals_token_mode():
    m = _model(dsa_block_topk=8)  # 8 blocks x 4 tokens cover the 30-token context
    tok = GLM5ForCausalLM(m.config.replace(dsa_selection="token"))
    tok.load_state_dict(m.state_dict())
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(m(ids), tok.eval()(ids))
