"""The engine's cache manager (glm5/engine/cache_manager.py): hand-computed golden cases for the
slot rows of a request, the prefix-cache key rule (position keys, page keys, which pages of a
request are cached and matched) and the page accounting (alloc / release / evict), plus the
engine's wiring (the manager is the one holder of the page size).

Each golden case is small enough to check by hand and would fail on an off-by-one in the slot
formula (page index, page offset) or in the key rule (a partial page cached, a page key one
token long or short, the MTP pair shifted)."""

from __future__ import annotations

import pytest
import torch

from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.cache_manager import CacheManager
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.engine.pages import OutOfPages
from glm5.engine.request import Request
from glm5.engine.sampling import SamplingParams


def refs(cm: CacheManager) -> list[int]:
    return [cm.allocator.refcount(p) for p in range(cm.num_pages)]


def request(tokens: list[int], pages: list[int], computed: int, rid: str = "r") -> Request:
    req = Request(rid, list(tokens), SamplingParams(), torch.Generator(), 0.0)
    req.pages, req.num_computed = list(pages), computed
    return req


# -- slot rows -----------------------------------------------------------------------------------

def rows(cm: CacheManager, table: list[list[int]], seq: list[int], pos: list[int]) -> list[int]:
    bt = torch.tensor(table, dtype=torch.int32)
    return cm.slot_rows(bt, torch.tensor(seq, dtype=torch.int32), torch.tensor(pos)).tolist()


def test_slot_rows_golden():
    cm = CacheManager(16, 4)
    # page size 4, block table [7, 2]: positions 0..3 in page 7 (rows 28..31), 4..5 in page 2
    assert rows(cm, [[7, 2]], [0] * 6, list(range(6))) == [28, 29, 30, 31, 8, 9]
    # two sequences in one step: (seq, position) -> row
    table = [[7, 2], [3, 5]]
    assert rows(cm, table, [0, 0, 1, 1, 1], [3, 4, 0, 4, 7]) == [31, 8, 12, 20, 23]
    # an int sequence index
    assert cm.slot_rows(torch.tensor(table, dtype=torch.int32), 1,
                        torch.tensor([5])).tolist() == [21]
    # page size 3: the boundary moves with the page size
    cm3 = CacheManager(16, 3)
    assert rows(cm3, [[4, 1]], [0] * 5, list(range(5))) == [12, 13, 14, 3, 4]
    # page size 1: the block table is the row list
    cm1 = CacheManager(16, 1)
    assert rows(cm1, [[9, 0, 5]], [0] * 3, [0, 1, 2]) == [9, 0, 5]


