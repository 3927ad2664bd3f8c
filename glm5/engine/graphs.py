"""Decode steps replayed from captured CUDA graphs, one graph per batch bucket.

A decode step (every sequence one token, no MTP drafts) launches the same kernels every time;
only the values change. Launching them one by one costs the host time for each of the
hundreds of launches a step makes, so on a CUDA device the step's forward — token ids to
logits — is captured once per (bucket, path) and replayed:

- the batch is padded up to the next bucket (``EngineConfig.cuda_graph_buckets``, default
  1, 2, 4, ..., 32); padded row j decodes token 0 at position j of a block table made of the
  pool's scratch pages (`KVPool.scratch_pages`, which no request owns): each padded row writes
  a slot of its own (mla_prolog's slots are distinct) and nothing of the real rows is written
  or read;
- inputs live in static buffers (token ids, positions, block tables of ``max_pages`` columns,
  the rows beyond a sequence's pages -1), written before each replay; outputs are the captured
  tensors, sliced to the real rows;
- the path (dense attention over the whole range while every sequence is within
  ``index_topk``, else the indexer's top-k) is part of the key, and the step is laid out with a
  fixed range bound so no shape depends on the lengths (`GLM5ForCausalLM.paged_step`);
- a step goes eager when it cannot be captured: not a pure decode, more sequences than the
  largest bucket, a sequence with more pages than the buffers hold, or a capture that failed
  (an op that synchronises, e.g. value checks under ``GLM5_STRICT=1``; that key is then never
  tried again).

`torch.cuda.CUDAGraph` is used by `CudaGraphCapture` alone; `EagerCapture` stands in for it on
a CPU (capture = run once, replay = run again into the same output tensors), so the bucket,
padding and static-buffer logic is tested without a GPU. `CompileCapture` (torch.compile,
inductor) is a measured CPU experiment, slower than eager and not used by the engine (its
docstring says why; bench/compile_decode.py measures it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from glm5.core.config import attends_densely

log = logging.getLogger("glm5")

# The outputs of one captured forward: (logits [Bb, V] fp32, normed hidden [Bb, D]).
Outputs = tuple[torch.Tensor, torch.Tensor]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


class Capture(Protocol):
    """``capture(fn)`` records ``fn`` (a forward over static buffers) and returns ``replay``,
    which runs it again and returns the same output tensors, now holding the new results."""

    def __call__(self, fn: Callable[[], Outputs]) -> Callable[[], Outputs]: ...


class CudaGraphCapture:
    """Capture with `torch.cuda.CUDAGraph` (the only place it is used): a warm-up run on a side
    stream (Triton compiles, the allocator settles), then the capture; every graph of one
    instance shares one memory pool (buckets replay one at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: Any = None

    def __call__(self, fn: Callable[[], Outputs]) -> Callable[[], Outputs]:
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            fn()
        cur.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> Outputs:
            graph.replay()
            return out

        return replay


class EagerCapture:
    """The CPU stand-in for `CudaGraphCapture`: capturing runs ``fn`` once (as the warm-up
    does); replaying runs it again on the static buffers and copies the results into the
    tensors the first run returned, as a graph's replay refills its captured outputs."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def __call__(self, fn: Callable[[], Outputs]) -> Callable[[], Outputs]:
        self.captures += 1
        out = fn()

        def replay() -> Outputs:
            self.replays += 1
            for dst, src in zip(out, fn()):
                dst.copy_(src)
            return out

        return replay


class CompileCapture:
    """A CPU experiment: "capture" = `torch.compile` ``fn`` (a forward over static buffers,
    no arguments: the buffers and pools are closure/attribute reads dynamo guards on) and run it
    once (dynamo traces, inductor compiles; the seconds go to ``compile_seconds``); replay runs
    the compiled function and returns its new outputs (logits [Bb, V] fp32, normed hidden
    [Bb, D]). Returning fresh tensors is correct for `DecodeGraphs.run`, which only slices what
    a replay returns and whose caller reads the slices before the next step; with
    ``copy_out=True`` they are copied into the first run's tensors instead, as `EagerCapture`
    and a CUDA graph do.

    ``backend`` / ``mode`` / ``fullgraph`` / ``options`` go to `torch.compile` as given;
    ``dynamic`` is False (the buffers have one shape per bucket).

    Not wired into `EngineConfig`: on the CPU (``small`` preset, one thread,
    bench/compile_decode.py) a compiled decode step is not faster than eager. With op
    validation skipped under tracing (glm5.ops: the fake kernel checks shapes, the binding's
    kernel validates at run time), a step is one graph with no break, and with the binding
    serving repeated signatures straight from their kernels, compiled vs eager was 14.7 vs
    13.4 ms at one sequence and 30.1 vs 27.2 ms at eight (2026-12-06): every glm5 op stays an
    opaque node called through the torch.library dispatcher, and what inductor fuses between
    them (reshapes, concatenations) is a small part of the step. Compiling costs 5-15 s per
    (bucket, path) with inductor's cache warm."""

    def __init__(self, backend: str = "inductor", mode: str | None = None,
                 fullgraph: bool = False, options: dict[str, Any] | None = None,
                 copy_out: bool = False) -> None:
        if mode is not None and options is not None:
            raise ValueError("glm5 CompileCapture: arguments 'mode' and 'options' expected at "
                             "most one of them set (torch.compile takes one), got both")
        self.backend, self.mode, self.fullgraph = backend, mode, fullgraph
        self.options, self.copy_out = options, copy_out
        self.compile_seconds: list[float] = []
        self.captures = 0
        self.replays = 0

    def __call__(self, fn: Callable[[], Outputs]) -> Callable[[], Outputs]:
        compiled = torch.compile(fn, backend=self.backend, mode=self.mode,
                                 fullgraph=self.fullgraph, dynamic=False, options=self.options)
        t0 = time.perf_counter()
        out = compiled()
        self.compile_seconds.append(time.perf_counter() - t0)
        self.captures += 1

        def replay() -> Outputs:
            self.replays += 1
            new = compiled()
            if not self.copy_out:
                return new
            for dst, src in zip(out, new):
                dst.copy_(src)
            return out

        return replay


def check_buckets(buckets: Sequence[int], where: str) -> tuple[int, ...]:
    """``buckets`` as a tuple of increasing ints >= 1, or a ValueError naming ``where``."""
    try:
        b = tuple(buckets)
    except TypeError:
        b = ()
    if not b or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b) \
            or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"glm5 {where}: argument 'cuda_graph_buckets' expected increasing "
                         f"ints >= 1, got {buckets!r}")
    return b


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n, or None when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    return None


