"""Communication of the model across processes (glm5.parallel, gloo on this CPU), in one run:

    python bench/dist_comm.py [--preset small] [--tp 2,4] [--tokens 8,512] [--repeat 5]
        [--procs 1,2,4] [--measured-procs 2] [--measured-tokens 5,512]
        [--skip comm,scaling,plan,measured] [--out bench/results/dist_comm.json]
    python bench/dist_comm.py --report bench/results/dist_comm.json   # its tables again

* **comm** — per layer, the link bytes and the wall time of each collective kind during one
  forward, for the all-reduce, FlashComm and FlashComm-int8 ways of summing the TP group's
  partial outputs, at a decode token count (``--tokens`` first entry: that many sequences, one
  new token each, after ``--decode-context`` tokens of context) and a prefill token count
  (second entry: one sequence of that many tokens), at each ``--tp`` (a world of that many
  processes). ``glm5.parallel.comm``'s functions are wrapped while the forward runs (the model
  calls them through the module): each call adds its wall time (on this rank, including the
  wait for the slowest rank) and its `glm5.parallel.link_bytes` to its kind (``all_gather_int8``:
  the quantized gathers); the totals of one forward are divided by the number of layers (a
  FlashComm forward also gathers the residual stream once at the end: included). Also the
  whole forward's time (the slowest rank's, without the wrappers), and the logits' deviation
  from the all-reduce path (max |diff| / max |logit|). Medians over ``--repeat`` forwards.
* **scaling** — tokens/s at 1, 2 and 4 processes (``--procs``) for tensor parallel (tp = P)
  and for data-parallel attention + expert parallel (ep = P): prefill of a fixed global batch
  (``--prefill-batch`` sequences of ``--prefill-len`` tokens; with DP attention each rank
  prefills batch / P of them) and decode (``--decode-batch`` sequences, ``--decode-steps``
  greedy steps after ``--decode-context`` tokens). One torch thread per process. Time = the
  slowest rank's; tokens/s = global tokens / time; median over ``--repeat``.
* **plan** — the planner's predicted communication for GLM-5 (w4a8, context 8192; decode at
  batch 64, prefill batch 1) on 8 x H200 and 16 x Ascend 910B (`glm5.deploy.plan.plan`, the
  layouts of docs/planner.md), beside the measurements.

* **measured** — planned against counted link bytes, per layer and per collective, for the
  layouts the model runs (tp all-reduce, tp FlashComm bf16 / int8, ep with replicated tokens,
  ep with data-parallel attention) at ``--measured-procs`` ranks and ``--measured-tokens``
  sequence lengths (one sequence; with DP attention one per rank): every collective is counted
  on every rank by `glm5.parallel.count_bytes` and tagged with its layer; the prediction is
  `glm5.deploy.plan.layer_comm` at the model's activation dtype, for the all-to-all with the
  routing the router produced (`route_pairs`); the planner's uniform-routing expectation beside.

The machine (CPU model, core count, load average before and after each part), the date and the
command are recorded with the results. With more processes than cores the processes share
cores (the JSON and the tables say so): a time then includes waiting for a core.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = {  # name: (flashcomm, comm_quant)
    "allreduce": (False, None),
    "flashcomm": (True, None),
    "flashcomm-int8": (True, "int8"),
}
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_gather_int8", "all_to_all")
PLAN_LAYOUTS = {"h200": [(8, 1), (8, 8), (4, 8), (2, 8), (1, 8)],
                "ascend-910b": [(16, 16), (8, 16), (4, 16), (2, 16), (1, 16)]}


# --------------------------------------------------------------------------- instrumentation
class CommMeter:
    """While active, every call of glm5.parallel.comm's all_reduce / reduce_scatter / all_gather /
    all_to_all adds (calls, wall seconds, link bytes) to its kind in ``self.totals``. The model
    reaches the collectives as ``comm.<name>`` (glm5.parallel.layouts), so patching the module's
    attributes sees every call; the link bytes are computed outside the timed region."""

    def __init__(self, keep_calls: bool = False) -> None:
        self.totals: dict[str, list[float]] = {}
        self.calls: list[tuple[str, Any, tuple, dict]] = []  # (kind, fn, args, kwargs)
        self.keep_calls = keep_calls
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "CommMeter":
        from glm5.parallel import comm

        for name in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
            orig = getattr(comm, name)
            self._saved[name] = orig
            setattr(comm, name, self._wrap(name, orig, inspect.signature(orig)))
        return self

    def __exit__(self, *exc: Any) -> None:
        from glm5.parallel import comm

        for name, orig in self._saved.items():
            setattr(comm, name, orig)
        self._saved.clear()

    def _wrap(self, name: str, orig: Any, sig: inspect.Signature) -> Any:
        from glm5.parallel import comm

        def timed(*args: Any, **kw: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            y = orig(*args, **kw)
            dt = time.perf_counter() - t0
            b = sig.bind(*args, **kw)
            b.apply_defaults()
            a = b.arguments
            attrs: dict[str, Any] = {}
            kind = name
            if name in ("all_gather", "reduce_scatter"):
                attrs["dim"] = a["dim"]
            if name == "all_gather" and a["quant"] is not None:
                attrs["quant"] = a["quant"]
                kind = "all_gather_int8"
            if name == "all_to_all":
                attrs["send_counts"] = a["send_counts"]
            nbytes = comm.link_bytes(name, a["x"], a["group"], **attrs)
            t = self.totals.setdefault(kind, [0, 0.0, 0.0])
            t[0] += 1
            t[1] += dt
            t[2] += nbytes
            if self.keep_calls:
                self.calls.append((kind, orig, args, kw))
            return y

        return timed


def replay(ctx: Any, calls: list[tuple[str, Any, tuple, dict]]) -> dict[str, float]:
    """Seconds per kind of the recorded collectives run again one by one, each after a
    barrier: the collective's own cost at these sizes, without the wait for a rank still
    computing that the in-forward times include."""
    out: dict[str, float] = {}
    for kind, fn, args, kw in calls:
        _barrier(ctx)
        t0 = time.perf_counter()
        fn(*args, **kw)
        out[kind] = out.get(kind, 0.0) + time.perf_counter() - t0
    return out


def _barrier(ctx: Any) -> None:
    import glm5.parallel as gd

    gd.all_reduce(torch.zeros(1), ctx.world)


def _every(ctx: Any, value: float) -> list[float]:
    """Every rank's ``value``, in rank order (a sum of one-hot slots)."""
    import glm5.parallel as gd

    if ctx.world_size == 1:
        return [value]
    v = torch.zeros(ctx.world_size, dtype=torch.float64)
    v[ctx.rank] = value
    return gd.all_reduce(v, ctx.world).tolist()


