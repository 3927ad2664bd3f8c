"""The fp8 indexer's Hadamard rotation (``dsa_indexer_hadamard``, glm5/core/hadamard.py): the
matrix by hand, dot products kept, what it buys (an outlier channel), the model rotating q and
k alike, the paged engine equal to generate, the checkpoint / LLM / serve options, errors."""

from __future__ import annotations

import pytest
import torch

import glm5
from glm5.core.config import ConfigError, GLM5Config, preset
from glm5.core.hadamard import hadamard_matrix, rotate
from glm5.ir.fp8 import e4m3_rows
from glm5.ir.ops_dsa import lightning_indexer_ref
from glm5.testing.compare import assert_matches

from engine_util import run_all

FP8_H = dict(dsa_indexer_dtype="fp8", dsa_indexer_hadamard=True)


# --------------------------------------------------------------------------- the matrix
def test_matrix_by_hand():
    h = hadamard_matrix(4) * 2  # Sylvester's order: (-1)^popcount(i & j)
    assert h.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    assert hadamard_matrix(1).tolist() == [[1.0]]
    for n in (2, 8, 64, 128, 256):
        m = hadamard_matrix(n).double()
        assert torch.equal(m, m.T)
        assert torch.allclose(m @ m.T, torch.eye(n, dtype=torch.float64), atol=1e-6)
        i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        sign = 1 - 2 * (torch.tensor([bin(v).count("1") for v in (i & j).flatten().tolist()])
                        .reshape(n, n) % 2)
        assert torch.allclose(m * n ** 0.5, sign.double(), atol=1e-6)


@pytest.mark.parametrize("n", [0, 3, 12, 96, True, 2.0])
def test_matrix_width_refused(n):
    with pytest.raises(ValueError, match="glm5.hadamard: argument 'n' expected a power of two"):
        hadamard_matrix(n)


def test_rotate_keeps_dot_products_and_dtype():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 3, 64, generator=g), torch.randn(7, 64, generator=g)
    qr, kr = rotate(q), rotate(k)
    assert torch.allclose(qr @ kr.T, q @ k.T, atol=1e-4)
    assert not torch.allclose(qr, q)
    b = rotate(q.bfloat16())
    assert b.dtype == torch.bfloat16
    # the +-1 sums in fp32, then the scale (as the fast transform): not the scaled matrix
    assert torch.equal(b, (q.bfloat16().float() @ (hadamard_matrix(64) * 8) / 8).bfloat16())


def test_rotation_helps_fp8_with_an_outlier_channel():
    """What it is for: with one channel 30x the others, e4m3 rounding of that channel dominates
    the score error; rotated, the rounding errors of 128 channels average out. Recall of the
    exact top-128 rises and the mean score error falls, on the op's own quantizer."""
    g = torch.Generator().manual_seed(0)
    T, S, Hi, Di = 32, 1024, 4, 128
    q = torch.randn(T, Hi, Di, generator=g, dtype=torch.float64)
    k = torch.randn(S, Di, generator=g, dtype=torch.float64)
    q[..., 5] *= 30
    k[:, 5] *= 30
    w = torch.rand(T, Hi, generator=g, dtype=torch.float64)
    ks, ke = torch.zeros(T, dtype=torch.int32), torch.full((T,), S, dtype=torch.int32)
    exact = lightning_indexer_ref(q, k, w, ks, ke)

    def fp8_scores(qq, kk):
        f64 = torch.float64
        return lightning_indexer_ref(e4m3_rows(qq, f64), e4m3_rows(kk, f64), w, ks, ke)

    def recall(s):
        a, b = exact.topk(128).indices, s.topk(128).indices
        return sum(len(set(a[i].tolist()) & set(b[i].tolist())) for i in range(T)) / (T * 128)

    def err(s):
        return float((s - exact).abs().mean() / exact.abs().mean())

    plain = fp8_scores(q, k)
    rot = fp8_scores(rotate(q.float()).double(), rotate(k.float()).double())
    assert recall(rot) > recall(plain) + 0.02 and recall(rot) > 0.99
    assert err(rot) < 0.25 * err(plain)


# --------------------------------------------------------------------------- config
def test_config_checks_and_round_trip():
    cfg = preset("tiny").replace(**FP8_H)
    assert GLM5Config.from_hf_dict(cfg.to_hf_dict()).dsa_indexer_hadamard is True
    assert preset("glm-5").dsa_indexer_hadamard is False
    with pytest.raises(ConfigError, match="dsa_indexer_hadamard expected dsa_indexer_dtype 'fp8'"):
        preset("tiny").replace(dsa_indexer_hadamard=True)
    with pytest.raises(ConfigError, match="power-of-two index_head_dim, got 24"):
        preset("tiny").replace(index_head_dim=24, **FP8_H)
    with pytest.raises(ConfigError, match="dsa_indexer_hadamard expected a bool"):
        preset("tiny").replace(dsa_indexer_dtype="fp8", dsa_indexer_hadamard="yes")


# --------------------------------------------------------------------------- the model
def _fp8_calls(m, ids, monkeypatch) -> list:
    calls = []
    real = glm5.ops.indexer_topk_fp8

    def spy(q, k, w, k_start, k_end, topk):
        out = real(q, k, w, k_start, k_end, topk)
        calls.append(({"q": q, "k": k, "w": w, "k_start": k_start, "k_end": k_end,
                       "topk": topk}, out))
        return out

    monkeypatch.setattr(glm5.ops, "indexer_topk_fp8", spy)
    with torch.no_grad(), glm5.use_backend("cpu"):
        m(ids)
    monkeypatch.undo()
    return calls


