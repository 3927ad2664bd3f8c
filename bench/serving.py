"""Serving benchmark: `glm5.engine.LLMEngine` under closed-loop load, beside transformers'
`generate` on the same checkpoint, plus the issue's three serving targets, in one run.

    python bench/serving.py [--preset small] [--dtype float32] [--threads 1]
        [--concurrency 1,8,32,128] [--requests N] [--prompt-len 64,512] [--max-tokens 64]
        [--hf-batches 1,8] [--grpo-prompt 1024] [--long-len 16384] [--long-chunks 512,32]
        [--skip hf,grpo,long] [--breakdown] [--quick] [--out FILE.json]
    python bench/serving.py --report bench/results/serving_small.json   # its tables again
    python bench/serving.py --glm5-shaped --device cuda   # the GLM-5-shaped model on a GPU
    python bench/serving.py --glm5-shaped --device meta   # build it only (no data): its sizes

Random weights (the preset's own initialisation, ``--seed``), saved once with
``save_pretrained`` so that transformers loads the very same checkpoint.

* **Table** — for each concurrency c a fresh engine is driven in this process by a closed
  loop: c requests are in flight, and a new one is added as soon as one finishes
  (``--requests`` in all, at least 2c). Prompts are random token ids of lengths drawn
  uniformly from ``--prompt-len``; every request generates exactly ``--max-tokens`` tokens
  (greedy, ``ignore_eos``). Per request the bench records when it was added and when each
  step handed back its new tokens: time to first token (TTFT) = first tokens - added;
  per-token latency (ITL) = the time between two consecutive deliveries, divided over the
  tokens delivered (mean and P99 over all tokens of all requests); throughput = generated
  tokens / the wall time from the first request added to the last one finished; tokens per
  CPU-second (this process's CPU time over the same span: the figure that other processes on
  a shared machine disturb least); peak memory = growth of the process's resident-set
  high-water mark (VmHWM, reset when the run starts) on CPU, ``torch.cuda.max_memory_allocated``
  on CUDA. transformers' rows: ``generate`` (greedy, eager attention) on left-padded static
  batches of the same prompts; its per-token times come from a logits processor that stamps
  each decoding step.
* **Targets** (pass/fail with the measured ratio): throughput at c=32 >= 8x c=1; at c=8 >= 3x
  transformers' batch 8; a GRPO group (8 samples of one ``--grpo-prompt``-token prompt, all
  added at once) prefills >= 85% fewer tokens with the prefix cache than without
  (``scheduler.stats.prefill_tokens``, both runs here); while a ``--long-len``-token prompt is
  prefilled with the engine's default configuration (``chunk_size`` 512 and the prefill budget,
  ``max_decode_slowdown`` 2.5: glm5.engine.step_budget), the P99 per-token latency of
  ``--long-decoders`` requests decoding alongside stays <= 3x its P99 in the ``--long-window``
  steps before the prompt arrived, and the prompt's time to first token <= 1.5x its value when
  prefilled in one step (unchunked). Each run reports the windows before / during / after
  separately, the prefill tokens per step and the time of each op in each window; fixed chunk
  sizes (``--long-chunks``, no budget) run beside them for comparison.

The engine and transformers run at ``--threads`` threads (torch and TVM): on a machine busier
than its cores a parallel region waits for its slowest thread, so 1 thread is the steadier
choice there. ``--breakdown`` adds the seconds spent in each glm5 op during each table run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"c32_over_c1": 8.0, "c8_over_transformers_b8": 3.0, "grpo_prefill_reduction": 0.85,
           "long_prefill_p99_ratio": 3.0, "long_ttft_ratio": 1.5}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------- statistics
def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of ``xs`` with linear interpolation between order statistics
    (numpy's default); NaN for no data."""
    if not 0 <= q <= 100:
        raise ValueError(f"bench/serving.py percentile: q expected in [0, 100], got {q!r}")
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


@dataclass
class Trace:
    """One request as the benchmark saw it: when it was added, when each delivery of new tokens
    came back (clock seconds, number of tokens), when it finished."""

    arrival: float
    deliveries: list[tuple[float, int]] = field(default_factory=list)
    finished: float | None = None
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)  # every generated token, once finished

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.deliveries)

    def ttft(self) -> float | None:
        return self.deliveries[0][0] - self.arrival if self.deliveries else None

    def itl(self) -> list[float]:
        """Per-token latencies after the first delivery: a delivery of n tokens after a gap g
        gives n samples of g / n."""
        out: list[float] = []
        for (t0, _), (t1, n) in zip(self.deliveries, self.deliveries[1:]):
            out += [(t1 - t0) / n] * n
        return out


