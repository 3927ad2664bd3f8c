"""Continuous batching: which requests run in the next step and how many of their tokens.

Every step the running requests (decodes: one token plus their MTP drafts; unfinished
prefills: a chunk) go first, then waiting requests are admitted while the step's token budget
(``max_num_batched_tokens``), the sequence limit (``max_num_seqs``) and the free pages allow.
Prefills are chunked (``chunk_size`` tokens per request and step), so a long prompt shares every
step with the running decodes instead of stalling them; while decodes run, the prefill tokens of
a step are further bounded by a `PrefillBudget` (glm5.engine.step_budget) when one is given: the
allowance that keeps the step within a multiple of a decode-only step's measured time. Pages come from the cache manager
(glm5.engine.cache_manager); when they run out it first evicts unreferenced prefix-cache pages
(LRU), and then the most recently admitted running request is preempted: its pages are freed
and it goes back to the front of the queue to be recomputed (prompt and generated tokens), so
no request is lost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from glm5.engine.cache_manager import CacheManager
from glm5.engine.pages import OutOfPages
from glm5.engine.request import Request, Status
from glm5.engine.step_budget import PrefillBudget


@dataclass
class Item:
    """One request's share of a step: tokens at positions start .. start + len(tokens) - 1."""

    req: Request
    start: int
    tokens: list[int]
    sample: bool  # the chunk reaches the request's last known token: sample after it
    decode: bool = False  # the request's last token (and drafts): not a prefill chunk


@dataclass
class SchedulerStats:
    prompt_tokens_queried: int = 0  # prompt tokens looked up in the prefix cache
    prompt_tokens_hit: int = 0
    prefill_tokens: int = 0  # tokens computed while not decoding (prompts and recomputes)
    preemptions: int = 0


