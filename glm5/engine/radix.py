"""Prefix cache over the paged latent / indexer cache (SGLang's RadixCache with page_size > 1).

A request whose prompt begins with pages another request already computed reuses those pages
instead of prefilling them again: a GRPO group (one prompt, G samples) prefills its prompt once.
Only FULL pages are ever cached — a page's latent rows depend on every token before them, so a
page is identified by its own ``page_size`` tokens together with the path of pages above it, and
a partial page could still change. The tree has one node per page; a node's key is the tuple of
its page's tokens (the same key as SGLang's ``page_size > 1`` child key). The page size and the
key rule belong to the cache manager that owns the tree (`glm5.engine.cache_manager`).

Reference counting is the whole locking story: the tree holds ONE reference on every page it
stores, each request holds its own reference on every page of its block table. A page is in use
by a request iff its refcount > 1, so eviction needs no request locks; it removes least recently
used leaves whose page only the tree holds, and a parent that becomes such a leaf follows
(SGLang's cascading eviction). Recency is a logical clock (one tick per match / insert), not
wall time, so eviction order is deterministic.

Not thread-safe: the engine calls it from its one scheduling loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Protocol

from glm5.engine.pages import PageAllocator, from_cache, page_id


class PagedCache(Protocol):
    """What the prefix cache reads from its owner (`glm5.engine.cache_manager.CacheManager`):
    the allocator, the page size and the page key rule."""

    allocator: PageAllocator
    page_size: int

    def page_keys(self, where: str, keys: Sequence[int], start: int, stop: int
                  ) -> list[tuple[int, ...]]: ...


class _Node:
    __slots__ = ("key", "page", "parent", "children", "tick")

    def __init__(self, key: tuple[int, ...] | None, page: int, parent: _Node | None, tick: int):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.tick = tick


class RadixCache:
    """Prefix cache at page granularity (SGLang's RadixCache with page_size > 1): the tree maps
    full pages of token ids to page ids. The tree holds ONE reference on every page it stores;
    each request holds its own reference on every page in its block table. A page is in use by a
    request iff its refcount > 1 (tree-held pages) — so eviction never needs request locks.

    ``cache`` is the owner (a `CacheManager`, which builds it): its allocator, page size and
    page key rule are the tree's. ``enabled=False`` gives a cache that holds nothing: ``match``
    finds nothing, ``insert`` and ``adopt`` hand the caller's pages back untouched, ``evict``
    frees nothing."""

    def __init__(self, cache: PagedCache, enabled: bool = True):
        self.cache = cache
        self.enabled = bool(enabled)
        self._clock = 0
        self._root = _Node(None, -1, None, 0)
        self._nodes: dict[int, _Node] = {}   # page id -> its node (every cached page)
        self._leaves: dict[int, _Node] = {}  # page id -> node, for the nodes without children

    allocator = from_cache("allocator")
    page_size = from_cache("page_size")

    # -- helpers ---------------------------------------------------------------------------------

    def _keys(self, where: str, tokens: Sequence[int], start: int, stop: int
              ) -> list[tuple[int, ...]]:
        return self.cache.page_keys(f"RadixCache.{where}", tokens, start, stop)

    def _num_tokens(self, where: str, tokens: Sequence[int]) -> int:
        try:
            return len(tokens)
        except TypeError:
            raise TypeError(f"glm5 RadixCache.{where}: argument 'tokens' expected a sequence of "
                            f"int token ids, got {type(tokens).__name__}") from None

    def _page_list(self, where: str, pages: Sequence[int]) -> list[int]:
        """``pages`` as distinct, allocated page ids (the caller must hold each one)."""
        ids = [page_id(f"RadixCache.{where}", p, self.allocator.num_pages) for p in pages]
        if len(set(ids)) != len(ids):
            dup = next(p for p in ids if ids.count(p) > 1)
            raise ValueError(f"glm5 RadixCache.{where}: page {dup} appears twice in 'pages' "
                             f"(a block table holds each page once)")
        for p in ids:
            if self.allocator.refcount(p) == 0:
                raise ValueError(f"glm5 RadixCache.{where}: page {p} is free (refcount 0); "
                                 f"'pages' must be pages the caller holds")
        return ids

    def _walk(self, keys: Iterable[tuple[int, ...]]) -> list[_Node]:
        """The nodes of the longest cached path that spells ``keys``' prefix (``keys`` is read
        only as far as the path goes: a long prompt that misses early costs one page)."""
        path: list[_Node] = []
        node = self._root
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _touch(self, nodes: list[_Node]) -> None:
        self._clock += 1
        for nd in nodes:
            nd.tick = self._clock

    # -- API -------------------------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return len(self._nodes)

    def __contains__(self, page: object) -> bool:
        """Whether the tree holds ``page`` (and so one reference on it)."""
        return page in self._nodes

    def match(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """The longest cached prefix of ``tokens`` made of FULL pages: (page ids, number of
        tokens = len(pages) * page_size). The CALLER now holds a reference on each returned page
        (match increfs them; release them with ``allocator.decref``), and the matched nodes
        become the most recently used. A caller that needs logits for the prompt's last token
        matches ``tokens[:-1]`` so at least one token is left to prefill. Disabled: ([], 0)."""
        n = self._num_tokens("match", tokens) // self.page_size
        if not self.enabled:
            return [], 0
        path = self._walk(self._keys("match", tokens, i, i + 1)[0] for i in range(n))
        self._touch(path)
        pages = [nd.page for nd in path]
        self.allocator.incref(pages)
        return pages, len(pages) * self.page_size

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache the ``len(pages)`` full pages of ``tokens`` held in ``pages`` (the caller's
        block table; ``len(tokens) >= len(pages) * page_size``, extra tokens ignored). Pages for
        prefixes not yet in the tree are adopted (the tree increfs them); for prefixes already in
        the tree the tree keeps its own page. Returns the tree's page ids for those positions
        (the caller's own where adopted). All inserted nodes become the most recently used.
        The caller's references are unchanged; ``adopt`` also switches the caller over.
        Disabled: returns ``pages`` and caches nothing."""
        ids = self._page_list("insert", pages)
        n = len(ids)
        have = self._num_tokens("insert", tokens)
        if have < n * self.page_size:
            raise ValueError(f"glm5 RadixCache.insert: {len(ids)} pages of {self.page_size} "
                             f"tokens need >= {n * self.page_size} tokens, got {have}")
        keys = self._keys("insert", tokens, 0, n)
        if not self.enabled:
            return ids
        path = self._walk(keys)
        new = ids[len(path):]
        for p in new:
            if p in self._nodes:
                # The page's rows were computed for another prefix: caching it here too would
                # let a request read another prompt's latents.
                raise ValueError(f"glm5 RadixCache.insert: page {p} is already cached under a "
                                 f"different prefix")
        node = path[-1] if path else self._root
        for key, p in zip(keys[len(path):], new):
            child = _Node(key, p, node, 0)
            node.children[key] = child
            self._leaves.pop(node.page, None)
            self._nodes[p] = child
            self._leaves[p] = child
            path.append(child)
            node = child
        self.allocator.incref(new)
        self._touch(path)
        return [nd.page for nd in path]

    def adopt(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Insert a request's block table and switch it to the tree's pages: returns the
        request's new block table. The first ``min(len(pages), len(tokens) // page_size)`` pages
        (those full of ``tokens``) are inserted; where the tree already had a page for a prefix
        the request gains a reference on the tree's page and drops its own duplicate (freed if
        nobody else holds it). Pages after those (a partial last page, pages reserved ahead)
        are returned unchanged."""
        table = self._page_list("adopt", pages)
        n = min(len(table), self._num_tokens("adopt", tokens) // self.page_size)
        tree = self.insert(tokens, table[:n])
        gained = [t for t, own in zip(tree, table) if t != own]
        dropped = [own for t, own in zip(tree, table) if t != own]
        self.allocator.incref(gained)
        self.allocator.decref(dropped)
        return tree + table[n:]

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages: repeatedly remove the least recently used leaf whose
        page only the tree holds (refcount 1) and drop the tree's reference; a parent that
        becomes such a leaf is a candidate in turn. Returns how many pages were freed."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"glm5 RadixCache.evict: argument 'num_pages' expected an int >= 0, "
                             f"got {num_pages!r}")
        refs = self.allocator._refs  # the counts themselves: refcount() validates every id
        # (tick, page) is unique per node (page ids are), so the heap never compares nodes.
        heap = [(nd.tick, p, nd) for p, nd in self._leaves.items() if refs[p] == 1]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, p, nd = heapq.heappop(heap)
            parent = nd.parent
            del parent.children[nd.key]
            del self._nodes[p]
            del self._leaves[p]
            self.allocator.decref([p])
            freed += 1
            if parent is not self._root and not parent.children:
                self._leaves[parent.page] = parent
                if refs[parent.page] == 1:
                    heapq.heappush(heap, (parent.tick, parent.page, parent))
        return freed

    def evictable_pages(self) -> int:
        """How many pages ``evict`` could free now: the nodes whose whole subtree (themselves
        included) only the tree holds. O(cached pages), no recursion (a long prompt is a path
        thousands of pages deep)."""
        refs = self.allocator._refs  # the counts themselves: refcount() validates every id
        pinned: set[int] = set()     # held by a request, or above a page that is
        for p, nd in self._nodes.items():
            if refs[p] > 1:
                while nd is not self._root and nd.page not in pinned:
                    pinned.add(nd.page)
                    nd = nd.parent
        return len(self._nodes) - len(pinned)

    def reset(self) -> None:
        """Drop every tree reference and empty the tree (requests' references stay)."""
        pages = list(self._nodes)
        self._root = _Node(None, -1, None, 0)
        self._nodes = {}
        self._leaves = {}
        self.allocator.decref(pages)
