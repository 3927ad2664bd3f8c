"""Coarse-to-fine DSA selection (glm5 option, `dsa_selection = "block"`; not in the published
GLM-5): key blocks of `dsa_block_size` tokens are scored by their mean-pooled indexer key with
the Lightning Indexer, the query's own (partial) block plus the `dsa_block_topk - 1` best
complete earlier blocks are kept, and the token-level top-k is taken inside the kept blocks.

Block scoring and the block top-k run through glm5.ops; the token scores inside the kept blocks
are computed here, a chunk of queries at a time, so memory is bounded by
chunk x dsa_block_topk x dsa_block_size — never by the context length.
"""

from __future__ import annotations

import torch

from glm5 import ops

QUERY_CHUNK = 64


def pooled_keys(keys: torch.Tensor, max_len: int, block: int) -> torch.Tensor:
    """Mean of each block of `block` rows within each sequence: [B * ceil(max_len/block), Di]."""
    S, Di = keys.shape
    B = S // max_len
    nb = -(-max_len // block)
    pad = nb * block - max_len
    k = keys.view(B, max_len, Di).float()
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))
    return k.view(B, nb, block, Di).mean(2).reshape(B * nb, Di).to(keys.dtype)


def block_select(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, k_start: torch.Tensor,
                 k_end: torch.Tensor, max_len: int, block: int, n_blocks: int,
                 topk: int) -> torch.Tensor:
    """q [N, Hi, Di] (roped), w [N, Hi] fp32, keys [B*max_len, Di] -> idx [N, topk] int32."""
    N = q.shape[0]
    dev = q.device
    nb = -(-max_len // block)
    seq = (k_start // max_len).long()  # sequence of each query
    pos = (k_end - 1 - k_start).long()  # position of each query in its sequence
    own = pos // block
    # 1. score the complete earlier blocks of each query's sequence, keep the best n_blocks - 1
    kept = torch.empty(N, 0, dtype=torch.long, device=dev)
    if n_blocks > 1:
        pk = pooled_keys(keys, max_len, block)
        bs = (seq * nb).to(torch.int32)
        be = (seq * nb + own).to(torch.int32)
        sel = ops.topk_indices(ops.lightning_indexer(q, pk, w, bs, be), n_blocks - 1).long()
        kept = torch.where(sel >= 0, sel - (seq * nb)[:, None], sel)  # block ids in the sequence
    blocks = torch.cat((own[:, None], kept), 1)  # [N, n_blocks], -1 = none
    # 2. candidate rows of the kept blocks (own block: only up to the query itself)
    off = torch.arange(block, device=dev)
    local = blocks[:, :, None] * block + off  # [N, nbk, block] positions in the sequence
    ok = (blocks[:, :, None] >= 0) & (local <= pos[:, None, None]) & (local < max_len)
    cand = torch.where(ok, local + (seq * max_len)[:, None, None], -1).reshape(N, -1)
    # 3. token-level top-k inside the candidates
    out = torch.full((N, topk), -1, dtype=torch.int32, device=dev)
    for a in range(0, N, QUERY_CHUNK):
        c = cand[a : a + QUERY_CHUNK]
        kc = keys[c.clamp(min=0)].float()  # [n, C, Di]
        s = torch.einsum("nhd,ncd->nhc", q[a : a + QUERY_CHUNK].float(), kc).relu()
        s = torch.einsum("nhc,nh->nc", s, w[a : a + QUERY_CHUNK].float())
        s = s.masked_fill(c < 0, float("-inf"))
        pick = ops.topk_indices(s, topk).long()
        rows = torch.gather(c, 1, pick.clamp(min=0))
        out[a : a + QUERY_CHUNK] = torch.where(pick >= 0, rows, -1).to(torch.int32)
    return out
