"""The serving engine's paged cache: per layer a pool of pages for the MLA latent
([num_pages * page_size, kv_lora_rank + qk_rope_head_dim]) and, on layers that run the
indexer, the indexer keys ([num_pages * page_size, index_head_dim] in the model's dtype, or
with ``dsa_indexer_dtype = "fp8"`` e4m3 codes and a scale per row: `glm5.core.index_cache`,
the paged_indexer_topk_fp8 op reads them); the MTP layers get pools
of their own, addressed by the same page ids (a token's MTP entry lives in the same page as its
main-model entries). Beyond the pages the allocator hands out, the pool holds scratch pages
(enough for ``scratch_rows`` rows) that no request owns: the padded rows of a captured decode
graph write and read them (glm5.engine.graphs)."""

from __future__ import annotations

import torch

from glm5.core.index_cache import FP8Keys, IndexKeys, index_keys_tensors, new_index_keys
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
        self.num_pages, self.num_rows = num_pages, rows
        self.scratch_pages = list(range(num_pages, num_pages + n_scratch))

        fp8 = cfg.dsa_indexer_dtype == "fp8"

        def pool(width: int) -> torch.Tensor:
            return torch.zeros(rows, width, dtype=dt, device=dev)

        def keys() -> IndexKeys:
            return new_index_keys(rows, cfg.index_head_dim, dt, dev, fp8)

        self.latent = [pool(cfg.kv_cache_dim) for _ in range(cfg.num_hidden_layers)]
        self.index_keys = [keys() if t == "full" else None for t in cfg.indexer_types]
        n_mtp = len(model.mtp) if (mtp and model.mtp is not None) else 0
        self.mtp_latent = [pool(cfg.kv_cache_dim) for _ in range(n_mtp)]
        self.mtp_index_keys = [keys() for _ in range(n_mtp)]

    @property
    def page_size(self) -> int:
        """Rows per page, from the pools' layout (the engine's page size is its cache
        manager's; the pool keeps no copy)."""
        return self.num_rows // (self.num_pages + len(self.scratch_pages))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of every pool (each indexed by pool row in its first dimension)."""
        out = [*self.latent, *self.mtp_latent]
        for c in (*self.index_keys, *self.mtp_index_keys):
            out += index_keys_tensors(c)
        return out

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
        esz = model.model.embed_tokens.weight.element_size()
        key = (FP8Keys.row_bytes(cfg.index_head_dim) if cfg.dsa_indexer_dtype == "fp8"
               else cfg.index_head_dim * esz)
        layers = cfg.num_hidden_layers
        key_layers = sum(t == "full" for t in cfg.indexer_types)
        if mtp and model.mtp is not None:
            layers += len(model.mtp)
            key_layers += len(model.mtp)
        return (layers * cfg.kv_cache_dim * esz + key_layers * key) * page_size
