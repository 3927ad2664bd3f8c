"""The serving engine: requests in, tokens out, one `step` at a time.

Each step the scheduler picks the running batch (continuous batching, chunked prefill, the
token budget), the model runs once over every scheduled token on the paged cache, the
sequences that reached their end are sampled (with MTP drafts verified), the MTP layer drafts
the next tokens, and finished requests give their pages to the prefix cache. `glm5.LLM` and
`glm5 serve` drive this loop.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

from glm5 import ops
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.graphs import (DEFAULT_BUCKETS, Capture, CudaGraphCapture, DecodeGraphs,
                                check_buckets)
from glm5.engine.cache_manager import CacheManager
from glm5.engine.outputs import OUTPUT_KINDS, RequestOutput, TokenLogprob
from glm5.engine.pages import from_cache
from glm5.engine.request import Request, Status
from glm5.engine.runner import Batch, ModelRunner, make_batch
from glm5.engine.sampling import (SamplingParams, find_stop, make_generator, sample_tokens,
                                  speculative_verify, target_probs, token_logprobs)
from glm5.engine.scheduler import Item, Scheduler
from glm5.engine.step_budget import PrefillBudget
from glm5.ir.opdef import strict_mode


@dataclass
class EngineConfig:
    """The engine's settings (the GLM-5 production values are the defaults)."""

    max_num_seqs: int = 256  # sequences in the running batch
    max_num_batched_tokens: int = 8192  # tokens per step (decodes + prefill chunks)
    chunk_size: int = 512  # prefill tokens per request and step (256-1024: tail latency)
    # While decodes run, a step that carries prefill tokens takes at most this multiple of a
    # decode-only step (measured; glm5.engine.step_budget); None: chunk_size alone bounds it.
    max_decode_slowdown: float | None = 2.5
    min_prefill_tokens: int = 16  # the smallest prefill allowance of a step (progress)
    page_size: int = 64  # tokens per cache page
    num_pages: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 2 * 2**30
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    num_speculative_tokens: int = 0  # MTP drafts per decode step (0: no MTP)
    long_prompt_tokens: int = 32768  # prompts longer than this are admitted under ...
    long_prompt_qps: float = 0.5  # ... their own rate limit (requests per second) ...
    long_prompt_burst: int = 2  # ... with this many at once
    seed: int | None = None  # the generator of requests without a seed of their own
    # Decode steps replayed from CUDA graphs (glm5.engine.graphs): None = on for a model on a
    # CUDA device (off under GLM5_STRICT=1, whose value checks cannot be captured), off
    # elsewhere; True requires a CUDA device. A decode batch is padded up to the next bucket.
    cuda_graphs: bool | None = None
    cuda_graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS

    def __post_init__(self) -> None:
        for f in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "page_size",
                  "kv_cache_bytes", "long_prompt_tokens", "long_prompt_burst",
                  "min_prefill_tokens"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"glm5 EngineConfig: argument {f!r} expected an int >= 1, "
                                 f"got {v!r}")
        for f in ("num_pages", "max_model_len"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"glm5 EngineConfig: argument {f!r} expected None or an int "
                                 f">= 1, got {v!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 8:
            raise ValueError(f"glm5 EngineConfig: argument 'num_speculative_tokens' expected an "
                             f"int in [0, 8], got {k!r}")
        if not (isinstance(self.long_prompt_qps, (int, float)) and self.long_prompt_qps > 0
                and math.isfinite(self.long_prompt_qps)):
            raise ValueError(f"glm5 EngineConfig: argument 'long_prompt_qps' expected a finite "
                             f"number > 0, got {self.long_prompt_qps!r}")
        m = self.max_decode_slowdown
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float))
                              or not 1 < m < math.inf):
            raise ValueError(f"glm5 EngineConfig: argument 'max_decode_slowdown' expected None "
                             f"or a finite number > 1, got {m!r}")
        if not (self.cuda_graphs is None or isinstance(self.cuda_graphs, bool)):
            raise ValueError(f"glm5 EngineConfig: argument 'cuda_graphs' expected None, True or "
                             f"False, got {self.cuda_graphs!r}")
        self.cuda_graph_buckets = check_buckets(self.cuda_graph_buckets, "EngineConfig")
        if self.chunk_size > self.max_num_batched_tokens:
            raise ValueError(f"glm5 EngineConfig: argument 'chunk_size' expected <= "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}, got "
                             f"{self.chunk_size}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class RequestRejected(ValueError):
    """A request the engine will not take: ``status`` 400 (malformed or too long), 429 (over
    the long-prompt rate limit; ``retry_after`` seconds) or 503 (shutting down)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after, self.param = status, retry_after, param


class _RateLimit:
    """A token bucket: ``burst`` requests at once, refilled at ``qps`` per second."""

    def __init__(self, qps: float, burst: int) -> None:
        self.qps, self.burst = qps, burst
        self.tokens, self.t = float(burst), time.monotonic()

    def take(self) -> float | None:
        """None when admitted, else the seconds until a request would be."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.qps)
        self.t = now
        if self.tokens >= 1:
            self.tokens -= 1
            return None
        return (1 - self.tokens) / self.qps


