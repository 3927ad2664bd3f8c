"""`glm5 tune`: a tile search for a backend's Triton kernels on the device at hand.

For each op (`specs`: GLM-5's shapes on a device, as one of ``tp`` tensor-parallel ranks runs
them; `TINY`: the interpreter's), one pass of coordinate descent over the op's launch
parameters, starting from what the backend runs now (its tuning table, and this device's cache
unless ``fresh``): every power-of-two ``BLOCK_*`` tile as half / same / double, ``num_warps``
halved / doubled, ``num_stages`` 1-4, the split targets (`SPLIT_KEYS`) half / double, boolean
path switches both ways; regime-prefixed keys (``MHA_BLOCK_N``, ``decode_num_warps``) like the
plain ones; a backend table's ``_tune.fixed`` keys never. Every candidate is first judged by
the conformance kit against the float64 oracle at each check shape of the op (small shapes of
the same regimes: head counts, head dims, decode vs prefill), then timed at each timing shape;
one that fails to compile (e.g. out of shared memory) or fails the verdict is recorded and
skipped. The score of an entry is the geometric mean of its times over the op's shapes
relative to the start; a winner is kept when it is faster by more than ``min_gain`` overall
and no shape is slower by more than ``min_gain``.

Winners go to the per-device tuning cache (`glm5.backends.tuning_cache`), which the backend
applies from the next process on (``--table`` also merges them into a tuning.json, for a
backend's maintainers). Timing: the device's events around each call with a 256 MiB buffer
rewritten before it (the L2 flushed), median of as many calls as ``per_measure_s`` allows; on
CPU (the interpreter) perf_counter, which says nothing about a device: ``--emulate`` checks the
procedure only.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

import glm5
from glm5.backends import tuning_cache as tc
from glm5.backends.vendor import tuning_for
from glm5.ir.catalog import OPS
from glm5.kernels.triton import registry
from glm5.perf import device_shapes as ds
from glm5.testing.compare import check_example

BF = torch.bfloat16
MAX_WARPS = 16
STAGES = (1, 2, 3, 4)
# How far decode work is split across programs (sparse_attention's keys, token_logprobs'
# vocabulary, the quant GEMV's K): halved and doubled like a tile.
SPLIT_KEYS = ("TARGET_PROGRAMS", "GEMV_TARGET_PROGRAMS", "SPLIT_MIN_KEYS")
FLUSH_BYTES = 256 * 2**20  # > any current GPU's L2 (H200: 60 MB)


@dataclass(frozen=True)
class Spec:
    """One shape an op is tuned at: ``timed`` and ``check`` are ``device_shapes`` builders
    (``build(dtype) -> args``), the check one small enough for the float64 oracle."""

    label: str
    timed: Callable[[torch.dtype], dict[str, Any]]
    check: Callable[[torch.dtype], dict[str, Any]]


HEADS, HIDDEN, VOCAB = 64, 6144, 154880  # GLM-5's attention heads, hidden size, vocabulary
TP_CHOICES = (1, 2, 4, 8, 16)


def specs(tp: int = 1) -> dict[str, list[Spec]]:
    """GLM-5's shapes as one of ``tp`` tensor-parallel ranks runs them (bench/gpu_suite.py
    times the tp = 1 ones): attention heads, the column-parallel linears' outputs and the
    vocabulary split ``tp`` ways, as `glm5 plan` lays them out; the indexer (replicated), the
    norms and the routed experts (split by expert parallelism, not by tp) as at tp = 1."""
    if tp not in TP_CHOICES:
        raise ValueError(f"glm5 tune: tp expected one of {TP_CHOICES} (a divisor of GLM-5's "
                         f"{HEADS} heads), got {tp}")
    H, N, V = HEADS // tp, HIDDEN // tp, VOCAB // tp
    return {
        "sparse_attention": [
            Spec(f"prefill T=4096 S=8192 K=2048 H={H} 576/512",
                 ds.b_sparse(4096, 8192, 2048, H, 1, 576, 512),
                 ds.b_sparse(8, 512, 256, H, 1, 576, 512)),
            Spec(f"decode T=64 S=8192 K=2048 H={H} 576/512",
                 ds.b_sparse(64, 8192, 2048, H, 1, 576, 512),
                 ds.b_sparse(2, 512, 256, H, 1, 576, 512))],
        "attention": [Spec(f"prefill T=S=4096 H={H} 256/256",
                           ds.b_attention(4096, 4096, H, H, 256, 256),
                           ds.b_attention(64, 128, H, H, 256, 256))],
        "lightning_indexer": [Spec("T=S=8192 Hi=32 Di=128",
                                   ds.b_indexer(8192, 8192, 32, 128),
                                   ds.b_indexer(128, 512, 32, 128))],
        "indexer_topk": [Spec("T=S=8192 Hi=32 Di=128 top-2048",
                              ds.b_indexer(8192, 8192, 32, 128, 2048),
                              ds.b_indexer(64, 4096, 32, 128, 2048))],
        "paged_indexer_topk": [Spec("decode B=32 L=32768 page=64 top-2048",
                                    ds.b_paged(32, 32768, 32, 128, 2048, 64, False),
                                    ds.b_paged(4, 4096, 32, 128, 2048, 64, False))],
        "moe_experts": [Spec("T=2048 k=8 E=64 D=6144 I=2048",
                             ds.b_moe(2048, 8, 64, 6144, 2048), ds.b_moe(64, 8, 16, 512, 256))],
        "quant_linear": [Spec(f"{s} M={m} K={HIDDEN} N={N}",
                              ds.b_quant_linear(m, HIDDEN, N, s),
                              ds.b_quant_linear(m, 512, 384, s))
                         for m in (512, 1) for s in ("w4a8", "w8a8", "w8a16", "w6a12")],
        "rms_norm": [Spec("T=4096 D=6144", ds.b_norm(4096, HIDDEN), ds.b_norm(64, HIDDEN))],
        "token_logprobs": [Spec(f"T=256 D=6144 V={V}", ds.b_logprobs(256, HIDDEN, V),
                                ds.b_logprobs(8, 256, 4096))],
    }


SPECS = specs(1)

# The same procedure at sizes the Triton interpreter runs in seconds (emulation).
TINY: dict[str, list[Spec]] = {
    "rms_norm": [Spec("tiny T=4 D=64", ds.b_norm(4, 64), ds.b_norm(4, 64))],
    "sparse_attention": [Spec("tiny T=2 S=64 K=16 H=4 32/16", ds.b_sparse(2, 64, 16, 4, 1, 32, 16),
                              ds.b_sparse(2, 64, 16, 4, 1, 32, 16))],
}


def candidates(key: str, value: Any) -> list[Any]:
    """The values the search tries for one launch parameter (its current value first)."""
    if key.endswith("num_warps"):  # also regime-prefixed: MHA_num_warps, decode_num_warps
        # halved / doubled: the backends' tables scale warps to their lanes (a wavefront of 64
        # on Hygon, a 128-lane MUSA warp): 4 on CUDA is 2 on Hygon, 1 on an S4000
        return [value] + [w for w in (value // 2, value * 2) if 1 <= w <= MAX_WARPS]
    if key.endswith("num_stages"):
        return [value] + [s for s in STAGES if s != value]
    if isinstance(value, bool):  # a path switch (sparse_attention's RESIDENT_Q, V_FROM_K)
        return [value, not value]
    if key in SPLIT_KEYS and isinstance(value, int) and value > 0:
        return [value, value // 2, value * 2] if value > 1 else [value, 2]
    if "BLOCK" in key and isinstance(value, int) and value >= 16 and value & (value - 1) == 0:
        return [value, value // 2, value * 2] if value >= 32 else [value, value * 2]
    return [value]


def searchable(entry: dict[str, Any], fixed: tuple[str, ...] = ()) -> list[str]:
    """The entry's searchable keys; the plain launch options only where the entry sets no
    regime-prefixed ones (a plain num_warps would pin every regime of such an entry). Keys
    named in ``fixed`` (a backend table's ``_tune.fixed``, e.g. Cambricon's num_warps, which
    must stay 1) and keys ending with one of them are never searched."""
    keys = [k for k, v in entry.items() if len(candidates(k, v)) > 1]
    keys += [k for k in ("num_warps", "num_stages") if not any(e.endswith(k) for e in entry)]
    return [k for k in keys if not any(k == f or k.endswith("_" + f) for f in fixed)]


def op_fn(op: str, entry: dict[str, Any]) -> Callable[..., Any]:
    """The Triton library's kernel for ``op`` built with launch parameters ``entry``."""
    rows = registry.kernels(lambda name: entry if name == op else {})
    return {r[0]: r[1] for r in rows}[op]


