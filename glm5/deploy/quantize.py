"""Offline quantization of transformers-format GLM-5 checkpoints into glm5's canonical schemes,
import of msModelSlim (Ascend) checkpoints, and the accuracy budget of each scheme.

Output format (a directory, `format_version` 1; see docs/quantization.md):
- `config.json`: the source config plus `quantization_config = {"quant_method": "glm5",
  "scheme": ..., "format_version": 1}`;
- safetensors (single file, or shards with `model.safetensors.index.json`): each quantized
  `X.weight` [N, K] is replaced by `X.weight_packed` (the scheme's canonical packed codes, docs/ops.md)
  and `X.weight_scale` (fp32 [N] or [N, ceil(K/128)]); per-expert tensors are quantized per
  expert (their own scales). Kept tensors are copied unchanged;
- `quant_description.json`: `{"quant_method": "glm5", "format_version": 1, "scheme": ...,
  "tensors": {name: scheme or "FLOAT"}}` naming every stored tensor.

Which tensors a scheme quantizes is `glm5.core.quant_policy` (the one rule).

Everything streams: tensors are read one at a time from the memory-mapped source and shards are
written as soon as they reach `max_shard_bytes`, so the working set is one shard plus one tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

# progress.progress_bar is looked up at call time: tests and callers may replace it
from glm5 import progress
from glm5.core.checkpoint import load_model, repack_model  # noqa: F401  (importable from here)
from glm5.core.checkpoint_files import (  # noqa: F401  (the format's names, importable from here)
    DESCRIPTION, FLOAT, FORMAT_VERSION, INDEX, METHOD, MSMODELSLIM_DESCRIPTION, SINGLE,
    CheckpointError, get_tensor, is_output_file, open_safetensors, read_description, read_index,
    stored_bytes)
from glm5.core.config import GLM5Config
from glm5.core.output import atomic_dir
from glm5.core.quant_policy import high_precision_reason, is_quantized
from glm5.ir.quant_formats import get_scheme, quantize_weight

DEFAULT_SHARD_BYTES = 5 * 2**30

# Accuracy budget of each scheme against the fp32 model, per preset (random weights with
# std = initializer_range, fixed seed, the batch of `accuracy_batch`): minimum mean logit cosine
# similarity, minimum top-1 agreement, and maximum bytes per parameter of the quantized tensors
# (packed codes + fp32 scales). Measured values: docs/quantization.md (bench/quant_accuracy.py).
# Budgets leave about 2x the measured error as margin, so a real regression (a wrong scale, a
# dropped bias, a mis-packed nibble) fails while seeds move the numbers a little. Random-weight
# networks amplify weight error layer by layer and through discrete choices (DSA top-k, expert
# routing), so these are regression budgets for glm5's pipeline, not predictions for trained
# GLM-5 weights. Tests check "tiny"; bench/quant_accuracy.py checks both.
BUDGETS: dict[str, dict[str, dict[str, float]]] = {
    "tiny": {
        # 8-bit weights, fp activations: error ~ 1/254 of each row's range per weight.
        "w8a16": {"cosine": 0.997, "top1": 0.90, "bytes_per_param": 1.1},
        # + per-token 8-bit activations: about twice the w8a16 error.
        "w8a8": {"cosine": 0.994, "top1": 0.85, "bytes_per_param": 1.1},
        # 4-bit weights (15 levels per group of 128) dominate: ~16x the 8-bit step.
        "w4a8": {"cosine": 0.94, "top1": 0.55, "bytes_per_param": 0.6},
        # 6-bit weights (63 levels per group of 128), 12-bit activations.
        "w6a12": {"cosine": 0.99, "top1": 0.75, "bytes_per_param": 0.85},
    },
    "small": {
        "w8a16": {"cosine": 0.994, "top1": 0.85, "bytes_per_param": 1.05},
        "w8a8": {"cosine": 0.988, "top1": 0.75, "bytes_per_param": 1.05},
        "w4a8": {"cosine": 0.78, "top1": 0.10, "bytes_per_param": 0.55},
        "w6a12": {"cosine": 0.97, "top1": 0.60, "bytes_per_param": 0.8},
    },
}

class QuantizeError(ValueError):
    """A checkpoint cannot be quantized or imported (the message names the tensor)."""


# --------------------------------------------------------------------------- reading
def source_files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file of a checkpoint directory: an index (transformers'
    or any `*.safetensors.index.json`), `model.safetensors`, or every `*.safetensors` in it.
    A missing shard or a corrupt file is a `CheckpointError` naming it."""
    indexes = [path / INDEX] if (path / INDEX).exists() else sorted(
        path.glob("*.safetensors.index.json"))
    if indexes:
        return read_index(indexes[0], "glm5 quantize")
    single = [path / SINGLE] if (path / SINGLE).exists() else sorted(path.glob("*.safetensors"))
    if not single:
        raise QuantizeError(f"glm5 quantize: no safetensors files in {path}")
    out: dict[str, Path] = {}
    for f in single:
        with open_safetensors(f, "glm5 quantize") as h:
            for k in h.keys():
                out[k] = f
    return out


