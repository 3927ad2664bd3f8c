"""A model built from a config: initialised as transformers initialises GlmMoeDsa, with its MTP
layers, and `generate` refusing non-finite logits with the module at fault named."""

from __future__ import annotations

import math

import pytest
import torch

from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM, NonFiniteLogitsError


def _kind(t: torch.Tensor) -> str:
    if bool((t == 1).all()):
        return "ones"
    if bool((t == 0).all()):
        return "zeros"
    return "normal"


def _assert_normal(name: str, t: torch.Tensor, std: float) -> None:
    """mean 0 and standard deviation ``std`` within 6 standard errors of the estimates."""
    x = t.detach().double().flatten()
    n = x.numel()
    assert n > 50, f"{name}: too few elements to judge ({n})"
    assert abs(float(x.mean())) <= 6 * std / math.sqrt(n), f"{name}: mean {float(x.mean())}"
    s = float(x.std())
    assert abs(s - std) <= 6 * std / math.sqrt(2 * n), f"{name}: std {s}, expected {std}"


def _hf_counterpart(name: str, n_layers: int) -> str:
    """transformers has no MTP modules: an MTP tensor is judged by the main model's tensor of
    the same role (the block by the last decoder layer, which is an MoE layer in `tiny`)."""
    if not name.startswith("mtp."):
        return name
    rest = name.split(".", 2)[2]
    if rest.startswith("block."):
        return f"model.layers.{n_layers - 1}." + rest[len("block."):]
    return {"enorm.weight": "model.norm.weight", "hnorm.weight": "model.norm.weight",
            "shared_head.norm.weight": "model.norm.weight",
            "eh_proj.weight": "lm_head.weight"}[rest]


def test_tiny_from_config_gives_finite_logits():
    torch.manual_seed(0)
    m = GLM5ForCausalLM(preset("tiny")).eval()
    with torch.no_grad():
        logits = m(torch.randint(0, 128, (2, 12)))
    assert bool(torch.isfinite(logits).all())
    # normal(0, 0.02) weights: small logits (not the huge or NaN values of uninitialised memory)
    assert 0 < float(logits.abs().max()) < 10


def test_init_matches_transformers_scheme():
    """Every tensor follows the scheme transformers' GlmMoeDsa uses for the tensor of the same
    name: all ones, all zeros, or normal(0, initializer_range) (checked statistically)."""
    pytest.importorskip("transformers")
    from hf_oracle import hf_config
    from transformers import GlmMoeDsaForCausalLM

    cfg = preset("tiny").replace(pad_token_id=3)
    torch.manual_seed(0)
    hf = GlmMoeDsaForCausalLM(hf_config(cfg))
    hf_tensors = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    torch.manual_seed(1)
    m = GLM5ForCausalLM(cfg)
    ours = {**dict(m.named_parameters()), **dict(m.named_buffers(remove_duplicate=False))}
    ours.pop("inv_freq")  # rope tables, not weights
    assert any(n.startswith("mtp.") for n in ours)
    std = cfg.initializer_range
    for name, t in ours.items():
        ref = hf_tensors[_hf_counterpart(name, cfg.num_hidden_layers)]
        kind = _kind(ref)
        if name == "model.embed_tokens.weight":  # transformers zeroes the padding row
            assert bool((t[3] == 0).all()) and bool((ref[3] == 0).all())
            t, ref = torch.cat((t[:3], t[4:])), torch.cat((ref[:3], ref[4:]))
        assert _kind(t) == kind, f"{name}: {_kind(t)}, transformers: {kind}"
        assert t.dtype == ref.dtype, f"{name}: {t.dtype}, transformers: {ref.dtype}"
        if kind == "normal":
            _assert_normal(f"transformers {name}", ref, std)
            _assert_normal(name, t, std)
    # the router's correction bias and the experts in particular (the tensors left
    # uninitialised / zero before)
    moe = m.model.layers[1].mlp
    assert bool((moe.gate.e_score_correction_bias == 0).all())
    _assert_normal("router", moe.gate.weight, std)
    _assert_normal("experts", moe.experts.gate_up_proj, std)


def test_mtp_present_by_default_and_opt_out():
    cfg = preset("tiny")
    assert cfg.num_nextn_predict_layers == 1
    m = GLM5ForCausalLM(cfg)
    assert m.mtp is not None and len(m.mtp) == 1
    out = m.generate(torch.tensor([[1, 2, 3]]), 4, use_mtp=True)
    assert out.shape == (1, 7)
    assert GLM5ForCausalLM(cfg, with_mtp=False).mtp is None
    assert GLM5ForCausalLM(cfg.replace(num_nextn_predict_layers=0)).mtp is None
    with pytest.raises(TypeError, match="with_mtp"):
        GLM5ForCausalLM(cfg, with_mtp="yes")


@pytest.mark.parametrize("where, expect", [
    # all routed experts: the MoE of layer 1 is the first module with NaN output
    (lambda m: m.model.layers[1].mlp.experts.down_proj, r"model\.layers\.1\.mlp; its weights "
     r"hold non-finite values: model\.layers\.1\.mlp\.experts\.down_proj"),
    # one weight of the last layer's attention
    (lambda m: m.model.layers[2].self_attn.q_b_proj.weight[3, 5:7],
     r"model\.layers\.2\.self_attn; its weights hold non-finite values: "
     r"model\.layers\.2\.self_attn\.q_b_proj\.weight"),
    (lambda m: m.model.layers[0].input_layernorm.weight[7:8],
     r"model\.layers\.0\.input_layernorm; its weights hold non-finite values: "
     r"model\.layers\.0\.input_layernorm\.weight"),
])
def test_generate_names_the_layer_of_a_planted_nan(where, expect):
    torch.manual_seed(0)
    m = GLM5ForCausalLM(preset("tiny")).eval()
    with torch.no_grad():
        where(m).fill_(float("nan"))
    with pytest.raises(NonFiniteLogitsError, match=r"glm5 generate: the logits at step \d+ "
                       r"are not finite \(NaN or inf\); the first module with a non-finite "
                       r"output is " + expect):
        m.generate(torch.tensor([[5, 6, 7, 8]]), 4)


def test_generate_names_a_non_finite_mtp_layer():
    torch.manual_seed(0)
    m = GLM5ForCausalLM(preset("tiny")).eval()
    with torch.no_grad():
        m.mtp[0].eh_proj.weight.fill_(float("inf"))
    with pytest.raises(NonFiniteLogitsError, match=r"MTP logits at step 0 .* is "
                       r"mtp\.0\.block\.input_layernorm; its weights are finite; non-finite "
                       r"weights elsewhere: mtp\.0\.eh_proj\.weight"):
        m.generate(torch.tensor([[5, 6, 7, 8]]), 4, use_mtp=True)


@pytest.mark.parametrize("bad", [0, -0.02, float("nan"), "0.02", True])
def test_initializer_range_must_be_a_positive_number(bad):
    from glm5.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"glm5 config: initializer_range expected a positive "
                       r"number"):
        preset("tiny").replace(initializer_range=bad)