def summarize(traces: Sequence[Trace], wall_s: float, cpu_s: float) -> dict[str, float]:
    """The table's row: counts, throughput (generated tokens / ``wall_s``; per CPU-second of
    ``cpu_s``), mean / P99 per-token latency and time to first token (milliseconds)."""
    if wall_s <= 0:
        raise ValueError(f"bench/serving.py summarize: wall_s expected > 0, got {wall_s!r}")
    tokens = sum(t.tokens for t in traces)
    itl = [x for t in traces for x in t.itl()]
    ttft = [x for t in traces if (x := t.ttft()) is not None]
    return {"requests": len(traces), "tokens": tokens, "wall_s": wall_s, "cpu_s": cpu_s,
            "throughput": tokens / wall_s,
            "tokens_per_cpu_s": tokens / cpu_s if cpu_s > 0 else math.nan,
            "itl_mean_ms": 1e3 * _mean(itl), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "ttft_mean_ms": 1e3 * _mean(ttft), "ttft_p99_ms": 1e3 * percentile(ttft, 99)}


# ---------------------------------------------------------------------------- measuring
class PeakMemory:
    """Peak memory over the block in bytes: growth of the resident-set high-water mark on CPU
    (`glm5.perf.measure.PeakRSS`), the most bytes torch allocated on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.kind = "cuda_max_allocated" if self.cuda else "rss_hwm_growth"
        self.peak = 0

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            from glm5.perf.measure import PeakRSS

            self._rss = PeakRSS().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._rss.__exit__(*exc)
            self.peak = self._rss.peak


# The torch calls model code makes outside glm5 ops (projections, the absorbed attention's
# einsums, the LM head): timed as kernels too, under this name, when no glm5 kernel is running.
TORCH_COMPUTE = "torch (model code)"
_TORCH_FNS = ((torch.nn.functional, "linear"), (torch, "einsum"), (torch, "matmul"),
              (torch, "mm"), (torch, "bmm"))


class OpTimer:
    """Seconds spent inside kernels while active: each glm5 op's kernel (self time: the ops a
    kernel calls are charged to them; validation and dispatch are not inside), through
    `glm5.backends.selection.wrapped_kernels`, and the torch GEMMs model code calls directly
    (``TORCH_COMPUTE``, counted only outside a glm5 kernel). ``window`` names the bucket the
    next calls are charged to. Whatever a step spends beyond these is outside kernels (Python,
    validation, dispatch, scheduling, sampling). The timer itself adds ~1-2 us per call. On
    CUDA every kernel is synchronised before and after (the breakdown then costs some speed)."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.window = "all"
        self.seconds: dict[str, dict[str, float]] = {}
        self._stack: list[float] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _timed(self, name: str, fn: Callable[..., Any], nested: bool = True
               ) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not nested and self._stack:
                return fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self._stack.append(0.0)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t
                child = self._stack.pop()
                b = self.seconds.setdefault(self.window, {})
                b[name] = b.get(name, 0.0) + dt - child
                if self._stack:
                    self._stack[-1] += dt

        return timed

    def __enter__(self) -> "OpTimer":
        from glm5.backends import selection

        self._ctx = selection.wrapped_kernels(lambda e: self._timed(e.op, e.fn))
        self._ctx.__enter__()
        for mod, name in _TORCH_FNS:
            f = getattr(mod, name)
            self._saved.append((mod, name, f))
            setattr(mod, name, self._timed(TORCH_COMPUTE, f, nested=False))
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, name, f in reversed(self._saved):
            setattr(mod, name, f)
        self._saved = []
        self._ctx.__exit__(*exc)

    def kernel_seconds(self, window: str = "all") -> float:
        """All seconds inside kernels in ``window``."""
        return sum(self.seconds.get(window, {}).values())


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def set_threads(n: int | None) -> None:
    """torch's and TVM's thread counts (TVM reads its variable when its runtime starts)."""
    if n is None:
        return
    if n < 1:
        raise ValueError(f"bench/serving.py: --threads expected >= 1, got {n}")
    torch.set_num_threads(n)
    os.environ["TVM_NUM_THREADS"] = str(n)