class Clock:
    """Median seconds of fn() on ``device``: its events around each call, a 256 MiB buffer
    rewritten before it (the L2 starts cold); perf_counter on CPU."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.mod = None if self.device.type == "cpu" else getattr(torch, self.device.type)
        self.flush = None if self.mod is None else torch.empty(FLUSH_BYTES, dtype=torch.int8,
                                                               device=self.device)

    def __call__(self, fn: Callable[[], Any], budget_s: float, max_iters: int = 50,
                 flush: bool = True) -> float:
        """At least 3 calls after a warm-up, as many as ``budget_s`` allows up to
        ``max_iters``. ``flush``: rewrite the buffer before each call (off where a cold L2 is
        not the point: a peak matmul or copy). On a device the calls are queued back to back
        with one synchronisation at the end, so the host's launch cost does not leak into a
        short kernel's time."""
        fn()  # warm-up: compilation, allocator
        if self.mod is None:
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            return statistics.median(ts)
        self.mod.synchronize()
        first = self._events(fn, 1, flush)[0]
        n = int(min(max_iters, max(3, budget_s / max(first, 1e-7))))
        return statistics.median(self._events(fn, n, flush))

    def _events(self, fn: Callable[[], Any], n: int, flush: bool) -> list[float]:
        ev = [(self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True))
              for _ in range(n)]
        for s, e in ev:
            if flush:
                self.flush.zero_()
            s.record()
            fn()
            e.record()
        self.mod.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in ev]


