"""Loading a checkpoint sharded: each rank reads only its slice of the safetensors.

`load_parallel(path, layout)` builds the model on the meta device (with the `QuantLinear` /
`QuantExperts` a glm5-quantized checkpoint needs, as `glm5.core.checkpoint.load_model` installs
them), cuts it with `glm5.parallel.layouts.parallelize` (which records, for every tensor it cuts,
the dimension and range this rank keeps, in the checkpoint tensor's own coordinates: packed
columns, scale columns), and then reads each tensor from the memory-mapped safetensors files —
the whole of a replicated one, only this rank's rows or columns of a split one (safetensors'
`get_slice`), and only the routed experts this rank owns (their packed codes and scales for
quantized experts). A rank never reads another rank's heads, columns or experts.

Quantized checkpoints: glm5's own layout (`glm5 quantize`, `quant_description.json`), including
one imported from msModelSlim (`glm5 quantize --from msmodelslim`: static W8A8 layers carry a
float bias, kept by tp rank 0 of a row-parallel layer). An msModelSlim directory itself is refused
as `load_model` refuses it (convert it first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from glm5.core import checkpoint as ck
from glm5.core.model import GLM5ForCausalLM
from glm5.core.rope import inv_freq
from glm5.parallel.layouts import RowParallelQuantLinear, parallelize

_WHO = "glm5 load_parallel"
_PROJS = ("gate_proj", "up_proj", "down_proj")


def load_parallel(path: str | Path, layout: Any, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu", indexer_dtype: str | None = None,
                  indexer_hadamard: bool | None = None) -> torch.nn.Module:
    """This rank's part of the checkpoint at ``path`` under ``layout`` (a
    `glm5.parallel.layouts.ParallelConfig`), as a parallelized GLM5ForCausalLM. ``dtype``,
    ``indexer_dtype`` and ``indexer_hadamard`` as in `glm5.core.checkpoint.load_model` (float
    tensors converted to ``dtype``; router and quantization scales stay fp32). A quantized
    checkpoint's weights are offered to the backend's repack hook and ``model.quantization`` is
    set, as load_model does. ``model.load_stats``: ``bytes_read`` by this rank and the
    checkpoint's total ``checkpoint_bytes``."""

    p = Path(path)
    cfg = ck.load_config(p, indexer_dtype, indexer_hadamard, _WHO)
    files = ck._files(p)
    L = cfg.num_hidden_layers
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg, with_mtp=ck._has_mtp(iter(files), L))
        quant = ck._install_quant_modules(model, p, files, L)
    parallelize(model, layout)
    spec = model.shard_spec
    want = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    plain: dict[str, str] = {}
    experts: dict[str, dict[int, dict[str, str]]] = {}
    for name in files:
        m = ck._EXPERT.match(name)
        target = ck._to_module_name(m.group(1) if m else name, L)
        if target is None:
            continue
        if m:  # key: "gate_proj" (float) or "gate_proj_packed" / "gate_proj_scale"
            key = m.group(3) if m.group(4) == "weight" else f"{m.group(3)}{m.group(4)[6:]}"
            experts.setdefault(target, {}).setdefault(int(m.group(2)), {})[key] = name
        elif target in want:
            plain[target] = name
        elif spec.get(target, (None, 0, 1))[1:] == (0, 0):
            continue  # this rank keeps none of it (a row-parallel bias off rank 0)
        else:
            raise ck.CheckpointError(f"{_WHO}: unexpected tensor {name} in {p}")
    kinds: dict[str, tuple[str, ...]] = {}  # expert prefix -> stacked tensor suffixes
    for prefix in experts:
        kinds[prefix] = ("_packed", "_scale") if f"{prefix}.gate_up_proj_packed" in want \
            else ("",)
    have = set(plain) | {f"{k}.{w}{s}" for k, ks in kinds.items() for s in ks
                         for w in ("gate_up_proj", "down_proj")}
    missing = sorted(set(want) - have)
    if missing:
        raise ck.CheckpointError(f"{_WHO}: tensors missing from {p}: "
                                 f"{', '.join(missing[:10])}")
    loaded: dict[str, torch.Tensor] = {}
    read_bytes = 0
    handles: dict[Path, Any] = {}

    def handle(f: Path) -> Any:
        if f not in handles:
            handles[f] = ck.open_safetensors(f, _WHO).__enter__()
        return handles[f]

    def read(name: str, target: str, dim: int | None = None, a: int = 0, b: int = 0
             ) -> torch.Tensor:
        nonlocal read_bytes
        sl = handle(files[name]).get_slice(name)
        if dim is None:
            t = sl[:]
        elif dim == 0:
            t = sl[a:b]
        else:
            t = sl[:, a:b]
        read_bytes += t.numel() * t.element_size()
        keep_fp32 = target.endswith(("mlp.gate.weight", "e_score_correction_bias",
                                     "_scale"))  # quantization scales are fp32 by format
        if dtype is not None and t.is_floating_point() and not keep_fp32:
            t = t.to(dtype)
        return t

    def put(target: str, t: torch.Tensor, what: str) -> None:
        mod_name, _, attr = target.rpartition(".")
        mod = model.get_submodule(mod_name)
        if isinstance(mod, RowParallelQuantLinear):  # its buffers extend the checkpoint slice
            t = mod.widen(attr, t)
        if tuple(t.shape) != tuple(want[target].shape):
            raise ck.CheckpointError(f"{_WHO}: tensor {what} has shape {list(t.shape)} on "
                                     f"this rank, expected {list(want[target].shape)}")
        loaded[target] = t

    try:
        for target, name in plain.items():
            d, a, b = spec.get(target, (None, 0, 0))
            put(target, read(name, target, d, a, b), name)
        for prefix, per in experts.items():  # only this rank's experts, one layer at a time
            for k in kinds[prefix]:
                gu, dn = f"{prefix}.gate_up_proj{k}", f"{prefix}.down_proj{k}"
                _, e0, e1 = spec.get(gu, (0, 0, cfg.n_routed_experts))
                mine = range(e0, e1)
                if any(e not in per or any(f"{w}{k}" not in per[e] for w in _PROJS)
                       for e in mine):
                    raise ck.CheckpointError(
                        f"{_WHO}: {prefix} expected experts {e0}..{e1 - 1} each with "
                        f"gate_proj, up_proj and down_proj"
                        + (" (weight_packed and weight_scale)" if k else ""))
                put(gu, torch.stack([torch.cat((read(per[e][f"gate_proj{k}"], gu),
                                                read(per[e][f"up_proj{k}"], gu)), 0)
                                     for e in mine]),
                    f"{prefix}.*.gate_proj/up_proj{'.weight' + k if k else ''}")
                put(dn, torch.stack([read(per[e][f"down_proj{k}"], dn) for e in mine]),
                    f"{prefix}.*.down_proj{'.weight' + k if k else ''}")
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    model.load_state_dict(loaded, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inv_freq(cfg)[0]
    model.load_stats = {"bytes_read": read_bytes, "checkpoint_bytes": ck.stored_bytes(files)}
    model = model.to(device)
    if quant is not None:
        quant["repacked"] = ck.repack_model(model)
        model.quantization = quant
    return model
