"""Checkpoints: transformers-format save/load (single and sharded), MTP layers, errors naming
the tensor, dtype on load, and MTP self-speculative decoding."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import glm5
from glm5.core.checkpoint import CheckpointError
from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from hf_oracle import randomize


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("glm5").setLevel(logging.ERROR)


def _mtp_model(seed=0):
    cfg = preset("tiny").replace(index_n_heads=8)
    return randomize(GLM5ForCausalLM(cfg, with_mtp=True), seed).eval()


def test_sharded_round_trip_with_mtp(tmp_path):
    m = _mtp_model()
    m.save_pretrained(tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert len(set(index["weight_map"].values())) > 1
    L = m.config.num_hidden_layers
    assert f"model.layers.{L}.eh_proj.weight" in names  # MTP stored as layer L
    assert f"model.layers.{L}.self_attn.q_a_proj.weight" in names
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names  # per-expert layout
    m2 = glm5.load_model(tmp_path).eval()
    assert m2.mtp is not None
    ids = torch.randint(0, m.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        l1, h1 = m.forward_with_hidden(ids)
        l2, h2 = m2.forward_with_hidden(ids)
        assert torch.equal(l1, l2)
        nxt = ids.roll(-1, 1)
        assert torch.equal(m.mtp_logits(h1, nxt), m2.mtp_logits(h2, nxt))


def test_transformers_checkpoint_has_no_mtp_and_dtype_on_load(tmp_path):
    pytest.importorskip("transformers")
    from hf_oracle import random_hf_model

    cfg = preset("tiny")
    random_hf_model(cfg, 0).save_pretrained(tmp_path)
    m = glm5.load_model(tmp_path, dtype=torch.bfloat16)
    assert m.mtp is None
    assert m.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert m.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert m.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router stays fp32
    with pytest.raises(ValueError, match="use_mtp"):
        m.generate(torch.zeros(1, 3, dtype=torch.long), 2, use_mtp=True)


def test_mtp_copies_of_shared_tensors_are_ignored(tmp_path):
    m = _mtp_model()
    m.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    L = m.config.num_hidden_layers
    sd[f"model.layers.{L}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[f"model.layers.{L}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, str(f))
    assert glm5.load_model(tmp_path).mtp is not None


@pytest.mark.parametrize("damage,match", [
    ("drop", "missing.*model.layers.0.self_attn.o_proj.weight"),
    ("extra", "unexpected.*model.layers.0.self_attn.bogus.weight"),
    ("shape", "model.layers.0.self_attn.o_proj.weight has shape"),
    ("expert", "experts 0..7"),
])
def test_checkpoint_errors_name_the_tensor(tmp_path, damage, match):
    m = randomize(GLM5ForCausalLM(preset("tiny")))
    m.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    if damage == "drop":
        del sd["model.layers.0.self_attn.o_proj.weight"]
    elif damage == "extra":
        sd["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    elif damage == "shape":
        sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    else:
        del sd["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(sd, str(f))
    with pytest.raises(CheckpointError, match=match):
        glm5.load_model(tmp_path)


def test_no_weights_is_an_error(tmp_path):
    preset("tiny").save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        glm5.load_model(tmp_path)


def test_mtp_speculative_decoding_equals_greedy():
    m = _mtp_model(seed=4)
    ids = torch.randint(0, m.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    plain = m.generate(ids, max_new_tokens=12)
    spec = m.generate(ids, max_new_tokens=12, use_mtp=True)
    assert torch.equal(plain, spec)
    st = m.last_mtp_stats
    assert st["drafted"] >= 1 and 0 <= st["accepted"] <= st["drafted"]


def test_generate_sampling_is_seeded():
    m = _mtp_model()
    ids = torch.zeros(2, 3, dtype=torch.long)
    a = m.generate(ids, 6, do_sample=True, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    b = m.generate(ids, 6, do_sample=True, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    assert a.shape == (2, 9) and torch.equal(a, b)
    with pytest.raises(ValueError, match="top_p"):
        m.generate(ids, 2, top_p=0.0)