@dataclass
class Prepared:
    """An op's shapes ready to run: check examples on the CPU, timing arguments on the
    device."""

    op: str
    labels: list[str]
    checks: list[dict[str, Any]]
    timed: list[tuple]


def prepare(op: str, op_specs: list[Spec], device: torch.device, dtype: torch.dtype = BF
            ) -> Prepared:
    """Build ``op``'s check examples (CPU) and timing arguments (``device``), each validated
    against the op's signature."""
    o = OPS[op]
    checks, timed = [], []
    for s in op_specs:
        with ds.on("cpu"):
            checks.append(o.validate((), s.check(dtype))[0])
        with ds.on(str(device)):
            values = o.validate((), s.timed(dtype))[0]
        timed.append(tuple(values[n] for n in o.param_names))
    return Prepared(op, [s.label for s in op_specs], checks, timed)


def trial(p: Prepared, entry: dict[str, Any], device: torch.device, clock: Clock,
          per_measure_s: float, make: Callable[[str, dict], Callable] | None = None,
          dtype: torch.dtype = BF) -> dict[str, Any]:
    """Judge ``entry`` at every check shape, then time it at every timing shape:
    {"params", "ms": [per shape]} or {"params", "error"}."""
    out: dict[str, Any] = {"params": dict(entry)}
    try:
        fn = (make or op_fn)(p.op, entry)
        for values in p.checks:
            v = check_example(OPS[p.op], fn, values, dtype, device=device)
            if not v.ok:
                out["error"] = f"verdict: {v.message[:200]}"
                return out
        with torch.inference_mode():
            out["ms"] = [1e3 * clock(lambda a=a: fn(*a), per_measure_s) for a in p.timed]
    except Exception as e:  # a tile that does not compile or fit: skipped, recorded
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def score(t: dict[str, Any], start: dict[str, Any]) -> float:
    """Geometric mean of t's times over start's, across the op's shapes (lower is faster)."""
    return math.exp(statistics.fmean(math.log(a / b) for a, b in zip(t["ms"], start["ms"])))