def test_pages_for():
    cm = CacheManager(8, 4)
    assert [cm.pages_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


# -- the key rule --------------------------------------------------------------------------------

def test_position_and_page_keys_golden():
    cm = CacheManager(8, 4)
    assert cm.prefix_keys([5, 6, 7, 8, 9], 3) == [5, 6, 7]
    assert cm.prefix_keys([5, 6, 7], 9) == [5, 6, 7]  # fewer when the tokens run out
    assert cm.page_keys("t", list(range(10, 20)), 0, 2) == [(10, 11, 12, 13), (14, 15, 16, 17)]
    assert cm.page_keys("t", list(range(10, 20)), 1, 2) == [(14, 15, 16, 17)]
    assert cm.page_keys("t", torch.tensor([1, 2, 3, 4]), 0, 1) == [(1, 2, 3, 4)]
    with pytest.raises(TypeError, match=r"glm5 t: argument 'tokens' expected a flat sequence"):
        cm.page_keys("t", [[1, 2], [3, 4]], 0, 1)
    # with MTP a position's key is (its token, the next token); the last known token has none
    mtp = CacheManager(8, 4, mtp=True)
    assert mtp.prefix_keys([1, 2, 3], 3) == [(1 << 32) | 2, (2 << 32) | 3]
    assert mtp.prefix_keys([1, 2, 3, 4], 2) == [(1 << 32) | 2, (2 << 32) | 3]
    req = request([1, 2, 3, 4, 5], [], 0)
    assert mtp.request_keys(req, 2) == [(1 << 32) | 2, (2 << 32) | 3]
    assert cm.request_keys(req, 2) == [1, 2]


A = list(range(100, 110))  # 10 tokens: 2 full pages of 4 + a partial page of 2


def test_full_pages_are_shared_a_partial_page_is_not():
    cm = CacheManager(16, 4)
    a = request(A, cm.alloc(3), 10)
    cm.cache_request(a)
    assert cm.radix.num_cached_pages == 2 and a.pages == [0, 1, 2] and 2 not in cm.radix
    # a request sharing the 2 full pages hits both: 8 tokens
    pages, n = cm.match_request(request(A[:8] + [1, 2, 3], [], 0, "b"))
    assert (pages, n) == ([0, 1], 8)
    cm.release(pages)
    # the same 10 tokens: the partial third page was never cached
    pages, n = cm.match_request(request(A, [], 0, "c"))
    assert (pages, n) == ([0, 1], 8)
    cm.release(pages)
    # one token differs in page 2 (position 7): only page 1 hits
    pages, n = cm.match_request(request(A[:7] + [0] + A[8:], [], 0, "d"))
    assert (pages, n) == ([0], 4)
    cm.release(pages)
    # one token differs in page 1 (position 0): nothing
    assert cm.match_request(request([0] + A[1:], [], 0, "e")) == ([], 0)
    # 7 tokens: one full page to match
    pages, n = cm.match_request(request(A[:7], [], 0, "f"))
    assert (pages, n) == ([0], 4)
    cm.release(pages)
    assert refs(cm)[:3] == [2, 2, 1]  # the tree + request a; page 2 is a's alone


def test_only_computed_full_pages_are_cached():
    cm = CacheManager(16, 4)
    a = request(A, cm.alloc(3), 7)  # positions 0..6 computed: one full page
    cm.cache_request(a)
    assert cm.radix.num_cached_pages == 1 and 0 in cm.radix and 1 not in cm.radix
    a.num_computed = 8  # the second page is now full
    cm.cache_request(a)
    assert cm.radix.num_cached_pages == 2 and 1 in cm.radix


def test_mtp_keys_need_the_next_token():
    """With MTP a page's last position is keyed with the token after it: a request whose token
    after page 2 differs reuses page 1 only; without MTP it reuses both."""
    for mtp, want in ((False, ([0, 1], 8)), (True, ([0], 4))):
        cm = CacheManager(16, 4, mtp=mtp)
        a = request(A, cm.alloc(3), 9)
        cm.cache_request(a)
        assert cm.radix.num_cached_pages == 2
        got = cm.match_request(request(A[:8] + [7, 7], [], 0, "b"))
        assert got == want, mtp
    # with MTP, 8 computed positions of 8 known tokens: the 8th has no key yet, 1 page cached
    cm = CacheManager(16, 4, mtp=True)
    cm.cache_request(request(A[:8], cm.alloc(2), 8))
    assert cm.radix.num_cached_pages == 1


def test_disabled_prefix_cache_caches_nothing():
    cm = CacheManager(8, 4, enable_prefix_cache=False)
    a = request(A, cm.alloc(3), 10)
    cm.cache_request(a)
    assert cm.radix.num_cached_pages == 0 and cm.match_request(a) == ([], 0)


# -- page accounting -----------------------------------------------------------------------------

def test_alloc_release_evict_accounting():
    cm = CacheManager(4, 2)
    table = cm.alloc(3)
    assert table == [0, 1, 2] and cm.allocator.num_free == 1 and cm.available_pages() == 1
    a = request([1, 2, 3, 4, 5], table, 5)  # pages 0, 1 full, page 2 partial
    cm.cache_request(a)
    assert refs(cm) == [2, 2, 1, 0] and cm.available_pages() == 1
    cm.release(a.pages)
    assert refs(cm) == [1, 1, 0, 0] and cm.allocator.num_free == 2
    assert cm.available_pages() == 4  # 2 free + 2 only the tree holds
    # 3 pages, 2 free: the least recently used leaf (page 1) is evicted first
    assert cm.alloc(3) == [1, 2, 3]
    assert 0 in cm.radix and 1 not in cm.radix and cm.available_pages() == 1
    # 2 pages, none free, 1 evictable: OutOfPages, nothing allocated; the evicted page is free
    with pytest.raises(OutOfPages) as e:
        cm.alloc(2)
    assert (e.value.requested, e.value.free) == (2, 1)
    assert refs(cm) == [0, 1, 1, 1] and cm.radix.num_cached_pages == 0
    cm.release([1, 2, 3])
    cm.release([])
    assert cm.allocator.num_free == 4 == cm.available_pages()


def test_pages_held_by_a_request_are_not_evicted():
    cm = CacheManager(3, 2)
    a = request([1, 2, 3, 4], cm.alloc(2), 4)
    cm.cache_request(a)  # the tree and a hold pages 0, 1
    assert cm.available_pages() == 1
    with pytest.raises(OutOfPages):
        cm.alloc(2)
    assert refs(cm) == [2, 2, 0] and cm.radix.num_cached_pages == 2
    cm.reset_prefix_cache()
    assert refs(cm) == [1, 1, 0] and cm.radix.num_cached_pages == 0


def test_bad_arguments():
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"CacheManager: argument 'page_size' expected"):
            CacheManager(4, bad)
    with pytest.raises(ValueError, match=r"'num_pages' expected an int >= 1"):
        CacheManager(0, 4)
    assert CacheManager(4, 2).pool is None


# -- the engine's wiring -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    torch.manual_seed(0)
    model = GLM5ForCausalLM(preset("tiny")).float().eval()
    return LLMEngine(model, EngineConfig(page_size=4, num_pages=32, max_num_batched_tokens=32,
                                         chunk_size=8))


def test_engine_parts_are_the_managers(engine):
    cm = engine.cache
    assert engine.pool is cm.pool and engine.allocator is cm.allocator
    assert engine.radix is cm.radix and engine.runner.pool is cm.pool
    assert engine.scheduler.cache is cm and engine.radix.cache is cm
    assert engine.page_size == cm.page_size == 4 == cm.pool.page_size
    assert cm.num_pages == 32 and cm.pool.num_pages == 32
    # the manager is the one object holding the page size
    for part in (engine, engine.scheduler, engine.runner, engine.radix, engine.pool,
                 engine.runner.graphs):
        if part is not None:
            assert not {"page_size", "ps"} & set(vars(part)), type(part).__name__
    assert vars(cm)["page_size"] == 4


def test_engine_serves_through_the_manager(engine):
    prompt = list(range(3, 13))  # 10 tokens: 2 full pages
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompt, params)
    while engine.has_unfinished():
        engine.step()
    cm = engine.cache
    assert cm.radix.num_cached_pages >= 2
    assert cm.allocator.num_free + cm.radix.num_cached_pages == cm.num_pages
    engine.add_request("b", prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.stats.prompt_tokens_hit == 8
