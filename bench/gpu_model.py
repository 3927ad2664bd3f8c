#!/usr/bin/env python
"""Model-level GPU run (issue 16), beside bench/gpu_suite.py: GLM-5's shapes with 2 layers (one
dense, one MoE with 64 routed experts), random weights, batch 1 prefill and batched decode on one
GPU, in one run of a few minutes.

1. Prefill at each context (default 4K ... 128K tokens): glm5's forward (first call and, where
   the first took under --repeat-below-s, a second one), seconds and microseconds per token; the
   same checkpoint through transformers' GlmMoeDsaForCausalLM (eager) up to --hf-max tokens (it
   runs out of memory at 16K on an H200), out-of-memory reported as such.
   Then, at each --fp8-prefill context, the same prefill with the fp8 indexer
   (dsa_indexer_dtype = "fp8": indexer_topk_fp8, the same weights) and its time over the bf16
   indexer's.
2. Decode through the serving engine (glm5.engine.LLMEngine) at each batch size (default 1, 8,
   32) after a --decode-prompt token prompt per sequence: the first --first-steps decode steps
   timed one by one (a compilation per sequence length, or a graph capture, shows up here),
   then the median of --decode-steps steady steps, and the host reads per step counted by
   glm5.testing.syncs.SyncCounter; with CUDA-graph decode steps and without (--graphs).
3. A torch.profiler trace of one prefill at --profile-len (and of steady decode steps at the
   largest batch): GPU time per kernel, the top kernels' shares.

Every time is measured with the device synchronised before and after (CUDA events are not
needed at these durations). Prints tables and writes JSON to --out (default
bench/results/gpu_model_<timestamp>.json). Without a CUDA device it says so and exits 0, unless
--device cpu is given: then it runs the same steps (tiny by --preset small) as a smoke test.

    python bench/gpu_model.py [--prefill 4096,8192,...] [--decode-batches 1,8,32]
                              [--hf-max 8192] [--profile-len 65536] [--budget-s 300]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from serving import build_model, glm5_shaped_config, load_hf  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


class Clock:
    """Wall seconds of fn() with the device synchronised around it."""

    def __init__(self, device: str) -> None:
        self.sync: Callable[[], None] = (torch.cuda.synchronize if device.startswith("cuda")
                                         else (lambda: None))

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        t = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - t, out


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def prefill_rows(model, hf_path: str | None, lengths: list[int], hf_max: int, clock: Clock,
                 device: str, repeat_below_s: float, deadline: float, vocab: int
                 ) -> list[dict[str, Any]]:
    rows = []
    hf = None
    for L in lengths:
        if time.monotonic() > deadline:
            rows.append({"tokens": L, "skipped": "time budget"})
            continue
        g = torch.Generator().manual_seed(L)
        ids = torch.randint(0, vocab, (1, L), generator=g).to(device)
        row: dict[str, Any] = {"tokens": L}
        try:
            with torch.inference_mode():
                first, _ = clock(lambda: model(ids))
                row["glm5_first_s"] = first
                if first < repeat_below_s:
                    row["glm5_s"], _ = clock(lambda: model(ids))
                else:
                    row["glm5_s"] = first
            row["glm5_us_per_token"] = 1e6 * row["glm5_s"] / L
        except Exception as e:  # noqa: BLE001 - this length fails, the others still run
            row["glm5_s"] = "OOM" if _oom(e) else None
            if not _oom(e):
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"prefill {L}: {row['error']}\n{traceback.format_exc(limit=6)}",
                      flush=True)
        _free(device)
        if hf is None and hf_path is not None and L <= hf_max:
            try:
                hf = load_hf(hf_path, next(model.parameters()).dtype, device)
            except (ImportError, AttributeError) as e:  # no transformers with GLM-5 here
                hf_path = None
                row["hf_note"] = f"transformers unavailable: {type(e).__name__}: {e}"
                print(row["hf_note"], flush=True)
            except RuntimeError as e:
                if not _oom(e):
                    raise
                hf_path, row["hf_s"] = None, "OOM"
        if hf is not None and L <= hf_max:
            try:
                with torch.inference_mode():
                    clock(lambda: hf(ids[:, : min(L, 512)], use_cache=False))  # warm-up
                    row["hf_s"], _ = clock(lambda: hf(ids, use_cache=False))
                row["speedup"] = row["hf_s"] / row["glm5_s"] if isinstance(
                    row.get("glm5_s"), float) else None
            except RuntimeError as e:
                if not _oom(e):
                    raise
                row["hf_s"] = "OOM"
            _free(device)
        rows.append(row)
        print(_prefill_line(row), flush=True)
    del hf
    _free(device)
    return rows


@contextlib.contextmanager
def indexer_dtype(model, dtype: str):
    """Every indexer of ``model`` scoring with ``dtype`` ("bf16" / "fp8") inside the block."""
    from glm5.core.attention import Indexer

    mods = [m for m in model.modules() if isinstance(m, Indexer)]
    old = [m.cfg for m in mods]
    for m in mods:
        m.cfg = m.cfg.replace(dsa_indexer_dtype=dtype)
    try:
        yield
    finally:
        for m, c in zip(mods, old):
            m.cfg = c


def fp8_prefill_rows(model, lengths: list[int], clock: Clock, device: str,
                     repeat_below_s: float, deadline: float, vocab: int,
                     bf16_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prefill rows at ``lengths`` with the fp8 indexer, each with its time over the bf16
    indexer's row of the same length (``fp8_over_bf16``, where that row has a time)."""
    bf16 = {r["tokens"]: r.get("glm5_s") for r in bf16_rows}
    with indexer_dtype(model, "fp8"):
        rows = prefill_rows(model, None, lengths, 0, clock, device, repeat_below_s, deadline,
                            vocab)
    for r in rows:
        b = bf16.get(r["tokens"])
        if isinstance(b, float) and isinstance(r.get("glm5_s"), float):
            r["fp8_over_bf16"] = r["glm5_s"] / b
            print(f"  fp8 indexer at {r['tokens']}: {r['fp8_over_bf16']:.3f} of the bf16 "
                  f"indexer's prefill time", flush=True)
    return rows


