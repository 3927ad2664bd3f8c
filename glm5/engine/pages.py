"""Reference-counted page allocator for the paged latent / indexer cache.

Pure bookkeeping over page ids ``0 .. num_pages - 1`` (the cache tensors themselves live in the
engine). Every holder of a page — a request's block table, the prefix cache — owns one reference;
a page whose count drops to 0 is free again. Every method validates its whole argument before it
changes anything, so a call that raises leaves the allocator exactly as it was.
"""

from __future__ import annotations

import heapq
import operator
from collections import Counter
from collections.abc import Iterable


class OutOfPages(RuntimeError):
    """``PageAllocator.alloc`` asked for more pages than are free; nothing was allocated.

    ``requested`` and ``free`` say how many were asked for and how many were free, so a
    scheduler can decide how much to evict or whom to preempt."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"glm5 PageAllocator.alloc: {requested} pages requested, only {free} free")
        self.requested = requested
        self.free = free


class DoubleFree(RuntimeError):
    """``PageAllocator.decref`` of a page with no reference left (``page``): some holder
    released a page it did not hold — an engine bug, reported before any count changes."""

    def __init__(self, page: int, message: str):
        super().__init__(message)
        self.page = page


def page_id(where: str, page: object, num_pages: int) -> int:
    """``page`` as an int in ``[0, num_pages)``, or a ValueError/TypeError naming ``where``."""
    if isinstance(page, bool):
        raise TypeError(f"glm5 {where}: page ids expected int, got bool {page!r}")
    try:
        p = operator.index(page)
    except TypeError:
        raise TypeError(f"glm5 {where}: page ids expected int, got {type(page).__name__} "
                        f"{page!r}") from None
    if not 0 <= p < num_pages:
        raise ValueError(f"glm5 {where}: unknown page {p} (page ids are 0..{num_pages - 1})")
    return p


class PageAllocator:
    """``num_pages`` pages with a reference count each. ``alloc`` hands out the lowest free ids
    first (deterministic, so runs and tests are reproducible)."""

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"glm5 PageAllocator: argument 'num_pages' expected an int >= 1, "
                             f"got {num_pages!r}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        # A min-heap: lowest free id first. Every id in it has refcount 0 and appears once.
        self._free = list(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh pages with refcount 1 each, lowest ids first; raises OutOfPages (and
        allocates nothing) when fewer than ``n`` are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"glm5 PageAllocator.alloc: argument 'n' expected an int >= 0, "
                             f"got {n!r}")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _counted(self, where: str, pages: Iterable[int]) -> Counter:
        return Counter(page_id(where, p, self.num_pages) for p in pages)

    def incref(self, pages: Iterable[int]) -> None:
        """One more reference on each page (a page listed twice gains two). Only a page that is
        allocated can gain a holder: incref of a free page would hand out a page the free list
        still owns."""
        counts = self._counted("PageAllocator.incref", pages)
        for p in counts:
            if self._refs[p] == 0:
                raise ValueError(f"glm5 PageAllocator.incref: page {p} is free (refcount 0); "
                                 f"only allocated pages can gain a reference")
        for p, c in counts.items():
            self._refs[p] += c

    def decref(self, pages: Iterable[int]) -> None:
        """One reference fewer on each page (a page listed twice loses two); a page whose count
        reaches 0 is free again. Releasing more references than a page has raises DoubleFree
        naming the page, before any count changes."""
        counts = self._counted("PageAllocator.decref", pages)
        for p, c in counts.items():
            if self._refs[p] < c:
                raise DoubleFree(p, f"glm5 PageAllocator.decref: double free of page {p} "
                                    f"(refcount {self._refs[p]}, {c} release(s) requested)")
        for p, c in counts.items():
            self._refs[p] -= c
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)

    def refcount(self, page: int) -> int:
        """How many holders ``page`` has (0: free)."""
        return self._refs[page_id("PageAllocator.refcount", page, self.num_pages)]


def from_cache(name: str) -> property:
    """A read-only attribute that is ``self.cache.<name>``: objects that hold the engine's cache
    manager as ``cache`` (the engine, the prefix cache) expose its parts under their old names
    without keeping a second copy."""
    return property(lambda self: getattr(self.cache, name),
                    doc=f"The cache manager's ``{name}`` (read-only).")
