"""CPU decode step: eager vs `EagerCapture` graphs vs `CompileCapture` (torch.compile, inductor).

    . .venv/bin/activate
    python bench/compile_decode.py --preset small --concurrency 1 8 --reps 3
    python bench/compile_decode.py --preset small --explain      # graph breaks, then exit

Every mode has its own engine over the same model (one torch thread, TVM_NUM_THREADS=1, prefix
cache off); each serves ``c`` requests of ``--prompt-len`` random tokens, greedy, ``--new-tokens``
tokens. A step counts as a decode step when all ``c`` requests were past their prompt before it
ran; it is on the dense path while every sequence's range is within ``index_topk`` (`DecodeGraphs`
then lays it out with the bound ``index_topk``), else the sparse path (bound: the block table's
``max_model_len`` keys). The first run of each (mode, c) is a warm-up that also captures /
compiles; then ``--reps`` rounds interleave the modes, and the table gives the median decode
step (ms) over every counted step of those rounds, split by path. Greedy tokens of every mode
are compared with eager's.

Results after glm5.ops skips its Python validation while dynamo traces (the fake kernel checks
shapes at trace time, the real kernel validates at run time) and mla_prolog's decomposition
returns contiguous outputs (the bench's runtime patch is gone): `--explain`: 1 graph, 0 breaks
per step (dense 198 ops, sparse 218 ops, c=1 and c=8). Timing (2-core shared CPU, 1 thread,
small preset, max_model_len 1024, medians, ms per decode step; two runs back to back, same
code, to show the noise; compile s warm-up of the first run (inductor cache cold for the new
graphs) / second run):

      c  eager        EagerCapture  CompileCapture   compile s per (bucket, path)
      1  17.6 / 14.3  17.4 / 14.4   16.9 / 16.1      13.4 + 8.8 / 3.8 + 1.5
      8  29.9 / 34.1  29.6 / 32.8   30.7 / 33.5      10.5 + 10.3 / 1.9 + 2.1

Compiled is now at par with eager (within this machine's run-to-run noise of ~20%), no longer
~2x slower at c=1; not faster by a margin that survives the noise, so it stays out of the
engine path. (Likely why no gain: every glm5 op stays an opaque custom-op node that goes
through the torch.library dispatcher and `validate_cached` per call at run time, overhead the
eager path skips; inductor fuses only the glue between them.) Greedy tokens identical in every
mode.

Before (commit 582684b, with the runtime contiguous-q_main patch; compile s from the first,
cold run at e682070 (inductor's disk cache empty); with the cache warm the rerun took 14.1 +
4.8 and 5.4 + 2.3 s):

      c  eager  EagerCapture  CompileCapture   compile s per (bucket, path)
      1  13.9   13.8          26.4             27.8 dense + 14.9 sparse
      8  31.5   31.7          41.0             22.7 dense +  9.1 sparse

(an earlier run at e682070, before the ops' dispatch changes: c=1 17.2 / 18.9 / 58.3, c=8
30.4 / 30.1 / 38.3). Greedy tokens identical in every mode. `--explain` then: 34 graphs (33
breaks) per dense step, 46 (45) per sparse step, all in the op validation of glm5/ir (shape
expressions evaluated with eval; the GLM5_STRICT ContextVar read; .item() / .tolist() value
checks; torch.unique in mla_prolog's slot check: a dynamic shape). The fixed range bound
(dense: index_topk keys, sparse: the indexer over all max_model_len keys) did not show on this
model: at --max-model-len 4096 the EagerCapture sparse step was 18.4 ms vs eager 18.7 (c=1)
and 36.0 vs 34.6 (c=8), 7 steps each, one round (noisy); the scoring work grows with
max_model_len, so recheck on a larger model or longer context before a CPU capture path
relies on it.

After the binding's served-kernel path and the cheaper environment reads (98ca6e3, same
machine, quiet, one run): c=1 eager 13.38 / compiled 14.66 ms, c=8 27.24 / 30.07 ms (compile
8.3 + 1.2 s and 5.8 + 1.1 s with inductor's cache warm): still not faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TVM_NUM_THREADS", "1")
import glm5  # noqa: E402,F401  (before torch, as the engine expects)
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import build_model  # noqa: E402

from glm5.core.config import preset  # noqa: E402
from glm5.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from glm5.engine.graphs import CompileCapture, EagerCapture  # noqa: E402
from glm5.engine.sampling import SamplingParams  # noqa: E402

MODES = ("eager", "eagercap", "compiled")


def make_engine(model, mode: str, buckets: tuple[int, ...], args) -> LLMEngine:
    """An engine whose decode steps run ``mode``: "eager" (runner.graphs None), "eagercap"
    (`EagerCapture` graphs), "compiled" (`CompileCapture`)."""
    pages = -(-args.max_model_len // args.page_size)
    eng = LLMEngine(model, EngineConfig(num_pages=max(buckets) * pages + 4,
                                        page_size=args.page_size, max_num_seqs=max(buckets),
                                        max_model_len=args.max_model_len,
                                        max_num_batched_tokens=max(512, max(buckets)
                                                                   * args.prompt_len),
                                        enable_prefix_cache=False,
                                        cuda_graph_buckets=buckets))
    if mode == "eagercap":
        eng.runner.graphs = eng.decode_graphs(EagerCapture(), buckets)
    elif mode == "compiled":
        eng.runner.graphs = eng.decode_graphs(
            CompileCapture(mode=args.compile_mode, fullgraph=args.fullgraph), buckets)
    elif mode != "eager":
        raise ValueError(f"make_engine: argument 'mode' expected one of {MODES}, got {mode!r}")
    return eng


def serve(eng: LLMEngine, prompts: list[list[int]], new_tokens: int, topk: int
          ) -> tuple[list[list[int]], list[tuple[float, bool]]]:
    """Serve ``prompts`` to the end: (greedy tokens per request, [(decode step seconds,
    dense path)])."""
    c = len(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    reqs = [eng.requests[f"r{i}"] for i in range(c)]
    steps: list[tuple[float, bool]] = []
    while any(r.finish_reason is None for r in reqs):
        live = [r for r in reqs if r.finish_reason is None]
        decode = len(live) == c and all(r.output_ids and not r.drafts for r in live)
        dense = max(r.num_tokens for r in live) <= topk
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        if decode:
            steps.append((dt, dense))
    for r in reqs:
        if r.error:
            raise RuntimeError(f"serve: request {r.request_id} failed: {r.error}")
    return [list(r.output_ids) for r in reqs], steps


def explain(model, args) -> None:
    """torch._dynamo.explain over one bucket's decode forward (both paths): graph and break
    counts and the break reasons."""
    import torch._dynamo

    for b in args.concurrency:
        eng = make_engine(model, "eager", tuple(args.concurrency), args)
        g = eng.decode_graphs(EagerCapture(), tuple(args.concurrency))
        buf = g._buffers_for(b)
        g._fill(buf, [0], [b], [g.scratch_pages[:1]])  # row 0 past the padding rows
        for dense in (True, False):
            bound = g._bound(dense)
            torch._dynamo.reset()
            ex = torch._dynamo.explain(lambda: eng.runner.main(buf.ids, buf.positions, buf.seq,
                                                               buf.block_table, bound))()
            print(f"bucket {b} {'dense' if dense else 'sparse'} (bound {bound}): "
                  f"{ex.graph_count} graphs, {ex.graph_break_count} breaks, "
                  f"{ex.op_count} ops")
            for br in ex.break_reasons:
                where = br.user_stack[-1] if br.user_stack else None
                loc = f"{where.filename}:{where.lineno}" if where is not None else "?"
                print(f"  break: {br.reason.splitlines()[0][:160]}  @ {loc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode (default None; e.g. max-autotune-no-cudagraphs)")
    ap.add_argument("--fullgraph", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--explain", action="store_true", help="print graph breaks and exit")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    model = build_model(cfg, torch.float32, "cpu", 0)
    if args.explain:
        explain(model, args)
        return
    topk = cfg.index_topk
    gen = torch.Generator().manual_seed(1)
    rows = []
    for c in args.concurrency:
        prompts = [torch.randint(2, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(c)]
        bucket = (c,)
        engines = {m: make_engine(model, m, bucket, args) for m in args.modes}
        tokens, times, warm = {}, {m: [] for m in args.modes}, {}
        for m in args.modes:  # warm-up: captures / compiles
            t0 = time.perf_counter()
            tokens[m], _ = serve(engines[m], prompts, args.new_tokens, topk)
            warm[m] = time.perf_counter() - t0
        for _ in range(args.reps):
            for m in args.modes:
                toks, st = serve(engines[m], prompts, args.new_tokens, topk)
                if toks != tokens[m]:
                    raise RuntimeError(f"main: mode {m} c={c}: tokens changed between runs")
                times[m] += st
        for m in args.modes:
            g = engines[m].runner.graphs
            cap = g.capture if g is not None else None
            comp = getattr(cap, "compile_seconds", [])
            dense = [t for t, d in times[m] if d]
            sparse = [t for t, d in times[m] if not d]
            med = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
            ref = tokens.get("eager", tokens[args.modes[0]])
            rows.append((c, m, med([t for t, _ in times[m]]), med(dense), med(sparse),
                         len(dense), len(sparse), "+".join(f"{s:.1f}" for s in comp) or "-",
                         warm[m], tokens[m] == ref,
                         f"{g.replays}/{g.eager}" if g is not None else "-"))
    print(f"\npreset {args.preset}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"max_model_len {args.max_model_len}, page {args.page_size}, index_topk {topk}, "
          f"threads {args.threads}, compile mode {args.compile_mode}, fullgraph {args.fullgraph}")
    print(f"{'c':>3} {'mode':<9} {'step ms':>8} {'dense':>8} {'sparse':>8} {'n_d':>5} {'n_s':>4} "
          f"{'compile s (per key)':>20} {'warm s':>7} {'tokens=':>7} {'replay/eager':>12}")
    for r in rows:
        print(f"{r[0]:>3} {r[1]:<9} {r[2]:8.2f} {r[3]:8.2f} {r[4]:8.2f} {r[5]:5d} {r[6]:4d} "
              f"{r[7]:>20} {r[8]:7.1f} {str(r[9]):>7} {r[10]:>12}")


if __name__ == "__main__":
    main()
