"""Checkpoints in the transformers format (config.json + safetensors, single or sharded with an
index), loaded by tensor name and memory-mapped; written back in the same format.

Name mapping between the checkpoint and glm5's modules:
- routed experts are stored per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) and held
  stacked (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]);
- the MTP layer d is stored as `model.layers.{L + d}.*` (DeepSeek-V3 / GLM-5) and held as
  `mtp.{d}.*` (its decoder block as `mtp.{d}.block.*`); its copies of `embed_tokens` and
  `shared_head.head` are the main model's and are not loaded twice.

A directory with `quant_description.json` (written by `glm5 quantize`, see
glm5/deploy/quantize.py and docs/quantization.md) holds `X.weight_packed` + `X.weight_scale` in place
of each quantized `X.weight`; `load_model` builds those layers as `QuantLinear` / `QuantExperts`
and offers each quantized weight to the selected backend's repack hook (`repack_model`).

The file names, the description's format, the checked readers and the writer are
`glm5.core.checkpoint_files` (below the model, which saves through it); this module builds a
model from them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

# progress.progress_bar is looked up at call time: tests and callers may replace it
from glm5 import ops, progress
from glm5.core.checkpoint_files import (  # noqa: F401  (the format's names, importable from here too)
    DESCRIPTION,
    FLOAT,
    FORMAT_VERSION,
    INDEX,
    METHOD,
    MSMODELSLIM_DESCRIPTION,
    SINGLE,
    CheckpointError,
    checkpoint_tensors,
    get_tensor,
    is_output_file,
    open_safetensors,
    read_description,
    read_index,
    save_pretrained,
    stored_bytes,
)
from glm5.core.config import GLM5Config
from glm5.core.layers import QuantExperts, QuantLinear
from glm5.core.model import GLM5ForCausalLM
from glm5.core.quant_policy import high_precision_reason
from glm5.core.rope import inv_freq

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)"
                     r"\.(weight|weight_packed|weight_scale)$")
_PACKED = ".weight_packed"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file."""
    if (path / INDEX).exists():
        return read_index(path / INDEX, "glm5.load_model")
    if (path / SINGLE).exists():
        with open_safetensors(path / SINGLE, "glm5.load_model") as f:
            return {k: path / SINGLE for k in f.keys()}
    raise CheckpointError(f"glm5.load_model: no {SINGLE} or {INDEX} in {path}")


def _to_module_name(name: str, L: int) -> str | None:
    """Checkpoint name -> module name (None: a tensor deliberately not loaded)."""
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= L:
        d, rest = int(m.group(1)) - L, m.group(2)
        if rest in _MTP_SHARED_COPIES:
            return None
        if rest.startswith(_MTP_OWN):
            return f"mtp.{d}.{rest}"
        return f"mtp.{d}.block.{rest}"
    return name


def _has_mtp(names: Iterator[str], L: int) -> bool:
    for n in names:
        m = _LAYER.match(n)
        if m and int(m.group(1)) >= L:
            return True
    return False


def load_config(p: Path, indexer_dtype: str | None, indexer_hadamard: bool | None,
                who: str) -> GLM5Config:
    """The config of the checkpoint directory ``p`` as a loader (``who``) builds the model from
    it: ``indexer_dtype`` / ``indexer_hadamard`` applied as `load_model` documents them; an
    msModelSlim directory (not loadable before `glm5 quantize --from msmodelslim`) refused."""
    cfg = GLM5Config.from_pretrained(p)
    if indexer_dtype == "bf16" and indexer_hadamard is None:
        indexer_hadamard = False  # the rotation belongs to the fp8 indexer
    over = {k: v for k, v in (("dsa_indexer_dtype", indexer_dtype),
                              ("dsa_indexer_hadamard", indexer_hadamard)) if v is not None}
    if over:
        cfg = cfg.replace(**over)
    if (p / MSMODELSLIM_DESCRIPTION).exists():
        raise CheckpointError(f"{who}: {p} is an msModelSlim checkpoint; convert it "
                              f"first with `glm5 quantize --from msmodelslim {p} DST`")
    return cfg