def search(p: Prepared, start: dict[str, Any], device: torch.device, clock: Clock,
           deadline: float, per_measure_s: float,
           make: Callable[[str, dict], Callable] | None = None,
           fixed: tuple[str, ...] = ()) -> dict[str, Any]:
    """One pass of coordinate descent from ``start``: {"op", "shapes", "start", "best",
    "trials"}; best is start when nothing beat it (or start itself failed). ``make(op,
    entry)`` builds the kernel (default `op_fn`)."""
    first = trial(p, start, device, clock, per_measure_s, make)
    trials, best = [first], first
    if "ms" in first:
        for key in searchable(start, fixed):
            for value in candidates(key, best["params"].get(key, start.get(key)))[1:]:
                if time.monotonic() > deadline:
                    break
                t = trial(p, {**best["params"], key: value}, device, clock, per_measure_s, make)
                trials.append(t)
                if "ms" in t and score(t, first) < score(best, first):
                    best = t
    return {"op": p.op, "shapes": p.labels, "start": first, "best": best, "trials": trials}


def winner(r: dict[str, Any], base: dict[str, Any], min_gain: float) -> dict[str, Any] | None:
    """The launch parameters to keep from a search result (its differences from ``base``, the
    backend's table entry), or None: not faster overall by more than ``min_gain``, or slower
    at some shape by more than it."""
    s, b = r["start"], r["best"]
    if "ms" not in s or "ms" not in b or b is s:
        return None
    if score(b, s) > 1 / (1 + min_gain):
        return None
    if any(x > y * (1 + min_gain) for x, y in zip(b["ms"], s["ms"])):
        return None
    diff = {k: v for k, v in b["params"].items() if base.get(k) != v}
    return diff or None


def fixed_keys(table_path: str | Path) -> tuple[str, ...]:
    """The launch parameters a backend's tuning table pins for the search (its
    ``"_tune": {"fixed": [...]}``)."""
    p = Path(table_path) if table_path else None
    if p is None or not p.exists():
        return ()
    fixed = json.loads(p.read_text()).get("_tune", {}).get("fixed", [])
    if not isinstance(fixed, list) or not all(isinstance(k, str) for k in fixed):
        raise ValueError(f"glm5 tune: {p}: _tune.fixed expected a list of parameter names, "
                         f"got {fixed!r}")
    return tuple(fixed)


