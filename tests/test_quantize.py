"""Quantization end to end: `glm5 quantize` (format, streaming shards, description of every
tensor), loading into QuantLinear / QuantExperts (decomposed prolog, quantized experts, MTP),
the accuracy budget of every scheme, the backend repack hook and the msModelSlim import."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import glm5
from glm5.cli import main as cli
from glm5.core.checkpoint import CheckpointError
from glm5.core.config import preset
from glm5.core.layers import QuantExperts, QuantLinear
from glm5.core.model import GLM5ForCausalLM
from glm5.core.quant_policy import is_quantized
from glm5.deploy.quantize import (
    BUDGETS,
    DESCRIPTION,
    QuantizeError,
    accuracy_batch,
    convert_msmodelslim_linear,
    deq_scale_fp32,
    evaluate_scheme,
    import_msmodelslim,
    logit_agreement,
    quantize_checkpoint,
    source_files,
)
from glm5.ir.quant_formats import dequantize_weight, quantize_weight
from glm5.ir.numerics import ErrorTerms
from glm5.testing.tolerances import bound as kit_bound
from hf_oracle import randomize
from kit_bounds import output_bound

SCHEMES = tuple(BUDGETS["tiny"])
TINY = BUDGETS["tiny"]


@pytest.fixture(autouse=True)
def _setup(reference_only):
    # The scheme's numerics are under test, not a kernel's: ops run on the reference backend.
    logging.getLogger("glm5").setLevel(logging.ERROR)


def _model(seed: int = 0, mtp: bool = True) -> GLM5ForCausalLM:
    cfg = preset("tiny")
    return randomize(GLM5ForCausalLM(cfg, with_mtp=mtp), seed, cfg.initializer_range).eval()


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    _model().save_pretrained(d / "fp32")
    return d


def _names(path) -> dict[str, torch.Size]:
    out = {}
    for name, f in source_files(path).items():
        with safe_open(str(f), "pt") as h:
            out[name] = h.get_slice(name).get_shape()
    return out


# --------------------------------------------------------------------------- accuracy budget
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_within_accuracy_budget(fp32_dir, scheme):
    model = glm5.load_model(fp32_dir / "fp32").eval()
    r = evaluate_scheme(model, fp32_dir, scheme, accuracy_batch(model.config.vocab_size))
    b = TINY[scheme]
    assert r["cosine"] >= b["cosine"], r
    assert r["top1"] >= b["top1"], r
    assert r["bytes_per_param"] <= b["bytes_per_param"], r
    assert r["cosine"] < 1.0 - 1e-9  # it really ran quantized


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant_small")
    cfg = preset("small")
    randomize(GLM5ForCausalLM(cfg, with_mtp=True), 0, cfg.initializer_range).save_pretrained(
        d / "fp32")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_small_preset_within_accuracy_budget(small_dir, scheme):
    model = glm5.load_model(small_dir / "fp32").eval()
    r = evaluate_scheme(model, small_dir, scheme, accuracy_batch(model.config.vocab_size))
    b = BUDGETS["small"][scheme]
    assert r["cosine"] >= b["cosine"] and r["top1"] >= b["top1"], r
    assert r["bytes_per_param"] <= b["bytes_per_param"], r


# --------------------------------------------------------------------------- format
def test_output_format_every_tensor_described(fp32_dir, tmp_path):
    dst = tmp_path / "q"
    s = quantize_checkpoint(fp32_dir / "fp32", dst, "w4a8", max_shard_bytes=32 * 1024)
    src = _names(fp32_dir / "fp32")
    out = _names(dst)
    desc = json.loads((dst / DESCRIPTION).read_text())
    assert desc["quant_method"] == "glm5" and desc["format_version"] == 1
    assert desc["scheme"] == "w4a8" and set(desc["tensors"]) == set(out)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "glm5", "scheme": "w4a8",
                                          "format_version": 1}
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # written shard by shard
    for name, shape in src.items():
        if is_quantized(name):
            stem = name[: -len(".weight")]
            assert name not in out
            assert desc["tensors"][f"{stem}.weight_packed"] == "w4a8"
            N, K = shape
            assert list(out[f"{stem}.weight_packed"]) == [N, (K + 1) // 2]
            assert list(out[f"{stem}.weight_scale"]) == [N, (K + 127) // 128]
        else:
            assert desc["tensors"][name] == "FLOAT" and list(out[name]) == list(shape)
    # per-expert tensors keep their own scales
    e3 = "model.layers.1.mlp.experts.3.down_proj.weight"
    w = load_file(str(source_files(fp32_dir / "fp32")[e3]))[e3]
    q = {k: v for f in set(source_files(dst).values()) for k, v in load_file(str(f)).items()}
    packed, scale = quantize_weight(w, "w4a8")
    assert torch.equal(q[e3 + "_packed"], packed) and torch.equal(q[e3 + "_scale"], scale)
    assert s.quantized == sum(is_quantized(n) for n in src) and s.kept == len(src) - s.quantized
    assert s.bytes_after < 0.5 * s.bytes_before


def test_loaded_modules_and_errors(fp32_dir, tmp_path):
    dst = tmp_path / "q"
    quantize_checkpoint(fp32_dir / "fp32", dst, "w8a8")
    m = glm5.load_model(dst)
    attn = m.model.layers[1].self_attn
    assert type(attn.q_a_proj) is QuantLinear and attn.quantized_prolog()
    assert type(attn.kv_b_proj) is torch.nn.Linear  # consumed as W_UK / W_UV
    assert type(m.model.layers[1].mlp.experts) is QuantExperts
    assert type(m.mtp[0].eh_proj) is QuantLinear and type(m.lm_head) is torch.nn.Linear
    assert m.quantization["scheme"] == "w8a8"
    fp = glm5.load_model(fp32_dir / "fp32")  # the unquantized model keeps the fused prolog
    assert not fp.model.layers[1].self_attn.quantized_prolog()
    assert not any(type(x) in (QuantLinear, QuantExperts) for x in fp.modules())
    assert not hasattr(fp, "quantization")
    mb = glm5.load_model(dst, dtype=torch.bfloat16).eval()
    assert mb.model.layers[1].self_attn.q_a_proj.weight_scale.dtype == torch.float32
    with torch.no_grad():
        lb = mb(accuracy_batch(mb.config.vocab_size, seq=12))
        lf = m.eval()(accuracy_batch(m.config.vocab_size, seq=12))
    assert lb.dtype == torch.bfloat16
    assert logit_agreement(lf, lb)["cosine"] > TINY["w8a8"]["cosine"]
    desc = json.loads((dst / DESCRIPTION).read_text())
    desc["format_version"] = 99
    (dst / DESCRIPTION).write_text(json.dumps(desc))
    with pytest.raises(CheckpointError, match="format_version"):
        glm5.load_model(dst)
    from glm5.core.output import OutputExistsError

    with pytest.raises(OutputExistsError, match="already holds a checkpoint"):
        quantize_checkpoint(fp32_dir / "fp32", dst, "w8a8")
    with pytest.raises(ValueError, match="scheme"):
        quantize_checkpoint(fp32_dir / "fp32", tmp_path / "x", "w3a3")


def _fake_quant(model: GLM5ForCausalLM, scheme: str) -> GLM5ForCausalLM:
    """The fp model with each quantized weight replaced by its dequantized value."""
    fq = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in fq.named_parameters():
            if not is_quantized(n):
                continue
            for w in (p if p.dim() == 3 else [p]):
                w.copy_(dequantize_weight(*quantize_weight(w, scheme), scheme, w.shape[-1]))
    return fq


def test_quantized_model_is_its_dequantized_twin(fp32_dir, tmp_path):
    """w8a16 computes x·(dequantized W)ᵀ: the loaded model (decomposed prolog with quant_linear,
    moe_experts_quant, MTP eh_proj) must match the fp model holding the dequantized weights, in
    prefill (MHA, sparse selection) and in cached decoding (absorbed MQA)."""
    ref = glm5.load_model(fp32_dir / "fp32").eval()
    quantize_checkpoint(fp32_dir / "fp32", tmp_path / "q", "w8a16")
    q = glm5.load_model(tmp_path / "q").eval()
    twin = _fake_quant(ref, "w8a16")
    ids = accuracy_batch(ref.config.vocab_size, seed=1, batch=2, seq=20)
    with torch.no_grad():
        lq, hq = q.forward_with_hidden(ids)
        lt, ht = twin.forward_with_hidden(ids)
        # on the reference backend w8a16 is the same fp32 arithmetic as the twin's linears
        # (codes * scale in fp32, then x @ W^T): bit for bit
        assert torch.equal(lq, lt)
        nxt = ids.roll(-1, 1)
        assert torch.equal(q.mtp_logits(hq, nxt), twin.mtp_logits(ht, nxt))
    assert torch.equal(q.generate(ids[:1, :6], 6), twin.generate(ids[:1, :6], 6))


def test_cli_quantize(fp32_dir, tmp_path, capsys):
    assert cli(["quantize", "--scheme", "w6a12", str(fp32_dir / "fp32"),
                str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "tensors quantized:" in out and "bytes:" in out and "w6a12" in out
    assert (tmp_path / "q" / DESCRIPTION).exists()
    assert cli(["quantize", str(fp32_dir / "fp32"), str(tmp_path / "r")]) == 2
    assert "--scheme is required" in capsys.readouterr().err


# --------------------------------------------------------------------------- repack hook
def test_backend_repack_hook_runs_once_at_load(fp32_dir, tmp_path):
    from glm5.backends.api import RepackCache
    from glm5.ir.ops_quant import moe_experts_quant_ref, quant_linear_ref

    quantize_checkpoint(fp32_dir / "fp32", tmp_path / "q", "w4a8")
    cache = RepackCache()
    repacks = {"quant_linear": 0, "moe_experts_quant": 0}
    served = {"quant_linear": 0, "moe_experts_quant": 0}
    b = glm5.Backend("repacktest", vendor="T", device_type="cpu")

    def layout(packed, scale, scheme):  # "its own layout": dense fp32, transposed
        return dequantize_weight(packed, scale, scheme, packed.shape[-1] * 2).transpose(-1, -2)

    @b.repack("quant_linear")
    def _rq(packed, scale, scheme):
        repacks["quant_linear"] += 1
        cache.put(packed, layout(packed, scale, scheme))

    @b.repack("moe_experts_quant")
    def _rm(packed, scale, scheme):
        repacks["moe_experts_quant"] += 1
        cache.put(packed, layout(packed, scale, scheme))

    @b.kernel("quant_linear")
    def _ql(x, w_packed, w_scale, scheme, bias=None):
        assert cache.get(w_packed) is not None, "kernel called with a weight never repacked"
        served["quant_linear"] += 1
        return quant_linear_ref(x, w_packed, w_scale, scheme, bias)  # canonical args intact

    @b.kernel("moe_experts_quant")
    def _me(x, ids, weights, w13p, w13s, w2p, w2s, scheme):
        assert cache.get(w13p) is not None and cache.get(w2p) is not None
        served["moe_experts_quant"] += 1
        return moe_experts_quant_ref(x, ids, weights, w13p, w13s, w2p, w2s, scheme)

    with pytest.raises(glm5.BackendError, match="repack"):
        b.repack("rms_norm")
    glm5.get_registry().register(b)
    with glm5.use_backend("repacktest"):
        q = glm5.load_model(tmp_path / "q").eval()
        n_lin = sum(type(m) is QuantLinear for m in q.modules())
        n_exp = sum(type(m) is QuantExperts for m in q.modules())
        assert repacks == {"quant_linear": n_lin, "moe_experts_quant": 2 * n_exp}
        assert len(cache) == n_lin + 2 * n_exp
        assert set(q.quantization["repacked"].values()) == {"repacktest"}
        with torch.no_grad():
            out = q(accuracy_batch(q.config.vocab_size, seq=12))
    assert served["quant_linear"] > 0 and served["moe_experts_quant"] > 0
    assert repacks["quant_linear"] == n_lin  # once, at load time, not per call
    with torch.no_grad():
        plain = glm5.load_model(tmp_path / "q").eval()(accuracy_batch(q.config.vocab_size,
                                                                      seq=12))
    assert torch.equal(out, plain)  # the repacked backend serves the same reference kernels
    del q
    import gc

    gc.collect()
    assert len(cache) == 0  # held weakly: freed with the model


# --------------------------------------------------------------------------- msModelSlim
def _ms_linear(w: torch.Tensor, kind: str, g: torch.Generator, *, o_in: int = 3,
               cancel_bias: bool = True) -> dict[str, torch.Tensor]:
    """One linear in msModelSlim's documented layout (quant-comm-compilers-vendors.md §1.1)."""
    n = w.shape[0]
    sw = w.abs().amax(1).clamp_min(1e-8) / 127
    codes = torch.round(w / sw[:, None]).clamp(-127, 127).to(torch.int8)
    if kind in ("W8A16", "W8A8_DYNAMIC"):
        return {"weight": codes, "weight_scale": sw[:, None].clone(),
                "weight_offset": torch.zeros(n, 1)}
    s_in = torch.tensor([0.05])
    qb = -o_in * codes.to(torch.int32).sum(1) if cancel_bias else \
        torch.randint(-500, 500, (n,), generator=g, dtype=torch.int32)
    return {"weight": codes, "input_scale": s_in, "input_offset": torch.tensor([float(o_in)]),
            "deq_scale": (sw * s_in).to(torch.float32), "quant_bias": qb.to(torch.int32),
            "weight_scale": sw[:, None].clone(), "weight_offset": torch.zeros(n, 1)}