def _prefill_line(r: dict[str, Any]) -> str:
    def f(v: Any, nd: int = 3) -> str:
        return f"{v:.{nd}f}" if isinstance(v, float) else str(v if v is not None else "-")

    return (f"prefill {r['tokens']:>7}  glm5 {f(r.get('glm5_s'))} s "
            f"(first {f(r.get('glm5_first_s'))})"
            f"  {f(r.get('glm5_us_per_token'), 1)} us/token  transformers {f(r.get('hf_s'))} s"
            f"  speed-up {f(r.get('speedup'), 2)}")


def _sync_counter() -> Any:
    try:
        from glm5.testing.syncs import SyncCounter  # issue 16's counter (if present)
    except ImportError:
        return None
    return SyncCounter


def decode_rows(model, batches: list[int], prompt: int, first_steps: int, steps: int,
                clock: Clock, deadline: float, vocab: int, engine_kw: dict[str, Any]
                ) -> list[dict[str, Any]]:
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams

    counter = _sync_counter()
    rows = []
    for B in batches:
        if time.monotonic() > deadline:
            rows.append({"batch": B, "skipped": "time budget"})
            continue
        total = first_steps + steps + 2
        ps = 64
        pages = B * (-(-(prompt + total + 8) // ps)) + 8
        eng = LLMEngine(model, EngineConfig(max_num_seqs=max(B, 1), num_pages=pages,
                                            page_size=ps, enable_prefix_cache=False,
                                            max_num_batched_tokens=max(8192, prompt),
                                            chunk_size=min(prompt, 8192), seed=0, **engine_kw))
        g = torch.Generator().manual_seed(B)
        for i in range(B):
            ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
            eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=total, temperature=0.0,
                                                         ignore_eos=True))
        # prefill: step until every sequence has its first token
        t0 = time.perf_counter()
        started: set[str] = set()
        while len(started) < B:
            for o in eng.step():
                if o.token_ids:
                    started.add(o.request_id)
        clock.sync()
        row: dict[str, Any] = {"batch": B, "prompt": prompt, "prefill_s": time.perf_counter() - t0}
        firsts = []
        for _ in range(first_steps):
            s, _ = clock(eng.step)
            firsts.append(s)
        steady = []
        for _ in range(steps):
            s, _ = clock(eng.step)
            steady.append(s)
        row["first_steps_ms"] = [1e3 * s for s in firsts]
        row["steady_ms"] = 1e3 * statistics.median(steady)
        row["tokens_per_s"] = B / (row["steady_ms"] / 1e3)
        if counter is not None:
            with counter() as c:
                eng.step()
            row["host_reads_per_step"] = int(c.count)
        rows.append(row)
        first = ", ".join(f"{x:.1f}" for x in row["first_steps_ms"])
        print(f"decode batch {B:>3}  first steps {first} ms"
              f"  steady {row['steady_ms']:.2f} ms/step  {row['tokens_per_s']:.0f} tok/s"
              + (f"  host reads/step {row['host_reads_per_step']}"
                 if "host_reads_per_step" in row else ""), flush=True)
        del eng
        _free(model.device.type)
    return rows