@dataclass
class EngineStats:
    """Counters since the engine started (the server's /metrics reads them)."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    generation_tokens: int = 0
    drafted: int = 0  # MTP drafts verified / accepted
    accepted: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    rejected: int = 0


class LLMEngine:
    """``add_request`` / ``step`` / ``abort`` over one model (any backend the model runs on).

    ``tokenizer`` (a `glm5.text.tokenizer.Tokenizer`, optional): text prompts, output text,
    stop strings and the end-of-sequence ids; without one the engine works on token ids and
    stops on the model config's ``eos_token_id``.
    """

    def __init__(self, model: GLM5ForCausalLM, config: EngineConfig | None = None,
                 tokenizer: Any = None, backend: str | None = None) -> None:
        cfg = config or EngineConfig()
        mc = model.config
        if mc.dsa_selection != "token":
            raise ValueError(f"glm5 engine: the paged cache supports dsa_selection='token', the "
                             f"model has {mc.dsa_selection!r}")
        if cfg.num_speculative_tokens and model.mtp is None:
            raise ValueError("glm5 engine: num_speculative_tokens needs a checkpoint with an MTP "
                             "layer (this model has none)")
        self.model, self.config, self.tokenizer = model.eval(), cfg, tokenizer
        self.backend = backend  # ops run under glm5.use_backend(backend) (every thread)
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        # The cache manager owns the page size, pages, pools and prefix cache. Beyond the pages
        # it hands out, the pool holds scratch pages for the padded rows of a decode graph
        # (fewer than the largest bucket).
        self.cache = CacheManager.for_model(
            model, cfg.page_size, cfg.num_pages, cfg.kv_cache_bytes,
            mtp=cfg.num_speculative_tokens > 0, scratch_rows=max(cfg.cuda_graph_buckets) - 1,
            enable_prefix_cache=cfg.enable_prefix_cache)
        budget = None if cfg.max_decode_slowdown is None else PrefillBudget(
            cfg.max_decode_slowdown, min(cfg.min_prefill_tokens, cfg.chunk_size), cfg.chunk_size)
        self.scheduler = Scheduler(self.cache, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.chunk_size, cfg.num_speculative_tokens, budget=budget)
        self.runner = ModelRunner(model, self.cache)
        self.runner.graphs = self._graphs(cfg)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._long = _RateLimit(cfg.long_prompt_qps, cfg.long_prompt_burst)
        self._gen = make_generator(cfg.seed, "cpu")
        if tokenizer is not None:
            self.eos_ids = frozenset(tokenizer.eos_token_ids)
        else:
            eos = mc.eos_token_id
            self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int)
                                     else eos)
        self._aborts: list[str] = []
        self._outputs: list[RequestOutput] = []
        # A step whose forward raises runs each request alone so that one bad request fails
        # alone. Ranks in lockstep (glm5.engine.lockstep) turn it off: a rank that retries alone
        # would issue collectives the others never match.
        self.isolate_failures = True
        # The version of the weights the model holds; every sampled token records it (RL rollouts
        # keep it per token to bound staleness). `set_weights_version` moves it.
        self.weights_version = 0

    # The cache manager's parts, under the names the server, RL and tests read.
    pool = from_cache("pool")
    allocator = from_cache("allocator")
    radix = from_cache("radix")
    page_size = from_cache("page_size")

    def _graphs(self, cfg: EngineConfig) -> DecodeGraphs | None:
        dev = self.model.device
        on = cfg.cuda_graphs
        if on and dev.type != "cuda":
            raise ValueError(f"glm5 EngineConfig: cuda_graphs=True needs the model on a CUDA "
                             f"device, it is on {dev}")
        if on is None:
            on = dev.type == "cuda" and not strict_mode()
        if not on:
            return None
        return self.decode_graphs(CudaGraphCapture(dev), cfg.cuda_graph_buckets)

    def decode_graphs(self, capture: Capture, buckets: Sequence[int] = DEFAULT_BUCKETS
                      ) -> DecodeGraphs:
        """Captured decode steps over this engine's model and pool (``capture``:
        `CudaGraphCapture` on a GPU; tests pass `EagerCapture` and set ``runner.graphs``)."""
        return DecodeGraphs(self.runner.main, self.model.device, buckets,
                            self.model.config.index_topk, self.cache.page_size,
                            self.cache.pages_for(self.max_model_len), self.pool.scratch_pages,
                            capture)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *,
                    output_kind: str = "cumulative", rate_limit: bool = True) -> None:
        """Queue a request; raises `RequestRejected` (nothing queued) when it cannot be served.
        ``output_kind``: "cumulative" (every output carries the tokens and text so far) or
        "delta" (only the final output does; see `RequestOutput`). ``rate_limit`` False: a
        long prompt is not counted against the long-prompt rate (a rank that replays what a
        front already admitted)."""
        params = params or SamplingParams()
        ids = self.check_request(request_id, prompt, params, output_kind=output_kind,
                                 rate_limit=rate_limit)
        self._add(request_id, ids, params, output_kind)

    def check_request(self, request_id: str, prompt: str | Sequence[int],
                      params: SamplingParams, *, output_kind: str = "cumulative",
                      rate_limit: bool = True) -> list[int]:
        """What `add_request` checks before it queues, without queueing: the prompt's token ids,
        or `RequestRejected` (a data-parallel front checks here for a rank of the same
        config). ``rate_limit``: take a long prompt's admission from the rate limit."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"glm5 engine: params expected SamplingParams, got "
                            f"{type(params).__name__}")
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"glm5 engine add_request: output_kind expected one of "
                             f"{OUTPUT_KINDS}, got {output_kind!r}")
        if request_id in self.requests:
            raise self._reject(400, f"glm5 engine: request id {request_id!r} is already in use",
                               "request_id")
        ids = self._prompt_ids(prompt)
        n, ctx = len(ids), self.max_model_len
        if n >= ctx:
            raise self._reject(400, f"glm5 engine: the prompt has {n} tokens; this model's "
                               f"context is {ctx} tokens (prompt + at least 1 generated)",
                               "prompt")
        if n + params.max_tokens > ctx:
            raise self._reject(400, f"glm5 engine: the prompt has {n} tokens and max_tokens is "
                               f"{params.max_tokens}; together they exceed this model's "
                               f"context of {ctx} tokens", "max_tokens")
        k = self.config.num_speculative_tokens
        need = self.cache.pages_for(n + params.max_tokens + 2 * k)
        if need > self.cache.num_pages:
            raise self._reject(400, f"glm5 engine: the request needs up to {need} cache pages of "
                               f"{self.cache.page_size} tokens; the cache has "
                               f"{self.cache.num_pages} (raise "
                               f"num_pages / kv_cache_bytes or lower max_tokens)", "max_tokens")
        if rate_limit and n > self.config.long_prompt_tokens:
            wait = self._long.take()
            if wait is not None:
                raise self._reject(429, f"glm5 engine: prompts longer than "
                                   f"{self.config.long_prompt_tokens} tokens are admitted at "
                                   f"{self.config.long_prompt_qps:g} per second; retry in "
                                   f"{wait:.1f} s", "prompt", retry_after=wait)
        return ids

    def _add(self, request_id: str, ids: list[int], params: SamplingParams,
             output_kind: str) -> None:
        gen = (make_generator(params.seed, "cpu") if params.seed is not None
               else make_generator(int(torch.randint(0, 2**62, (1,), generator=self._gen)),
                                   "cpu"))
        dec = self.tokenizer.incremental_decoder() if self.tokenizer is not None else None
        req = Request(request_id, ids, params, gen, time.monotonic(), dec, output_kind)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.stats.prompt_tokens += len(ids)

    def _reject(self, status: int, msg: str, param: str | None,
                retry_after: float | None = None) -> RequestRejected:
        self.stats.rejected += 1
        return RequestRejected(status, msg, retry_after, param)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise self._reject(400, "glm5 engine: a text prompt needs a tokenizer (the model "
                                   "directory's tokenizer.json); pass token ids instead",
                                   "prompt")
            try:
                ids = self.tokenizer.encode(prompt)
            except (TypeError, ValueError, UnicodeError) as e:  # e.g. a lone surrogate
                raise self._reject(400, f"glm5 engine: the prompt cannot be tokenized: "
                                   f"{type(e).__name__}: {e}", "prompt") from None
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise self._reject(400, "glm5 engine: prompt expected a string or a list of "
                                   "token ids", "prompt") from None
            if any(isinstance(t, bool) for t in prompt) or any(
                    int(t) != t for t in prompt if isinstance(t, float)):
                raise self._reject(400, "glm5 engine: prompt token ids expected ints", "prompt")
        if not ids:
            raise self._reject(400, "glm5 engine: the prompt is empty (at least one token is "
                               "needed)", "prompt")
        V = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise self._reject(400, f"glm5 engine: prompt token ids expected in [0, {V}), got "
                               f"{bad[0]}", "prompt")
        return ids

    def abort(self, request_id: str) -> None:
        """Stop a request (its pages are freed in the next step). Unknown ids are ignored: the
        request may have finished meanwhile."""
        self._aborts.append(request_id)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request with ``message`` as its error (finish_reason "error"); their
        final outputs (the engine could not step: its steps cannot go on)."""
        for req in list(self.requests.values()):
            req.error = message
            self._finish(req, "error")
        out, self._outputs = self._outputs, []
        return out

    def snapshot(self) -> dict:
        """The engine's gauges and counters, one consistent dict (what ``/metrics`` shows)."""
        s = self.scheduler.stats
        return {"waiting": self.num_waiting, "running": self.num_running,
                "free_pages": self.allocator.num_free, "num_pages": self.allocator.num_pages,
                "cached_pages": self.radix.num_cached_pages,
                "prefix_queried_tokens": s.prompt_tokens_queried,
                "prefix_hit_tokens": s.prompt_tokens_hit, "prefill_tokens": s.prefill_tokens,
                "preemptions": s.preemptions, **vars(self.stats)}

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborts)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def set_weights_version(self, version: int) -> None:
        """Record that the model's weights changed to ``version`` (call between steps, after
        changing them). Tokens sampled from now on carry it; the prefix cache is emptied, as
        its keys and values came from the old weights (requests in flight keep theirs)."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"glm5 engine set_weights_version: version expected an int, got "
                            f"{version!r}")
        self.cache.reset_prefix_cache()
        self.weights_version = version

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of every request that produced tokens or finished."""
        for rid in self._aborts:
            req = self.requests.get(rid)
            if req is not None:
                req.aborted = True
                self._finish(req, "abort")
                self.stats.aborted += 1
        self._aborts = []
        items = self.scheduler.schedule()
        if items:
            self.stats.steps += 1
            now = time.monotonic()
            for it in items:
                if it.req.metrics.first_scheduled is None:
                    it.req.metrics.first_scheduled = now
            try:
                t0 = time.perf_counter()
                with self._backend():
                    self._run(items)
                self._observe(items, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - isolate: run each request alone
                if not self.isolate_failures or getattr(e, "fatal_to_step", False):
                    raise
                for it in items:
                    try:
                        with self._backend():
                            self._run([it])
                    except Exception as e:  # noqa: BLE001 - this request fails, not the rest
                        it.req.error = f"{type(e).__name__}: {e}"
                        self._finish(it.req, "error")
                        self.stats.failed += 1
        out, self._outputs = self._outputs, []
        return out

    def _observe(self, items: list[Item], seconds: float) -> None:
        """Feed the step's time to the prefill budget (decode-only steps set its reference)."""
        budget = self.scheduler.budget
        if budget is not None and seconds > 0:
            n_decode = sum(it.decode for it in items)
            budget.observe(n_decode, sum(len(it.tokens) for it in items if not it.decode),
                           seconds)

    @contextlib.contextmanager
    def _backend(self):
        """The engine's backend (if it names one), and the dispatch environment read once for
        the step (`glm5.ops.frozen_dispatch`)."""
        with (ops.use_backend(self.backend) if self.backend else contextlib.nullcontext()), \
                ops.frozen_dispatch():
            yield

    def _run(self, items: list[Item]) -> None:
        """Forward, sample, draft; then commit. Nothing about a request changes unless every
        part succeeded (the cache rows written are rewritten when the request runs again).

        Host reads (synchronisations on a device): one per step without MTP drafts, the
        sampled tokens with the logits' finiteness flags (`_sample`); see docs/performance.md
        for the reads MTP and logprobs add."""
        out = None if self.config.num_speculative_tokens else self.runner.decode(items)
        batch = None
        if out is not None:  # a captured decode graph: one logits row per item
            logits, hn = out
            owner = list(range(len(items)))
        else:
            batch = make_batch(items, self.model.device)
            rows, owner = [], []  # logits rows: the last token of a sampled item and its drafts
            for i, it in enumerate(items):
                if it.sample:
                    n_draft = len(it.tokens) - 1 if it.req.num_tokens - it.start == 1 else 0
                    end = batch.offsets[i + 1]
                    rows += range(end - 1 - n_draft, end)
                    owner += [i] * (n_draft + 1)
            row_t = torch.tensor(rows, dtype=torch.long, device=self.model.device)
            logits, hn = self.runner.forward(batch, row_t)
        new_tokens, fails = self._sample(items, logits, owner) if owner else ({}, {})
        drafts = self._draft(items, batch, hn, new_tokens, fails) if batch is not None else {}
        self._commit(items, new_tokens, fails, drafts, logits, owner)

    # ------------------------------------------------------------------ sampling
    def _sample(self, items: list[Item], logits: torch.Tensor, owner: list[int]
                ) -> tuple[dict[int, list[tuple[int, int]]], dict[int, str]]:
        """{item: [(token, logits row), ...]} of the new tokens of each sampled item (accepted
        drafts, then the bonus or the correction), and {item: error} for items whose logits
        are not finite.

        One host read per draft depth verified (one in all without drafts): the tokens, the
        acceptances and, at depth 0, every row's finiteness, in one transfer. Rows that are
        not finite are sampled from zeros meanwhile (so no kernel meets a NaN) and their items
        fail."""
        first: dict[int, int] = {}
        for r, i in enumerate(owner):
            first.setdefault(i, r)
        dev = logits.device
        finite = torch.isfinite(logits).all(-1)
        safe = torch.where(finite[:, None], logits, logits.new_zeros(()))
        fails: dict[int, str] = {}
        out: dict[int, list[tuple[int, int]]] = {i: [] for i in first}
        pending = list(first)  # items still verifying drafts at this depth
        depth = 0
        while pending:
            with_draft = [i for i in pending if depth < self._n_drafts(items[i])]
            plain = [i for i in pending if depth >= self._n_drafts(items[i])]
            parts = []
            if plain:  # no draft left: sample the next token from this row
                r = torch.tensor([first[i] + depth for i in plain], device=dev)
                parts.append(sample_tokens(safe[r], [items[i].req.params for i in plain],
                                           [items[i].req.generator for i in plain]))
            if with_draft:
                r = torch.tensor([first[i] + depth for i in with_draft], device=dev)
                d = torch.tensor([items[i].tokens[1 + depth] for i in with_draft], device=dev)
                q = [items[i].req.draft_probs[depth] for i in with_draft]
                qt = None  # greedy rows verify by argmax; their row of qt is not read
                if any(x is not None for x in q):
                    ref = next(x for x in q if x is not None)
                    qt = torch.stack([ref.new_zeros(ref.shape) if x is None else x for x in q])
                ok, tok = speculative_verify(safe[r], d, qt,
                                             [items[i].req.params for i in with_draft],
                                             [items[i].req.generator for i in with_draft])
                parts += [tok, ok.long()]
            if depth == 0:
                parts.append(finite.long())
            host = torch.cat(parts).tolist()  # the read
            if depth == 0:
                fin = host[len(host) - len(owner):]
                for i, r0 in first.items():
                    if not all(fin[r0:r0 + 1 + self._n_drafts(items[i])]):
                        fails[i] = "the model's logits are not finite (NaN or inf)"
            n_p, n_d = len(plain), len(with_draft)
            for j, i in enumerate(plain):
                out[i].append((host[j], first[i] + depth))
            nxt = []
            for j, i in enumerate(with_draft):
                out[i].append((host[n_p + j], first[i] + depth))
                if host[n_p + n_d + j] and i not in fails:
                    nxt.append(i)
            pending = nxt
            depth += 1
        return {i: v for i, v in out.items() if i not in fails}, fails

    @staticmethod
    def _n_drafts(it: Item) -> int:
        return len(it.tokens) - 1 if it.req.num_tokens - it.start == 1 else 0

    # ------------------------------------------------------------------ MTP drafts
    def _draft(self, items: list[Item], batch: Batch, hn: torch.Tensor,
               new_tokens: dict[int, list[tuple[int, int]]], fails: dict[int, str]
               ) -> dict[int, tuple[list[int], list[torch.Tensor | None]]]:
        """The MTP layer over every position the main model kept this step (hidden state at i,
        token at i + 1), then ``num_speculative_tokens`` drafts for each sampled sequence (one
        host read per draft depth: the drafted tokens)."""
        k = self.config.num_speculative_tokens
        if not k:
            return {}
        rows, nxt, pos, seq, last = [], [], [], [], {}
        for i, it in enumerate(items):
            if i in fails:
                continue
            toks = [t for t, _ in new_tokens.get(i, [])]
            # the positions kept (a decode keeps its accepted drafts) and the tokens that
            # follow them (positions start + 1 .. start + kept)
            if self._n_drafts(it):
                kept, follow = len(toks), toks
            elif it.sample:
                kept, follow = len(it.tokens), it.tokens[1:] + toks[-1:]
            else:
                kept = len(it.tokens)
                follow = it.req.tokens(it.start + 1, it.start + kept + 1)
            base = batch.offsets[i]
            rows += range(base, base + kept)
            nxt += follow[:kept]
            pos += range(it.start, it.start + kept)
            seq += [i] * kept
            if it.sample:
                last[i] = len(rows) - 1
        if not rows:
            return {}
        dev = hn.device
        pos_t = torch.tensor(pos, device=dev)
        seq_t = torch.tensor(seq, dtype=torch.int32, device=dev)
        sel = list(last)
        # int64 even when empty: torch.tensor([]) is float and cannot index
        last_t = torch.tensor([last[i] for i in sel], dtype=torch.long, device=dev)
        logits, h = self.runner.mtp(batch, hn[torch.tensor(rows, device=dev)],
                                    torch.tensor(nxt, device=dev), pos_t, seq_t, last_t,
                                    max_range=max(pos) + 1)
        if not sel:  # only prefill chunks: their MTP cache rows are written, nothing to draft
            return {}
        drafts: dict[int, tuple[list[int], list[torch.Tensor | None]]] = {i: ([], []) for i in sel}
        hid = h[last_t]
        p_host = [pos[last[i]] for i in sel]
        p_pos = pos_t[last_t]
        for depth in range(k):
            params = [items[i].req.params for i in sel]
            s = sample_tokens(logits, params, [items[i].req.generator for i in sel])
            greedy = all(p.greedy for p in params)
            q = None if greedy else target_probs(logits, params)
            for j, (i, t) in enumerate(zip(sel, s.tolist())):  # the read
                drafts[i][0].append(t)
                drafts[i][1].append(None if q is None or params[j].greedy else q[j])
            if depth + 1 == k:
                break
            p_pos = p_pos + 1  # the draft's position: its MTP entry, drafted recursively
            p_host = [p + 1 for p in p_host]
            seq_sel = torch.tensor(sel, dtype=torch.int32, device=dev)
            logits, hid = self.runner.mtp(batch, hid, s.to(dev), p_pos, seq_sel,
                                          torch.arange(len(sel), device=dev),
                                          max_range=max(p_host) + 1)
        return drafts

    # ------------------------------------------------------------------ commit
    def _commit(self, items, new_tokens, fails, drafts, logits, owner) -> None:
        now = time.monotonic()
        lps = self._logprobs(items, new_tokens, fails, logits)
        for i, it in enumerate(items):
            req = it.req
            if i in fails:
                req.error = f"glm5 engine: {fails[i]}"
                self._finish(req, "error")
                self.stats.failed += 1
                continue
            # An error here fails this request alone: raising would make `step` run the whole
            # step again item by item, committing the requests before this one twice.
            try:
                self._commit_one(i, it, new_tokens, drafts, lps.get(i), now)
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer rejecting an id
                req.error = f"{type(e).__name__}: {e}"
                self._finish(req, "error")
                self.stats.failed += 1

    def _logprobs(self, items: list[Item], new_tokens: dict[int, list[tuple[int, int]]],
                  fails: dict[int, str], logits: torch.Tensor) -> dict[int, list[TokenLogprob]]:
        """{item: the TokenLogprob of each new token} for the items whose requests ask for
        logprobs, from one `token_logprobs` over all their rows. Host reads: the logprobs, and
        with a top-n the ids and their logprobs (plus one where top-n values tie)."""
        want = [i for i, it in enumerate(items) if it.sample and i not in fails
                and it.req.logprobs is not None and new_tokens.get(i)]
        if not want:
            return {}
        rows = [r for i in want for _, r in new_tokens[i]]
        toks = [t for i in want for t, _ in new_tokens[i]]
        params = [items[i].req.params for i in want for _ in new_tokens[i]]
        dev = logits.device
        lp, top_i, top_l = token_logprobs(logits[torch.tensor(rows, device=dev)], params,
                                          torch.tensor(toks, device=dev))
        lp = lp.tolist()
        if top_i is not None:
            top_i, top_l = top_i.tolist(), top_l.tolist()
        out: dict[int, list[TokenLogprob]] = {}
        k = 0
        for i in want:
            n = items[i].req.params.logprobs or 0
            out[i] = []
            for t, _ in new_tokens[i]:
                top = list(zip(top_i[k][:n], top_l[k][:n])) if n else []
                out[i].append(TokenLogprob(t, lp[k], top))
                k += 1
        return out

    def _commit_one(self, i: int, it: Item, new_tokens, drafts,
                    lps: list[TokenLogprob] | None, now: float) -> None:
        """Item ``i``'s results: its cache progress, new tokens, logprobs (``lps``, from
        `_logprobs`), drafts, stops."""
        req = it.req
        n_draft = self._n_drafts(it)
        toks = new_tokens.get(i, [])
        req.num_computed = it.start + (len(toks) if n_draft else len(it.tokens))
        req.drafts, req.draft_probs = drafts.get(i, ([], []))
        if n_draft:
            req.metrics.num_drafted += n_draft
            req.metrics.num_accepted += len(toks) - 1
            self.stats.drafted += n_draft
            self.stats.accepted += len(toks) - 1
        if not it.sample:
            self.scheduler.cache_progress(req)
            return
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        for j, (t, _) in enumerate(toks):
            req.output_ids.append(t)
            req.output_versions.append(self.weights_version)
            self.stats.generation_tokens += 1
            if req.logprobs is not None:
                req.logprobs.append(lps[j])
            if self._stopped(req, t):
                break
        req.num_computed = min(req.num_computed, req.num_tokens)
        if req.finish_reason is not None:
            self._finish(req, req.finish_reason)
        else:
            self.scheduler.cache_progress(req)
            self._emit(req)

    def _stopped(self, req: Request, t: int) -> bool:
        """Update the request's text with token ``t``; True when it ends the request."""
        p = req.params
        if req.decoder is not None:
            start = len(req.text)
            req.text += req.decoder.push([t])
            if p.stop:
                hit = find_stop(req.text, p.stop, start)
                if hit is not None:
                    at, stop = hit
                    req.text = req.text[: at + len(stop) if p.include_stop_str_in_output else at]
                    req.finish_reason, req.stop_reason = "stop", stop
                    return True
        if t in p.stop_token_ids or (not p.ignore_eos and t in self.eos_ids):
            req.finish_reason, req.stop_reason = "stop", t
            return True
        if len(req.output_ids) >= p.max_tokens:
            req.finish_reason = "length"
            return True
        return False

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is Status.FINISHED:
            return
        req.finish_reason = reason
        req.metrics.finished = time.monotonic()
        if req.decoder is not None and not isinstance(req.stop_reason, str):
            req.text += req.decoder.flush()
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        if reason in ("stop", "length"):
            self.stats.finished += 1
        self._emit(req, finished=True)

    def _emit(self, req: Request, finished: bool = False) -> None:
        new_ids = req.output_ids[req.sent_tokens:]
        # While running, text that could be the start of a stop string is held back.
        hold = 0 if finished else max((len(s) for s in req.params.stop), default=1) - 1
        upto = max(len(req.text) - hold, req.sent_text)
        new_text = req.text[req.sent_text:upto]
        if not new_ids and not new_text and not finished:
            return
        new_lp = req.logprobs[req.sent_tokens:] if req.logprobs is not None else None
        new_versions = req.output_versions[req.sent_tokens:]
        req.sent_tokens, req.sent_text = len(req.output_ids), upto
        if finished or req.output_kind == "cumulative":
            self._outputs.append(RequestOutput(
                req.request_id, req.prompt_ids, list(req.output_ids), new_ids, req.text[:upto],
                new_text, list(req.logprobs) if req.logprobs is not None else None, new_lp,
                finished, req.finish_reason if finished else None,
                req.stop_reason if finished else None, req.error, req.metrics,
                token_versions=list(req.output_versions), new_token_versions=new_versions))
        else:  # "delta": what was sent before is not copied again (a stalled stream's backlog)
            self._outputs.append(RequestOutput(
                req.request_id, req.prompt_ids, [], new_ids, "", new_text,
                None, new_lp, False, None, None, req.error, req.metrics,
                new_token_versions=new_versions))

    # ------------------------------------------------------------------ offline
    def run_to_completion(self) -> list[RequestOutput]:
        """Step until every request has finished; the final output of each, in finishing order."""
        done = []
        while self.has_unfinished():
            done += [o for o in self.step() if o.finished]
        return done