def _ms_kind(name: str) -> str | None:
    if ".mlp.experts." in name:
        return "W8A8_DYNAMIC"
    if "self_attn.kv_b_proj" in name:
        return "W8A16"  # glm5 keeps it in high precision: dequantized on import
    if "self_attn." in name and not name.endswith("norm.weight") and is_quantized(name):
        return "W8A8"
    return "W8A16" if is_quantized(name) else None


def _write_msmodelslim(model: GLM5ForCausalLM, path, int64_deq: bool = False,
                       bias_layer: str = "") -> None:
    from glm5.core.checkpoint_files import checkpoint_tensors

    g = torch.Generator().manual_seed(0)
    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    sd, desc = {}, {"model_quant_type": "W8A8"}
    for name, t in checkpoint_tensors(model):
        kind = _ms_kind(name)
        if kind is None:
            sd[name] = t.detach().clone()
            desc[name] = "FLOAT"
            continue
        stem = name[: -len(".weight")]
        for k, v in _ms_linear(t.detach(), kind, g, cancel_bias=stem != bias_layer).items():
            if k == "deq_scale" and int64_deq:
                v = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
            sd[f"{stem}.{k}"] = v
            desc[f"{stem}.{k}"] = kind
    save_file(sd, str(path / "quant_model_weight.safetensors"))
    (path / "quant_model_description.json").write_text(json.dumps(desc))


