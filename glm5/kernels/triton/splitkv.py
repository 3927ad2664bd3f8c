"""Split-KV for the attention kernels (host side): how many ranges a query's keys are cut into,
the partial buffers, and the merge.

A prefill has thousands of query rows, enough programs for every SM; a decode step has one
query per sequence (a single program block for the whole GPU at batch 1). When an attention
grid is short of about ``TARGET_PROGRAMS`` programs, its keys are cut into SPLIT ranges of
whole key blocks (the rule token_logprobs and the quant GEMV use, `launch.split_for_target`;
no range below ``SPLIT_MIN_KEYS`` keys, since each range's partial out has to be written and
read back). Each program writes its range's normalized out and lse in fp32 into
``[SPLIT, T, H, Dv]`` / ``[SPLIT, T, H]`` buffers, and ``splitkv_combine_kernel`` merges them by
their lse (``_splitkv_kernels``). Tuning keys of the op's entry: ``TARGET_PROGRAMS``,
``TARGET_PROGRAMS_INTERPRETED`` (the interpreter runs programs one after another: 0, never
split), ``SPLIT_MIN_KEYS``, ``SPLIT_K`` (forces a count), ``COMBINE_BLOCK_DV`` and
``combine_num_warps``.

No triton import here (the kernels are imported on the first launch).
"""

from __future__ import annotations

from typing import Any

import torch

from glm5.kernels.triton.launch import (cdiv, interpreted, launch, launch_opts, next_pow2,
                                        split_for_target)

# The tuning keys every split-KV op's DEFAULTS entry carries (values for an H100/H200).
DEFAULTS: dict[str, Any] = {
    # split until about this many programs run (2 per H100/H200 SM); 0 = never split
    "TARGET_PROGRAMS": 264,
    "TARGET_PROGRAMS_INTERPRETED": 0,
    # no range takes fewer keys: GLM-5's [64 heads, 512] fp32 partial (128 KiB) is about the
    # bytes of 114 gathered 576-wide bf16 rows
    "SPLIT_MIN_KEYS": 128,
    "COMBINE_BLOCK_DV": 512, "combine_num_warps": 4,
}


def split_keys(p: dict[str, Any], blocks: int, keys: int, block_k: int) -> tuple[int, int]:
    """(SPLIT, keys per split) for ``blocks`` programs per split over ``keys`` keys walked in
    ``block_k`` blocks under tuning p: ``SPLIT_K`` when given, else about ``TARGET_PROGRAMS``
    programs (``TARGET_PROGRAMS_INTERPRETED`` under the interpreter) with at least
    ``SPLIT_MIN_KEYS`` keys per split; no split is left empty. Keys per split is a whole number
    of blocks."""
    chunks = max(1, cdiv(keys, block_k))
    forced = p.get("SPLIT_K")
    if forced is not None:
        split, per = split_for_target(blocks, chunks, 0, int(forced))
    else:
        key = "TARGET_PROGRAMS_INTERPRETED" if interpreted() else "TARGET_PROGRAMS"
        split, per = split_for_target(blocks, chunks, int(p.get(key, 0)))
        most = max(1, chunks // max(1, cdiv(int(p.get("SPLIT_MIN_KEYS", 0)), block_k)))
        if split > most:
            split, per = split_for_target(blocks, chunks, 0, most)
    return split, per * block_k


def partials(split: int, out: torch.Tensor, lse: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(out buffer, lse buffer, split stride of each) for a kernel writing ``split`` ranges:
    the op's own ``out`` [T, H, Dv] / ``lse`` [T, H] with stride 0 for one split, else fresh
    contiguous fp32 ``[split, T, H, Dv]`` / ``[split, T, H]``."""
    if split == 1:
        return out, lse, 0, 0
    T, H, Dv = out.shape
    po = torch.empty((split, T, H, Dv), dtype=torch.float32, device=out.device)
    pl = torch.empty((split, T, H), dtype=torch.float32, device=out.device)
    return po, pl, T * H * Dv, T * H


def merge(p: dict[str, Any], op: str, po: torch.Tensor, pl: torch.Tensor, out: torch.Tensor,
          lse: torch.Tensor) -> None:
    """Merge the partials of `partials` into ``out`` / ``lse`` (a no-op for one split)."""
    if po is out:
        return
    # lazy: optional dependency: _splitkv_kernels imports triton (on the first launch)
    from glm5.kernels.triton import _splitkv_kernels

    split, T, H, Dv = po.shape
    cdv = max(16, min(next_pow2(max(Dv, 1)), next_pow2(int(p.get("COMBINE_BLOCK_DV", 512)))))
    launch(_splitkv_kernels.splitkv_combine_kernel, (T, H), p, op,
           po, pl, out, lse, T, H, Dv, split, out.stride(0), out.stride(1), out.stride(2),
           lse.stride(0), lse.stride(1), BLOCK_DV=cdv,
           **launch_opts(p, "combine_", num_warps=4))