# ---------------------------------------------------------------------------- workloads
def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids in [2, vocab) (0 / 1 are bos / eos), lengths uniform
    in [lo, hi]."""
    if not 1 <= lo <= hi:
        raise ValueError(f"bench/serving.py: --prompt-len expected 1 <= MIN <= MAX, got "
                         f"{lo},{hi}")
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def pages_for(n_requests: int, max_len: int, page_size: int, spare: int = 8) -> int:
    """Cache pages for ``n_requests`` sequences of up to ``max_len`` tokens at once."""
    return n_requests * -(-max_len // page_size) + spare


def make_engine(model, **config: Any):
    from glm5.engine.engine import EngineConfig, LLMEngine

    return LLMEngine(model, EngineConfig(**config))


def closed_loop(engine, prompts: Sequence[Sequence[int]], concurrency: int, n_requests: int,
                max_tokens: int, clock: Callable[[], float] = time.perf_counter,
                tag: str = "r") -> tuple[list[Trace], float, float]:
    """Keep ``concurrency`` requests in flight until ``n_requests`` have finished (a new one is
    added as soon as one finishes; prompts taken in turn). Returns the traces, the wall seconds
    from the first request added to the last finished, and this process's CPU seconds over the
    same span. A request that does not end by length (an error, a stop) raises: every request
    must generate ``max_tokens`` tokens for the rows to compare."""
    from glm5.engine.sampling import SamplingParams

    if concurrency < 1 or n_requests < 1:
        raise ValueError(f"bench/serving.py closed_loop: concurrency and n_requests expected "
                         f">= 1, got {concurrency}, {n_requests}")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    traces: dict[str, Trace] = {}
    nxt = 0

    def submit() -> None:
        nonlocal nxt
        rid = f"{tag}{nxt}"
        traces[rid] = Trace(clock())
        engine.add_request(rid, list(prompts[nxt % len(prompts)]), params)
        nxt += 1

    cpu0, t0 = time.process_time(), clock()
    for _ in range(min(concurrency, n_requests)):
        submit()
    while engine.has_unfinished():
        outs = engine.step()
        now = clock()
        for o in outs:
            tr = traces[o.request_id]
            if o.new_token_ids:
                tr.deliveries.append((now, len(o.new_token_ids)))
            if o.finished:
                tr.finished, tr.finish_reason = now, o.finish_reason
                tr.token_ids = list(o.token_ids)
                if o.finish_reason != "length":
                    raise RuntimeError(f"bench/serving.py: request {o.request_id} ended with "
                                       f"{o.finish_reason!r} ({o.error}) instead of generating "
                                       f"{max_tokens} tokens")
                if nxt < n_requests:
                    submit()
    wall = max(t.finished for t in traces.values()) - t0
    return list(traces.values()), wall, time.process_time() - cpu0


def engine_row(model, prompts: list[list[int]], concurrency: int, n_requests: int,
               max_tokens: int, page_size: int = 64, breakdown: bool = False) -> dict[str, Any]:
    """One table row: a fresh engine (cache sized for ``concurrency`` requests of the longest
    prompt + ``max_tokens``) under `closed_loop`. With ``breakdown``: the seconds inside each
    op's kernel over the run, and per kind of step (``decode``: every item a decode;
    ``prefill``: any prefill tokens) the steps, their seconds and the share outside kernels."""
    longest = max(len(p) for p in prompts) + max_tokens
    engine = make_engine(model, num_pages=pages_for(concurrency, longest, page_size),
                         page_size=page_size, max_num_seqs=max(concurrency, 1))
    timer = OpTimer(model.device.type == "cuda") if breakdown else None
    kinds: dict[str, list[float]] = {"decode": [], "prefill": []}
    if timer is not None:
        schedule, step = engine.scheduler.schedule, engine.step

        def spy() -> list:
            items = schedule()
            timer.window = "decode" if all(it.decode for it in items) else "prefill"
            return items

        def timed_step() -> list:
            t = time.perf_counter()
            out = step()
            kinds[timer.window].append(time.perf_counter() - t)
            return out

        engine.scheduler.schedule, engine.step = spy, timed_step
    with PeakMemory(model.device) as mem, timer or _nothing():
        traces, wall, cpu = closed_loop(engine, prompts, concurrency, n_requests, max_tokens,
                                        tag=f"c{concurrency}-")
    row = {"system": "glm5 engine", "concurrency": concurrency,
           **summarize(traces, wall, cpu), "peak_mem_mb": mem.peak / 2**20,
           "peak_mem_kind": mem.kind, "kv_pool_mb": engine.pool.nbytes() / 2**20,
           "steps": engine.stats.steps}
    if timer is not None:
        row["op_seconds"] = {}
        for w in kinds:
            for k, v in timer.seconds.get(w, {}).items():
                row["op_seconds"][k] = row["op_seconds"].get(k, 0.0) + v
        row["step_kinds"] = {w: {"steps": len(ts), "seconds": sum(ts),
                                 "kernel_seconds": timer.kernel_seconds(w),
                                 "outside_kernels": 1 - timer.kernel_seconds(w) / sum(ts)
                                 if ts else None,
                                 "op_seconds": timer.seconds.get(w, {})}
                             for w, ts in kinds.items()}
    return row


class _Stamps:
    """A transformers logits processor that records when each decoding step's logits arrive."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.times = clock, []

    def __call__(self, input_ids, scores):
        self.times.append(self.clock())
        return scores


def hf_row(hf_model, prompts: list[list[int]], batch: int, max_tokens: int,
           clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """transformers' ``generate`` (greedy, exactly ``max_tokens`` new tokens) on static batches
    of ``batch`` prompts, left-padded to the batch's longest."""
    from transformers import LogitsProcessorList

    dev = hf_model.device
    traces: list[Trace] = []
    with PeakMemory(dev) as mem:
        cpu0, t0 = time.process_time(), clock()
        for i in range(0, len(prompts), batch):
            group = prompts[i:i + batch]
            L = max(len(p) for p in group)
            ids = torch.tensor([[0] * (L - len(p)) + list(p) for p in group], device=dev)
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in group], device=dev)
            stamps = _Stamps(clock)
            start = clock()
            with torch.inference_mode():
                out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                        max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                        logits_processor=LogitsProcessorList([stamps]))
            end = clock()
            if out.shape[1] - L != max_tokens or len(stamps.times) != max_tokens:
                raise RuntimeError(f"bench/serving.py: transformers generated {out.shape[1] - L} "
                                   f"tokens in {len(stamps.times)} steps, expected {max_tokens}")
            for _ in group:
                traces.append(Trace(start, [(t, 1) for t in stamps.times], end, "length"))
        wall, cpu = clock() - t0, time.process_time() - cpu0
    return {"system": "transformers generate", "batch": batch, **summarize(traces, wall, cpu),
            "peak_mem_mb": mem.peak / 2**20, "peak_mem_kind": mem.kind}


