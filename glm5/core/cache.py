"""The KV cache: per layer an MLA latent cache [B * max_len, kv_lora_rank + qk_rope_head_dim]
and, on layers that run the indexer, an indexer key cache [B * max_len, index_head_dim].

Rows are flat ("TND"): sequence b owns rows [b * max_len, (b + 1) * max_len). All sequences of a
batch advance together (equal lengths, no padding).
"""

from __future__ import annotations

import torch

from glm5.core.config import GLM5Config


class KVCache:
    def __init__(self, cfg: GLM5Config, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", n_layers: int | None = None,
                 indexer_layers: list[bool] | None = None) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"glm5 KVCache: batch and max_len expected >= 1, got {batch}, "
                             f"{max_len}")
        n = cfg.num_hidden_layers if n_layers is None else n_layers
        has_idx = indexer_layers or [t == "full" for t in cfg.indexer_types]
        rows = batch * max_len
        self.batch, self.max_len, self.length = batch, max_len, 0
        self.latent = [torch.zeros(rows, cfg.kv_cache_dim, dtype=dtype, device=device)
                       for _ in range(n)]
        self.index_keys = [
            torch.zeros(rows, cfg.index_head_dim, dtype=dtype, device=device) if has_idx[i]
            else None for i in range(n)
        ]

    def positions(self, T: int) -> torch.Tensor:
        """Positions of the next T tokens of every sequence: [B, T]."""
        if self.length + T > self.max_len:
            raise ValueError(f"glm5 KVCache: {self.length} cached + {T} new tokens exceed "
                             f"max_len={self.max_len}")
        dev = self.latent[0].device
        return (self.length + torch.arange(T, device=dev)).expand(self.batch, T)

    def layout(self, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [B*T], slots [B*T], k_start [B*T], k_end [B*T]) for T new tokens per
        sequence: causal key ranges over the flat rows."""
        pos = self.positions(T)
        dev = pos.device
        base = (torch.arange(self.batch, device=dev) * self.max_len)[:, None].expand_as(pos)
        slots = (base + pos).reshape(-1).to(torch.int32)
        k_start = base.reshape(-1).to(torch.int32)
        return pos.reshape(-1), slots, k_start, slots + 1

    def advance(self, T: int) -> None:
        self.length += T

    def rollback(self, n: int) -> None:
        """Forget the last n tokens (rejected drafts); their rows are overwritten later."""
        if not 0 <= n <= self.length:
            raise ValueError(f"glm5 KVCache: cannot roll back {n} of {self.length} tokens")
        self.length -= n

    def nbytes(self) -> int:
        ts = [t for t in self.latent + self.index_keys if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)