def test_model_rotates_queries_and_keys_alike(monkeypatch):
    """The same weights with and without the rotation: the first indexer layer gets rotate(q)
    and rotate(k) of the unrotated model's q and k (so the exact q.k are kept; later layers see
    hidden states that differ by the selections made), and every call's selection is the fp8
    op's (judged by its oracle)."""
    pytest.importorskip("tvm")
    from glm5.core.model import GLM5ForCausalLM

    torch.manual_seed(0)
    m0 = GLM5ForCausalLM(preset("tiny").replace(dsa_indexer_dtype="fp8")).float().eval()
    mh = GLM5ForCausalLM(preset("tiny").replace(**FP8_H)).float().eval()
    mh.load_state_dict(m0.state_dict())
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    plain, rot = _fp8_calls(m0, ids, monkeypatch), _fp8_calls(mh, ids, monkeypatch)
    assert len(plain) == len(rot) == 2  # the two 'full' layers of tiny
    v0, vh = plain[0][0], rot[0][0]
    for name in ("q", "k"):
        assert torch.equal(vh[name], rotate(v0[name])), name
    n = int(vh["k_end"].max())
    s0 = torch.einsum("thd,sd->ths", v0["q"].double(), v0["k"][:n].double())
    sh = torch.einsum("thd,sd->ths", vh["q"].double(), vh["k"][:n].double())
    assert torch.allclose(sh, s0, atol=1e-5) and not torch.allclose(vh["q"], v0["q"])
    for vals, out in rot:
        assert_matches("indexer_topk_fp8", out, vals, what="model call")


def test_engine_with_the_rotation_is_generate(monkeypatch):
    """The paged engine (fp8 key pool, chunked prefill, prefix reuse) gives generate's greedy
    tokens with the rotation on: keys are rotated before they are quantized into the pool."""
    pytest.importorskip("tvm")
    from glm5.core.model import GLM5ForCausalLM
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams

    torch.manual_seed(0)
    m = GLM5ForCausalLM(preset("tiny").replace(**FP8_H)).float().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (12, 30)]
    prompts.append(prompts[1][:24] + [9, 9])
    with torch.no_grad(), glm5.use_backend("cpu"):
        want = [m.generate(torch.tensor([p]), 5)[0, len(p):].tolist() for p in prompts]
        eng = LLMEngine(m, EngineConfig(page_size=4, num_pages=64, chunk_size=8,
                                        max_num_batched_tokens=32))
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in run_all(eng, prompts, sp)]
    assert got == want


def test_checkpoint_llm_and_serve_options(tmp_path, monkeypatch):
    pytest.importorskip("tvm")
    from glm5.cli import main
    from glm5.core import checkpoint
    from glm5.core.model import GLM5ForCausalLM

    torch.manual_seed(0)
    GLM5ForCausalLM(preset("tiny")).float().eval().save_pretrained(tmp_path)
    mh = checkpoint.load_model(tmp_path, indexer_dtype="fp8", indexer_hadamard=True)
    assert (mh.config.dsa_indexer_dtype, mh.config.dsa_indexer_hadamard) == ("fp8", True)
    with pytest.raises(ConfigError, match="dsa_indexer_hadamard expected dsa_indexer_dtype"):
        checkpoint.load_model(tmp_path, indexer_hadamard=True)  # the checkpoint's is bf16
    mh.save_pretrained(tmp_path / "h")
    back = checkpoint.load_model(tmp_path / "h")
    assert back.config.dsa_indexer_hadamard is True
    # back to bf16: the rotation goes with the fp8 indexer
    assert checkpoint.load_model(tmp_path / "h", indexer_dtype="bf16").config \
        .dsa_indexer_hadamard is False
    llm = glm5.LLM(str(tmp_path), indexer_dtype="fp8", indexer_hadamard=True, page_size=4,
                   num_pages=16)
    assert llm.engine.model.config.dsa_indexer_hadamard is True
    with pytest.raises(TypeError, match="'indexer_hadamard' expected only with a checkpoint"):
        glm5.LLM(mh, indexer_hadamard=True)
    seen = {}

    def fake_load(path, dtype=None, device="cpu", indexer_dtype=None, indexer_hadamard=None):
        seen.update(indexer_dtype=indexer_dtype, indexer_hadamard=indexer_hadamard)
        raise checkpoint.CheckpointError("stopped by the test")

    monkeypatch.setattr(checkpoint, "load_model", fake_load)
    assert main(["serve", str(tmp_path), "--port", "0", "--indexer-dtype", "fp8",
                 "--indexer-hadamard"]) != 0
    assert seen == {"indexer_dtype": "fp8", "indexer_hadamard": True}
    assert main(["serve", str(tmp_path), "--port", "0"]) != 0
    assert seen == {"indexer_dtype": None, "indexer_hadamard": None}


def test_planner_costs_the_rotation():
    from glm5.deploy.plan import plan

    cfg = preset("glm-5").replace(**FP8_H)
    kw = dict(batch=1, context=32768, tp=8, ep=8, suggest=False)
    d = {r["label"]: r for r in plan(cfg, "h200", "w4a8", **kw)["decode"]["ops"]}
    # one token: 32 query heads and one key, each 128 values times the 128 x 128 matrix
    assert d["indexer.q_hadamard"]["flops"] == 78 * 2 * 32 * 128 * 128
    assert d["indexer.k_hadamard"]["flops"] == 78 * 2 * 128 * 128
    labels = {r["label"] for r in plan(cfg, "h200", "w4a8", indexer_dtype="bf16", **kw)[
        "decode"]["ops"]}
    assert not any("hadamard" in x for x in labels)
