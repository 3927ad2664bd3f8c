"""Loading a checkpoint sharded: each rank reads only its slice of the safetensors.

`load_parallel(path, layout)` builds the model on the meta device, cuts it with
`glm5.parallel.layouts.parallelize` (which records, for every parameter it cuts, the dimension and
range this rank keeps), and then reads each tensor from the memory-mapped safetensors files —
the whole of a replicated one, only this rank's rows or columns of a split one (safetensors'
`get_slice`), and only the routed experts this rank owns. A rank never reads another rank's
heads, columns or experts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from glm5.core import checkpoint as ck
from glm5.core.config import GLM5Config
from glm5.core.model import GLM5ForCausalLM
from glm5.core.rope import inv_freq
from glm5.parallel.layouts import parallelize


def load_parallel(path: str | Path, layout: Any, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> torch.nn.Module:
    """This rank's part of the checkpoint at ``path`` under ``layout`` (a
    `glm5.parallel.layouts.ParallelConfig`), as a parallelized GLM5ForCausalLM. ``stats`` on the model:
    bytes read by this rank and the checkpoint's total."""

    p = Path(path)
    cfg = GLM5Config.from_pretrained(p)
    if (p / ck.DESCRIPTION).exists() or (p / ck.MSMODELSLIM_DESCRIPTION).exists():
        raise ck.CheckpointError(f"glm5 load_parallel: {p} is a quantized checkpoint; quantized "
                                 f"layers are not split yet")
    files = ck._files(p)
    L = cfg.num_hidden_layers
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg, with_mtp=ck._has_mtp(iter(files), L))
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
        if m:
            if m.group(4) != "weight":
                raise ck.CheckpointError(f"glm5 load_parallel: {name}: quantized experts are "
                                         f"not split yet")
            experts.setdefault(target, {}).setdefault(int(m.group(2)), {})[m.group(3)] = name
        elif target in want:
            plain[target] = name
        else:
            raise ck.CheckpointError(f"glm5 load_parallel: unexpected tensor {name} in {p}")
    have = set(plain) | {f"{k}.{w}" for k in experts for w in ("gate_up_proj", "down_proj")}
    missing = sorted(set(want) - have)
    if missing:
        raise ck.CheckpointError(f"glm5 load_parallel: tensors missing from {p}: "
                                 f"{', '.join(missing[:10])}")
    loaded: dict[str, torch.Tensor] = {}
    read_bytes = 0
    handles: dict[Path, Any] = {}

    def handle(f: Path) -> Any:
        if f not in handles:
            handles[f] = ck.open_safetensors(f, "glm5 load_parallel").__enter__()
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
        keep_fp32 = target.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        if dtype is not None and t.is_floating_point() and not keep_fp32:
            t = t.to(dtype)
        return t

    def put(target: str, t: torch.Tensor, what: str) -> None:
        if tuple(t.shape) != tuple(want[target].shape):
            raise ck.CheckpointError(f"glm5 load_parallel: tensor {what} has shape "
                                     f"{list(t.shape)} on this rank, expected "
                                     f"{list(want[target].shape)}")
        loaded[target] = t

    try:
        for target, name in plain.items():
            d, a, b = spec.get(target, (None, 0, 0))
            put(target, read(name, target, d, a, b), name)
        for prefix, per in experts.items():
            gu, dn = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
            _, e0, e1 = spec.get(gu, (0, 0, cfg.n_routed_experts))
            mine = range(e0, e1)
            if any(e not in per or set(per[e]) != {"gate_proj", "up_proj", "down_proj"}
                   for e in mine):
                raise ck.CheckpointError(f"glm5 load_parallel: {prefix} expected experts "
                                         f"{e0}..{e1 - 1} each with gate_proj, up_proj and "
                                         f"down_proj")
            put(gu, torch.stack([torch.cat((read(per[e]["gate_proj"], gu),
                                            read(per[e]["up_proj"], gu)), 0) for e in mine]),
                f"{prefix}.*.gate_proj/up_proj")
            put(dn, torch.stack([read(per[e]["down_proj"], dn) for e in mine]),
                f"{prefix}.*.down_proj")
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    model.load_state_dict(loaded, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inv_freq(cfg)[0]
    model.load_stats = {"bytes_read": read_bytes, "checkpoint_bytes": ck.stored_bytes(files)}
    return model.to(device)
