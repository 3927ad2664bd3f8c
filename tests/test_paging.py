"""The paged layout's one definition (glm5.ir.paging.pool_rows), by hand."""

from __future__ import annotations

import torch

from glm5.ir.paging import pool_rows


def test_pool_rows_by_hand():
    bt = torch.tensor([[3, 0, -1], [1, 2, 4]], dtype=torch.int32)  # 2 sequences, 3 pages of 4
    j = torch.arange(9)
    # sequence 0: page 3 -> rows 12..15, page 0 -> 0..3, page -1 -> negative (unallocated)
    assert pool_rows(bt, 0, j, 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, -4]
    assert pool_rows(bt, 1, j, 4).tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 16]
    # per-token sequences (the engine's slot writes) and a [N, W] grid (paged attention)
    seq = torch.tensor([1, 0, 1], dtype=torch.int32)
    pos = torch.tensor([5, 1, 8])
    assert pool_rows(bt, seq, pos, 4).tolist() == [9, 13, 16]
    grid = pool_rows(bt, seq[:, None], torch.arange(3), 4)
    assert grid.tolist() == [[4, 5, 6], [12, 13, 14], [4, 5, 6]] and grid.dtype == torch.int64
