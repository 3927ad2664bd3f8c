"""The files of a checkpoint as glm5 reads and writes them (the transformers layout:
config.json + safetensors, single or sharded with an index; a glm5-quantized directory's
description): their names, the errors that name what is wrong with one, checked readers of
safetensors headers, indexes and descriptions, and the writer (`save_pretrained`).

Below the model: `glm5.core.checkpoint` (which builds models from these files) and the model's
own `save_pretrained` both use it; it never imports the model class. glm5/deploy/quantize.py,
which writes quantized directories, imports the names from here (never the reverse).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch

# progress.progress_bar is looked up at call time: tests and callers may replace it
from glm5 import progress
from glm5.core.output import atomic_dir
from glm5.ir.quant_formats import SCHEMES

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# A glm5-quantized directory: its description file, method and format version, and the scheme
# name of a tensor kept in high precision.
DESCRIPTION = "quant_description.json"
METHOD = "glm5"
FORMAT_VERSION = 1
FLOAT = "FLOAT"
# An msModelSlim (Ascend) checkpoint, which `glm5 quantize --from msmodelslim` converts.
MSMODELSLIM_DESCRIPTION = "quant_model_description.json"

class CheckpointError(ValueError):
    """A checkpoint does not match the model (missing, unexpected or mis-shaped tensors)."""


def is_output_file(name: str) -> bool:
    """Whether a directory entry is part of a checkpoint as glm5 writes it (what a new save
    replaces; anything else in the directory, e.g. a tokenizer, is kept)."""
    return name in ("config.json", DESCRIPTION, MSMODELSLIM_DESCRIPTION) or name.endswith(
        (".safetensors", ".safetensors.index.json"))


def open_safetensors(f: Path, who: str):
    """``safe_open(f)`` (use it as a context manager), or a `CheckpointError` naming the file and
    what is wrong with it instead of safetensors' bare `SafetensorError`."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(f), "pt", device="cpu")
    except SafetensorError as e:
        why = str(e).removeprefix("Error while deserializing header: ")
        raise CheckpointError(f"{who}: {f} is not a valid safetensors file (header: {why}); "
                              f"it is truncated or corrupt: download or save it again") from e
    except FileNotFoundError as e:
        raise CheckpointError(f"{who}: {f} is missing") from e
    except OSError as e:
        raise CheckpointError(f"{who}: cannot read {f}: {e.strerror or e}") from e


def get_tensor(handle, name: str, f: Path, who: str) -> torch.Tensor:
    """``handle.get_tensor(name)``; a tensor the file does not hold (an index that disagrees
    with its shards) or cannot return is a `CheckpointError` naming both."""
    from safetensors import SafetensorError

    try:
        return handle.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"{who}: cannot read tensor {name} from {f}: {e}") from e


def read_index(index: Path, who: str) -> dict[str, Path]:
    """tensor name -> shard file of a sharded checkpoint's ``*.safetensors.index.json``, checked:
    valid JSON with a ``weight_map`` of file names, every shard present."""
    try:
        doc = json.loads(index.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{who}: {index} is not valid JSON ({e.msg} at line {e.lineno}); "
                              f"it is truncated or corrupt") from e
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{who}: {index} expected a \"weight_map\" object mapping tensor "
                              f"names to shard file names")
    missing = sorted({v for v in wm.values() if not (index.parent / v).is_file()})
    if missing:
        raise CheckpointError(f"{who}: {index} names {len(missing)} shard(s) missing from "
                              f"{index.parent}: {', '.join(missing[:3])}")
    return {k: index.parent / v for k, v in wm.items()}


def stored_bytes(files: dict[str, Path]) -> int:
    """Bytes of the tensors named in ``files`` (tensor name -> file), read from the files'
    headers (no tensor data is read); used as a progress bar's total."""
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    total = 0
    for f, names in by_file.items():
        with open(f, "rb") as h:
            header = json.loads(h.read(int.from_bytes(h.read(8), "little")))
        total += sum(e - s for s, e in (header[n]["data_offsets"] for n in names if n in header))
    return total


def read_description(path: Path) -> dict | None:
    """The parsed quant_description.json of a glm5-quantized directory, or None when absent."""
    f = Path(path) / DESCRIPTION
    if not f.exists():
        return None
    d = json.loads(f.read_text())
    if d.get("quant_method") != METHOD or d.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"glm5.load_model: {f} expected quant_method {METHOD!r} format_version "
            f"{FORMAT_VERSION}, got {d.get('quant_method')!r} {d.get('format_version')!r}")
    for name, sch in d.get("tensors", {}).items():
        if sch != FLOAT and sch not in SCHEMES:
            raise CheckpointError(f"glm5.load_model: {f} names unknown scheme {sch!r} for "
                                  f"{name}; known: {', '.join(SCHEMES)}")
    return d


def checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
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


def save_pretrained(model: torch.nn.Module, path: str | Path,
                    max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> None:
    """Write config.json + safetensors (sharded with an index above ``max_shard_bytes``).

    The directory is written atomically (glm5/core/output.py): into a temporary directory beside
    ``path`` that then replaces it, so a reader never sees a mixture of two saves, a failed or
    interrupted save leaves ``path`` as it was, and no shard of an earlier save survives. A
    ``path`` that already holds a checkpoint is refused (`OutputExistsError`) unless
    ``overwrite``; other files in it (a tokenizer, a README) are kept.
    """
    from safetensors.torch import save_file  # lazy: safetensors loads only when saving

    if max_shard_bytes <= 0:
        raise ValueError(f"glm5.save_pretrained: argument 'max_shard_bytes' expected > 0, got "
                         f"{max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in checkpoint_tensors(model):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    total = sum(t.numel() * t.element_size() for sh in shards for t in sh.values())
    with atomic_dir(path, overwrite=overwrite, who="glm5.save_pretrained",
                    replaces=is_output_file, kind="a checkpoint") as p, \
            progress.progress_bar(total, f"saving {Path(path).name}", "B") as bar:
        model.config.save_pretrained(p)
        weight_map = {}
        for i, sh in enumerate(shards):
            # one shard at a time on the CPU, so saving needs one shard of extra memory
            sh = {k: t.detach().contiguous().cpu() for k, t in sh.items()}
            fname = SINGLE if len(shards) == 1 else \
                f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, str(p / fname), metadata={"format": "pt"})
            bar.update(sum(t.numel() * t.element_size() for t in sh.values()))
            weight_map.update({k: fname for k in sh})
        if len(shards) > 1:
            (p / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                               "weight_map": weight_map}, indent=2))
