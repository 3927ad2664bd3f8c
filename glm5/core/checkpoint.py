"""Checkpoints in the transformers format (config.json + safetensors, single or sharded with an
index), loaded by tensor name and memory-mapped; written back in the same format.

Name mapping between the checkpoint and glm5's modules:
- routed experts are stored per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) and held
  stacked (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]);
- the MTP layer d is stored as `model.layers.{L + d}.*` (DeepSeek-V3 / GLM-5) and held as
  `mtp.{d}.*` (its decoder block as `mtp.{d}.block.*`); its copies of `embed_tokens` and
  `shared_head.head` are the main model's and are not loaded twice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch

from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.core.rope import inv_freq

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


class CheckpointError(ValueError):
    """A checkpoint does not match the model (missing, unexpected or mis-shaped tensors)."""


def _files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file."""
    if (path / INDEX).exists():
        wm = json.loads((path / INDEX).read_text())["weight_map"]
        return {k: path / v for k, v in wm.items()}
    if (path / SINGLE).exists():
        from safetensors import safe_open

        with safe_open(str(path / SINGLE), "pt") as f:
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


def load_model(path: str | Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> GLM5ForCausalLM:
    """Load a directory written by `GlmMoeDsaForCausalLM.save_pretrained` (or by glm5).

    Tensors are memory-mapped and assigned without a copy where no dtype change is asked, so a
    large checkpoint never needs twice its size in RAM. The router weight and correction bias
    stay fp32 (as transformers keeps them).
    """
    from safetensors import safe_open

    p = Path(path)
    cfg = GLM5Config.from_pretrained(p)
    files = _files(p)
    L = cfg.num_hidden_layers
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg, with_mtp=_has_mtp(iter(files), L))
    want = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    loaded: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    unexpected: list[str] = []
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(str(f), "pt", device="cpu") as sf:
            for name in names:
                m = _EXPERT.match(name)
                if m:
                    target = _to_module_name(m.group(1), L)
                    if target is None:
                        continue
                    experts.setdefault(target, {}).setdefault(int(m.group(2)), {})[m.group(3)] = \
                        sf.get_tensor(name)
                    continue
                target = _to_module_name(name, L)
                if target is None:
                    continue
                if target not in want:
                    unexpected.append(name)
                    continue
                loaded[target] = sf.get_tensor(name)
    for prefix, per in experts.items():
        E = cfg.n_routed_experts
        if sorted(per) != list(range(E)) or any(len(v) != 3 for v in per.values()):
            raise CheckpointError(f"glm5.load_model: {prefix} expected experts 0..{E - 1} each "
                                  f"with gate_proj, up_proj and down_proj")
        loaded[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat((per[e]["gate_proj"], per[e]["up_proj"]), 0) for e in range(E)])
        loaded[f"{prefix}.down_proj"] = torch.stack([per[e]["down_proj"] for e in range(E)])
    missing = sorted(set(want) - set(loaded))
    if unexpected:
        raise CheckpointError(f"glm5.load_model: unexpected tensors in {p}: "
                              f"{', '.join(sorted(unexpected)[:10])}")
    if missing:
        raise CheckpointError(f"glm5.load_model: tensors missing from {p}: "
                              f"{', '.join(missing[:10])}")
    for k, t in loaded.items():
        if tuple(t.shape) != tuple(want[k].shape):
            raise CheckpointError(f"glm5.load_model: tensor {k} has shape {list(t.shape)}, "
                                  f"expected {list(want[k].shape)}")
        keep_fp32 = k.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        if dtype is not None and t.is_floating_point() and not keep_fp32:
            loaded[k] = t.to(dtype)
    model.load_state_dict(loaded, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inv_freq(cfg)[0]  # non-persistent buffer: rebuilt, not loaded
    return model.to(device)


def _checkpoint_tensors(model: GLM5ForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """Module tensors -> checkpoint names (inverse of load_model's mapping)."""
    L = model.config.num_hidden_layers
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        m = re.match(r"^mtp\.(\d+)\.(block\.)?(.*)$", name)
        if m:
            name = f"model.layers.{L + int(m.group(1))}.{m.group(3)}"
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len(".gate_up_proj")]
            I = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{pre}.{e}.gate_proj.weight", t[e, :I]
                yield f"{pre}.{e}.up_proj.weight", t[e, I:]
            continue
        if name.endswith("mlp.experts.down_proj"):
            pre = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                yield f"{pre}.{e}.down_proj.weight", t[e]
            continue
        yield name, t


def save_pretrained(model: GLM5ForCausalLM, path: str | Path,
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json + safetensors (sharded with an index above ``max_shard_bytes``)."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(p)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in _checkpoint_tensors(model):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(p / SINGLE), metadata={"format": "pt"})
        return
    weight_map = {}
    total = 0
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(p / fname), metadata={"format": "pt"})
        for k, t in sh.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    (p / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                       "weight_map": weight_map}, indent=2))
