"""One forward of the model over a step's items on the paged cache: the tensors of the step
(token ids, positions, physical slots, block tables) and the model calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.core.model import GLM5ForCausalLM
from glm5.engine.kv_pool import KVPool
from glm5.engine.scheduler import Item


@dataclass
class Batch:
    """A step's N tokens, flattened: item i owns rows offsets[i] .. offsets[i + 1] - 1."""

    ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    seq: torch.Tensor  # [N] int32: the item (block table row) of each token
    block_table: torch.Tensor  # [B, P] int32
    offsets: list[int]

    def slots(self, positions: torch.Tensor, seq: torch.Tensor, page_size: int) -> torch.Tensor:
        """Physical rows of logical ``positions`` of the items ``seq``."""
        page = self.block_table[seq.long(), positions // page_size].long()
        return page * page_size + positions % page_size


def make_batch(items: list[Item], device: torch.device) -> Batch:
    ids: list[int] = []
    pos: list[int] = []
    seq: list[int] = []
    offsets = [0]
    for i, it in enumerate(items):
        n = len(it.tokens)
        ids += it.tokens
        pos += range(it.start, it.start + n)
        seq += [i] * n
        offsets.append(offsets[-1] + n)
    width = max(len(it.req.pages) for it in items)
    table = torch.full((len(items), width), -1, dtype=torch.int32)
    for i, it in enumerate(items):
        table[i, : len(it.req.pages)] = torch.tensor(it.req.pages, dtype=torch.int32)
    return Batch(torch.tensor(ids, dtype=torch.long, device=device),
                 torch.tensor(pos, dtype=torch.long, device=device),
                 torch.tensor(seq, dtype=torch.int32, device=device), table.to(device), offsets)


class ModelRunner:
    def __init__(self, model: GLM5ForCausalLM, pool: KVPool) -> None:
        self.model, self.pool = model, pool
        self.ps = pool.page_size

    def _step(self, batch: Batch, positions: torch.Tensor, seq: torch.Tensor):
        slots = batch.slots(positions, seq, self.ps)
        return self.model.paged_step(positions, slots, batch.block_table, seq, self.ps)

    @torch.no_grad()
    def forward(self, batch: Batch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model over the batch: (logits [len(rows), V] fp32 of the given rows, the
        normed final hidden states [N, D] of every row — what the MTP layer consumes)."""
        st = self._step(batch, batch.positions, batch.seq)
        h = self.model.hidden_states_paged(batch.ids, st, self.pool.latent, self.pool.index_keys)
        hn = self.model.model.norm(h)
        logits = torch.nn.functional.linear(hn[rows], self.model.lm_head.weight)
        return logits.float(), hn

    @torch.no_grad()
    def mtp(self, batch: Batch, hidden: torch.Tensor, next_ids: torch.Tensor,
            positions: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor, depth: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer ``depth`` at ``positions`` (its own pool, the same pages): (logits of
        ``rows`` [len(rows), V] fp32, the layer's output hidden states [N', D])."""
        st = self._step(batch, positions, seq)
        h = self.model.mtp_paged(hidden, next_ids, st, self.pool.mtp_latent[depth],
                                 self.pool.mtp_index_keys[depth], depth)
        return self.model.mtp_head(h[rows], depth).float(), h