@dataclass
class _Buffers:
    """A bucket's static inputs (the graphs of its paths read them)."""

    ids: torch.Tensor  # [Bb] int64
    positions: torch.Tensor  # [Bb] int64
    seq: torch.Tensor  # [Bb] int32, 0 .. Bb - 1 (row b's block table is row b)
    block_table: torch.Tensor  # [Bb, max_pages] int32


# forward(ids, positions, seq, block_table, max_range) -> Outputs: the runner's main forward.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], Outputs]


class DecodeGraphs:
    """Captured decode forwards per (bucket, dense path); see the module docstring.

    ``forward`` is the eager forward the graphs capture (`ModelRunner.main`); ``index_topk``
    the model's; ``page_size`` / ``max_pages`` the block-table layout (``max_pages`` columns
    hold the longest sequence: ceil(max_model_len / page_size); only their product, the
    table's ``max_keys``, is kept: the page size is the cache manager's); ``scratch_pages`` the pool
    pages padded rows use (room for a row per padded row: the largest bucket - 1); ``capture``
    a `Capture` (`CudaGraphCapture` on a GPU, `EagerCapture` in tests). ``captured``,
    ``replays`` and ``eager`` count what happened."""

    def __init__(self, forward: Forward, device: torch.device, buckets: Sequence[int],
                 index_topk: int, page_size: int, max_pages: int, scratch_pages: Sequence[int],
                 capture: Capture) -> None:
        self.forward, self.device = forward, device
        self.buckets = check_buckets(buckets, "DecodeGraphs")
        self.index_topk, self.max_pages = index_topk, max_pages
        self.max_keys = max_pages * page_size  # the block table's tokens
        self.scratch_pages = list(scratch_pages)
        room = min(len(self.scratch_pages), max_pages) * page_size
        if self.buckets[-1] - 1 > room:
            raise ValueError(f"glm5 DecodeGraphs: argument 'buckets' expected at most {room + 1} "
                             f"sequences per bucket (the padded rows of the largest bucket each "
                             f"need a scratch row: {len(self.scratch_pages)} scratch pages of "
                             f"{page_size}, {max_pages} block-table columns), got "
                             f"{self.buckets[-1]}")
        self.capture = capture
        self._buffers: dict[int, _Buffers] = {}
        self._graphs: dict[tuple[int, bool], Callable[[], Outputs]] = {}
        self._failed: dict[tuple[int, bool], str] = {}
        self.captured = self.replays = self.eager = 0

    def key(self, n: int, max_range: int) -> tuple[int, bool] | None:
        """(bucket, dense) of a decode of ``n`` sequences whose longest causal range is
        ``max_range``, or None when no bucket holds ``n``."""
        b = bucket_for(n, self.buckets)
        return None if b is None else (b, attends_densely(max_range, self.index_topk))

    def _bound(self, dense: bool) -> int:
        """The range bound a path is laid out with (same side of index_topk as the step)."""
        keys = self.max_keys
        return min(self.index_topk, keys) if dense else keys

    def _buffers_for(self, b: int) -> _Buffers:
        buf = self._buffers.get(b)
        if buf is None:
            dev = self.device
            buf = _Buffers(torch.zeros(b, dtype=torch.long, device=dev),
                           torch.zeros(b, dtype=torch.long, device=dev),
                           torch.arange(b, dtype=torch.int32, device=dev),
                           torch.full((b, self.max_pages), -1, dtype=torch.int32, device=dev))
            self._buffers[b] = buf
        return buf

    def _fill(self, buf: _Buffers, ids: list[int], positions: list[int],
              pages: list[list[int]]) -> None:
        """Write a step's inputs into the static buffers (one host-to-device copy each); row
        n + j (padding) is token 0 at position j of the scratch pages."""
        b, n, width = buf.ids.shape[0], len(ids), self.max_pages
        pad = b - n
        table = torch.full((b, width), -1, dtype=torch.int32)
        for r, p in enumerate(pages):
            table[r, :len(p)] = torch.tensor(p, dtype=torch.int32)
        scratch = self.scratch_pages[:width]
        table[n:, :len(scratch)] = torch.tensor(scratch, dtype=torch.int32)
        buf.ids.copy_(torch.tensor(ids + [0] * pad, dtype=torch.long), non_blocking=True)
        buf.positions.copy_(torch.tensor(positions + list(range(pad)), dtype=torch.long),
                            non_blocking=True)
        buf.block_table.copy_(table, non_blocking=True)

    def run(self, ids: list[int], positions: list[int], pages: list[list[int]]
            ) -> Outputs | None:
        """The decode forward of ``len(ids)`` sequences (sequence r: token ``ids[r]`` at
        ``positions[r]``, block table ``pages[r]``) from a graph: (logits [n, V] fp32, normed
        hidden [n, D]); None when this step must run eager (the caller does)."""
        n = len(ids)
        key = self.key(n, max(positions) + 1) if n else None
        if key is None or key in self._failed or any(len(p) > self.max_pages for p in pages):
            self.eager += 1
            return None
        b, dense = key
        buf = self._buffers_for(b)
        self._fill(buf, ids, positions, pages)
        replay = self._graphs.get(key)
        if replay is None:
            bound = self._bound(dense)

            def fn() -> Outputs:
                return self.forward(buf.ids, buf.positions, buf.seq, buf.block_table, bound)

            try:
                replay = self.capture(fn)
            except Exception as e:  # noqa: BLE001 - any capture failure means: run eager
                self._failed[key] = f"{type(e).__name__}: {e}"
                log.warning("glm5 engine: decode graph for bucket %d (%s path) not captured, "
                            "running eager: %s", b, "dense" if dense else "sparse",
                            self._failed[key])
                self.eager += 1
                return None
            self._graphs[key] = replay
            self.captured += 1
        logits, hn = replay()
        self.replays += 1
        # Slices of the captured outputs: the caller reads them before the next replay.
        return logits[:n], hn[:n]
