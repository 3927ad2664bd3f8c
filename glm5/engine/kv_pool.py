"""The serving engine's paged cache: per layer a pool of pages for the MLA latent
([num_pages * page_size, kv_lora_rank + qk_rope_head_dim]) and, on layers that run the
indexer, the indexer keys ([num_pages * page_size, index_head_dim]); the MTP layers get pools
of their own, addressed by the same page ids (a token's MTP entry lives in the same page as its
main-model entries). Beyond the pages the allocator hands out, the pool holds scratch pages
(enough for ``scratch_rows`` rows) that no request owns: the padded rows of a captured decode
graph write and read them (glm5.engine.graphs)."""

from __future__ import annotations

import torch

from glm5.core.model import GLM5ForCausalLM


class KVPool:
    """Page pools of one model. Page p holds rows [p * page_size, (p + 1) * page_size);
    pages 0 .. num_pages - 1 are the requests', ``scratch_pages`` (the next
    ``scratch_page_count(scratch_rows, page_size)``) no request's."""

    def __init__(self, model: GLM5ForCausalLM, num_pages: int, page_size: int,
                 mtp: bool = False, scratch_rows: int = 1) -> None:
        if num_pages < 1 or page_size < 1 or scratch_rows < 0:
            raise ValueError(f"glm5 KVPool: num_pages and page_size expected >= 1 and "
                             f"scratch_rows >= 0, got {num_pages}, {page_size}, {scratch_rows}")
        cfg = model.config
        n_scratch = self.scratch_page_count(scratch_rows, page_size)
        rows = (num_pages + n_scratch) * page_size
        dt, dev = model.dtype, model.device
        self.num_pages, self.page_size = num_pages, page_size
        self.scratch_pages = list(range(num_pages, num_pages + n_scratch))

        def pool(width: int) -> torch.Tensor:
            return torch.zeros(rows, width, dtype=dt, device=dev)

        self.latent = [pool(cfg.kv_cache_dim) for _ in range(cfg.num_hidden_layers)]
        self.index_keys = [pool(cfg.index_head_dim) if t == "full" else None
                           for t in cfg.indexer_types]
        n_mtp = len(model.mtp) if (mtp and model.mtp is not None) else 0
        self.mtp_latent = [pool(cfg.kv_cache_dim) for _ in range(n_mtp)]
        self.mtp_index_keys = [pool(cfg.index_head_dim) for _ in range(n_mtp)]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.latent, *self.index_keys, *self.mtp_latent,
                            *self.mtp_index_keys) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def copy_page(self, src: int, dst: int) -> None:
        """Copy every pool's rows of page ``src`` into page ``dst`` (copy-on-write of a shared
        page a request must write into)."""
        ps = self.page_size
        for t in self.tensors():
            t[dst * ps:(dst + 1) * ps] = t[src * ps:(src + 1) * ps]

    @staticmethod
    def scratch_page_count(scratch_rows: int, page_size: int) -> int:
        """Scratch pages that hold ``scratch_rows`` rows."""
        return -(-scratch_rows // page_size)

    @staticmethod
    def page_bytes(model: GLM5ForCausalLM, page_size: int, mtp: bool = False) -> int:
        """Bytes one page takes in every pool."""
        cfg = model.config
        per_row = cfg.num_hidden_layers * cfg.kv_cache_dim + sum(
            cfg.index_head_dim for t in cfg.indexer_types if t == "full")
        if mtp and model.mtp is not None:
            per_row += len(model.mtp) * (cfg.kv_cache_dim + cfg.index_head_dim)
        return per_row * page_size * model.model.embed_tokens.weight.element_size()