def grpo_prefill(model, prompt_len: int, group: int, max_tokens: int, seed: int,
                 page_size: int = 64) -> dict[str, Any]:
    """A GRPO group: ``group`` sampled requests (seeds 0..group-1) of one random prompt, added
    at once, run to completion by an engine without and then with the prefix cache."""
    from glm5.engine.sampling import SamplingParams

    prompt = random_prompts(1, prompt_len, prompt_len, model.config.vocab_size, seed)[0]
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "group": group, "max_tokens": max_tokens}
    for cache in (False, True):
        eng = make_engine(model, enable_prefix_cache=cache, page_size=page_size,
                          num_pages=pages_for(group, prompt_len + max_tokens, page_size))
        for i in range(group):
            eng.add_request(f"g{i}", prompt, SamplingParams(max_tokens=max_tokens, seed=i,
                                                            ignore_eos=True))
        t = time.perf_counter()
        done = eng.run_to_completion()
        if len(done) != group or any(o.finish_reason != "length" for o in done):
            raise RuntimeError("bench/serving.py grpo: not every sample generated its tokens")
        s = eng.scheduler.stats
        out["with_cache" if cache else "without_cache"] = {
            "prefill_tokens": s.prefill_tokens, "prompt_tokens_hit": s.prompt_tokens_hit,
            "wall_s": time.perf_counter() - t}
    w, wo = out["with_cache"]["prefill_tokens"], out["without_cache"]["prefill_tokens"]
    out["reduction"] = 1 - w / wo
    return out