@pytest.mark.parametrize("int64_deq", [False, True])
def test_msmodelslim_import_end_to_end(tmp_path, int64_deq):
    model = _model(seed=2, mtp=False)
    _write_msmodelslim(model, tmp_path / "ms", int64_deq)
    s = import_msmodelslim(tmp_path / "ms", tmp_path / "q")
    assert cli(["quantize", "--from", "msmodelslim", str(tmp_path / "ms"),
                str(tmp_path / "q_cli")]) == 0
    assert (tmp_path / "q_cli" / DESCRIPTION).read_text() == \
        (tmp_path / "q" / DESCRIPTION).read_text()
    assert s.schemes == {"w8a16", "w8a8"} and s.dequantized == model.config.num_hidden_layers
    q = glm5.load_model(tmp_path / "q").eval()
    attn = q.model.layers[0].self_attn
    assert attn.q_a_proj.scheme == "w8a8" and q.model.layers[0].mlp.gate_proj.scheme == "w8a16"
    assert attn.q_a_proj.bias is None  # offset and quant_bias cancel in this checkpoint
    assert type(attn.kv_b_proj) is torch.nn.Linear
    assert q.model.layers[1].mlp.experts.scheme == "w8a8"
    ids = accuracy_batch(model.config.vocab_size)
    with torch.no_grad():
        r = logit_agreement(model(ids), q(ids))
    assert r["cosine"] >= TINY["w8a8"]["cosine"] and r["top1"] >= TINY["w8a8"]["top1"], r
    # FLOAT tensors copied bit for bit
    out = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert torch.equal(out["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_msmodelslim_static_w8a8_bias_matches_formula():
    """The converted layer (weight scale deq/s_in, float bias) reproduces msModelSlim's
    y = (round(x/s_in + o_in)·Wᵀ + quant_bias)·deq_scale up to the activation rounding."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 40, generator=g)
    t = _ms_linear(w, "W8A8", g, o_in=-5, cancel_bias=False)
    codes, scale, bias, clamped = convert_msmodelslim_linear("l", "W8A8",
                                                             lambda n: t.get(n[2:]))
    assert clamped == 0 and bias is not None and bool((bias != 0).any())
    x = torch.randn(7, 40, generator=g, dtype=torch.float64)
    s_in, o_in = float(t["input_scale"]), float(t["input_offset"])
    W = t["weight"].to(torch.float64)
    dq = t["deq_scale"].to(torch.float64)
    qb = t["quant_bias"].to(torch.float64)
    wd = codes.to(torch.float64) * scale.to(torch.float64)[:, None]
    ours = x @ wd.T + bias.double()
    exact = ((x / s_in + o_in) @ W.T + qb) * dq  # the formula without rounding: same algebra
    # the converted layer holds deq/s_in and the bias rounded once to fp32: the kit's bound of
    # one fp32 rounding of each product x_k w_k scale and of the bias
    b_conv = _fp32_rounding_bound(exact, x, wd, bias)
    assert bool(((ours - exact).abs() <= b_conv).all())
    xq = torch.round(x / s_in + o_in).clamp(-128, 127)
    ms = (xq @ W.T + qb) * dq
    bound = 0.5 * dq * W.abs().sum(1)  # |round error| <= 1/2 per activation element
    assert bool(((ours - ms).abs() <= bound + b_conv).all())
    # and through the op, in canonical w8a8 (per-token dynamic activations): within the op's own
    # bound of its oracle, which is off the formula by the per-token activation rounding (at most
    # a step of the row scale max|x| / 127 per element) and the fp32 roundings of x, the scale
    # and the bias
    xf = x.float()
    y = glm5.ops.quant_linear(xf, codes, scale, "w8a8", bias)
    _, b_op = output_bound("quant_linear", {"x": xf, "w_packed": codes, "w_scale": scale,
                                            "scheme": "w8a8", "bias": bias}, "y")
    b_x = _fp32_rounding_bound(exact, x, wd, bias, roundings=2)
    assert bool(((y.double() - exact).abs() <= float(
        (dq * W.abs().sum(1)).max() * (x.abs().max() / s_in) / 127) + b_op + b_x).all())


def _fp32_rounding_bound(ref, x, wd, bias, roundings=1):
    """The kit's bound (numerics' 'mid' term, rounding to fp32) for ``ref = x @ wd^T + bias``
    whose factors were each rounded to fp32 ``roundings`` times per product (the weight scale;
    the activation too for 2) and whose bias was rounded once."""
    mag = roundings * (x.abs() @ wd.abs().T) + bias.double().abs()
    return kit_bound(ref, ErrorTerms(mid=mag), torch.float64, torch.float32)


def test_msmodelslim_deq_scale_int64_bits():
    v = torch.tensor([0.5, 1e-3, -2.25], dtype=torch.float32)
    packed = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(deq_scale_fp32(packed), v)


@pytest.mark.parametrize("damage,match", [
    ("offset", "weight_offset is nonzero"),
    ("group", "per-channel"),
    ("min_code", "code\\(s\\) -128"),
    ("type", "W4A8_DYNAMIC"),
])
def test_msmodelslim_errors_name_the_tensor(tmp_path, damage, match):
    name = "model.layers.0.mlp.gate_proj"
    model = _model(seed=1, mtp=False)
    _write_msmodelslim(model, tmp_path / "ms")
    f = tmp_path / "ms" / "quant_model_weight.safetensors"
    sd = load_file(str(f))
    desc = json.loads((tmp_path / "ms" / "quant_model_description.json").read_text())
    if damage == "offset":
        sd[f"{name}.weight_offset"][3] = 2.0
    elif damage == "group":
        sd[f"{name}.weight_scale"] = sd[f"{name}.weight_scale"].repeat(1, 2)
    elif damage == "min_code":
        sd[f"{name}.weight"][0, 0] = -128
    else:
        desc[f"{name}.weight"] = "W4A8_DYNAMIC"
        (tmp_path / "ms" / "quant_model_description.json").write_text(json.dumps(desc))
    save_file(sd, str(f))
    with pytest.raises(QuantizeError, match=match) as e:
        import_msmodelslim(tmp_path / "ms", tmp_path / "q")
    assert name in str(e.value)
    if damage == "min_code":  # opt-in clamp: -128 -> -127, counted
        s = import_msmodelslim(tmp_path / "ms", tmp_path / "q2", clamp_min_code=True)
        assert s.clamped == 1
        out = load_file(str(tmp_path / "q2" / "model.safetensors"))
        assert int(out[f"{name}.weight_packed"][0, 0]) == -127
    with pytest.raises(CheckpointError, match="--from msmodelslim"):
        glm5.load_model(tmp_path / "ms")


def test_msmodelslim_static_bias_reaches_the_loaded_layer(tmp_path):
    """A static W8A8 layer whose quant_bias does not cancel the input offset loads as a
    QuantLinear with the derived float bias, and computes msModelSlim's formula."""
    model = _model(seed=4, mtp=False)
    stem = "model.layers.0.self_attn.o_proj"
    _write_msmodelslim(model, tmp_path / "ms", bias_layer=stem)
    import_msmodelslim(tmp_path / "ms", tmp_path / "q")
    q = glm5.load_model(tmp_path / "q")
    layer = q.model.layers[0].self_attn.o_proj
    assert layer.bias is not None and bool((layer.bias != 0).any())
    ms = load_file(str(tmp_path / "ms" / "quant_model_weight.safetensors"))
    W, dq = ms[f"{stem}.weight"].double(), ms[f"{stem}.deq_scale"].double()
    s_in, o_in = float(ms[f"{stem}.input_scale"]), float(ms[f"{stem}.input_offset"])
    x = accuracy_batch(8, seed=5, batch=3, seq=W.shape[1]).double() / 8 - 0.5
    want = ((x / s_in + o_in) @ W.T + ms[f"{stem}.quant_bias"].double()) * dq
    with torch.no_grad():
        got = layer(x.float()).double()
    # per-token int8 activations: error <= half a step of each row's scale times sum |w|, plus
    # the op's own bound of its oracle and the fp32 roundings of the stored scale and bias (x is
    # exact in fp32: multiples of 1/8)
    step = x.abs().amax(1, keepdim=True) / 127
    _, b_op = output_bound("quant_linear", {"x": x.float(), "w_packed": layer.weight_packed,
                                            "w_scale": layer.weight_scale,
                                            "scheme": layer.scheme, "bias": layer.bias}, "y")
    wd = W * (dq / s_in)[:, None]
    bound = (0.5 * step * wd.abs().sum(1)[None] + b_op
             + _fp32_rounding_bound(want, x, wd, layer.bias))
    assert bool(((got - want).abs() <= bound).all())


def test_stacked_expert_checkpoint_quantizes_per_expert(fp32_dir, tmp_path):
    """A source holding experts stacked ([E, 2I, D] / [E, D, I], glm5's module names) is
    quantized expert by expert and loads to the same model as the per-expert layout."""
    src = tmp_path / "stacked"
    src.mkdir()
    (src / "config.json").write_text((fp32_dir / "fp32" / "config.json").read_text())
    sd = load_file(str(fp32_dir / "fp32" / "model.safetensors"))
    pre = "model.layers.1.mlp.experts"
    E = preset("tiny").n_routed_experts
    sd[f"{pre}.gate_up_proj"] = torch.stack([torch.cat((sd.pop(f"{pre}.{e}.gate_proj.weight"),
                                                        sd.pop(f"{pre}.{e}.up_proj.weight")))
                                             for e in range(E)])
    sd[f"{pre}.down_proj"] = torch.stack([sd.pop(f"{pre}.{e}.down_proj.weight")
                                          for e in range(E)])
    save_file(sd, str(src / "model.safetensors"))
    quantize_checkpoint(src, tmp_path / "qs", "w6a12")
    quantize_checkpoint(fp32_dir / "fp32", tmp_path / "qe", "w6a12")
    desc = json.loads((tmp_path / "qs" / DESCRIPTION).read_text())["tensors"]
    assert desc[f"{pre}.gate_up_proj_packed"] == "w6a12"
    a, b = glm5.load_model(tmp_path / "qs"), glm5.load_model(tmp_path / "qe")
    ea, eb = a.model.layers[1].mlp.experts, b.model.layers[1].mlp.experts
    for k in ("gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed", "down_proj_scale"):
        assert torch.equal(getattr(ea, k), getattr(eb, k)), k
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_checkpoint(tmp_path / "qs", tmp_path / "again", "w8a8")
