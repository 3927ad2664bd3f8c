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


# --------------------------------------------------------------------------- atomic saving
def _tiny(seed: int) -> GLM5ForCausalLM:
    return randomize(GLM5ForCausalLM(preset("tiny")), seed).eval()


def _tree(path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))
            if f.is_file()}


def _same_weights(a: GLM5ForCausalLM, b: GLM5ForCausalLM) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_over_a_sharded_save_replaces_it_whole(tmp_path):
    """Defect 2: a single-file save into a directory holding a sharded save left the old shards
    and index, and load_model returned the OLD weights."""
    old, new = _tiny(0), _tiny(1)
    d = tmp_path / "ck"
    old.save_pretrained(d, max_shard_bytes=64 * 1024)
    assert len(list(d.glob("model-*-of-*.safetensors"))) > 1
    (d / "tokenizer.json").write_text("{}")  # not part of the checkpoint: kept
    new.save_pretrained(d, overwrite=True)
    assert sorted(f.name for f in d.iterdir()) == ["config.json", "model.safetensors",
                                                   "tokenizer.json"]
    assert _same_weights(glm5.load_model(d), new)
    assert (d / "tokenizer.json").read_text() == "{}"
    assert [f.name for f in tmp_path.iterdir()] == ["ck"]  # no temporary directory left


def test_save_refuses_an_existing_checkpoint_unless_overwrite(tmp_path):
    from glm5.core.output import OutputExistsError

    d = tmp_path / "ck"
    _tiny(0).save_pretrained(d)
    before = _tree(d)
    with pytest.raises(OutputExistsError, match=r"ck already holds a checkpoint .*overwrite=True"):
        _tiny(1).save_pretrained(d)
    assert _tree(d) == before
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file, expected a directory"):
        _tiny(1).save_pretrained(tmp_path / "f")
    empty = tmp_path / "empty"
    empty.mkdir()
    _tiny(1).save_pretrained(empty)  # an empty directory holds nothing to overwrite
    assert (empty / "model.safetensors").exists()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_failed_save_leaves_the_target_as_it_was(tmp_path, monkeypatch, exchange):
    """A save that fails half-way (here: at the second shard) loses nothing: the earlier save is
    intact and loadable, and no temporary directory or new parent directory is left."""
    import safetensors.torch

    from glm5.core import output

    if not exchange:  # the portable path (no renameat2): still whole, never mixed
        monkeypatch.setattr(output, "_exchange", lambda a, b: False)
    old = _tiny(0)
    d = tmp_path / "ck"
    old.save_pretrained(d, max_shard_bytes=64 * 1024)
    before = _tree(d)
    real, calls = safetensors.torch.save_file, []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="No space left"):
        _tiny(1).save_pretrained(d, max_shard_bytes=64 * 1024, overwrite=True)
    assert _tree(d) == before and _same_weights(glm5.load_model(d), old)
    calls.clear()
    with pytest.raises(OSError, match="No space left"):
        _tiny(1).save_pretrained(tmp_path / "new" / "deeper" / "ck", max_shard_bytes=64 * 1024)

    def interrupted(tensors, filename, metadata=None):  # Ctrl-C during the write
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tiny(1).save_pretrained(d, overwrite=True)
    assert _tree(d) == before
    assert sorted(f.name for f in tmp_path.iterdir()) == ["ck"]
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    _tiny(1).save_pretrained(d, overwrite=True)  # and a save that succeeds replaces it
    assert _same_weights(glm5.load_model(d), _tiny(1))
    assert sorted(f.name for f in tmp_path.iterdir()) == ["ck"]


# --------------------------------------------------------------------------- corrupt files
def _corrupt(d, how: str) -> tuple[str, str]:
    """Damage the sharded checkpoint ``d``; returns (file named in the error, what is wrong)."""
    shards = sorted(d.glob("model-*-of-*.safetensors"))
    if how == "truncated":
        shards[1].write_bytes(shards[1].read_bytes()[:-100])
        return shards[1].name, "incomplete metadata"
    if how == "garbage":
        shards[0].write_bytes(b"not a safetensors file")
        return shards[0].name, "header"
    if how == "empty":
        shards[-1].write_bytes(b"")
        return shards[-1].name, "header too small"
    if how == "index-json":
        (d / "model.safetensors.index.json").write_text('{"weight_map": {')
        return "model.safetensors.index.json", "not valid JSON"
    shards[1].unlink()
    return shards[1].name, "missing"


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "index-json", "missing-shard"])
def test_corrupt_checkpoint_is_an_error_naming_the_file(tmp_path, how):
    """Defect 3: a corrupt safetensors file raised safetensors' bare SafetensorError."""
    _tiny(0).save_pretrained(tmp_path, max_shard_bytes=64 * 1024)
    name, what = _corrupt(tmp_path, how)
    with pytest.raises(CheckpointError, match="^glm5.load_model: ") as ei:
        glm5.load_model(tmp_path)
    assert name in str(ei.value) and what in str(ei.value)


def test_loading_reports_progress_in_bytes(tmp_path, monkeypatch):
    """load_model drives one progress bar over a sharded checkpoint: its total is the bytes
    stored and the updates add up to exactly that."""
    import glm5.progress

    bars = []

    class Recorder:
        def __init__(self, total, desc, unit="it", delay=0.5):
            self.total, self.desc, self.unit, self.done = total, desc, unit, 0
            bars.append(self)

        def update(self, n=1):
            self.done += n

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    m = _tiny(0)
    m.save_pretrained(tmp_path / "ck", max_shard_bytes=64 * 1024)
    monkeypatch.setattr(glm5.progress, "progress_bar", Recorder)
    glm5.load_model(tmp_path / "ck")
    stored = sum(f.stat().st_size for f in (tmp_path / "ck").glob("*.safetensors"))
    (bar,) = bars
    assert bar.unit == "B" and "ck" in bar.desc
    assert bar.done == bar.total and 0.9 * stored < bar.total < stored  # headers excluded
