"""PageAllocator and RadixCache (glm5/engine/pages.py, radix.py; a CacheManager builds them):
hand-computed golden cases, error cases, and a hypothesis state machine that checks the
reference counts, the page contents a request would read, and the LRU eviction order against a
plain model after every step."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from glm5.engine.cache_manager import CacheManager
from glm5.engine.pages import DoubleFree, OutOfPages, PageAllocator
from glm5.engine.radix import RadixCache


def refs(alloc: PageAllocator) -> list[int]:
    return [alloc.refcount(p) for p in range(alloc.num_pages)]


def radix_cache(num_pages: int, page_size: int, enabled: bool = True
                ) -> tuple[PageAllocator, RadixCache]:
    """The allocator and prefix cache of a bookkeeping-only cache manager (no pools)."""
    m = CacheManager(num_pages, page_size, enable_prefix_cache=enabled)
    return m.allocator, m.radix


# -- PageAllocator -------------------------------------------------------------------------------

def test_alloc_incref_decref_counts():
    a = PageAllocator(4)
    assert a.num_pages == 4 and a.num_free == 4
    got = a.alloc(3)
    assert got == [0, 1, 2] and a.num_free == 1 and refs(a) == [1, 1, 1, 0]
    a.incref([1, 1, 2])
    assert refs(a) == [1, 3, 2, 0]
    a.decref([0, 1])
    assert refs(a) == [0, 2, 2, 0] and a.num_free == 2
    # The freed page comes back first (lowest free id): allocation is deterministic.
    assert a.alloc(1) == [0]
    assert a.alloc(0) == [] and a.num_free == 1


def test_out_of_pages_leaves_state_unchanged():
    a = PageAllocator(4)
    held = a.alloc(3)
    a.decref([held[1]])
    before = refs(a)
    with pytest.raises(OutOfPages) as e:
        a.alloc(3)
    assert (e.value.requested, e.value.free) == (3, 2)
    assert isinstance(e.value, RuntimeError) and "3 pages requested, only 2 free" in str(e.value)
    assert refs(a) == before and a.num_free == 2
    assert a.alloc(2) == [1, 3]


def test_double_free_names_the_page():
    a = PageAllocator(3)
    (p,) = a.alloc(1)
    a.decref([p])
    with pytest.raises(DoubleFree, match=r"double free of page 0") as e:
        a.decref([p])
    assert e.value.page == 0
    # Two releases of a page held once: refused before any count changes.
    q, r = a.alloc(2)
    with pytest.raises(DoubleFree, match=rf"page {r}"):
        a.decref([q, r, r])
    assert a.refcount(q) == 1 and a.refcount(r) == 1 and a.num_free == 1


@pytest.mark.parametrize("bad, err, msg", [
    (7, ValueError, r"PageAllocator.decref: unknown page 7 \(page ids are 0..2\)"),
    (-1, ValueError, r"unknown page -1"),
    ("0", TypeError, r"PageAllocator.decref: page ids expected int, got str"),
    (True, TypeError, r"got bool"),
    (1.0, TypeError, r"got float"),
])
def test_decref_of_unknown_page_changes_nothing(bad, err, msg):
    a = PageAllocator(3)
    a.alloc(2)
    with pytest.raises(err, match=msg):
        a.decref([0, bad])
    assert refs(a) == [1, 1, 0]


def test_incref_of_free_page_and_bad_arguments():
    a = PageAllocator(2)
    a.alloc(1)
    with pytest.raises(ValueError, match=r"PageAllocator.incref: page 1 is free"):
        a.incref([0, 1])
    assert refs(a) == [1, 0]
    with pytest.raises(ValueError, match=r"PageAllocator.refcount: unknown page 2"):
        a.refcount(2)
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"'num_pages' expected an int >= 1"):
            PageAllocator(bad)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match=r"alloc: argument 'n' expected an int >= 0"):
            a.alloc(bad)


# -- RadixCache: golden cases (page_size 4) ------------------------------------------------------

PS = 4
A_TOK = list(range(100, 110))                       # 10 tokens: 2 full pages + 2 tokens
B_TOK = list(range(100, 108)) + [200, 201, 202]     # same first 2 pages, then its own


def test_two_requests_share_two_prefix_pages():
    a, c = radix_cache(8, PS)
    table_a = a.alloc(3)                             # [0, 1, 2]; page 2 is partial
    table_a = c.adopt(A_TOK, table_a)
    assert table_a == [0, 1, 2]
    assert c.num_cached_pages == 2 and 2 not in c and refs(a)[:3] == [2, 2, 1]

    pages, n = c.match(B_TOK)
    assert (pages, n) == ([0, 1], 8)
    assert refs(a)[:3] == [3, 3, 1]
    table_b = pages + a.alloc(1)                     # page 3 for B's 3 own tokens
    assert table_b == [0, 1, 3]
    assert c.evictable_pages() == 0 and c.evict(8) == 0

    a.decref(table_a)                                # A finishes: its partial page is freed
    assert refs(a)[:4] == [2, 2, 0, 1] and c.evictable_pages() == 0
    a.decref(table_b)
    assert refs(a)[:4] == [1, 1, 0, 0] and a.num_free == 6
    assert c.evictable_pages() == 2


def test_requests_diverging_in_third_page():
    a, c = radix_cache(8, PS)
    x = list(range(12))
    y = list(range(8)) + [50, 51, 52, 53]
    tx = c.adopt(x, a.alloc(3))
    assert tx == [0, 1, 2]
    py, n = c.match(y)
    assert (py, n) == ([0, 1], 8)
    ty = c.adopt(y, py + a.alloc(1))
    assert ty == [0, 1, 3]
    assert c.num_cached_pages == 4
    assert refs(a)[:4] == [3, 3, 2, 2]
    pages, _ = c.match(x)
    assert pages == [0, 1, 2]
    a.decref(pages)
    pages, _ = c.match(y + [9, 9])
    assert pages == [0, 1, 3]
    a.decref(pages)
    # Prefill of the same prompt that raced the first one (no match): its duplicates are dropped.
    dup = a.alloc(3)
    assert dup == [4, 5, 6]
    t = c.adopt(x, dup)
    assert t == [0, 1, 2] and refs(a)[:7] == [4, 4, 3, 2, 0, 0, 0] and a.num_free == 4


def test_partial_last_page_is_never_cached():
    a, c = radix_cache(4, PS)
    tok = list(range(7))                             # 1 full page + 3 tokens
    table = c.adopt(tok, a.alloc(2))
    assert table == [0, 1] and c.num_cached_pages == 1 and 1 not in c
    assert refs(a) == [2, 1, 0, 0]
    assert c.match(tok) == ([0], 4)
    assert c.match(tok[:3]) == ([], 0)               # less than one page: nothing to reuse
    assert c.match(tok + [7]) == ([0], 4)            # page 1 now full in the query, not cached
    with pytest.raises(ValueError, match=r"RadixCache.insert: 2 pages of 4 tokens need >= 8 "
                                         r"tokens, got 7"):
        c.insert(tok, table)
    assert refs(a) == [4, 1, 0, 0] and c.num_cached_pages == 1


def test_match_after_evict_and_lru_order():
    a, c = radix_cache(8, PS)
    x = list(range(12))
    y = list(range(8)) + [50, 51, 52, 53]
    a.decref(c.adopt(x, a.alloc(3)))                 # x: pages 0, 1, 2 — then x finishes
    a.decref(c.adopt(y, a.alloc(3)))                 # y: shares 0, 1; own page 5 (3, 4 dropped)
    assert c.num_cached_pages == 4 and refs(a)[:6] == [1, 1, 1, 0, 0, 1]
    assert c.evictable_pages() == 4
    # x was used before y: its leaf goes first.
    assert c.evict(1) == 1
    assert 2 not in c and a.refcount(2) == 0
    pages, n = c.match(x)
    assert (pages, n) == ([0, 1], 8)
    a.decref(pages)                                  # that match made 0, 1 most recent; 5 older
    pages, n = c.match(y)
    assert (pages, n) == ([0, 1, 5], 12)
    a.decref(pages)
    assert c.evict(1) == 1 and 5 not in c            # the only leaf
    # A running request pins its path: nothing of it is evicted, the rest is.
    held, _ = c.match(x)
    assert c.evictable_pages() == 0 and c.evict(5) == 0
    a.decref(held)
    assert c.evictable_pages() == 2
    assert c.evict(5) == 2 and c.num_cached_pages == 0 and a.num_free == 8
    assert c.match(x) == ([], 0)


def test_a_held_page_pins_the_pages_above_it():
    """insert (without adopt) can cache a request's page under a parent the request does not
    hold: the parent has refcount 1 but is not evictable while its child is in use."""
    a, c = radix_cache(6, 2)
    x = [1, 2, 3, 4]
    first = a.alloc(2)
    assert c.insert(x, first) == [0, 1]
    a.decref(first)
    assert c.evict(1) == 1 and 1 not in c            # the tree keeps page 0 only
    own = a.alloc(2)                                 # [1, 2]: recomputed both pages
    assert c.insert(x, own) == [0, 2]                # the tree keeps 0, adopts 2 under it
    assert refs(a) == [1, 1, 2, 0, 0, 0]
    assert c.evictable_pages() == 0 and c.evict(5) == 0 and c.num_cached_pages == 2
    a.decref(own)
    assert c.evictable_pages() == 2 and c.evict(5) == 2 and a.num_free == 6


def test_lru_prefers_the_least_recently_matched_leaf():
    a, c = radix_cache(6, 2)
    p1 = [1, 1, 1, 1]
    p2 = [1, 1, 2, 2]
    p3 = [3, 3]
    for tok in (p1, p2, p3):
        pages, n = c.match(tok)
        a.decref(c.adopt(tok, pages + a.alloc(len(tok) // 2 - len(pages))))
    # Leaves in insertion order: p1's page 1, p2's page 2, p3's page 3. Touch p1 again.
    a.decref(c.match(p1)[0])
    assert c.evict(1) == 1 and 2 not in c            # p2's leaf: least recently used
    assert c.evict(1) == 1 and 3 not in c            # p3 next
    assert c.evict(1) == 1 and 1 not in c            # then p1's leaf, then its parent
    assert c.evict(1) == 1 and c.num_cached_pages == 0


def test_disabled_cache_holds_nothing():
    a, c = radix_cache(4, 2, enabled=False)
    table = a.alloc(2)
    assert c.adopt([1, 2, 3, 4], table) == table
    assert c.insert([1, 2, 3, 4], table) == table
    assert c.match([1, 2, 3, 4]) == ([], 0)
    assert c.num_cached_pages == 0 and c.evictable_pages() == 0 and c.evict(4) == 0
    assert refs(a) == [1, 1, 0, 0]


def test_tensor_tokens_match_list_tokens():
    a, c = radix_cache(4, 2)
    c.adopt(torch.tensor([5, 6, 7, 8]), a.alloc(2))
    assert c.match([5, 6, 7, 8, 9]) == ([0, 1], 4)
    assert c.match(torch.tensor([5, 6, 7])) == ([0], 2)


def test_reset_drops_only_tree_references():
    a, c = radix_cache(4, 2)
    table = c.adopt([1, 2, 3, 4, 5], a.alloc(3))
    a.decref(c.adopt([9, 9], a.alloc(1)))
    assert refs(a) == [2, 2, 1, 1]
    c.reset()
    assert refs(a) == [1, 1, 1, 0] and c.num_cached_pages == 0
    assert c.match([1, 2, 3, 4]) == ([], 0)
    a.decref(table)
    assert a.num_free == 4


def test_deep_path_needs_no_recursion():
    n = 3000                                         # deeper than Python's recursion limit
    a, c = radix_cache(n, 1)
    a.decref(c.adopt(list(range(n)), a.alloc(n)))
    assert c.evictable_pages() == n
    assert c.evict(n) == n and a.num_free == n


def test_radix_cache_bad_arguments():
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"CacheManager: argument 'page_size' expected an "
                                             r"int >= 1"):
            CacheManager(4, bad)
    with pytest.raises(ValueError, match=r"'num_pages' expected an int >= 1, got 0"):
        CacheManager(0, 2)
    a, c = radix_cache(4, 2)
    p = a.alloc(3)
    before = refs(a)
    with pytest.raises(ValueError, match=r"RadixCache.insert: page 3 is free"):
        c.insert([1, 2, 3, 4], [p[0], 3])
    with pytest.raises(ValueError, match=r"RadixCache.insert: page 0 appears twice"):
        c.insert([1, 2, 3, 4], [0, 0])
    with pytest.raises(ValueError, match=r"RadixCache.adopt: unknown page 9"):
        c.adopt([1, 2, 3, 4], [0, 9])
    with pytest.raises(TypeError, match=r"RadixCache.match: argument 'tokens' expected a flat"):
        c.match([[1, 2], [3, 4]])
    with pytest.raises(TypeError, match=r"RadixCache.insert: argument 'tokens' expected a seq"):
        c.insert(None, [0])
    with pytest.raises(ValueError, match=r"RadixCache.evict: argument 'num_pages' expected an "
                                         r"int >= 0, got -1"):
        c.evict(-1)
    assert refs(a) == before and c.num_cached_pages == 0
    # A page already cached under one prefix cannot be cached under another.
    c.insert([1, 2], [p[0]])
    with pytest.raises(ValueError, match=r"page 0 is already cached under a different prefix"):
        c.insert([7, 7, 8, 8], [p[1], p[0]])
    assert c.num_cached_pages == 1 and refs(a) == [2, 1, 1, 0]


# -- state machine -------------------------------------------------------------------------------

# A few shared prompts plus a short tail of two symbols: requests share prefixes and diverge
# at every page position.
PROMPTS = ((), (0, 1, 0, 1, 1, 0), (0, 1, 0, 0), (1, 1, 1, 1, 1, 1, 1))
TOKENS = st.tuples(st.sampled_from(PROMPTS), st.lists(st.integers(0, 1), max_size=4)).map(
    lambda t: [*t[0], *t[1]])


class RadixMachine(RuleBasedStateMachine):
    """Requests are (tokens, block table). ``shadow[page]`` is what the page holds: the token
    prefix its latent rows were computed from (a partial page: up to the request's last token).
    The model of the tree is ``model`` (prefix of full pages -> page) with ``tick`` (prefix ->
    logical time of its last match / insert)."""

    @initialize(page_size=st.integers(1, 3), num_pages=st.integers(4, 24),
                enabled=st.sampled_from([True, True, True, False]))
    def setup(self, page_size, num_pages, enabled):
        self.ps = page_size
        self.alloc, self.cache = radix_cache(num_pages, page_size, enabled)
        self.enabled = enabled
        self.requests: dict[int, tuple[list[int], list[int]]] = {}
        self.admitting: list[int] = []               # pages matched by a request not yet running
        self.finished: list[list[int]] = []          # tokens of finished requests
        self.next_id = 0
        self.shadow: dict[int, tuple[int, ...]] = {}
        self.model: dict[tuple[int, ...], int] = {}
        self.tick: dict[tuple[int, ...], int] = {}
        self.clock = 0

    # -- helpers --

    def _pick(self, i):
        return sorted(self.requests)[i % len(self.requests)]

    def _expected_match(self, tokens):
        pages = []
        for i in range(len(tokens) // self.ps):
            page = self.model.get(tuple(tokens[:(i + 1) * self.ps]))
            if page is None:
                break
            pages.append(page)
        return pages

    def _touch(self, tokens, n_pages):
        self.clock += 1
        for i in range(n_pages):
            self.tick[tuple(tokens[:(i + 1) * self.ps])] = self.clock

    def _holders(self, page):
        return self.admitting.count(page) + sum(table.count(page)
                                                for _, table in self.requests.values())

    def _model_evict(self, k):
        """The pages LRU eviction of ``k`` must free, in order, computed from the model."""
        model, order = dict(self.model), []
        while len(order) < k:
            leaves = [q for q in model if self._holders(model[q]) == 0 and not any(
                len(r) == len(q) + self.ps and r[:len(q)] == q for r in model)]
            if not leaves:
                break
            q = min(leaves, key=lambda q: self.tick[q])
            order.append(model.pop(q))
        return order

    def _alloc(self, n):
        """n fresh pages, evicting from the cache if short; None when even that is not enough."""
        try:
            return self.alloc.alloc(n)
        except OutOfPages as e:
            assert (e.requested, e.free) == (n, self.alloc.num_free) and n > e.free
        before = refs(self.alloc)
        try:
            self.alloc.alloc(n)
        except OutOfPages:
            pass
        assert refs(self.alloc) == before             # a failed alloc allocates nothing
        self.do_evict(n - self.alloc.num_free)
        if self.alloc.num_free < n:
            return None
        return self.alloc.alloc(n)

    def _write(self, tokens, table, start):
        """Prefill: pages table[start:] now hold the rows of their tokens."""
        for i in range(start, len(table)):
            self.shadow[table[i]] = tuple(tokens[:min((i + 1) * self.ps, len(tokens))])

    def _insert_model(self, tokens, table, tree_pages):
        expect = []
        for i, page in enumerate(table):
            key = tuple(tokens[:(i + 1) * self.ps])
            expect.append(self.model.setdefault(key, page) if self.enabled else page)
        assert tree_pages == expect
        if self.enabled:
            self._touch(tokens, len(table))

    # -- rules --

    @precondition(lambda self: len(self.requests) < 3)
    @rule(tokens=TOKENS, cache_prefill=st.booleans())
    def start_request(self, tokens, cache_prefill):
        pages, n = self.cache.match(tokens)
        assert pages == self._expected_match(tokens) and n == len(pages) * self.ps
        for i, page in enumerate(pages):             # what the request will read is its prefix
            assert self.shadow[page] == tuple(tokens[:(i + 1) * self.ps])
        if pages:
            self._touch(tokens, len(pages))
        self.admitting = pages                       # held: eviction must not take them
        own = self._alloc(-(-len(tokens) // self.ps) - len(pages))
        self.admitting = []
        if own is None:                              # not admitted: give the matched pages back
            self.alloc.decref(pages)
            return
        table = pages + own
        self._write(tokens, table, len(pages))
        self.requests[self.next_id] = (list(tokens), table)
        self.next_id += 1
        if cache_prefill:                            # cache the prompt's pages right away
            self._adopt(self.next_id - 1, finish=False)

    @precondition(lambda self: len(self.requests) < 2)
    @rule(tokens=TOKENS, size=st.integers(2, 3))
    def start_group(self, tokens, size):
        """Requests of one prompt admitted in one step (a GRPO group): all match before any
        has cached its prefill, so later adopts find the tree's page for their own duplicates."""
        for _ in range(min(size, 3 - len(self.requests))):
            self.start_request(tokens, cache_prefill=False)

    @rule(tokens=TOKENS)
    def probe(self, tokens):
        pages, _ = self.cache.match(tokens)
        assert pages == self._expected_match(tokens)
        if pages:
            self._touch(tokens, len(pages))
        self.alloc.decref(pages)

    @precondition(lambda self: self.finished)
    @rule(j=st.integers(0, 50))
    def probe_finished(self, j):
        """Match a finished request's tokens again: its whole cached path, leaf included,
        becomes the most recently used."""
        self.probe(self.finished[j % len(self.finished)])

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 50), extra=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def decode(self, i, extra):
        rid = self._pick(i)
        tokens, table = self.requests[rid]
        new_tokens = tokens + extra
        own = self._alloc(-(-len(new_tokens) // self.ps) - len(table))
        if own is None:
            return
        if len(tokens) % self.ps:
            # The partial last page is written again: only this request may hold it.
            assert self.alloc.refcount(table[-1]) == 1 and table[-1] not in self.cache
        table = table + own
        self._write(new_tokens, table, len(tokens) // self.ps)
        self.requests[rid] = (new_tokens, table)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 50))
    def insert(self, i):
        tokens, table = self.requests[self._pick(i)]
        full = table[:len(tokens) // self.ps]
        self._insert_model(tokens, full, self.cache.insert(tokens, full))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 50), finish=st.booleans())
    def adopt(self, i, finish):
        self._adopt(self._pick(i), finish)

    def _adopt(self, rid, finish):
        tokens, table = self.requests[rid]
        n = len(tokens) // self.ps
        new_table = self.cache.adopt(tokens, table)
        self._insert_model(tokens, table[:n], new_table[:n])
        assert new_table[n:] == table[n:]
        self.requests[rid] = (tokens, new_table)
        if finish:                                   # the engine's cache-finished-request
            self.finish(rid)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 50))
    def finish_request(self, i):
        self.finish(self._pick(i))

    def finish(self, rid):
        tokens, table = self.requests.pop(rid)
        self.alloc.decref(table)
        self.finished.append(tokens)

    @rule(k=st.integers(0, 6))
    def do_evict(self, k):
        held = {p for _, table in self.requests.values() for p in table} | set(self.admitting)
        expected = self._model_evict(k)
        assert self.cache.evictable_pages() == len(self._model_evict(len(self.model)))
        freed = self.cache.evict(k)
        assert freed == len(expected)
        for page in expected:                        # freed in LRU order = these pages
            assert page not in self.cache and self.alloc.refcount(page) == 0
        assert not held & set(expected)
        self.model = {q: p for q, p in self.model.items() if p not in expected}

    # Only over a well-filled tree: a rule without arguments is drawn often, and resetting an
    # almost empty tree at every other step would leave little to match or evict.
    @precondition(lambda self: self.cache.num_cached_pages >= 6)
    @rule()
    def reset(self):
        self.cache.reset()
        self.model.clear()

    # -- invariants --

    @invariant()
    def refcounts_are_tree_plus_requests(self):
        tree = set(self.model.values())
        assert {p for p in range(self.alloc.num_pages) if p in self.cache} == tree
        assert self.cache.num_cached_pages == len(self.model)
        for p in range(self.alloc.num_pages):
            assert self.alloc.refcount(p) == (p in tree) + self._holders(p), p
        assert self.alloc.num_free == sum(r == 0 for r in refs(self.alloc))
        if not self.enabled:
            assert self.cache.num_cached_pages == 0

    @invariant()
    def eviction_order_is_lru(self):
        """On a copy: evicting one page at a time frees the evictable pages in the model's LRU
        order (least recently matched / inserted leaf first, parents after their children)."""
        cache = copy.deepcopy(self.cache)
        order: list[int] = []
        while cache.evict(1):
            order += [p for p in self.model.values() if p not in cache and p not in order]
        assert order == self._model_evict(len(self.model))

    @invariant()
    def pages_hold_what_their_readers_expect(self):
        for prefix, page in self.model.items():
            assert self.shadow[page] == prefix
        for tokens, table in self.requests.values():
            assert len(table) == -(-len(tokens) // self.ps)
            for i, page in enumerate(table):
                assert self.shadow[page] == tuple(tokens[:min((i + 1) * self.ps, len(tokens))])


TestRadixMachine = RadixMachine.TestCase
