"""Shared argument checks and layout helpers of the torch_npu contract emulators
(:mod:`glm5.backends.ascend.contract`).

``fail`` / ``req`` / ``tensor`` raise ``ValueError("contract.<op>: argument 'x' expected ...,
got ...")`` so a binding that breaks a documented contract fails with the op and argument named.
The layout helpers turn the attention ops' documented layouts (TND with prefix-sum lengths, BSND
with per-batch counts, PA_BSND paged through a block table) into per-batch query offsets and
request-local key rows, and ``causal_limit`` is the rightDownCausal mask (sparse_mode 3) shared by
the lightning indexer and sparse flash attention.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

I64_MAX = 2**63 - 1
POW2_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def fail(op: str, arg: str, expected: str, got: Any) -> None:
    raise ValueError(f"contract.{op}: argument {arg!r} expected {expected}, got {got}")


def req(cond: bool, op: str, arg: str, expected: str, got: Any) -> None:
    if not cond:
        fail(op, arg, expected, got)


def tensor(op: str, arg: str, t: Any, dims: Sequence[int] | int | None = None,
            dtypes: Sequence[torch.dtype] | None = None, contiguous: bool = False,
            nonempty: bool = True) -> torch.Tensor:
    req(isinstance(t, torch.Tensor), op, arg, "a tensor", type(t).__name__)
    if dims is not None:
        ds = (dims,) if isinstance(dims, int) else tuple(dims)
        req(t.dim() in ds, op, arg, f"a {'/'.join(map(str, ds))}-D tensor", list(t.shape))
    if dtypes is not None:
        req(t.dtype in dtypes, op, arg, f"dtype in {[str(d) for d in dtypes]}", t.dtype)
    if contiguous:
        req(t.is_contiguous(), op, arg, "a contiguous tensor (the op rejects non-contiguous "
             "input)", f"strides {t.stride()}")
    if nonempty:
        req(t.numel() > 0, op, arg, "a non-empty tensor", list(t.shape))
    return t


def ints(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.reshape(-1).tolist()]


def block_size_ok(op: str, arg: str, bs: int) -> None:
    # LI/SFA/MLA-prolog docs: block_size a multiple of 16, at most 1024.
    req(bs % 16 == 0 and 16 <= bs <= 1024, op, arg,
         "a block_size (dim 1) that is a multiple of 16 and <= 1024", bs)


def seq_lengths(op: str, arg: str, t: torch.Tensor | None, B: int | None, prefix: bool,
                 ) -> list[int] | None:
    """Per-batch lengths from ``actual_seq_lengths_*`` (int32 [B]); prefix sums for TND."""
    if t is None:
        return None
    tensor(op, arg, t, 1, (torch.int32,))
    v = ints(t)
    if B is not None:
        req(len(v) == B, op, arg, f"length B={B}", len(v))
    req(all(x >= 0 for x in v), op, arg, "non-negative entries", v)
    if not prefix:
        return v
    req(all(b >= a for a, b in zip(v, v[1:])), op, arg,
         "a non-decreasing prefix sum (TND layout)", v)
    return [b - a for a, b in zip([0] + v[:-1], v)]


def split_q(op: str, layout: str, q: torch.Tensor, act_q: torch.Tensor | None,
             arg: str = "actual_seq_lengths_query") -> list[tuple[int, int]]:
    """(row offset into the flattened [T, ...] view, length) per batch for a query tensor."""
    if layout == "TND":
        req(act_q is not None, op, arg, "a tensor (required when layout_query is TND)", None)
        lens = seq_lengths(op, arg, act_q, None, prefix=True)
        assert lens is not None
        req(sum(lens) <= q.shape[0], op, arg, f"a last prefix sum <= T={q.shape[0]}", sum(lens))
        out, off = [], 0
        for n in lens:
            out.append((off, n))
            off += n
        return out
    B, S1 = q.shape[0], q.shape[1]
    lens = seq_lengths(op, arg, act_q, B, prefix=False) or [S1] * B
    req(all(n <= S1 for n in lens), op, arg, f"entries <= S1={S1}", lens)
    return [(b * S1, n) for b, n in enumerate(lens)]


def kv_rows(op: str, layout: str, key: torch.Tensor, act_kv: torch.Tensor | None,
             block_table: torch.Tensor | None, B: int, arg: str) -> list[torch.Tensor]:
    """Per batch, the key rows [S2_b, N2, D] in request-local order (PA_BSND via block_table)."""
    if layout == "PA_BSND":
        req(act_kv is not None, op, arg, "a tensor (required when the key layout is PA_BSND)",
             None)
        req(block_table is not None, op, "block_table", "a tensor (required for PA_BSND)", None)
        tensor(op, "block_table", block_table, 2, (torch.int32,))
        req(block_table.shape[0] == B, op, "block_table", f"B={B} rows", list(block_table.shape))
        lens = seq_lengths(op, arg, act_kv, B, prefix=False)
        assert lens is not None
        nb, bs = key.shape[0], key.shape[1]
        block_size_ok(op, "key", bs)
        need = max((math.ceil(n / bs) for n in lens), default=0)
        req(block_table.shape[1] >= need, op, "block_table",
             f"at least ceil(max S2 / block_size)={need} columns", block_table.shape[1])
        flat = key.reshape(nb * bs, *key.shape[2:])
        rows = []
        for b, n in enumerate(lens):
            blocks = ints(block_table[b, : math.ceil(n / bs)])
            req(all(0 <= i < nb for i in blocks), op, "block_table",
                 f"block ids in [0, {nb})", blocks)
            pos = torch.arange(n)
            phys = torch.tensor(blocks, dtype=torch.long)[pos // bs] * bs + pos % bs \
                if n else pos
            rows.append(flat[phys])
        return rows
    if layout == "TND":
        req(act_kv is not None, op, arg, "a tensor (required when the key layout is TND)", None)
        lens = seq_lengths(op, arg, act_kv, B, prefix=True)
        assert lens is not None
        req(sum(lens) <= key.shape[0], op, arg, f"a last prefix sum <= T2={key.shape[0]}",
             sum(lens))
        out, off = [], 0
        for n in lens:
            out.append(key[off: off + n])
            off += n
        return out
    req(key.shape[0] == B, op, "key", f"batch B={B} in BSND layout", list(key.shape))
    S2 = key.shape[1]
    lens = seq_lengths(op, arg, act_kv, B, prefix=False) or [S2] * B
    req(all(n <= S2 for n in lens), op, arg, f"entries <= S2={S2}", lens)
    return [key[b, :n] for b, n in enumerate(lens)]


def causal_limit(sparse_mode: int, n_q: int, n_k: int, i: int) -> int:
    """Keys j < limit are visible to query i of a batch. rightDownCausal (sparse_mode 3):
    j <= (L_kv - L_q) + i (ops-transformer torchapi_sparse_flash_attention.md; the
    lightning_indexer golden masks j >= L_kv - L_q + i + 1)."""
    if sparse_mode == 3:
        return max(0, min(n_k, n_k - n_q + i + 1))
    return n_k


def stable_desc_order(x: torch.Tensor) -> torch.Tensor:
    # Stable sort of -x: equal scores keep ascending index order (ties -> smaller index).
    return torch.sort(x, descending=True, stable=True).indices
