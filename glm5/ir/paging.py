"""The paged cache layout, defined once: a cache is a pool of pages of ``page_size`` rows, and
sequence b's logical position j lives in pool row

    block_table[b, j // page_size] * page_size + j % page_size

(`pool_rows`). The op contract (paged_indexer_topk, its references and kernels), the model's
paged attention (`glm5.core.attention.Pages`) and the serving engine's slot writes
(`glm5.engine.cache_manager.CacheManager.slot_rows`) all take rows from here.
"""

from __future__ import annotations

import torch


def pool_rows(block_table: torch.Tensor, seq: torch.Tensor | int, j: torch.Tensor,
              page_size: int) -> torch.Tensor:
    """int64 pool rows of logical positions ``j`` of the sequences ``seq`` (rows of
    ``block_table`` [B, P] int32; an int, or a tensor broadcasting with ``j``: e.g. seq [N, 1]
    and j [W] give [N, W]). A page id of -1 (not allocated) gives a negative row: callers mask
    positions past a sequence's length."""
    s = seq.long() if isinstance(seq, torch.Tensor) else seq
    j = j.long()
    return block_table.long()[s, j // page_size] * page_size + j % page_size