class _Reader:
    """Memory-mapped reads, one tensor at a time, one open handle per file (every file is
    opened, so checked, before any output is written). The first read of each tensor advances
    the progress bar ``bar`` by its bytes."""

    def __init__(self, files: dict[str, Path], bar: Any = None) -> None:
        self.files = files
        self._handles = {f: open_safetensors(f, "glm5 quantize")
                         for f in dict.fromkeys(files.values())}
        self.bar = bar
        self._counted: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        f = self.files[name]
        t = get_tensor(self._handles[f], name, f, "glm5 quantize")
        if self.bar is not None and name not in self._counted:
            self._counted.add(name)
            self.bar.update(_nbytes(t))
        return t

    def names_in_file_order(self) -> list[str]:
        return sorted(self.files, key=lambda n: (str(self.files[n]), n))


# --------------------------------------------------------------------------- writing
class _ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_bytes`` as they come."""

    def __init__(self, dst: Path, max_bytes: int) -> None:
        self.dst, self.max_bytes = dst, max_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[tuple[str, list[str], int]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.buf and self.size + n > self.max_bytes:
            self.flush()
        self.buf[name] = t.contiguous()
        self.size += n

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buf:
            return
        fname = f"part-{len(self.shards) + 1:05d}.safetensors"
        save_file(self.buf, str(self.dst / fname), metadata={"format": "pt"})
        self.shards.append((fname, list(self.buf), self.size))
        self.buf, self.size = {}, 0

    def close(self) -> None:
        """Final names: `model.safetensors`, or `model-0000i-of-0000n.safetensors` + index."""
        self.flush()
        if len(self.shards) <= 1:
            if self.shards:
                os.replace(self.dst / self.shards[0][0], self.dst / SINGLE)
            else:
                from safetensors.torch import save_file

                save_file({}, str(self.dst / SINGLE), metadata={"format": "pt"})
            return
        n = len(self.shards)
        wm, total = {}, 0
        for i, (tmp, names, size) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dst / tmp, self.dst / final)
            wm.update({k: final for k in names})
            total += size
        (self.dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": wm}, indent=2))


# --------------------------------------------------------------------------- summary
@dataclass
class Summary:
    """What a quantization or import did."""

    schemes: set[str] = field(default_factory=set)
    quantized: int = 0  # source tensors replaced by packed codes + scales
    kept: int = 0  # tensors copied unchanged
    dequantized: int = 0  # msModelSlim tensors glm5 keeps in high precision (dequantized)
    clamped: int = 0  # msModelSlim -128 codes clamped to -127 (with clamp_min_code)
    bytes_before: int = 0
    bytes_after: int = 0
    params_quantized: int = 0
    bytes_quantized: int = 0  # packed + scales of the quantized tensors
    tensors: dict[str, str] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return next(iter(self.schemes)) if len(self.schemes) == 1 else (
            "mixed" if self.schemes else FLOAT)

    def lines(self) -> list[str]:
        bpp = self.bytes_quantized / max(self.params_quantized, 1)
        out = [
            f"scheme: {self.scheme}" + (f" ({', '.join(sorted(self.schemes))})"
                                        if len(self.schemes) > 1 else ""),
            f"tensors quantized: {self.quantized}, kept: {self.kept}",
            f"bytes: {self.bytes_before:,} -> {self.bytes_after:,} "
            f"({self.bytes_after / max(self.bytes_before, 1):.3f}x); quantized tensors "
            f"{bpp:.3f} bytes/param",
        ]
        if self.dequantized:
            out.append(f"dequantized to high precision (glm5's quant_policy keeps them): "
                       f"{self.dequantized}")
        if self.clamped:
            out.append(f"int8 codes -128 clamped to -127: {self.clamped}")
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write_metadata(src: Path, dst: Path, summary: Summary) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": METHOD, "scheme": summary.scheme,
                                  "format_version": FORMAT_VERSION}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (dst / DESCRIPTION).write_text(json.dumps({
        "quant_method": METHOD, "format_version": FORMAT_VERSION, "scheme": summary.scheme,
        "schemes": sorted(summary.schemes), "tensors": dict(sorted(summary.tensors.items())),
    }, indent=2) + "\n")


def _source(src: str | Path, dst: str | Path) -> Path:
    """SRC as a Path, checked: a readable GLM-5 config (ConfigError otherwise), not DST."""

    s = Path(src)
    GLM5Config.from_pretrained(s)
    if Path(dst).resolve() == s.resolve():
        raise QuantizeError("glm5 quantize: DST must differ from SRC")
    return s


def _output(dst: str | Path, overwrite: bool):
    """The atomic output directory of a quantization (glm5/core/output.py): written beside
    ``dst`` and renamed into place at the end, so a failure leaves nothing behind; an existing
    checkpoint at ``dst`` is replaced only with ``overwrite``."""

    return atomic_dir(dst, overwrite=overwrite, who="glm5 quantize", replaces=is_output_file,
                      kind="a checkpoint")


def _put_quantized(w: _ShardWriter, base: str, packed: torch.Tensor, scale: torch.Tensor,
                   scheme: str, summary: Summary, params: int) -> None:
    """Store X.weight_packed / X.weight_scale (``base`` = X.weight), or, for stacked experts,
    X_packed / X_scale."""
    stem = base[: -len(".weight")] + ".weight" if base.endswith(".weight") else base
    for suffix, t in (("_packed", packed), ("_scale", scale.to(torch.float32))):
        w.add(stem + suffix, t)
        summary.tensors[stem + suffix] = scheme
        summary.bytes_after += _nbytes(t)
        summary.bytes_quantized += _nbytes(t)
    summary.params_quantized += params
    summary.quantized += 1
    summary.schemes.add(scheme)


def _keep(w: _ShardWriter, name: str, t: torch.Tensor, summary: Summary) -> None:
    w.add(name, t)
    summary.tensors[name] = FLOAT
    summary.bytes_after += _nbytes(t)
    summary.kept += 1


def quantize_tensor(t: torch.Tensor, scheme: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical (packed, scale) of a 2-D weight, or of a stacked [E, N, K] expert tensor
    quantized expert by expert (packed [E, N, P], scales [E, N(, G)])."""
    if not t.is_floating_point() or t.dim() not in (2, 3):
        raise QuantizeError(f"glm5 quantize: tensor {name} expected a floating 2-D weight (or "
                            f"3-D stacked experts), got {t.dtype} {list(t.shape)}")
    if t.dim() == 2:
        return quantize_weight(t, scheme)
    parts = [quantize_weight(t[e], scheme) for e in range(t.shape[0])]
    return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str,
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                        log: Callable[[str], None] | None = None,
                        overwrite: bool = False) -> Summary:
    """Quantize the transformers-format checkpoint ``src`` into ``dst`` with ``scheme``
    (w8a16 | w8a8 | w4a8 | w6a12). Tensors that `quant_policy.is_quantized` selects become
    packed codes + fp32 scales; every other tensor is copied. Streams tensor by tensor.

    ``dst`` is written atomically: it appears complete or not at all, and an existing
    checkpoint there is replaced only with ``overwrite`` (`OutputExistsError` otherwise)."""

    get_scheme(scheme, "quantize")
    for already in (DESCRIPTION, MSMODELSLIM_DESCRIPTION):
        if (Path(src) / already).exists():
            raise QuantizeError(f"glm5 quantize: {src} is already quantized ({already}); "
                                f"quantize an unquantized checkpoint"
                                + (" or use --from msmodelslim" if already != DESCRIPTION
                                   else ""))
    s = _source(src, dst)
    reader = _Reader(source_files(s))  # opens (checks) every file before DST is touched
    with _output(dst, overwrite) as d, \
            progress.progress_bar(stored_bytes(reader.files), f"quantize {scheme}", "B") as bar:
        reader.bar = bar
        writer = _ShardWriter(d, max_shard_bytes)
        summary = Summary(schemes={scheme})
        for name in reader.names_in_file_order():
            t = reader(name)
            summary.bytes_before += _nbytes(t)
            if is_quantized(name):
                packed, scale = quantize_tensor(t, scheme, name)
                _put_quantized(writer, name, packed, scale, scheme, summary, t.numel())
            else:
                _keep(writer, name, t, summary)
            del t
        writer.close()
        _write_metadata(s, d, summary)
    for line in summary.lines():
        (log or (lambda _x: None))(line)
    return summary