def long_prefill(model, chunk: int, long_len: int, n_decode: int, decode_prompt: int,
                 window: int, seed: int, page_size: int = 64, slowdown: float | None = None,
                 label: str | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """``n_decode`` requests decode; after ``window`` steps a ``long_len``-token prompt is added
    and prefilled (``chunk_size`` ``chunk``, the prefill budget ``max_decode_slowdown``
    ``slowdown``: None = off); then ``window`` more steps. The decoders' per-token latencies in
    the window before the prompt arrived, while it prefilled (from its arrival to its first
    token) and after, each on its own, with the seconds of each op in each window, the long
    prompt's time to first token and the prefill tokens of each step during it."""
    from glm5.engine.sampling import SamplingParams

    V = model.config.vocab_size
    steps = 2 * window + -(-long_len // min(chunk, 16)) + -(-decode_prompt // chunk) + 8
    dec = random_prompts(n_decode, decode_prompt, decode_prompt, V, seed)
    long = random_prompts(1, long_len, long_len, V, seed + 1)[0]
    eng = make_engine(model, chunk_size=chunk, page_size=page_size, max_num_batched_tokens=max(
        chunk, 8192), num_pages=pages_for(n_decode, decode_prompt + steps, page_size)
        + pages_for(1, long_len + 1, page_size), max_decode_slowdown=slowdown)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i in range(n_decode):
        eng.add_request(f"d{i}", dec[i], params)
    last: dict[str, float] = {}
    itl: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    step_s: dict[str, list[float]] = {k: [] for k in itl}
    chunks: list[int] = []
    timer = OpTimer(model.device.type == "cuda")
    phase, long_first, long_added = "warmup", None, None
    schedule = eng.scheduler.schedule

    def spy() -> list:
        items = schedule()
        if phase == "during":
            chunks.append(sum(len(it.tokens) for it in items if it.req.request_id == "long"))
        return items

    eng.scheduler.schedule = spy

    def step() -> list:
        t = clock()
        outs = eng.step()
        now = clock()
        if phase in step_s:
            step_s[phase].append(now - t)
        for o in outs:
            if o.request_id == "long":
                continue
            if o.new_token_ids and o.request_id in last and phase in itl:
                itl[phase] += [(now - last[o.request_id]) / len(o.new_token_ids)] * len(
                    o.new_token_ids)
            if o.new_token_ids:
                last[o.request_id] = now
        return outs

    with timer:
        while len(last) < n_decode:  # the decoders' prefills
            timer.window = phase
            step()
        for phase in ("before", "during", "after"):
            timer.window = phase
            if phase == "during":
                long_added = clock()
                eng.add_request("long", long, SamplingParams(max_tokens=1, ignore_eos=True))
                while long_first is None:
                    for o in step():
                        if o.request_id == "long" and o.new_token_ids:
                            long_first = clock()
            else:
                for _ in range(window):
                    step()
    for i in range(n_decode):
        eng.abort(f"d{i}")
    eng.run_to_completion()
    p99 = {k: percentile(v, 99) for k, v in itl.items()}
    return {"config": label or (f"chunk {chunk}" + (f", budget {slowdown:g}x" if slowdown
                                                      else "")),
            "chunk_size": chunk, "max_decode_slowdown": slowdown,
            "long_prompt_tokens": long_len, "decoders": n_decode,
            "long_ttft_s": long_first - long_added,
            **{f"itl_p99_ms_{k}": 1e3 * v for k, v in p99.items()},
            **{f"itl_mean_ms_{k}": 1e3 * _mean(v) for k, v in itl.items()},
            "p99_ratio": p99["during"] / p99["before"],
            "p99_ratio_after": p99["during"] / p99["after"],
            "prefill_chunks": {"count": len(chunks), "min": min(chunks, default=0),
                               "median": percentile(chunks, 50), "max": max(chunks, default=0)},
            "steps": {k: len(v) for k, v in step_s.items()},
            "step_seconds": {k: sum(v) for k, v in step_s.items()},
            "op_seconds": {k: timer.seconds.get(k, {}) for k in itl}}


def long_prefill_runs(model, a: argparse.Namespace, report: Callable[[str], None] = print
                      ) -> list[dict[str, Any]]:
    """The long-prompt runs: unchunked (the prompt in one step: its time to first token is the
    reference), the engine's default configuration (chunk_size 512 and the prefill budget), and
    each fixed ``--long-chunks`` size without the budget."""
    from glm5.engine.engine import EngineConfig

    d = EngineConfig()
    runs = [(a.long_len, None, "unchunked"),
            (d.chunk_size, d.max_decode_slowdown, "default")]
    runs += [(c, None, None) for c in a.long_chunks]
    out = []
    for chunk, slow, label in runs:
        t = time.perf_counter()
        r = long_prefill(model, chunk, a.long_len, a.long_decoders, 128, a.long_window, a.seed,
                         slowdown=slow, label=label)
        out.append(r)
        report(f"  long prefill {r['config']}: P99 during / before {r['p99_ratio']:.2f}, TTFT "
               f"{r['long_ttft_s']:.1f} s, {time.perf_counter() - t:.0f} s")
    return out


# ---------------------------------------------------------------------------- models
def glm5_shaped_config():
    """The issue's GPU model: GLM-5's shapes with 2 layers (one dense, one MoE) and 64 routed
    experts (hidden 6144, 64 heads, MLA 512 latent / 64 rope, indexer 32 heads x 128, top-2048,
    experts of 2048)."""
    from glm5.core.config import preset

    return preset("glm-5").replace(num_hidden_layers=2, first_k_dense_replace=1,
                                   n_routed_experts=64)


def build_model(cfg, dtype: torch.dtype, device: str, seed: int):
    """`GLM5ForCausalLM` with the config's own random initialisation (seeded)."""
    from glm5.core.model import GLM5ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = GLM5ForCausalLM(cfg)
    return model.to(dtype).eval()


def load_hf(path: str, dtype: torch.dtype, device: str):
    """transformers' GlmMoeDsaForCausalLM from a checkpoint directory (eager attention), never
    stopping early (no eos), pad id 0."""
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    # the checkpoint's MTP layer is not part of transformers' model: its "unexpected" tensors
    # are expected here
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    m = GlmMoeDsaForCausalLM.from_pretrained(path, dtype=dtype,
                                             attn_implementation="eager").to(device).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def logits_gap(model, hf_model, vocab: int) -> float:
    """Largest |glm5 - transformers| logit on a prompt of min(32, index_topk) tokens (every
    token selected: no indexer score ties to break): the two load the same weights."""
    n = min(32, model.config.index_topk)
    ids = torch.tensor([random_prompts(1, n, n, vocab, 123)[0]], device=model.device)
    with torch.inference_mode():
        a = model(ids).float()
        b = hf_model(ids).logits.float()
    return float((a - b).abs().max())


# ---------------------------------------------------------------------------- report
def targets(rows: list[dict], hf: list[dict], grpo: dict | None, long: list[dict]
            ) -> dict[str, dict[str, Any]]:
    """Each target: the measured value, the bound, pass/fail (None when not measured)."""
    by_c = {r["concurrency"]: r for r in rows}
    by_b = {r["batch"]: r for r in hf}
    out: dict[str, dict[str, Any]] = {}

    def put(name: str, value: float | None, ok: bool | None, **extra: Any) -> None:
        out[name] = {"value": value, "target": TARGETS[name], "pass": ok, **extra}

    v = (by_c[32]["throughput"] / by_c[1]["throughput"]) if 32 in by_c and 1 in by_c else None
    put("c32_over_c1", v, None if v is None else v >= TARGETS["c32_over_c1"],
        cpu_time_ratio=(by_c[32]["tokens_per_cpu_s"] / by_c[1]["tokens_per_cpu_s"])
        if v is not None else None)
    v = (by_c[8]["throughput"] / by_b[8]["throughput"]) if 8 in by_c and 8 in by_b else None
    put("c8_over_transformers_b8", v,
        None if v is None else v >= TARGETS["c8_over_transformers_b8"],
        cpu_time_ratio=(by_c[8]["tokens_per_cpu_s"] / by_b[8]["tokens_per_cpu_s"])
        if v is not None else None)
    v = grpo["reduction"] if grpo else None
    put("grpo_prefill_reduction", v, None if v is None else v >= TARGETS[
        "grpo_prefill_reduction"])
    by = {r["config"]: r for r in long}
    dflt, ref = by.get("default"), by.get("unchunked")
    v = dflt["p99_ratio"] if dflt else None
    put("long_prefill_p99_ratio", v, None if v is None else v <= TARGETS[
        "long_prefill_p99_ratio"], by_config={k: r["p99_ratio"] for k, r in by.items()})
    v = dflt["long_ttft_s"] / ref["long_ttft_s"] if dflt and ref else None
    put("long_ttft_ratio", v, None if v is None else v <= TARGETS["long_ttft_ratio"],
        by_config={k: r["long_ttft_s"] / ref["long_ttft_s"] for k, r in by.items()}
        if ref else {})
    return out


def time_shares(op_seconds: dict[str, float], wall_s: float, top: int = 5) -> str:
    """The ``top`` ops by their share of ``wall_s``, and the rest of the time (linears outside
    the ops, Python, scheduling, sampling) as "other"."""
    ranked = sorted(op_seconds.items(), key=lambda kv: -kv[1])
    parts = [f"{k} {100 * v / wall_s:.0f}%" for k, v in ranked[:top]]
    rest = wall_s - sum(op_seconds.values())
    return ", ".join(parts + [f"other {100 * rest / wall_s:.0f}%"])


WINDOWS = ("before", "during", "after")


def _f(x: float | None, nd: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown(result: dict[str, Any]) -> str:
    """The table, the long-prompt sweep and the targets as markdown."""
    lines = ["| system | concurrency / batch | requests | tokens/s | tokens/CPU-s | mean ITL ms "
             "| P99 ITL ms | mean TTFT ms | P99 TTFT ms | peak mem MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["table"]:
        who = r.get("concurrency", r.get("batch"))
        lines.append(f"| {r['system']} | {who} | {r['requests']} | {_f(r['throughput'])} | "
                     f"{_f(r['tokens_per_cpu_s'])} | {_f(r['itl_mean_ms'])} | "
                     f"{_f(r['itl_p99_ms'])} | {_f(r['ttft_mean_ms'], 0)} | "
                     f"{_f(r['ttft_p99_ms'], 0)} | {_f(r['peak_mem_mb'], 0)} |")
    kinds = {r.get("peak_mem_kind") for r in result["table"]}
    lines += ["", "peak mem: " + ("growth of the process's resident-set high-water mark (VmHWM) "
                                  "during the run" if kinds == {"rss_hwm_growth"} else
                                  "torch.cuda.max_memory_allocated during the run"
                                  if kinds == {"cuda_max_allocated"} else "—")]
    gap = result.get("logits_max_abs_diff_vs_transformers")
    if gap is not None:
        lines.append(f"same checkpoint: largest |glm5 - transformers| logit {gap:.2e}")
    shares = [r for r in result["table"] if r.get("op_seconds")]
    if shares:
        lines += ["", "Where the time goes (share of the run's wall time):", ""]
        lines += [f"- c={r['concurrency']}: {time_shares(r['op_seconds'], r['wall_s'])}"
                  for r in shares]
        lines += ["", "| concurrency | step | steps | ms a step | outside kernels | top "
                  "kernels (share of those steps) |", "|---|---|---|---|---|---|"]
        for r in shares:
            for w, k in r.get("step_kinds", {}).items():
                if k["steps"]:
                    lines.append(f"| {r['concurrency']} | {w} | {k['steps']} | "
                                 f"{_f(1e3 * k['seconds'] / k['steps'])} | "
                                 f"{100 * k['outside_kernels']:.0f}% | "
                                 f"{time_shares(k['op_seconds'], k['seconds'], top=4)} |")
    if result.get("long_prefill"):
        lines += ["", "| configuration | long prompt TTFT s | prefill tokens a step (min / "
                  "median / max) | P99 ITL ms before / during / after | during / before | "
                  "mean ITL ms before / during / after |", "|---|---|---|---|---|---|"]
        for r in result["long_prefill"]:
            c = r["prefill_chunks"]
            lines.append(
                f"| {r['config']} | {_f(r['long_ttft_s'])} | {c['min']} / {_f(c['median'], 0)} "
                f"/ {c['max']} | " + " / ".join(_f(r[f"itl_p99_ms_{w}"]) for w in WINDOWS)
                + f" | {_f(r['p99_ratio'], 2)} | "
                + " / ".join(_f(r[f"itl_mean_ms_{w}"]) for w in WINDOWS) + " |")
        lines += [""]
        for r in result["long_prefill"]:
            for w in ("before", "during"):
                sec = r["step_seconds"][w]
                if sec > 0 and r["op_seconds"].get(w):
                    lines.append(f"- {r['config']}, steps {w} the long prompt "
                                 f"({1e3 * sec / r['steps'][w]:.0f} ms a step): "
                                 f"{time_shares(r['op_seconds'][w], sec)}")
    g = result.get("grpo")
    if g:
        lines += ["", f"GRPO group of {g['group']} x {g['prompt_tokens']}-token prompt: prefill "
                  f"tokens {g['without_cache']['prefill_tokens']} without the prefix cache, "
                  f"{g['with_cache']['prefill_tokens']} with it ({100 * g['reduction']:.1f}% "
                  f"fewer)."]
    lines += ["", "| target | measured | same in tokens per CPU-second | bound | result |",
              "|---|---|---|---|---|"]
    names = {"c32_over_c1": "throughput c=32 / c=1", "c8_over_transformers_b8":
             "throughput c=8 / transformers batch 8", "grpo_prefill_reduction":
             "GRPO prefill tokens saved by the prefix cache", "long_prefill_p99_ratio":
             "P99 ITL during a long prefill / before it (default config)", "long_ttft_ratio":
             "long prompt TTFT, default config / unchunked"}
    for k, t in result["targets"].items():
        verdict = {True: "pass", False: "FAIL", None: "not measured"}[t["pass"]]
        bound = "<=" if k.startswith("long_") else ">="
        lines.append(f"| {names[k]} | {_f(t['value'], 2)} | {_f(t.get('cpu_time_ratio'), 2)} | "
                     f"{bound} {t['target']:g} | {verdict} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
def _ints(s: str, name: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        v = []
    if not v or any(x < 1 for x in v):
        raise SystemExit(f"bench/serving.py: {name} expected comma-separated ints >= 1, got "
                         f"{s!r}")
    return v


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--glm5-shaped", action="store_true",
                    help="the issue's GPU model (GLM-5 shapes, 2 layers, 64 experts)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="default: float32 on cpu (faster here than bfloat16 at decode), "
                         "bfloat16 on cuda and meta")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "meta"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per concurrency level (at least 8 and 2x the concurrency)")
    ap.add_argument("--prompt-len", default="64,512", help="MIN,MAX prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batches", default="1,8")
    ap.add_argument("--hf-requests", type=int, default=8,
                    help="prompts per transformers batch size (at least 2 batches)")
    ap.add_argument("--grpo-prompt", type=int, default=1024)
    ap.add_argument("--grpo-group", type=int, default=8)
    ap.add_argument("--long-len", type=int, default=16384)
    ap.add_argument("--long-chunks", default="512,32",
                    help="fixed chunk sizes run without the prefill budget, beside the "
                         "unchunked and the default configuration")
    ap.add_argument("--long-decoders", type=int, default=8)
    ap.add_argument("--long-window", type=int, default=24,
                    help="decode steps measured before and after the long prompt")
    ap.add_argument("--skip", default="", help="comma list of hf,grpo,long")
    ap.add_argument("--breakdown", action="store_true",
                    help="seconds per glm5 op in each table run")
    ap.add_argument("--quick", action="store_true",
                    help="a short run: concurrency 1,8, short prompts and generations, a 2K "
                         "long prompt")
    ap.add_argument("--report", default=None, metavar="FILE.json",
                    help="print the markdown of a result file written before, run nothing")
    ap.add_argument("--out", default=None,
                    help="JSON file (default bench/results/serving_<preset>.json; none with "
                         "--quick)")
    a = ap.parse_args(argv)
    if a.quick:
        given = {x.split("=")[0] for x in (argv if argv is not None else sys.argv[1:])}
        for k, v in (("concurrency", "1,8"), ("prompt_len", "32,128"), ("max_tokens", 16),
                     ("grpo_prompt", 256), ("long_len", 2048), ("long_chunks", "64"),
                     ("long_window", 8), ("hf_requests", 8)):
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
    skip = {s for s in a.skip.split(",") if s}
    if skip - {"hf", "grpo", "long"}:
        raise SystemExit(f"bench/serving.py: --skip expected names from hf,grpo,long, got "
                         f"{a.skip!r}")
    a.skip = skip
    a.concurrency = _ints(a.concurrency, "--concurrency")
    a.hf_batches = _ints(a.hf_batches, "--hf-batches")
    a.long_chunks = _ints(a.long_chunks, "--long-chunks")
    a.prompt_len = _ints(a.prompt_len, "--prompt-len")
    if len(a.prompt_len) == 1:
        a.prompt_len *= 2
    if len(a.prompt_len) != 2 or a.prompt_len[0] > a.prompt_len[1]:
        raise SystemExit(f"bench/serving.py: --prompt-len expected MIN,MAX, got {a.prompt_len}")
    for k in ("max_tokens", "grpo_prompt", "grpo_group", "long_len", "long_decoders",
              "long_window", "hf_requests"):
        if getattr(a, k) < 1:
            raise SystemExit(f"bench/serving.py: --{k.replace('_', '-')} expected >= 1, got "
                             f"{getattr(a, k)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/serving.py: --device cuda expected a CUDA GPU; none is visible")
    if a.glm5_shaped and a.device == "cpu":
        raise SystemExit("bench/serving.py: --glm5-shaped expected --device cuda (a GPU run) "
                         "or --device meta (build only); its weights alone are ~15 GB in "
                         "bfloat16")
    a.dtype = DTYPES[a.dtype or ("float32" if a.device == "cpu" else "bfloat16")]
    return a


def describe_meta(model) -> dict[str, Any]:
    """Sizes of a model built on the meta device (no data): parameters, weight bytes, cache
    bytes per token."""
    from glm5.engine.kv_pool import KVPool

    n = sum(p.numel() for p in model.parameters())
    return {"parameters": n, "weight_gb": sum(p.numel() * p.element_size()
                                              for p in model.parameters()) / 1e9,
            "kv_bytes_per_token": KVPool.page_bytes(model, 1, mtp=True),
            "layers": model.config.num_hidden_layers, "mlp_layer_types":
                model.config.mlp_layer_types}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.report:
        try:
            result = json.loads(Path(a.report).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"bench/serving.py: --report expected a result JSON file: {e}")
        print(markdown(result))
        return result
    set_threads(a.threads)
    import logging

    logging.getLogger("glm5").setLevel(logging.ERROR)
    from glm5.core.config import preset

    cfg = glm5_shaped_config() if a.glm5_shaped else preset(a.preset)
    name = "glm5_shaped" if a.glm5_shaped else a.preset
    model = build_model(cfg, a.dtype, a.device, a.seed)
    if a.device == "meta":
        info = {"model": name, "device": "meta", **describe_meta(model)}
        print(json.dumps(info, indent=1))
        return info
    lo, hi = a.prompt_len
    V = cfg.vocab_size
    result: dict[str, Any] = {
        "model": name, "dtype": str(a.dtype).replace("torch.", ""), "device": a.device,
        "threads": torch.get_num_threads(), "seed": a.seed, "prompt_len": [lo, hi],
        "max_tokens": a.max_tokens, "argv": argv if argv is not None else sys.argv[1:],
        "table": []}
    t_all = time.perf_counter()
    # warm-up: load or build every kernel the runs use (a prompt past index_topk: sparse path)
    warm = random_prompts(2, max(hi, cfg.index_topk + 8), max(hi, cfg.index_topk + 8), V, 99)
    eng = make_engine(model, num_pages=pages_for(2, len(warm[0]) + 4, 64))
    closed_loop(eng, warm, 2, 2, 4, tag="warm")
    del eng
    hf = None
    tmp = tempfile.TemporaryDirectory()
    if "hf" not in a.skip:
        model.save_pretrained(tmp.name)
        hf = load_hf(tmp.name, a.dtype, a.device)
        result["logits_max_abs_diff_vs_transformers"] = logits_gap(model, hf, V)
    # Interleaved: engine c, then transformers at batch c when it is one of --hf-batches
    # (the pairs compared sit next to each other in time).
    order: list[tuple[str, int]] = []
    for c in a.concurrency:
        order.append(("engine", c))
        if hf is not None and c in a.hf_batches:
            order.append(("hf", c))
    order += [("hf", b) for b in a.hf_batches if hf is not None and b not in a.concurrency]
    hf_rows = []
    for kind, n in order:
        t = time.perf_counter()
        if kind == "engine":
            n_req = max(a.requests, 2 * n, 8)
            prompts = random_prompts(n_req, lo, hi, V, a.seed + n)
            row = engine_row(model, prompts, n, n_req, a.max_tokens, breakdown=a.breakdown)
        else:
            n_req = max(a.hf_requests, 2 * n)
            row = hf_row(hf, random_prompts(n_req, lo, hi, V, a.seed + n), n, a.max_tokens)
            hf_rows.append(row)
        result["table"].append(row)
        print(f"  {row['system']} {kind == 'engine' and 'c' or 'b'}={n}: "
              f"{row['throughput']:.1f} tok/s, {time.perf_counter() - t:.0f} s", flush=True)
    del hf
    tmp.cleanup()
    if "grpo" not in a.skip:
        result["grpo"] = grpo_prefill(model, a.grpo_prompt, a.grpo_group, 8, a.seed)
        print(f"  grpo: {result['grpo']['reduction']:.3f} fewer prefill tokens", flush=True)
    result["long_prefill"] = [] if "long" in a.skip else long_prefill_runs(model, a)
    engine_rows = [r for r in result["table"] if r["system"] == "glm5 engine"]
    result["targets"] = targets(engine_rows, hf_rows, result.get("grpo"), result["long_prefill"])
    result["seconds"] = time.perf_counter() - t_all
    print(markdown(result))
    out = a.out or (None if a.quick else str(ROOT / "bench" / "results" / f"serving_{name}.json"))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