def profile_prefill(model, L: int, device: str, vocab: int, top: int = 12) -> dict[str, Any]:
    """GPU (or CPU) self time per kernel over one prefill of L tokens."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(ProfilerActivity.CUDA)
    ids = torch.randint(0, vocab, (1, L), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.inference_mode():
        model(ids)  # warm
        with profile(activities=acts) as prof:
            model(ids)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
    use_cuda = device.startswith("cuda")
    rows = []
    for ev in prof.key_averages():
        t = (getattr(ev, "self_device_time_total", 0) if use_cuda
             else ev.self_cpu_time_total)
        if t > 0:
            rows.append((ev.key, float(t) / 1e6, int(ev.count)))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows) or 1.0
    out = {"tokens": L, "device_time_s": total,
           "kernels": [{"name": k, "seconds": s, "share": s / total, "calls": n}
                       for k, s, n in rows[:top]]}
    print(f"profile: prefill {L} tokens, {'GPU' if use_cuda else 'CPU'} time {total:.3f} s")
    for k in out["kernels"]:
        print(f"  {100 * k['share']:5.1f}%  {k['seconds'] * 1e3:9.2f} ms  {k['calls']:6d}x  "
              f"{k['name'][:90]}")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="glm5-2layer",
                    help="glm5-2layer (GLM-5 shapes, 2 layers, 64 experts) or a glm5 preset "
                         "name such as small (for a CPU smoke run)")
    ap.add_argument("--prefill", type=_ints, default=[4096, 8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--fp8-prefill", type=_ints, default=[8192, 65536],
                    help="contexts re-run with the fp8 indexer (empty: none)")
    ap.add_argument("--hf-max", type=int, default=8192,
                    help="largest context run through transformers (0: none)")
    ap.add_argument("--repeat-below-s", type=float, default=5.0)
    ap.add_argument("--decode-batches", type=_ints, default=[1, 8, 32])
    ap.add_argument("--decode-prompt", type=int, default=2048)
    ap.add_argument("--first-steps", type=int, default=4)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--graphs", choices=("auto", "on", "off", "both"), default="both",
                    help="CUDA-graph decode steps (EngineConfig.cuda_graphs): both runs the "
                         "decode rows with and without (on a CUDA device)")
    ap.add_argument("--profile-len", type=int, default=65536, help="0: no profile")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="rows not started by then are reported as skipped")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def model_config(preset: str):
    if preset == "glm5-2layer":
        return glm5_shaped_config()
    from glm5.core.config import preset as get

    return get(preset)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to time (use --device cpu --preset small for a smoke run)")
        return 0
    deadline = time.monotonic() + a.budget_s
    dtype = torch.bfloat16
    cfg = model_config(a.preset)
    model = build_model(cfg, dtype, a.device, a.seed)
    clock = Clock(a.device)
    result: dict[str, Any] = {
        "when": datetime.now().isoformat(timespec="seconds"), "device": a.device,
        "device_name": (torch.cuda.get_device_name() if a.device.startswith("cuda")
                        else "cpu"),
        "torch": torch.__version__, "preset": a.preset,
        "config": {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size",
                                                "n_routed_experts", "index_topk")},
        "argv": sys.argv[1:]}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    out = Path(a.out) if a.out else (ROOT / "bench" / "results" /
                                    f"gpu_model_{datetime.now():%Y%m%d_%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}

    def stage(name: str, fn: Callable[[], Any]) -> None:
        """Run one part of the sequence; an exception is recorded and the rest still runs, and
        the JSON is rewritten after every part (a run killed at its time limit keeps what it
        measured)."""
        try:
            got = fn()
            if got is not None:
                result[name] = got
        except Exception as e:  # noqa: BLE001 - one broken part must not cost the others
            errors[name] = f"{type(e).__name__}: {e}"
            result["errors"] = errors
            print(f"{name} raised {errors[name]}\n{traceback.format_exc(limit=6)}", flush=True)
        out.write_text(json.dumps(result, indent=1, default=str))

    def prefill() -> list[dict[str, Any]]:
        with contextlib.ExitStack() as stack:
            hf_path = None
            if a.hf_max > 0 and any(L <= a.hf_max for L in a.prefill):
                tmp = stack.enter_context(tempfile.TemporaryDirectory())
                model.save_pretrained(tmp)
                hf_path = tmp
            return prefill_rows(model, hf_path, a.prefill, a.hf_max, clock, a.device,
                                a.repeat_below_s, deadline, cfg.vocab_size)

    stage("prefill", prefill)
    if a.fp8_prefill:
        print("prefill with the fp8 indexer")
        stage("prefill_fp8", lambda: fp8_prefill_rows(
            model, a.fp8_prefill, clock, a.device, a.repeat_below_s, deadline, cfg.vocab_size,
            result.get("prefill", [])))
    modes = {"auto": [None], "on": [True], "off": [False], "both": [True, False]}[a.graphs]
    if not a.device.startswith("cuda"):
        modes = [None]  # graphs are a CUDA feature (the engine refuses them elsewhere)
    result["decode"] = []

    def decode(graphs: bool | None) -> None:
        if graphs is not None:
            print(f"decode with cuda_graphs={graphs}")
        for row in decode_rows(model, a.decode_batches, a.decode_prompt, a.first_steps,
                               a.decode_steps, clock, deadline, cfg.vocab_size,
                               {"cuda_graphs": graphs}):
            result["decode"].append({"cuda_graphs": graphs, **row})

    for graphs in modes:
        stage("decode" if graphs is None else f"decode_graphs_{graphs}",
              lambda graphs=graphs: decode(graphs))
    if a.profile_len > 0 and time.monotonic() < deadline:
        stage("profile", lambda: profile_prefill(model, a.profile_len, a.device,
                                                 cfg.vocab_size))
    print(f"wrote {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