def run(backend: Any, ops: list[str] | None, device: torch.device, *, emulate: bool = False,
        budget_s: float = 600.0, per_measure_s: float = 0.15, min_gain: float = 0.05,
        fresh: bool = False, write_cache: bool = True, tp: int = 1,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    """Tune ``backend``'s Triton kernels for ``ops`` (default: every op with shapes here) on
    ``device`` at the shapes of one of ``tp`` tensor-parallel ranks (`specs`); returns the
    report (what was tried, what was kept, where it was written)."""
    if emulate and tp != 1:
        raise ValueError("glm5 tune: tp applies to the device shapes, not to the emulated ones")
    shapes = TINY if emulate else specs(tp)
    ops = list(shapes) if not ops else ops
    unknown = [o for o in ops if o not in shapes]
    if unknown:
        raise ValueError(f"glm5 tune: no {'emulation' if emulate else 'tuning'} shapes for "
                         f"{unknown}; ops with shapes: {', '.join(shapes)}")
    table_path = backend.settings.get("tuning_table") or ""
    table = tuning_for(table_path)
    fixed = fixed_keys(table_path)
    key, name = tc.device_key(device)
    path = tc.path_for(backend.name, key)
    cached = {} if fresh or path is None else tc.entries(backend.name, key)[0]
    clock = Clock(device)
    deadline = time.monotonic() + budget_s
    results, keep, drop = [], {}, []
    for op in ops:
        if time.monotonic() > deadline:
            say(f"{op}: skipped (time budget)")
            continue
        base = table(op)
        start = {**base, **cached.get(op, {})}
        prepared = prepare(op, shapes[op], device)
        r = search(prepared, start, device, clock, deadline, per_measure_s, fixed=fixed)
        if "ms" not in r["start"] and op in cached:
            # the cached entry no longer passes here (e.g. another Triton): start over from
            # the table, and the cache forgets it whatever the new search finds
            say(f"{op}: the cached entry {cached[op]} failed ({r['start'].get('error')}); "
                f"searching from the backend's table")
            drop.append(op)
            r = search(prepared, base, device, clock, deadline, per_measure_s, fixed=fixed)
        w = winner(r, base, min_gain)
        r["kept"] = w
        if w is not None:
            keep[op] = w
        results.append(r)
        say(_line(r))
    report = {"backend": backend.name, "device": name, "device_key": key, "emulated": emulate,
              "tp": tp, "results": results, "kept": keep, "cache": None}
    report["dropped"] = drop
    report["cache"] = save(path, keep, lambda: {**_meta(backend.name, name, key, results),
                                                "tp": tp}, write_cache, say, drop)
    return report


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def save(path: Path | None, keep: dict[str, dict[str, Any]], meta: Callable[[], dict],
         write_cache: bool, say: Callable[[str], None],
         drop: list[str] | tuple[str, ...] = ()) -> str | None:
    """Write ``keep`` (per-op entries; ``drop``: ops to forget) to the tuning cache file
    ``path`` with ``meta()``, or say why nothing is written; returns the path written."""
    if not keep and not drop:
        say("nothing to write: no entry beat what runs now")
    elif not write_cache:
        say("not written (--no-cache)")
    elif path is None:
        say(f"{tc.ENV}=off: nothing written")
    else:
        tc.write(path, keep, meta(), drop=drop)
        gone = f"; removed {', '.join(drop)}" if drop else ""
        say(f"wrote {', '.join(sorted(keep)) or 'nothing'} to {path}{gone}")
        return str(path)
    return None


def _line(r: dict[str, Any]) -> str:
    s, b = r["start"], r["best"]
    if "ms" not in s:
        return f"{r['op']:20} failed at the start: {s.get('error')}"
    ms = lambda t: "/".join(f"{x:.3f}" for x in t["ms"])  # noqa: E731
    kept = r["kept"] if r["kept"] else "nothing"
    return (f"{r['op']:20} {ms(s)} -> {ms(b)} ms (x{1 / score(b, s):.2f}, "
            f"{len(r['trials'])} trials): kept {kept}")


def _meta(backend: str, name: str, key: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        import triton
        tv = triton.__version__
    except ImportError:  # pragma: no cover - the kernels need it
        tv = None
    return {"backend": backend, "device": name, "device_key": key, "kernels": tc.kernels_hash(),
            "triton": tv, "torch": torch.__version__, "glm5": glm5.__version__,
            "date": utc_now(),
            "results": {r["op"]: {"shapes": r["shapes"], "start_ms": r["start"].get("ms"),
                                  "best_ms": r["best"].get("ms"), "kept": r["kept"]}
                        for r in results}}


def merge_table(table: dict[str, dict[str, Any]], keep: dict[str, dict[str, Any]]
                ) -> dict[str, dict[str, Any]]:
    """A tuning.json's contents with ``keep`` merged in op by op (other ops kept)."""
    return {**table, **{op: {**table.get(op, {}), **e} for op, e in keep.items()}}