# --------------------------------------------------------------------------- msModelSlim import
MSMODELSLIM_TYPES = {"W8A16": "w8a16", "W8A8": "w8a8", "W8A8_DYNAMIC": "w8a8"}
_AUX = ("weight_scale", "weight_offset", "input_scale", "input_offset", "deq_scale",
        "quant_bias")


def deq_scale_fp32(t: torch.Tensor) -> torch.Tensor:
    """msModelSlim ``deq_scale`` as fp32: stored fp32, or int64 whose low 32 bits are the fp32
    bit pattern (the layout the NPU kernel takes)."""
    if t.dtype == torch.float32:
        return t
    if t.dtype != torch.int64:
        raise QuantizeError(f"glm5 quantize: deq_scale expected fp32 or int64, got {t.dtype}")
    low = t & 0xFFFFFFFF
    return (low - ((low & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def _per_channel(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """[n] or [n, 1] -> fp32 [n]; a per-group [n, G>1] tensor is an error naming ``name``."""
    if t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if tuple(t.shape) != (n,):
        raise QuantizeError(
            f"glm5 quantize: {name} has shape {list(t.shape)}, expected per-channel [{n}] or "
            f"[{n}, 1]: canonical w8a16/w8a8 are per-output-channel (per-group msModelSlim "
            f"scales have no canonical 8-bit equivalent)")
    return t.to(torch.float32)


def _per_tensor(name: str, t: torch.Tensor) -> float:
    if t.numel() != 1:
        raise QuantizeError(f"glm5 quantize: {name} expected one per-tensor value (shape [1]), "
                            f"got shape {list(t.shape)}")
    return float(t.reshape(()).to(torch.float64))


def convert_msmodelslim_linear(prefix: str, kind: str, get: Callable[[str], torch.Tensor | None],
                               clamp_min_code: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """One msModelSlim linear ``prefix`` of type ``kind`` (W8A16 | W8A8 | W8A8_DYNAMIC) ->
    canonical (codes int8 [n, k], weight scale fp32 [n], float bias fp32 [n] or None, number of
    -128 codes clamped). ``get(name)`` returns a tensor of the checkpoint or None.

    W8A16 / W8A8_DYNAMIC: ``w ≈ weight · weight_scale`` (symmetric: weight_offset must be 0).
    W8A8 static: ``y = (round(x/s_in + o_in)·Wᵀ + quant_bias) · deq_scale``; without the rounding
    this is ``x · (W · deq_scale/s_in)ᵀ + deq_scale · (quant_bias + o_in · Σ_k W[:, k])``, so the
    canonical weight scale is ``deq_scale / s_in`` and the float bias the second term.
    """
    w = get(f"{prefix}.weight")
    if w is None or w.dtype != torch.int8 or w.dim() != 2:
        got = "nothing" if w is None else f"{w.dtype} {list(w.shape)}"
        raise QuantizeError(f"glm5 quantize: {prefix}.weight ({kind}) expected int8 [n, k], "
                            f"got {got}")
    n = w.shape[0]
    low = int((w == -128).sum())
    if low:
        if not clamp_min_code:
            raise QuantizeError(
                f"glm5 quantize: {prefix}.weight has {low} code(s) -128; canonical int8 codes "
                f"are symmetric in [-127, 127]. Pass --clamp-int8 to clamp them to -127 (an "
                f"error of one quantization step on those weights)")
        w = w.clamp(min=-127)

    def need(aux: str) -> torch.Tensor:
        t = get(f"{prefix}.{aux}")
        if t is None:
            raise QuantizeError(f"glm5 quantize: {prefix}.{aux} missing ({kind} needs it)")
        return t

    bias = None
    if kind in ("W8A16", "W8A8_DYNAMIC"):
        scale = _per_channel(f"{prefix}.weight_scale", need("weight_scale"), n)
        off = get(f"{prefix}.weight_offset")
        if off is not None and bool((off != 0).any()):
            raise QuantizeError(
                f"glm5 quantize: {prefix}.weight_offset is nonzero (asymmetric weights); "
                f"canonical {MSMODELSLIM_TYPES[kind]} is symmetric, re-export with symmetric "
                f"quantization")
    elif kind == "W8A8":
        s_in = _per_tensor(f"{prefix}.input_scale", need("input_scale"))
        o_in = _per_tensor(f"{prefix}.input_offset", need("input_offset"))
        if not s_in > 0:
            raise QuantizeError(f"glm5 quantize: {prefix}.input_scale expected > 0, got {s_in}")
        dq = _per_channel(f"{prefix}.deq_scale", deq_scale_fp32(need("deq_scale")), n)
        qb = need("quant_bias")
        if tuple(qb.shape) != (n,):
            raise QuantizeError(f"glm5 quantize: {prefix}.quant_bias expected [{n}], got "
                                f"{list(qb.shape)}")
        dq64 = dq.to(torch.float64)
        scale = (dq64 / s_in).to(torch.float32)
        rowsum = w.to(torch.float64).sum(1)
        bias = (dq64 * (qb.to(torch.float64) + o_in * rowsum)).to(torch.float32)
    else:
        raise QuantizeError(f"glm5 quantize: {prefix}.weight has msModelSlim type {kind!r}; "
                            f"supported: {', '.join(MSMODELSLIM_TYPES)} and FLOAT")
    return w, scale, bias, low


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _float_dtype(cfg: dict, reader: _Reader, desc: dict) -> torch.dtype:
    """The dtype dequantized layers take: the config's, else that of the checkpoint's FLOAT
    tensors (read from the safetensors header, no data), else bf16."""
    named = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
    dt = named.get(str(cfg.get("torch_dtype") or cfg.get("dtype")))
    if dt is not None:
        return dt
    for name, f in reader.files.items():
        if desc.get(name, FLOAT) == FLOAT:
            with open_safetensors(f, "glm5 quantize") as h:
                dt = _ST_DTYPES.get(h.get_slice(name).get_dtype())
            if dt is not None:
                return dt
    return torch.bfloat16


def import_msmodelslim(src: str | Path, dst: str | Path,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES, clamp_min_code: bool = False,
                       log: Callable[[str], None] | None = None,
                       overwrite: bool = False) -> Summary:
    """Convert an msModelSlim checkpoint (``quant_model_description.json`` + safetensors) into
    glm5's format: W8A16 -> w8a16, W8A8 (static) and W8A8_DYNAMIC -> w8a8 (per-token dynamic
    activations; static W8A8's offsets and quant_bias become a float bias), FLOAT copied.
    Layers that glm5's quant_policy keeps in high precision are dequantized (to the config's
    dtype, else the dtype of the checkpoint's FLOAT tensors). ``dst`` is written atomically, as
    by `quantize_checkpoint`."""

    s = _source(src, dst)
    f = s / MSMODELSLIM_DESCRIPTION
    if not f.exists():
        raise QuantizeError(f"glm5 quantize: no {MSMODELSLIM_DESCRIPTION} in {s}")
    try:
        desc = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise QuantizeError(f"glm5 quantize: {f} is not valid JSON ({e.msg} at line "
                            f"{e.lineno})") from e
    cfg = json.loads((s / "config.json").read_text())
    reader = _Reader(source_files(s))  # opens (checks) every file before DST is touched
    with _output(dst, overwrite) as d, \
            progress.progress_bar(stored_bytes(reader.files), "import msModelSlim", "B") as bar:
        reader.bar = bar
        summary = _import_msmodelslim(s, d, desc, cfg, reader, max_shard_bytes, clamp_min_code)
    for line in summary.lines():
        (log or (lambda _x: None))(line)
    return summary


def _import_msmodelslim(s: Path, d: Path, desc: dict, cfg: dict, reader: _Reader,
                        max_shard_bytes: int, clamp_min_code: bool) -> Summary:
    """The body of `import_msmodelslim`, writing into the (temporary) directory ``d``."""
    present = set(reader.files)
    hp_dtype = _float_dtype(cfg, reader, desc)
    prefixes: dict[str, str] = {}
    for name, kind in desc.items():
        if name in present and kind != FLOAT and kind not in MSMODELSLIM_TYPES:
            raise QuantizeError(f"glm5 quantize: {name} has msModelSlim type {kind!r}; "
                                f"supported: {', '.join(MSMODELSLIM_TYPES)} and FLOAT")
        if not isinstance(kind, str) or kind == FLOAT or not name.endswith(".weight"):
            continue
        if name not in present:
            raise QuantizeError(f"glm5 quantize: {MSMODELSLIM_DESCRIPTION} names {name} "
                                f"({kind}), which no safetensors file holds")
        prefixes[name[: -len(".weight")]] = kind
    aux = {f"{p}.{a}": p for p in prefixes for a in _AUX}
    writer = _ShardWriter(d, max_shard_bytes)
    summary = Summary()

    def get(name: str) -> torch.Tensor | None:
        return reader(name) if name in present else None

    for name in reader.names_in_file_order():
        if name in aux:
            continue  # consumed with its weight
        t = reader(name)
        summary.bytes_before += _nbytes(t)
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix not in prefixes:
            if name.endswith(".bias") and name[: -len(".bias")] in prefixes \
                    and prefixes[name[: -len(".bias")]] == "W8A8":
                raise QuantizeError(f"glm5 quantize: {name} is a float bias beside a static "
                                    f"W8A8 quant_bias; it is ambiguous whether quant_bias "
                                    f"already folds it in")
            _keep(writer, name, t, summary)
            continue
        kind = prefixes[prefix]
        codes, scale, bias, clamped = convert_msmodelslim_linear(prefix, kind, get,
                                                                 clamp_min_code)
        summary.bytes_before += sum(_nbytes(reader(a)) for a, p in aux.items()
                                    if p == prefix and a in present)
        summary.clamped += clamped
        if bias is not None and not bool((bias != 0).any()):
            bias = None
        why = high_precision_reason(name)
        if why is not None or ".mlp.experts." in name and bias is not None:
            if why is None:
                raise QuantizeError(f"glm5 quantize: {prefix} is a routed expert with a nonzero "
                                    f"static-W8A8 offset/quant_bias; moe_experts_quant has no "
                                    f"bias (experts are expected as W8A8_DYNAMIC)")
            if bias is not None:
                raise QuantizeError(f"glm5 quantize: {prefix} is kept in high precision by glm5 "
                                    f"({why}) but its W8A8 conversion has a nonzero bias, which "
                                    f"this layer has no slot for")
            wf = (codes.to(torch.float32) * scale[:, None]).to(hp_dtype)
            _keep(writer, name, wf, summary)
            summary.kept -= 1
            summary.dequantized += 1
            continue
        scheme = MSMODELSLIM_TYPES[kind]
        _put_quantized(writer, name, codes, scale, scheme, summary, codes.numel())
        if bias is not None:
            _keep(writer, f"{prefix}.bias", bias, summary)
            summary.kept -= 1
    writer.close()
    _write_metadata(s, d, summary)
    return summary


# --------------------------------------------------------------------------- accuracy
def accuracy_batch(vocab_size: int, seed: int = 0, batch: int = 2, seq: int = 32) -> torch.Tensor:
    """The fixed token batch [batch, seq] accuracy is measured on."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


@torch.no_grad()
def logit_agreement(ref: torch.Tensor, test: torch.Tensor) -> dict[str, float]:
    """Mean per-token cosine similarity of logits [.., V] and top-1 agreement (fraction)."""
    r = ref.reshape(-1, ref.shape[-1]).to(torch.float64)
    t = test.reshape(-1, test.shape[-1]).to(torch.float64)
    cos = torch.nn.functional.cosine_similarity(r, t, dim=-1)
    return {"cosine": float(cos.mean()),
            "top1": float((r.argmax(-1) == t.argmax(-1)).to(torch.float64).mean())}


def checkpoint_params(path: str | Path) -> int:
    """Parameters stored in an unquantized checkpoint directory."""
    n = 0
    for name, f in source_files(Path(path)).items():
        with open_safetensors(f, "glm5 quantize") as h:
            shape = h.get_slice(name).get_shape()
        n += int(torch.tensor(shape).prod()) if shape else 1
    return n


def evaluate_scheme(model: torch.nn.Module, workdir: str | Path, scheme: str,
                    ids: torch.Tensor) -> dict[str, float]:
    """Save the fp32 ``model``, quantize it with ``scheme``, load it and compare logits on
    ``ids``: cosine, top1, bytes/param of the quantized tensors and of the whole model."""
    w = Path(workdir)
    src, dst = w / "fp32", w / scheme
    if not (src / "config.json").exists():
        model.save_pretrained(src)
    summary = quantize_checkpoint(src, dst, scheme)
    q = load_model(dst).eval()
    with torch.no_grad():
        ref = model(ids)
        out = q(ids)
    res = logit_agreement(ref, out)
    params = checkpoint_params(src)
    res["bytes_per_param"] = summary.bytes_quantized / max(summary.params_quantized, 1)
    res["model_bytes_per_param"] = summary.bytes_after / params
    res["quantized_fraction"] = summary.params_quantized / params
    return res