class Scheduler:
    """Picks each step's items; pages, the prefix cache and the page size are ``cache``'s.
    ``copy_page`` (default: ``cache.copy_page``) copies a shared page into a private one;
    ``budget`` bounds the prefill tokens of a step while decodes run (None: ``chunk_size``
    per request only)."""

    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunk_size: int, num_speculative_tokens: int,
                 copy_page: Callable[[int, int], None] | None = None,
                 budget: PrefillBudget | None = None) -> None:
        self.cache = cache
        self.max_num_seqs, self.max_tokens, self.chunk = (max_num_seqs, max_num_batched_tokens,
                                                          chunk_size)
        self.k = num_speculative_tokens
        self.copy_page = copy_page or cache.copy_page
        self.budget = budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        """Release a finished (or aborted / failed) request: its fully computed pages go to the
        prefix cache, its references are dropped."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.cache_request(req)
        self._release(req)
        req.status = Status.FINISHED

    def _release(self, req: Request) -> None:
        self.cache.release(req.pages)
        req.pages = []

    # ------------------------------------------------------------------ pages
    def _pages_for(self, req: Request, n_positions: int) -> bool:
        """Make ``req``'s block table cover positions 0 .. n_positions - 1; False when the pages
        cannot be found without preempting ``req`` itself."""
        need = self.cache.pages_for(n_positions) - len(req.pages)
        while need > 0:
            try:
                req.pages += self.cache.alloc(need)  # evicts from the prefix cache first
                return True
            except OutOfPages:
                victim = self._victim()
                if victim is None or victim is req:
                    return False
                self._preempt(victim)
        return True

    def _victim(self) -> Request | None:
        """The running request admitted last that has no tokens in this step yet."""
        for r in reversed(self.running):
            if r.request_id not in self._scheduled:
                return r
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.drafts, req.draft_probs = [], []
        req.status = Status.WAITING
        req.metrics.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        self._preempted.append(req)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[Item]:
        self._preempted: list[Request] = []
        self._scheduled: set[str] = set()
        items: list[Item] = []
        budget = self.max_tokens
        decoding = any(not r.in_prefill for r in self.running)
        allow = None if self.budget is None else self.budget.allowance(decoding)
        self._prefill_left = self.max_tokens if allow is None else allow
        # Running requests first, oldest first: decodes and continuing prefills.
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted by an older request's page demand
                continue
            if req.in_prefill and self._prefill_left <= 0:
                continue  # the step's prefill allowance is spent: this chunk waits a step
            item = self._item(req, budget)
            if not self._pages_for(req, item.start + len(item.tokens) + max(self.k - 1, 0)):
                self._preempt(req)
                continue
            items.append(item)
            self._scheduled.add(req.request_id)
            budget -= len(item.tokens)
        # Then admit waiting requests in arrival order (preempted ones are at the front).
        prefilling = [r for r in self.running if r.in_prefill]
        deferred: list[Request] = []
        while (self.waiting and budget > 0 and self._prefill_left > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting.popleft()
            if req in self._preempted:  # not in the step that preempted it
                deferred.append(req)
                continue
            if self._shares_prefill(req, prefilling):
                deferred.append(req)  # its prefix will be cached in a step or two: wait
                continue
            self._admit_prefix(req)
            item = self._item(req, budget)
            need = item.start + len(item.tokens) + max(self.k - 1, 0)
            if not self._can_alloc(req, need):
                self._release(req)
                req.num_computed = 0
                deferred.append(req)
                break
            self._pages_for(req, need)
            hit = min(req.num_computed, len(req.prompt_ids))
            self.stats.prompt_tokens_queried += len(req.prompt_ids)
            self.stats.prompt_tokens_hit += hit
            if req.metrics.num_preemptions == 0:
                req.metrics.num_cached_prompt_tokens = hit
            req.status = Status.RUNNING
            self.running.append(req)
            self._scheduled.add(req.request_id)
            prefilling.append(req)
            items.append(item)
            budget -= len(item.tokens)
        self.waiting.extendleft(reversed(deferred))
        for it in items:
            # Prompt positions, and generated ones recomputed after a preemption (all but the
            # last, where decoding resumes). Not "more than one token left": a prompt's last
            # chunk can be a single token when the budget split it.
            end = max(len(it.req.prompt_ids), it.req.num_tokens - 1)
            self.stats.prefill_tokens += max(0, min(end, it.start + len(it.tokens)) - it.start)
        return items

    def _item(self, req: Request, budget: int) -> Item:
        start = req.num_computed
        left = req.num_tokens - start
        if left == 1:  # decoding: the last token and the drafts that follow it
            drafts = req.drafts[: max(budget - 1, 0)]
            req.drafts, req.draft_probs = drafts, req.draft_probs[: len(drafts)]
            return Item(req, start, [req.token(start)] + drafts, True, decode=True)
        n = min(left, self.chunk, budget, self._prefill_left)
        self._prefill_left -= n
        return Item(req, start, req.tokens(start, start + n), start + n == req.num_tokens)

    def _can_alloc(self, req: Request, n_positions: int) -> bool:
        """Whether a new request's pages can be found without preempting a running one."""
        need = self.cache.pages_for(n_positions) - len(req.pages)
        return need <= self.cache.available_pages()

    def _shares_prefill(self, req: Request, prefilling: list[Request]) -> bool:
        """Whether a request now prefilling starts with the same first page: admitting ``req``
        once that prefill is cached prefills the shared prompt once (a GRPO group)."""
        ps = self.cache.page_size
        if len(req.prompt_ids) <= ps or not self.cache.radix.enabled:
            return False
        head = req.prompt_ids[:ps]
        return any(r.prompt_ids[:ps] == head and r.num_computed < len(r.prompt_ids)
                   for r in prefilling)

    def _admit_prefix(self, req: Request) -> None:
        """Reuse the cached prefix of a request's tokens. At least its last token is computed
        (its logits are needed): a prefix covering every token gives up its last page, which
        is copied into a private page (copy on write) and only the last token is recomputed.
        (With MTP the keys reach one token further, so the match stops a page earlier.)"""
        pages, n = self.cache.match_request(req)
        if n >= req.num_tokens and pages:
            try:
                own = self.cache.alloc(1)  # evicts from the prefix cache first
            except OutOfPages:
                own = None
            if own is None:
                self.cache.release(pages[-1:])
                pages, n = pages[:-1], n - self.cache.page_size
            else:
                self.copy_page(pages[-1], own[0])
                self.cache.release(pages[-1:])
                pages = pages[:-1] + own
                n = req.num_tokens - 1
        req.pages = pages
        req.num_computed = n

    def cache_progress(self, req: Request) -> None:
        """After a step: put a prefilling request's newly completed pages in the prefix cache, so
        that requests sharing its prompt can start from them."""
        self.cache.cache_request(req)
