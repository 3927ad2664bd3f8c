"""The engine's cache manager: one object owns the paged cache (SGLang's ``BasePrefixCache`` +
``TokenToKVPool``, vLLM's ``KVCacheManager``).

`CacheManager` owns

- the page size: stored here and nowhere else in the engine (the scheduler, the step runner,
  the prefix cache and `LLMEngine` read ``cache.page_size``; `EngineConfig.page_size` is only
  the setting it is built from);
- the page allocator (`glm5.engine.pages.PageAllocator`, reference-counted page ids);
- the KV pools (`glm5.engine.kv_pool.KVPool`: the MLA latent and indexer-key rows of every
  layer, and the MTP layers' pools), absent in a bookkeeping-only manager (tests);
- the prefix cache (`glm5.engine.radix.RadixCache`), with its page accounting: `alloc`
  evicts unreferenced cached pages (LRU) before it gives up, `available_pages` counts them;
- the slot rule: a request's logical position j lives in pool row
  ``pages[j // page_size] * page_size + j % page_size`` (`slot_rows`, which calls the one
  definition, `glm5.ir.paging.pool_rows`);
- the prefix-cache key rule: the key of a position (`prefix_keys`) and of a page
  (`page_keys`).

Not thread-safe: the engine calls it from its one scheduling loop.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from glm5.core.model import GLM5ForCausalLM
from glm5.engine.kv_pool import KVPool
from glm5.engine.pages import OutOfPages, PageAllocator
from glm5.engine.radix import RadixCache
from glm5.engine.request import Request
from glm5.ir.paging import pool_rows


def _checked_page_size(page_size: object) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"glm5 CacheManager: argument 'page_size' expected an int >= 1, got "
                         f"{page_size!r}")
    return page_size


class CacheManager:
    """The paged cache of one engine: ``num_pages`` pages of ``page_size`` token rows.

    ``model`` (optional) gets a `KVPool` of those pages (plus scratch pages for
    ``scratch_rows`` rows, and MTP pools when ``mtp``); without one the manager is bookkeeping
    only (``pool`` is None). ``mtp``: the engine drafts with the MTP layer, which changes the
    key rule (see `prefix_keys`). ``enable_prefix_cache=False``: the prefix cache holds
    nothing."""

    def __init__(self, num_pages: int, page_size: int, *, model: GLM5ForCausalLM | None = None,
                 mtp: bool = False, scratch_rows: int = 1,
                 enable_prefix_cache: bool = True) -> None:
        self.page_size = _checked_page_size(page_size)  # the engine's one copy
        self.mtp = bool(mtp)
        self.allocator = PageAllocator(num_pages)
        self.pool = (None if model is None
                     else KVPool(model, num_pages, page_size, self.mtp, scratch_rows))
        self.radix = RadixCache(self, enable_prefix_cache)

    @classmethod
    def for_model(cls, model: GLM5ForCausalLM, page_size: int, num_pages: int | None,
                  kv_cache_bytes: int, *, mtp: bool = False, scratch_rows: int = 1,
                  enable_prefix_cache: bool = True) -> CacheManager:
        """A manager with ``num_pages`` pages (None: as many as ``kv_cache_bytes`` holds
        beside the scratch pages, at least 1) and their pools on ``model``'s device."""
        page_size = _checked_page_size(page_size)
        num_pages = num_pages or max(
            kv_cache_bytes // KVPool.page_bytes(model, page_size, mtp)
            - KVPool.scratch_page_count(scratch_rows, page_size), 1)
        return cls(num_pages, page_size, model=model, mtp=mtp, scratch_rows=scratch_rows,
                   enable_prefix_cache=enable_prefix_cache)

    # -- pages -----------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Pages the allocator hands out (the pool's scratch pages are not among them)."""
        return self.allocator.num_pages

    def pages_for(self, num_positions: int) -> int:
        """Pages that hold positions 0 .. num_positions - 1."""
        return -(-num_positions // self.page_size)

    def available_pages(self) -> int:
        """Pages `alloc` could hand out now: the free ones and those only the prefix cache
        holds (evictable)."""
        return self.allocator.num_free + self.radix.evictable_pages()

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh pages (refcount 1 each, lowest ids first). When fewer are free, the
        prefix cache first evicts least recently used pages nobody else holds; raises
        `OutOfPages` (allocating nothing; what was evicted stays free) when that is not
        enough."""
        short = n - self.allocator.num_free
        if short > 0:
            self.radix.evict(short)
        return self.allocator.alloc(n)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page (a request's block table it no longer uses)."""
        if pages:
            self.allocator.decref(pages)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page ``src``'s rows into page ``dst`` in every pool (copy on write)."""
        self.pool.copy_page(src, dst)

    # -- slots -----------------------------------------------------------------------------------

    def slot_rows(self, block_table: torch.Tensor, seq: torch.Tensor | int,
                  positions: torch.Tensor) -> torch.Tensor:
        """Pool rows [N] int64 of logical ``positions`` [N] of the sequences ``seq`` (rows of
        ``block_table`` [B, P] int32): `glm5.ir.paging.pool_rows` at this page size."""
        return pool_rows(block_table, seq, positions, self.page_size)

    # -- the prefix-cache key rule ---------------------------------------------------------------

    def prefix_keys(self, tokens: Sequence[int], n: int) -> list[int]:
        """The prefix cache's keys of positions 0 .. n - 1 of a sequence whose known tokens are
        ``tokens`` (fewer keys when the tokens run out).

        Without MTP a position's key is its token. A page's main-model rows depend on the
        tokens up to its last position, but with MTP its MTP rows also depend on the token
        AFTER it (the MTP entry at position i is made from the hidden state at i and the token
        at i + 1). Keying position i by the pair (token i, token i + 1) makes a page match only
        where both agree; a request that reused a page whose last MTP entry was made with
        another request's next token would draft from a wrong cache. So with MTP the last
        known token has no key yet."""
        if not self.mtp:
            return list(tokens[:n])
        toks = tokens[:min(n, len(tokens) - 1) + 1]
        return [(a << 32) | b for a, b in zip(toks, toks[1:])]

    def request_keys(self, req: Request, n: int) -> list[int]:
        """`prefix_keys` of a request's positions 0 .. n - 1."""
        return self.prefix_keys(req.tokens(0, min(n + 1, req.num_tokens)), n)

    def page_keys(self, where: str, keys: Sequence[int], start: int, stop: int
                  ) -> list[tuple[int, ...]]:
        """The keys of full pages ``start .. stop - 1`` of a sequence of position keys: a
        page's key is the tuple of its ``page_size`` position keys as plain ints (only a FULL
        page has one; the caller checked that these are full). ``where`` names the caller in
        errors."""
        ps = self.page_size
        chunk = keys[start * ps: stop * ps]
        # A tensor's elements are 0-d tensors that hash by identity: equal tokens would never
        # match. tolist() turns tensors and numpy arrays into plain ints.
        if hasattr(chunk, "tolist"):
            chunk = chunk.tolist()
        try:
            ids = [operator.index(t) for t in chunk]
        except TypeError:
            raise TypeError(f"glm5 {where}: argument 'tokens' expected a flat sequence of int "
                            f"token ids") from None
        return [tuple(ids[i * ps:(i + 1) * ps]) for i in range(stop - start)]

    # -- a request's pages in the prefix cache ---------------------------------------------------

    def match_request(self, req: Request) -> tuple[list[int], int]:
        """The cached prefix of every known token of ``req``: (page ids the caller now holds
        a reference on, tokens they cover)."""
        return self.radix.match(self.request_keys(req, req.num_tokens))

    def cache_request(self, req: Request) -> None:
        """Offer the request's fully computed pages to the prefix cache, switching its block
        table to pages the cache already held for the same keys."""
        full = min(req.num_computed // self.page_size, len(req.pages))
        if full and self.radix.enabled:
            keys = self.request_keys(req, full * self.page_size)
            req.pages[:full] = self.radix.adopt(keys, req.pages[:full])

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (new weights: its rows are stale); requests keep theirs."""
        self.radix.reset()

