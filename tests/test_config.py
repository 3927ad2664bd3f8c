"""GLM5Config presets/validation, the transformers config.json round trip, and `glm5 info`
counts checked against transformers' GlmMoeDsaForCausalLM built on the meta device."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from glm5.cli import main as cli_main
from glm5.core.config import PRESETS, ConfigError, GLM5Config, preset
from glm5.deploy.info import count_params, kv_cache_per_token, model_info

transformers = pytest.importorskip("transformers")
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: E402
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (  # noqa: E402
    GlmMoeDsaDecoderLayer,
)

HF_FIELDS = {f.name for f in dataclasses.fields(GlmMoeDsaConfig)}
SHARED_FIELDS = [f.name for f in dataclasses.fields(GLM5Config) if f.name in HF_FIELDS]
GLM5_ONLY = [f.name for f in dataclasses.fields(GLM5Config) if f.name not in HF_FIELDS]


def _shared_cfg(attention_bias: bool = False) -> GLM5Config:
    """Shared indexer layers + tied embeddings (+ attention biases): every optional count path.

    glm5's validation rejects attention_bias=True (its MLA path has no biases), so the bias
    variant sets the attribute after construction; the counting code still covers it."""
    cfg = preset("tiny").replace(
        num_hidden_layers=6, indexer_types=["full", "shared", "shared", "full", "shared", "full"],
        first_k_dense_replace=2, tie_word_embeddings=True, n_shared_experts=2,
        num_nextn_predict_layers=2)
    cfg.attention_bias = attention_bias
    return cfg


def _to_hf(cfg: GLM5Config, tmp: Path) -> GlmMoeDsaConfig:
    cfg.save_pretrained(tmp)
    return GlmMoeDsaConfig.from_pretrained(tmp)


def _saved_numel(module: torch.nn.Module) -> int:
    """Elements a checkpoint of `module` holds: unique parameters (tied ones once) plus
    persistent buffers; non-persistent buffers (rotary inv_freq) are not saved."""
    seen: set[int] = set()
    n = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    for mod in module.modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                n += b.numel()
    return n


# --------------------------------------------------------------------------- presets / validation
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_validate(name):
    cfg = preset(name)
    cfg.validate()
    assert len(cfg.mlp_layer_types) == len(cfg.indexer_types) == cfg.num_hidden_layers
    assert cfg.indexer_types[0] == "full"


def test_glm5_preset_is_the_published_shape():
    c = preset("glm-5")
    assert (c.hidden_size, c.num_hidden_layers, c.first_k_dense_replace, c.intermediate_size) == \
        (6144, 78, 3, 12288)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (64, 2048, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (192, 64, 256)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (256, 8, 1)
    assert (c.moe_intermediate_size, c.n_group, c.topk_group, c.routed_scaling_factor) == \
        (2048, 1, 1, 2.5)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 2048)
    assert (c.vocab_size, c.max_position_embeddings, c.rms_norm_eps) == (154880, 202752, 1e-5)
    assert c.num_nextn_predict_layers == 1 and c.kv_cache_dim == 576
    assert c.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 75
    assert c.indexer_types == ["full"] * 78


@pytest.mark.parametrize("changes, field", [
    ({"indexer_types": ["full", "shared"]}, "indexer_types"),
    ({"indexer_types": ["shared", "full", "full"]}, "indexer_types[0]"),
    ({"indexer_types": ["full", "half", "full"]}, "indexer_types"),
    ({"mlp_layer_types": ["dense"] * 2}, "mlp_layer_types"),
    ({"dsa_selection": "page"}, "dsa_selection"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"topk_group": 2}, "topk_group"),
    ({"index_head_dim": 4}, "index_head_dim"),
    ({"rope_parameters": {"rope_type": "default"}}, "rope_theta"),
])
def test_bad_config_raises_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        preset("tiny").replace(**changes)


def test_unknown_preset_and_model_type():
    with pytest.raises(ConfigError, match="preset 'glm-6'"):
        preset("glm-6")
    with pytest.raises(ConfigError, match="model_type"):
        GLM5Config.from_hf_dict({"model_type": "deepseek_v3"})
    assert issubclass(ConfigError, ValueError)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        GLM5Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        GLM5Config.from_pretrained(tmp_path)


# --------------------------------------------------------------------------- config.json round trip
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_through_transformers(name, tmp_path):
    cfg = preset(name)
    hf = _to_hf(cfg, tmp_path / "a")
    for f in SHARED_FIELDS:
        assert getattr(hf, f) == getattr(cfg, f), f
    assert hf.qk_head_dim == cfg.qk_head_dim and hf.head_dim == cfg.qk_rope_head_dim
    # direct construction from the dict, restricted to transformers' fields
    hf2 = GlmMoeDsaConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k in HF_FIELDS})
    assert {f: getattr(hf2, f) for f in SHARED_FIELDS} == {f: getattr(hf, f) for f in SHARED_FIELDS}
    # transformers keeps the glm5-only keys as extra attributes, so the trip back is lossless
    hf.save_pretrained(tmp_path / "b")
    assert GLM5Config.from_pretrained(tmp_path / "b") == cfg


def test_reads_config_written_by_transformers(tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 500_000.0, "factor": 4.0,
            "original_max_position_embeddings": 1024, "mscale_all_dim": 1.0, "beta_fast": 32,
            "beta_slow": 1}
    hf = GlmMoeDsaConfig(
        vocab_size=300, hidden_size=96, intermediate_size=128, moe_intermediate_size=24,
        num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=6, n_shared_experts=2,
        n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2,
        routed_scaling_factor=1.5, kv_lora_rank=40, q_lora_rank=56, qk_rope_head_dim=8,
        qk_nope_head_dim=24, v_head_dim=20, max_position_embeddings=4096, rms_norm_eps=1e-6,
        index_topk=16, index_head_dim=32, index_n_heads=3, first_k_dense_replace=2,
        indexer_types=["full", "shared", "shared", "full", "shared"], attention_bias=False,
        tie_word_embeddings=True, norm_topk_prob=False, rope_parameters=rope,
        bos_token_id=5, eos_token_id=[6, 7], pad_token_id=8)
    hf.save_pretrained(tmp_path)
    cfg = GLM5Config.from_pretrained(tmp_path)
    for f in SHARED_FIELDS:
        assert getattr(cfg, f) == getattr(hf, f), f
    assert cfg.indexer_types == ["full", "shared", "shared", "full", "shared"]
    assert cfg.rope_parameters == rope
    assert cfg.mlp_layer_types == ["dense", "dense", "sparse", "sparse", "sparse"]
    # keys transformers does not know keep glm5's defaults
    defaults = GLM5Config()
    assert {f: getattr(cfg, f) for f in GLM5_ONLY} == {f: getattr(defaults, f) for f in GLM5_ONLY}
    # a value glm5 does not implement is refused by name
    GlmMoeDsaConfig(num_hidden_layers=2, attention_bias=True).save_pretrained(tmp_path / "b")
    with pytest.raises(ConfigError, match="attention_bias"):
        GLM5Config.from_pretrained(tmp_path / "b")


@pytest.mark.parametrize("kw", [
    {"index_topk_pattern": "FSSFSSFS"},
    {"index_topk_freq": 3},
    {"index_topk_freq": 4, "index_skip_topk_offset": 1},
    {},
])
def test_indexer_schedule_without_indexer_types_matches_transformers(kw):
    hf = GlmMoeDsaConfig(num_hidden_layers=8, **kw)
    d = {**kw, "model_type": "glm_moe_dsa", "num_hidden_layers": 8}
    assert GLM5Config.from_hf_dict(d).indexer_types == hf.indexer_types


# --------------------------------------------------------------------------- counts vs transformers
@pytest.mark.parametrize("name", ["glm-5", "tiny", "small", "shared", "shared+bias"])
def test_counts_equal_transformers_meta_model(name, tmp_path):
    if name.startswith("shared"):
        cfg = _shared_cfg(attention_bias=name.endswith("bias"))
    else:
        cfg = preset(name)
    hf = _to_hf(cfg, tmp_path)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(hf)
    assert time.perf_counter() - t0 < 10, "meta-device build expected in seconds"
    c = count_params(cfg)

    # total = unique nn.Parameters + the persistent e_score_correction_bias buffers
    n_param = sum(p.numel() for p in model.parameters())  # parameters() yields tied ones once
    assert c["total_params"] == _saved_numel(model)
    assert c["total_params"] - c["buffer_params"] == n_param
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert c["buffer_params"] == bias
    assert sum(c["components"].values()) == c["total_params"]
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert c["components"]["lm_head"] == 0

    # per-component sums by state-dict name
    named = dict(model.named_parameters())
    def numel(pred):
        return sum(p.numel() for n, p in named.items() if pred(n))
    comp = c["components"]
    assert comp["indexer"] == numel(lambda n: ".self_attn.indexer." in n)
    assert comp["attention"] == numel(lambda n: ".self_attn." in n and ".indexer." not in n)
    assert comp["routed_experts"] == numel(lambda n: ".mlp.experts." in n)
    assert comp["shared_experts"] == numel(lambda n: ".mlp.shared_experts." in n)
    assert comp["moe_router"] == numel(lambda n: n.endswith(".mlp.gate.weight"))
    assert comp["layer_norms"] == numel(lambda n: n.endswith("layernorm.weight")
                                        and ".self_attn." not in n)

    # active: every non-routed-expert element + k/E of each routed expert tensor
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    routed = comp["routed_experts"]
    assert routed % e == 0
    assert c["active_params"] == c["total_params"] - routed + routed // e * k


def test_mtp_block_count_equals_transformers_modules():
    """One MTP block = a full decoder layer of the MoE type with an indexer (built by
    transformers on meta) + enorm + hnorm + eh_proj + shared_head.norm."""
    for cfg in (preset("glm-5"), _shared_cfg(), _shared_cfg(attention_bias=True)):
        hf = GlmMoeDsaConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k in HF_FIELDS})
        sparse_full = next(i for i in range(cfg.num_hidden_layers)
                           if cfg.mlp_layer_types[i] == "sparse" and cfg.indexer_types[i] == "full")
        with torch.device("meta"):
            layer = GlmMoeDsaDecoderLayer(hf, sparse_full)
            eh = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        h = cfg.hidden_size
        block = _saved_numel(layer) + eh.weight.numel() + 3 * h
        c = count_params(cfg)
        assert c["mtp"]["decoder_layer"] == _saved_numel(layer)
        assert c["mtp_params"] == cfg.num_nextn_predict_layers * block


def test_glm5_headline_numbers():
    c = count_params(preset("glm-5"))
    assert c["total_params"] == 743_911_218_432
    assert round(c["total_params"] / 1e9, 1) == 743.9
    assert c["active_params"] == 41_784_728_832
    assert round(c["active_params"] / 1e9, 1) == 41.8
    assert c["mtp_params"] == 9_952_920_576
    kv = kv_cache_per_token(preset("glm-5"))
    assert kv["elements_per_layer"] == 576 + 128
    assert kv["elements"] == 78 * 704
    assert kv["bytes"] == {"bf16": 109_824, "fp8": 54_912}


def test_kv_cache_matches_transformers_dynamic_cache(tmp_path):
    """Run the tiny model (one 'shared' layer) for a few tokens and measure its cache."""
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(_to_hf(cfg, tmp_path)).eval()
    T = 5
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, cfg.vocab_size, (1, T)), use_cache=True).cache
    n = 0
    for layer in cache.layers:
        n += layer.keys.numel() + layer.values.numel()
        n += layer.indexer_keys.numel() if layer.indexer_keys is not None else 0
    kv = kv_cache_per_token(cfg)
    assert n == T * kv["elements"]
    assert kv["indexer_layers"] == 2 and kv["elements"] == 3 * 40 + 2 * 16


# --------------------------------------------------------------------------- glm5 info
def test_cli_info_json(capsys):
    assert cli_main(["info", "--preset", "glm-5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("source", "total_params", "active_params", "mtp_params",
                "kv_cache_bytes_per_token", "params", "kv_cache_per_token", "config"):
        assert key in doc
    assert doc["source"] == {"preset": "glm-5"}
    p = doc["params"]
    assert doc["total_params"] == p["total_params"] == sum(p["components"].values())
    assert doc["active_params"] == p["active_params"] < doc["total_params"]
    assert doc["mtp_params"] == sum(p["mtp"].values())
    b = doc["kv_cache_bytes_per_token"]
    assert b["bf16"] == 2 * b["fp8"] == 2 * doc["kv_cache_per_token"]["elements"]
    assert doc == json.loads(json.dumps({"source": {"preset": "glm-5"},
                                         **model_info(preset("glm-5"))}))


def test_cli_info_human(capsys):
    assert cli_main(["info", "--preset", "glm-5"]) == 0
    out = capsys.readouterr().out
    assert "743.9 B" in out and "743,911,218,432" in out
    assert "41.8 B" in out and "41,784,728,832" in out
    assert "109,824 bytes/token" in out and "54,912 bytes/token" in out


def test_cli_info_model_dir(tmp_path, capsys):
    cfg = _shared_cfg()
    cfg.save_pretrained(tmp_path)
    assert cli_main(["info", "--model", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == {"model": str(tmp_path)}
    assert doc["params"] == count_params(cfg)
    assert doc["kv_cache_per_token"]["indexer_layers"] == 3


def test_cli_info_fp8_index_cache(tmp_path, capsys):
    """A config with the fp8 indexer: every key row is index_head_dim codes + a 4-byte scale,
    in both columns (tiny: 3 x 40 latent + 2 rows of 16 + 4)."""
    preset("tiny").replace(dsa_indexer_dtype="fp8").save_pretrained(tmp_path)
    assert cli_main(["info", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bf16: 280 bytes/token" in out and "fp8: 160 bytes/token" in out
    assert "16 e4m3 codes + an fp32 scale = 20 bytes" in out
    assert cli_main(["info", "--model", str(tmp_path), "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv_cache_per_token"]
    assert kv["indexer_dtype"] == "fp8" and kv["indexer_key_bytes"] == {"bf16": 20, "fp8": 20}


@pytest.mark.parametrize("argv, msg", [
    (["info", "--preset", "glm-6"], "unknown preset 'glm-6'"),
    (["info", "--model", "{tmp}"], "no config.json"),
    (["info", "--model", "{tmp}/nowhere"], "no config.json"),
])
def test_cli_info_errors_exit_2(argv, msg, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm5 info: ") and msg in err


def test_cli_info_bad_config_exit_1_and_usage_exit_2(tmp_path, capsys):
    # an inconsistent config.json is a failure of the input (1), not of the command line (2)
    bad = preset("tiny").to_hf_dict()
    bad["indexer_types"] = ["shared", "full", "full"]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    assert cli_main(["info", "--model", str(tmp_path)]) == 1
    assert "indexer_types[0]" in capsys.readouterr().err
    for argv in (["info"], ["info", "--preset", "tiny", "--model", str(tmp_path)]):
        assert cli_main(argv) == 2  # argparse's errors: one line, exit 2, no SystemExit
        err = capsys.readouterr().err
        assert err.startswith("glm5 info: ") and err.count("\n") == 1


def test_the_dense_sparse_rule_at_its_boundary():
    from glm5.core.config import attends_densely

    # a range of exactly index_topk keys: the selection would keep them all, so dense
    assert attends_densely(2048, 2048) and attends_densely(1, 2048)
    assert not attends_densely(2049, 2048)
