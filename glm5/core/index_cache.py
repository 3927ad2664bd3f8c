"""The indexer's key cache of one layer: rows of index_head_dim values in the model's dtype, or
(``dsa_indexer_dtype = "fp8"`` in the paged engine) DeepSeek-V3.2's fp8 form, `FP8Keys`: each
key row stored once, when its token is written, as e4m3 codes and one fp32 power-of-two scale
(`glm5.ir.fp8`), index_head_dim + 4 bytes a row instead of 2 x index_head_dim in bf16.

The keys are cast to the model's dtype before they are quantized, so the codes are the ones
``indexer_topk_fp8`` makes from a bf16 cache of the same keys: the paged engine and the flat
``generate`` path select the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.ir.fp8 import quantize_rows_e4m3

#: bytes of the one fp32 scale each row of the fp8 index cache carries
FP8_KEY_SCALE_BYTES = 4


def index_key_row_bytes(width: int, element_bytes: int, fp8: bool) -> int:
    """Bytes one indexer key row of ``width`` values takes: ``width`` e4m3 codes and an fp32
    scale in the fp8 index cache (``fp8``), else ``width`` elements of ``element_bytes``."""
    return width + FP8_KEY_SCALE_BYTES if fp8 else width * element_bytes


@dataclass
class FP8Keys:
    """codes [rows, Di] float8_e4m3fn, scale [rows] fp32 (0 on rows never written); ``dtype``:
    the model's dtype, the keys' rounding before quantization."""

    codes: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def zeros(cls, rows: int, width: int, dtype: torch.dtype,
              device: torch.device | str) -> "FP8Keys":
        return cls(torch.zeros(rows, width, dtype=torch.float8_e4m3fn, device=device),
                   torch.zeros(rows, dtype=torch.float32, device=device), dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale]

    @staticmethod
    def row_bytes(width: int) -> int:
        """Bytes one key row takes: its codes and its scale."""
        return index_key_row_bytes(width, 1, fp8=True)


IndexKeys = torch.Tensor | FP8Keys


def new_index_keys(rows: int, width: int, dtype: torch.dtype, device: torch.device | str,
                   fp8: bool) -> IndexKeys:
    """A zeroed key cache of ``rows`` rows: `FP8Keys` when ``fp8``, else a [rows, width]
    tensor of ``dtype``."""
    if fp8:
        return FP8Keys.zeros(rows, width, dtype, device)
    return torch.zeros(rows, width, dtype=dtype, device=device)


def write_index_keys(cache: IndexKeys, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """cache[slots] = keys [N, Di] (quantized per row for `FP8Keys`), in place."""
    s = slots.long()
    if isinstance(cache, FP8Keys):
        codes, scale = quantize_rows_e4m3(keys.to(cache.dtype))
        cache.codes[s] = codes
        cache.scale[s] = scale
    else:
        cache[s] = keys.to(cache.dtype)


def index_keys_tensors(cache: IndexKeys | None) -> list[torch.Tensor]:
    """The tensors holding ``cache`` (none for a layer without an indexer)."""
    if cache is None:
        return []
    return cache.tensors() if isinstance(cache, FP8Keys) else [cache]