def _slowest(ctx: Any, seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    return max(_every(ctx, seconds))


def _model(preset_name: str, seed: int = 0) -> Any:
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    torch.manual_seed(seed)  # the same weights on every rank
    return GLM5ForCausalLM(preset(preset_name).replace(num_nextn_predict_layers=0)).eval()


# --------------------------------------------------------------------------- part 1: comm
def comm_task(ctx: Any, preset_name: str, tokens: list[int], repeat: int, context: int
              ) -> dict[str, Any]:
    """On every rank of a TP world: per mode and token count, the per-kind totals of one forward
    (medians over ``repeat``) and the forward's time."""
    from glm5.parallel.layouts import ParallelConfig, parallelize

    out: dict[str, Any] = {}
    ref_logits: dict[int, torch.Tensor] = {}
    g = torch.Generator().manual_seed(1)
    for mode, (fc, quant) in MODES.items():
        cfg = ParallelConfig.from_context(ctx, tp=ctx.world_size, flashcomm=fc,
                                          flashcomm_min_tokens=0, comm_quant=quant)
        model = parallelize(_model(preset_name), cfg)
        n_layers = len(model.model.layers)
        V = model.config.vocab_size
        for i, n in enumerate(tokens):
            decode = i == 0
            g.manual_seed(1 + n)
            if decode:  # n sequences, one new token each, after `context` tokens
                cache = model.new_cache(n, context + 1)
                with torch.no_grad():
                    model(torch.randint(0, V, (n, context), generator=g), cache)
                step = torch.randint(0, V, (n, 1), generator=g)

                def fwd() -> torch.Tensor:
                    y = model(step, cache)
                    cache.rollback(1)
                    return y
            else:  # one sequence of n tokens
                ids = torch.randint(0, V, (1, n), generator=g)

                def fwd() -> torch.Tensor:
                    return model(ids)

            with torch.no_grad():
                logits = fwd()  # warm-up
                if mode == "allreduce":
                    ref_logits[n] = logits
                dev = float((logits - ref_logits[n]).abs().max() / ref_logits[n].abs().max())
                fwd_s, per_kind, isolated = [], [], []
                for _ in range(repeat):
                    _barrier(ctx)
                    t0 = time.perf_counter()
                    fwd()
                    fwd_s.append(_slowest(ctx, time.perf_counter() - t0))
                for r in range(repeat):
                    _barrier(ctx)
                    with CommMeter(keep_calls=r == 0) as m:
                        fwd()
                    per_kind.append(m.totals)
                    if r == 0:
                        calls = m.calls
                for _ in range(repeat):
                    isolated.append(replay(ctx, calls))
            kinds = {}
            for k in sorted({k for t in per_kind for k in t}):
                n_calls, _, nbytes = per_kind[0][k]
                kinds[k] = {"calls_per_forward": n_calls, "link_bytes_per_forward": nbytes,
                            "seconds_per_forward": statistics.median(t[k][1] for t in per_kind),
                            "isolated_seconds_per_forward": statistics.median(
                                t[k] for t in isolated)}
            out[f"{mode}/{n}"] = {"mode": mode, "tokens": n, "phase": "decode" if decode
                                  else "prefill", "layers": n_layers,
                                  "forward_s": statistics.median(fwd_s),
                                  "logit_dev_vs_allreduce": dev, "kinds": kinds}
    return out


def run_comm(a: argparse.Namespace) -> list[dict[str, Any]]:
    from glm5.testing.dist import DistPool, values

    rows = []
    for tp in a.tp:
        with DistPool(tp, comm_timeout_s=300) as pool:
            res = values(pool.run(comm_task, a.preset, a.tokens, a.repeat, a.decode_context,
                                  timeout_s=1800))
        for key, r0 in res[0].items():
            L = r0["layers"]
            per_layer = {}
            for k, v in r0["kinds"].items():
                secs = [r[key]["kinds"][k]["seconds_per_forward"] for r in res]
                iso = [r[key]["kinds"][k]["isolated_seconds_per_forward"] for r in res]
                per_layer[k] = {
                    "calls": v["calls_per_forward"] / L,
                    "link_bytes": v["link_bytes_per_forward"] / L,
                    "us_in_forward_rank_mean": 1e6 * statistics.fmean(secs) / L,
                    "us_in_forward_rank_max": 1e6 * max(secs) / L,
                    "us_isolated_rank_mean": 1e6 * statistics.fmean(iso) / L,
                }
            rows.append({
                "tp": tp, "mode": r0["mode"], "phase": r0["phase"], "tokens": r0["tokens"],
                "layers": L, "forward_ms": 1e3 * r0["forward_s"],
                "comm_link_bytes_per_layer": sum(v["link_bytes"] for v in per_layer.values()),
                "comm_us_in_forward_per_layer": sum(v["us_in_forward_rank_mean"]
                                                    for v in per_layer.values()),
                "comm_us_isolated_per_layer": sum(v["us_isolated_rank_mean"]
                                                  for v in per_layer.values()),
                "logit_dev_vs_allreduce": r0["logit_dev_vs_allreduce"],
                "per_layer": per_layer,
            })
            print(_comm_line(rows[-1]), flush=True)
    return rows


# --------------------------------------------------------------------------- part 2: scaling
def scaling_task(ctx: Any, preset_name: str, layout: str, pb: int, pl: int, db: int,
                 steps: int, context: int, repeat: int) -> dict[str, Any]:
    """Prefill and decode times (the slowest rank's, medians) of ``layout`` on this world."""
    from glm5.parallel.layouts import ParallelConfig, parallelize

    P = ctx.world_size
    model = _model(preset_name)
    if P > 1:
        cfg = (ParallelConfig.from_context(ctx, tp=P) if layout == "tp" else
               ParallelConfig.from_context(ctx, ep=P, dp_attention=True))
        parallelize(model, cfg)
    V = model.config.vocab_size
    share = layout == "dp-attention+ep" and P > 1  # each rank its own sequences

    def mine(ids: torch.Tensor) -> torch.Tensor:
        if not share:
            return ids
        per = ids.shape[0] // P
        return ids[ctx.rank * per:(ctx.rank + 1) * per]

    g = torch.Generator().manual_seed(2)
    pids = mine(torch.randint(0, V, (pb, pl), generator=g))
    dctx = mine(torch.randint(0, V, (db, context), generator=g))
    prefill, decode, pcpu, dcpu = [], [], [], []
    with torch.no_grad():
        model(pids)  # warm-up
        for _ in range(repeat):
            _barrier(ctx)
            t0, c0 = time.perf_counter(), time.process_time()
            model(pids)
            c1, t1 = time.process_time(), time.perf_counter()
            prefill.append(_slowest(ctx, t1 - t0))
            pcpu.append(sum(_every(ctx, c1 - c0)))
        for r in range(repeat + 1):  # the first: warm-up
            cache = model.new_cache(dctx.shape[0], context + steps)
            tok = model(dctx, cache)[:, -1].argmax(-1, keepdim=True)
            _barrier(ctx)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                tok = model(tok, cache)[:, -1].argmax(-1, keepdim=True)
            c1, t1 = time.process_time(), time.perf_counter()
            dt = _slowest(ctx, t1 - t0)
            dc = sum(_every(ctx, c1 - c0))
            if r:
                decode.append(dt)
                dcpu.append(dc)
    return {"prefill_s": statistics.median(prefill), "decode_s": statistics.median(decode),
            "prefill_cpu_s_all_ranks": statistics.median(pcpu),
            "decode_cpu_s_all_ranks": statistics.median(dcpu),
            "threads": torch.get_num_threads()}


def run_scaling(a: argparse.Namespace) -> list[dict[str, Any]]:
    from glm5.testing.dist import DistPool, values

    rows = []
    for P in a.procs:
        with DistPool(P, comm_timeout_s=300) as pool:
            for layout in ("tp", "dp-attention+ep"):
                if P == 1 and layout != "tp":  # one process: the same single model
                    rows.append({**rows[-1], "layout": layout, "note": "the single model (the "
                                 "1-process tp row)"})
                    continue
                r = values(pool.run(scaling_task, a.preset, layout, a.prefill_batch,
                                    a.prefill_len, a.decode_batch, a.decode_steps,
                                    a.decode_context, a.repeat, timeout_s=1800))[0]
                rows.append({
                    "procs": P, "layout": layout,
                    "oversubscribed": P > _cores(),
                    "threads_per_process": r["threads"],
                    "prefill_tokens": a.prefill_batch * a.prefill_len,
                    "prefill_s": r["prefill_s"],
                    "prefill_tokens_per_s": a.prefill_batch * a.prefill_len / r["prefill_s"],
                    "decode_tokens": a.decode_batch * a.decode_steps,
                    "decode_s": r["decode_s"],
                    "decode_tokens_per_s": a.decode_batch * a.decode_steps / r["decode_s"],
                    # CPU seconds all ranks together spent (process time: compute, and gloo's
                    # own threads): above the 1-process figure = work the layout replicates or
                    # adds; wall x processes above it = time a rank waited (peers, a core)
                    "prefill_cpu_s_all_ranks": r["prefill_cpu_s_all_ranks"],
                    "decode_cpu_s_all_ranks": r["decode_cpu_s_all_ranks"],
                })
                print(_scaling_line(rows[-1]), flush=True)
    base = {r["layout"]: r for r in rows if r["procs"] == 1}
    for r in rows:
        b = base.get(r["layout"])
        if b:
            r["prefill_speedup"] = r["prefill_tokens_per_s"] / b["prefill_tokens_per_s"]
            r["decode_speedup"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
    return rows


# --------------------------------------------------------------------------- part 3: plan
def run_plan() -> list[dict[str, Any]]:
    """The planner's communication figures for GLM-5 (the layouts of docs/planner.md)."""
    from glm5.core.config import preset
    from glm5.deploy.plan import plan

    cfg = preset("glm-5")
    rows = []
    for chip, layouts in PLAN_LAYOUTS.items():
        for tp, ep in layouts:
            for phase, batch in (("decode", 64), ("prefill", 1)):
                p = plan(cfg, chip, "w4a8", batch, 8192, tp=tp, ep=ep)
                ph = p[phase]
                c = ph["comm"]
                moe = next(k for k in c["kinds"] if k["kind"] == "moe")
                rows.append({
                    "chip": chip, "tp": tp, "ep": ep, "phase": phase, "batch": batch,
                    "context": 8192, "quant": "w4a8",
                    "command": (f"glm5 plan --preset glm-5 --chip {chip} --quant w4a8 "
                                f"--context 8192 --batch {batch} --tp {tp} --ep {ep} --json"),
                    "tokens_per_tp_group": c["tokens_per_tp_group"],
                    "thresholds": c["thresholds"],
                    "per_moe_layer": {
                        **{opt: {"link_bytes": v["link_bytes"], "comm_us": v["comm_us"],
                                 "total_us": v["total_us"]}
                           for opt, v in (moe["tp"] or {}).items()},
                        "ep_alltoall": moe["ep_alltoall"],
                    },
                    "comm_option": ph["comm_option"], "compute_ms": ph["compute_ms"],
                    "tp_comm_ms": ph["tp_comm_ms"], "ep_alltoall_ms": ph["ep_alltoall_ms"],
                    "total_ms": ph["total_ms"], "fits": p["memory"]["fits"],
                })
    return rows


# --------------------------------------------------------------------------- part 4: measured
MEASURED_LAYOUTS = {  # name: (tp, ep, dp_attention, flashcomm, comm_quant); "n": the world size
    "tp": ("n", 1, False, False, None),
    "tp+flashcomm": ("n", 1, False, True, None),
    "tp+flashcomm-int8": ("n", 1, False, True, "int8"),
    "ep": (1, "n", False, False, None),
    "ep+dp-attention": (1, "n", True, False, None),
}


def measured_task(ctx: Any, preset_name: str, tokens: list[int]) -> dict[str, Any]:
    """On every rank: per layout of MEASURED_LAYOUTS and sequence length, one forward of one
    sequence (with DP attention: one per rank) under `glm5.parallel.count_bytes`, each call
    tagged with its layer (a forward pre-hook); returns each layer's (collective, link bytes),
    the router's expert ids per MoE layer (the routing the all-to-all followed), the tokens
    this rank ran and the activations' dtype."""
    from glm5.parallel import comm
    from glm5.parallel.layouts import ParallelConfig, parallelize

    n = ctx.world_size
    out: dict[str, Any] = {}
    for name, (tp, ep, dp, fc, quant) in MEASURED_LAYOUTS.items():
        tp, ep = (n if tp == "n" else tp), (n if ep == "n" else ep)
        model = _model(preset_name)
        parallelize(model, ParallelConfig.from_context(ctx, tp=tp, ep=ep, dp_attention=dp,
                                                       flashcomm=fc, flashcomm_min_tokens=0,
                                                       comm_quant=quant))
        V = model.config.vocab_size
        for seq in tokens:
            ids = torch.randint(0, V, (n, seq), generator=torch.Generator().manual_seed(seq))
            mine = ids[ctx.rank:ctx.rank + 1] if dp else ids[:1]
            routes: dict[int, list] = {}
            hooks = []
            with comm.count_bytes() as rec:
                for i, layer in enumerate(model.model.layers):
                    hooks.append(layer.register_forward_pre_hook(
                        lambda _m, _a, i=i: setattr(rec, "scope", i)))
                    gate = getattr(layer.mlp, "gate", None)
                    if gate is not None:
                        hooks.append(gate.register_forward_hook(
                            lambda _m, _i, o, i=i: routes.__setitem__(i, o[1].tolist())))
                try:
                    with torch.no_grad():
                        model(mine)
                finally:
                    for h in hooks:
                        h.remove()
            out[f"{name}/{seq}"] = {
                "layout": name, "seq": seq, "tokens": mine.numel(),
                "dtype": str(model.model.embed_tokens.weight.dtype).replace("torch.", ""),
                "calls": [(c.scope, c.op + ("_int8" if c.quant else ""), c.link_bytes)
                          for c in rec.calls],
                "routes": routes}
    return out


def run_measured(a: argparse.Namespace, task: Any = None) -> list[dict[str, Any]]:
    """Counted (every rank) against planned (`glm5.deploy.plan.layer_comm` with the measured
    routing) link bytes per layer, at ``--measured-procs`` ranks; also the planner's
    uniform-routing expectation for the all-to-all layers. ``task``: `measured_task` unless
    given (a caller that loaded this file under another module name passes a picklable
    wrapper)."""
    from glm5.core.config import preset
    from glm5.deploy.plan import layer_comm, route_pairs
    from glm5.testing.dist import DistPool, values

    n = a.measured_procs
    with DistPool(n, comm_timeout_s=300) as pool:
        res = values(pool.run(task or measured_task, a.preset, a.measured_tokens,
                              timeout_s=1800))
    cfg = preset(a.preset).replace(num_nextn_predict_layers=0)
    L, E = cfg.num_hidden_layers, cfg.n_routed_experts
    rows = []
    for key, r0 in res[0].items():
        tp, ep, dp, fc, quant = MEASURED_LAYOUTS[r0["layout"]]
        tp, ep = (n if tp == "n" else tp), (n if ep == "n" else ep)
        option = "allreduce" if not fc else ("flashcomm-int8" if quant else "flashcomm")
        dtype = getattr(torch, r0["dtype"])
        for i in range(L):
            moe = cfg.mlp_layer_types[i] == "sparse"
            pairs = (route_pairs([torch.tensor(r[key]["routes"][i]) for r in res], E, ep)
                     if dp and moe else None)
            counted, planned = [], []
            for rank, r in enumerate(res):
                counted.append([(op, b) for s, op, b in r[key]["calls"] if s == i])
                planned.append(layer_comm(cfg, tp, ep, r[key]["tokens"], option, moe=moe,
                                          dp_attention=dp, last=i == L - 1, dtype=dtype,
                                          pairs=pairs, rank=rank))
            uniform = layer_comm(cfg, tp, ep, r0["tokens"], option, moe=moe, dp_attention=dp,
                                 last=i == L - 1, dtype=dtype)
            rows.append({
                "procs": n, "layout": r0["layout"], "seq": r0["seq"],
                "tokens_per_rank": r0["tokens"], "dtype": r0["dtype"], "layer": i,
                "kind": "moe" if moe else "dense",
                "collectives": [op for op, _ in counted[0]],
                "counted_rank0": [b for _, b in counted[0]],
                "planned_rank0": [b for _, b in planned[0]],
                "counted_per_rank": [sum(b for _, b in c) for c in counted],
                "planned_per_rank": [sum(b for _, b in p) for p in planned],
                "planned_uniform_routing": sum(b for _, b in uniform),
                "equal": all([(op.replace("_int8", ""), b) for op, b in c] == p
                             for c, p in zip(counted, planned)),
            })
    return rows


def _short(op: str) -> str:
    return {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG",
            "all_gather_int8": "AG8", "all_to_all": "A2A"}[op]


# --------------------------------------------------------------------------- reporting
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _comm_line(r: dict[str, Any]) -> str:
    kinds = "  ".join(f"{k} {v['calls']:g}x {v['link_bytes'] / 1e3:.1f} KB "
                      f"{v['us_in_forward_rank_mean']:.0f}/{v['us_isolated_rank_mean']:.0f} us"
                      for k, v in r["per_layer"].items())
    return (f"tp {r['tp']} {r['phase']:7} {r['tokens']:4} tok {r['mode']:14} forward "
            f"{r['forward_ms']:8.2f} ms | per layer {r['comm_link_bytes_per_layer'] / 1e3:8.1f} "
            f"KB {r['comm_us_in_forward_per_layer']:7.0f} us in forward, "
            f"{r['comm_us_isolated_per_layer']:6.0f} us isolated | {kinds} | dev "
            f"{r['logit_dev_vs_allreduce']:.2g}")


def _scaling_line(r: dict[str, Any]) -> str:
    return (f"{r['procs']} proc {r['layout']:16} prefill {r['prefill_tokens_per_s']:8.1f} tok/s "
            f"decode {r['decode_tokens_per_s']:7.1f} tok/s"
            + (" (oversubscribed)" if r["oversubscribed"] else ""))


def report(res: dict[str, Any]) -> None:
    m = res["machine"]
    print(f"{res['date']}  {m['cpu']}, {m['cores']} cores; load {m.get('load_before')} -> "
          f"{m.get('load_after')}\n{res['command']}")
    if res.get("comm"):
        print("\nper layer: link bytes and wall time of the collectives (in the forward, with the "
              "wait for the slowest rank / isolated, after a barrier), whole forward")
        print("| tp | phase | tokens | mode | collectives / layer | link KB / layer | comm us / "
              "layer in forward | isolated | forward ms | logits vs all-reduce |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in res["comm"]:
            calls = ", ".join(f"{v['calls']:.3g} {k}" for k, v in r["per_layer"].items())
            print(f"| {r['tp']} | {r['phase']} | {r['tokens']} | {r['mode']} | {calls} | "
                  f"{r['comm_link_bytes_per_layer'] / 1e3:.1f} | "
                  f"{r['comm_us_in_forward_per_layer']:,.0f} | "
                  f"{r['comm_us_isolated_per_layer']:,.0f} | {r['forward_ms']:.1f} | "
                  f"{r['logit_dev_vs_allreduce']:.2g} |")
    if res.get("scaling"):
        print("\ntokens/s (1 torch thread per process)")
        print("| processes | layout | prefill tok/s | x | CPU s, all ranks | decode tok/s | x | "
              "CPU s, all ranks |")
        print("|---|---|---|---|---|---|---|---|")
        for r in res["scaling"]:
            over = " (oversubscribed)" if r["oversubscribed"] else ""
            print(f"| {r['procs']}{over} | {r['layout']} | {r['prefill_tokens_per_s']:.0f} | "
                  f"{r.get('prefill_speedup', 1):.2f} | {r['prefill_cpu_s_all_ranks']:.2f} | "
                  f"{r['decode_tokens_per_s']:.1f} | {r.get('decode_speedup', 1):.2f} | "
                  f"{r['decode_cpu_s_all_ranks']:.2f} |")
    if res.get("measured"):
        ms = res["measured"]
        print(f"\nmeasured vs planned link bytes per layer ({res['preset']}, {ms[0]['procs']} "
              f"ranks, {ms[0]['dtype']} activations; counted by glm5.parallel.count_bytes, "
              f"planned by glm5.deploy.plan.layer_comm with the measured routing)")
        print("| layout | tokens / rank | layer | collectives, rank 0: counted bytes | planned "
              "| counted / layer, each rank | planned / layer, each rank | planner, uniform "
              "routing | equal |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in ms:
            got = ", ".join(f"{_short(op)} {b:,.0f}" for op, b in
                            zip(r["collectives"], r["counted_rank0"])) or "-"
            want = ", ".join(f"{b:,.0f}" for b in r["planned_rank0"]) or "-"
            print(f"| {r['layout']} | {r['tokens_per_rank']} | {r['layer']} ({r['kind']}) | "
                  f"{got} | {want} | "
                  f"{' / '.join(f'{b:,.0f}' for b in r['counted_per_rank'])} | "
                  f"{' / '.join(f'{b:,.0f}' for b in r['planned_per_rank'])} | "
                  f"{r['planned_uniform_routing']:,.1f} | {'yes' if r['equal'] else 'NO'} |")
    if res.get("plan"):
        print("\nplanner: GLM-5 w4a8, context 8192 (us per MoE layer)")
        print("| chip | tp | ep | phase | tokens / TP group | allreduce | flashcomm | "
              "flashcomm-int8 | EP all-to-all | auto | TP comm ms | EP ms | total ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["plan"]:
            pl = r["per_moe_layer"]

            def us(k: str) -> str:
                return f"{pl[k]['total_us']:,.1f}" if k in pl else "-"
            ep = f"{pl['ep_alltoall']['us']:,.1f}" if pl["ep_alltoall"] else "-"
            print(f"| {r['chip']} | {r['tp']} | {r['ep']} | {r['phase']} | "
                  f"{r['tokens_per_tp_group']:,} | {us('allreduce')} | {us('flashcomm')} | "
                  f"{us('flashcomm-int8')} | {ep} | "
                  f"{r['comm_option']} | {r['tp_comm_ms']:.2f} | {r['ep_alltoall_ms']:.2f} | "
                  f"{r['total_ms']:.2f} |")


def _ints(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/dist_comm.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tp", type=_ints, default=[2, 4], help="TP sizes of the comm part (2,4)")
    ap.add_argument("--tokens", type=_ints, default=[8, 512],
                    help="decode,prefill token counts of the comm part (8,512)")
    ap.add_argument("--decode-context", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--procs", type=_ints, default=[1, 2, 4], help="scaling: processes (1,2,4)")
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--measured-procs", type=int, default=2,
                    help="measured: processes (2)")
    ap.add_argument("--measured-tokens", type=_ints, default=[5, 512],
                    help="measured: sequence lengths, one sequence per forward (5,512)")
    ap.add_argument("--skip", default="",
                    help="comma-separated parts to skip: comm,scaling,plan,measured")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--report", default=None, metavar="FILE", help="print a results file")
    a = ap.parse_args(argv)
    if a.report:
        report(json.loads(Path(a.report).read_text()))
        return 0
    skip = set(filter(None, a.skip.split(",")))
    bad = skip - {"comm", "scaling", "plan", "measured"}
    if bad:
        ap.error(f"--skip expected parts among comm, scaling, plan, measured; got "
                 f"{', '.join(sorted(bad))}")
    if a.measured_procs < 2:
        ap.error(f"--measured-procs expected at least 2, got {a.measured_procs}")
    if len(a.tokens) != 2:
        ap.error(f"--tokens expected two counts (decode, prefill), got {a.tokens}")
    for P in a.procs:
        if a.prefill_batch % P or a.decode_batch % P:
            ap.error(f"--prefill-batch and --decode-batch expected multiples of every --procs "
                     f"entry (DP attention splits them), got {a.prefill_batch}, "
                     f"{a.decode_batch} and {P}")
    if "scaling" not in skip and a.procs[0] != 1:
        ap.error("--procs expected to start at 1 (the speed-ups are relative to it)")
    from glm5.perf.measure import cpu_model

    res: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python bench/dist_comm.py " + " ".join(sys.argv[1:] if argv is None
                                                           else argv),
        "machine": {"cpu": cpu_model(), "cores": _cores(), "platform": platform.platform(),
                    "torch": torch.__version__, "collective_backend": "gloo",
                    "torch_threads_per_process": 1, "load_before": _load()},
        "preset": a.preset,
        "settings": {k: getattr(a, k) for k in ("tp", "tokens", "decode_context", "repeat",
                                                  "procs", "prefill_batch", "prefill_len",
                                                  "decode_batch", "decode_steps",
                                                  "measured_procs", "measured_tokens")},
    }
    if "plan" not in skip:
        res["plan"] = run_plan()
    if "measured" not in skip:
        res["measured"] = run_measured(a)
    if "comm" not in skip:
        res["machine"]["load_before_comm"] = _load()
        res["comm"] = run_comm(a)
        res["machine"]["load_after_comm"] = _load()
    if "scaling" not in skip:
        res["machine"]["load_before_scaling"] = _load()
        res["scaling"] = run_scaling(a)
    res["machine"]["load_after"] = _load()
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {a.out}")
    report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