def load_model(path: str | Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu",
               indexer_dtype: str | None = None,
               indexer_hadamard: bool | None = None) -> GLM5ForCausalLM:
    """Load a directory written by `GlmMoeDsaForCausalLM.save_pretrained` (or by glm5).

    ``indexer_dtype`` ("bf16" / "fp8"), when given, overrides the config's ``dsa_indexer_dtype``
    (the same weights: "fp8" runs DeepSeek-V3.2's fp8 indexer and, in the serving engine, keeps
    the indexer keys in fp8); ``indexer_hadamard`` (a bool), when given, its
    ``dsa_indexer_hadamard`` (the fp8 indexer's q and k rotated before quantization).

    The model is built on the meta device and each tensor is read from the memory-mapped
    safetensors file one at a time (converted to ``dtype`` at once, experts stacked layer by
    layer), so loading never needs twice the checkpoint's size in RAM. The router weight and
    correction bias stay fp32, as transformers keeps them. A missing, unexpected or mis-shaped
    tensor is a `CheckpointError` naming it.
    """
    from contextlib import ExitStack

    p = Path(path)
    cfg = load_config(p, indexer_dtype, indexer_hadamard, "glm5.load_model")
    files = _files(p)
    L = cfg.num_hidden_layers
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg, with_mtp=_has_mtp(iter(files), L))
        quant = _install_quant_modules(model, p, files, L)
    want = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    plain: dict[str, str] = {}  # module name -> checkpoint name
    experts: dict[str, dict[int, dict[str, str]]] = {}
    unexpected: list[str] = []
    for name in files:
        m = _EXPERT.match(name)
        target = _to_module_name(m.group(1) if m else name, L)
        if target is None:
            continue
        if m:
            key = m.group(3) if m.group(4) == "weight" else f"{m.group(3)}{m.group(4)[6:]}"
            experts.setdefault(target, {}).setdefault(int(m.group(2)), {})[key] = name
        elif target in want:
            plain[target] = name
        else:
            unexpected.append(name)
    if unexpected:
        raise CheckpointError(f"glm5.load_model: unexpected tensors in {p}: "
                              f"{', '.join(sorted(unexpected)[:10])}")
    E = cfg.n_routed_experts
    stacked: dict[str, tuple[str, ...]] = {}  # expert prefix -> stacked tensor suffixes
    for prefix, per in experts.items():
        if f"{prefix}.gate_up_proj" in want:
            kinds = ("",)
        elif f"{prefix}.gate_up_proj_packed" in want:
            kinds = ("_packed", "_scale")
        else:
            raise CheckpointError(f"glm5.load_model: unexpected tensors in {p}: {prefix}.*")
        stacked[prefix] = kinds
        need = {f"{w}{k}" for w in ("gate_proj", "up_proj", "down_proj") for k in kinds}
        if sorted(per) != list(range(E)) or any(set(v) != need for v in per.values()):
            raise CheckpointError(f"glm5.load_model: {prefix} expected experts 0..{E - 1} each "
                                  f"with gate_proj, up_proj and down_proj"
                                  + (" (weight_packed and weight_scale)" if kinds != ("",)
                                     else ""))
    have = set(plain) | {f"{k}.{w}{s}" for k, kinds in stacked.items() for s in kinds
                         for w in ("gate_up_proj", "down_proj")}
    missing = sorted(set(want) - have)
    if missing:
        raise CheckpointError(f"glm5.load_model: tensors missing from {p}: "
                              f"{', '.join(missing[:10])}")

    loaded: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        for f in dict.fromkeys(files.values()):  # every shard's header, before any data is read
            handles[f] = stack.enter_context(open_safetensors(f, "glm5.load_model"))
        bar = stack.enter_context(progress.progress_bar(stored_bytes(files), f"loading {p.name}",
                                                        "B"))

        def read(name: str, target: str) -> torch.Tensor:
            f = files[name]
            t = get_tensor(handles[f], name, f, "glm5.load_model")
            bar.update(t.numel() * t.element_size())
            keep_fp32 = target.endswith(("mlp.gate.weight", "e_score_correction_bias",
                                         "_scale"))  # quantization scales are fp32 by format
            if dtype is not None and t.is_floating_point() and not keep_fp32:
                t = t.to(dtype)
            return t

        def put(target: str, t: torch.Tensor, what: str) -> None:
            if tuple(t.shape) != tuple(want[target].shape):
                raise CheckpointError(f"glm5.load_model: tensor {what} has shape "
                                      f"{list(t.shape)}, expected {list(want[target].shape)}")
            loaded[target] = t

        for target, name in plain.items():
            put(target, read(name, target), name)
        for prefix, per in experts.items():  # one layer's experts at a time
            for k in stacked[prefix]:  # packed codes and scales stack like weights (rows)
                gu = f"{prefix}.gate_up_proj{k}"
                dn = f"{prefix}.down_proj{k}"
                put(gu, torch.stack([torch.cat((read(per[e][f"gate_proj{k}"], gu),
                                                read(per[e][f"up_proj{k}"], gu)), 0)
                                     for e in range(E)]),
                    f"{prefix}.*.gate_proj/up_proj{'.weight' + k if k else ''}")
                put(dn, torch.stack([read(per[e][f"down_proj{k}"], dn) for e in range(E)]),
                    f"{prefix}.*.down_proj{'.weight' + k if k else ''}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inv_freq(cfg)[0]  # non-persistent buffer: rebuilt, not loaded
    model = model.to(device)
    if quant is not None:
        quant["repacked"] = repack_model(model)
        model.quantization = quant
    return model


def _install_quant_modules(model: GLM5ForCausalLM, p: Path, files: dict[str, Path],
                           L: int) -> dict | None:
    """Replace the layers a quantized checkpoint stores as packed codes with QuantLinear /
    QuantExperts (on the meta device, before loading). None for an unquantized checkpoint."""

    desc = read_description(p)
    if desc is None:
        return None
    schemes = desc["tensors"]
    expert_schemes: dict[str, set[str]] = {}
    for name in files:
        if not name.endswith(_PACKED) and not name.endswith("_proj_packed"):
            continue
        scheme = schemes.get(name)
        if scheme is None or scheme == FLOAT:
            raise CheckpointError(f"glm5.load_model: {name} has no quantization scheme in "
                                  f"{p / DESCRIPTION}")
        weight = name[: -len(_PACKED)] + ".weight" if name.endswith(_PACKED) else name[:-7]
        why = high_precision_reason(weight)
        if why is not None:
            raise CheckpointError(f"glm5.load_model: {name} is quantized but glm5 keeps "
                                  f"{weight} in high precision ({why})")
        m = _EXPERT.match(name)
        if m or name.endswith("_proj_packed"):
            prefix = _to_module_name(m.group(1) if m else name.rsplit(".", 1)[0], L)
            expert_schemes.setdefault(prefix, set()).add(scheme)
            continue
        target = _to_module_name(name, L)[: -len(_PACKED)]
        parent_name, _, attr = target.rpartition(".")
        try:
            old = model.get_submodule(target)
        except AttributeError:
            old = None
        if not isinstance(old, torch.nn.Linear):
            raise CheckpointError(f"glm5.load_model: unexpected tensors in {p}: {name}")
        bias = f"{name[: -len(_PACKED)]}.bias" in files
        setattr(model.get_submodule(parent_name), attr,
                QuantLinear(old.in_features, old.out_features, scheme, bias=bias))
    for prefix, sset in expert_schemes.items():
        if len(sset) != 1:
            raise CheckpointError(f"glm5.load_model: {prefix} mixes schemes {sorted(sset)}; "
                                  f"one layer's routed experts share one scheme")
        parent_name, _, attr = prefix.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:
            raise CheckpointError(f"glm5.load_model: unexpected tensors in {p}: {prefix}.*")
        setattr(parent, attr, QuantExperts(parent.gate.cfg, sset.pop()))
    return {"scheme": desc["scheme"], "format_version": desc["format_version"]}


def repack_model(model: torch.nn.Module) -> dict[str, str]:
    """Offer each quantized weight to the repack hook of the backend selected for its op on the
    weight's device (once, at load time). Returns {module name: backend} for those repacked."""

    act = model.dtype
    out: dict[str, str] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):  # a tensor-parallel part (a subclass) too
            b = ops.repack_weight("quant_linear", mod.weight_packed, mod.weight_scale,
                                  mod.scheme, act)
        elif type(mod) is QuantExperts:
            b = ops.repack_weight("moe_experts_quant", mod.gate_up_proj_packed,
                                  mod.gate_up_proj_scale, mod.scheme, act)
            if b is not None:
                ops.repack_weight("moe_experts_quant", mod.down_proj_packed,
                                  mod.down_proj_scale, mod.scheme, act)
        else:
            continue
        if b is not None:
            out[name] = b
    return out
