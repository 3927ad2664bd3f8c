"""Shared by the paged_indexer_topk tests (reference, TVM, Triton): the op's defining property
computed independently of the code under test, and integer-valued inputs with exact scores.

``unpaged_then_mapped`` gathers each query's logical keys with a plain Python loop over its
block-table row (not glm5.ir's compaction helpers), runs an ``indexer_topk`` implementation on
them with ``k_start = 0, k_end = k_len[t]`` and maps the logical indices to pool rows."""

from __future__ import annotations

from typing import Any, Callable

import torch

PARAMS = ("q", "k", "w", "block_table", "seq", "k_len", "page_size", "topk")


def args(values: dict[str, Any]) -> tuple:
    return tuple(values[n] for n in PARAMS)


def logical_rows(table_row: list[int], page_size: int, n: int) -> list[int]:
    """Pool rows of logical keys 0 .. n-1 of a sequence whose block-table row is ``table_row``."""
    return [table_row[j // page_size] * page_size + j % page_size for j in range(n)]


def unpaged_then_mapped(indexer_topk: Callable[..., torch.Tensor],
                        values: dict[str, Any]) -> torch.Tensor:
    """[T, topk] int32 (on the CPU): per query, ``indexer_topk`` over its sequence's keys in
    logical order, each selected logical index replaced by its pool row."""
    q, k, w = values["q"], values["k"], values["w"]
    table = values["block_table"].cpu().tolist()
    seq, k_len = values["seq"].cpu().tolist(), values["k_len"].cpu().tolist()
    ps, topk = values["page_size"], values["topk"]
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    for t, (b, n) in enumerate(zip(seq, k_len)):
        if n == 0:
            continue
        rows = logical_rows(table[b], ps, n)
        keys = k[torch.tensor(rows, device=k.device)]
        zero = torch.zeros(1, dtype=torch.int32, device=q.device)
        got = indexer_topk(q[t:t + 1], keys, w[t:t + 1], zero, zero + n, topk)[0].cpu()
        out[t] = torch.tensor([rows[j] if j >= 0 else -1 for j in got.tolist()],
                              dtype=torch.int32)
    return out


def integer_valued(values: dict[str, Any], seed: int) -> dict[str, Any]:
    """``values`` with q, k in {-1, 0, 1} and w in {1, 2} (same shapes, dtypes, devices): every
    score is an exact small integer in any summation order, with many exact ties, so any correct
    kernel's order is exactly the reference's (ties to the smaller logical position)."""
    g = torch.Generator().manual_seed(seed)
    out = dict(values)
    for name, lo, hi in (("q", -1, 2), ("k", -1, 2), ("w", 1, 3)):
        x = values[name]
        out[name] = torch.randint(lo, hi, x.shape, generator=g).to(x.dtype).to(x.device)
    return out
