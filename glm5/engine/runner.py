"""One forward of the model over a step's items on the paged cache: the tensors of the step
(token ids, positions, physical slots, block tables) and the model calls. A pure decode step
may be replayed from a captured CUDA graph instead (glm5.engine.graphs). The pools, the page
size and the slot rows come from the engine's cache manager (glm5.engine.cache_manager)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.core.model import GLM5ForCausalLM
from glm5.engine.cache_manager import CacheManager
from glm5.engine.graphs import DecodeGraphs
from glm5.engine.kv_pool import KVPool
from glm5.engine.scheduler import Item


@dataclass
class Batch:
    """A step's N tokens, flattened: item i owns rows offsets[i] .. offsets[i + 1] - 1.
    ``max_range`` is max(positions) + 1, known on the host (None: read from ``positions``)."""

    ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    seq: torch.Tensor  # [N] int32: the item (block table row) of each token
    block_table: torch.Tensor  # [B, P] int32
    offsets: list[int]
    max_range: int | None = None


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
                 torch.tensor(seq, dtype=torch.int32, device=device), table.to(device), offsets,
                 max(pos) + 1)


class ModelRunner:
    """The model's forwards over the pools of ``cache`` (a `CacheManager` with a pool).
    ``graphs``: captured decode steps (None: every step runs eager)."""

    def __init__(self, model: GLM5ForCausalLM, cache: CacheManager,
                 graphs: DecodeGraphs | None = None) -> None:
        if cache.pool is None:
            raise ValueError("glm5 ModelRunner: argument 'cache' expected a CacheManager with "
                             "a pool (built with the model)")
        self.model, self.cache = model, cache
        self.graphs = graphs

    @property
    def pool(self) -> KVPool:
        return self.cache.pool

    def _step(self, block_table: torch.Tensor, positions: torch.Tensor, seq: torch.Tensor,
              max_range: int | None):
        slots = self.cache.slot_rows(block_table, seq, positions)
        return self.model.paged_step(positions, slots, block_table, seq, self.cache.page_size,
                                     max_range)

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, seq: torch.Tensor,
                block_table: torch.Tensor, max_range: int | None) -> torch.Tensor:
        """The normed final hidden states [N, D] of the main model over N tokens."""
        st = self._step(block_table, positions, seq, max_range)
        h = self.model.hidden_states_paged(ids, st, self.pool.latent, self.pool.index_keys)
        return self.model.model.norm(h)

    @torch.no_grad()
    def main(self, ids: torch.Tensor, positions: torch.Tensor, seq: torch.Tensor,
             block_table: torch.Tensor, max_range: int | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model over N tokens: (logits [N, V] fp32 of every row, normed final hidden
        [N, D]). What a decode graph captures (`DecodeGraphs`)."""
        hn = self._hidden(ids, positions, seq, block_table, max_range)
        return torch.nn.functional.linear(hn, self.model.lm_head.weight).float(), hn

    @torch.no_grad()
    def forward(self, batch: Batch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model over the batch: (logits [len(rows), V] fp32 of the given rows, the
        normed final hidden states [N, D] of every row — what the MTP layer consumes)."""
        hn = self._hidden(batch.ids, batch.positions, batch.seq, batch.block_table,
                          batch.max_range)
        logits = torch.nn.functional.linear(hn[rows], self.model.lm_head.weight)
        return logits.float(), hn

    def decode(self, items: list[Item]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A pure decode step (each item one token, sampled) from a captured graph: (logits
        [len(items), V] fp32, normed hidden [len(items), D]); None when it runs eager."""
        if self.graphs is None or not all(len(it.tokens) == 1 and it.sample for it in items):
            return None
        return self.graphs.run([it.tokens[0] for it in items], [it.start for it in items],
                               [it.req.pages for it in items])

    @torch.no_grad()
    def mtp(self, batch: Batch, hidden: torch.Tensor, next_ids: torch.Tensor,
            positions: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor, depth: int = 0,
            max_range: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer ``depth`` at ``positions`` (its own pool, the same pages): (logits of
        ``rows`` [len(rows), V] fp32, the layer's output hidden states [N', D]).
        ``max_range``: max(positions) + 1 when the caller knows it (None reads it)."""
        st = self._step(batch.block_table, positions, seq, max_range)
        h = self.model.mtp_paged(hidden, next_ids, st, self.pool.mtp_latent[depth],
                                 self.pool.mtp_index_keys[depth], depth)
        return self.model.mtp_head(h[rows], depth).float(), h
