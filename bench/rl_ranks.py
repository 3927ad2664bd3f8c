"""The RL trainer across data-parallel ranks (FSDP2 over gloo on CPU): per-rank memory, step
time, weight-sync cost, and Muon's gather-to-owner against a sharded Newton–Schulz.

    python bench/rl_ranks.py --out bench/results/rl_ranks.json [--quick] [--worlds 1 2 4]
        [--optimizers muon adamw] [--steps 3] [--publish-steps 2] [--trajectories 16]

For each optimizer and each world size N (1: no mesh, the plain one-process trainer; N > 1:
`GRPOTrainer(mesh=...)`, FSDP2-sharded, WholeMatrixMuon), a fresh world of N gloo processes
(`glm5.testing.dist.run_multiprocess`, one torch thread each) runs, on every rank:

1. ``1 + --steps`` `train_step` calls on its `dp_slice` of one global batch (the first is a
   warm-up); the step time is the median over the timed steps of the slowest rank's time.
   Then the bytes each rank holds, counted from the tensors themselves: parameters (local
   shards), gradients, every tensor of every optimizer's state, and (after phase 3) the
   publishers' snapshots; FSDP's unsharded parameter storage still allocated; peak RSS.
2. Muon: the Muon optimizer's `step()` alone (grads of the last step), median over
   ``--opt-steps`` calls, slowest rank. At N > 1 the alternative, a Newton–Schulz on the row
   shards (`_sharded_ns`: X^T X all-reduced each iteration), on the same gradients: its
   all-reduces alone (5 x [cols, cols] fp32 per matrix plus the norm) and the whole thing.
3. Publishing: publishers made (N = 1: `WeightPublisher`; N > 1: the "shards" and the
   "gathered" routes side by side, each diffing from the same version 0), then
   ``--publish-steps`` x (train_step, publish by every route). Time of `publish()` (slowest
   rank; median), `nbytes` and `len(to_bytes())` of the update. Rank 0 applies every route's
   updates to its own `WeightReceiver` on a copy of the version-0 weights and compares the
   receivers' `state_checksums` (and with the trainer's published checksums).

On 2 cores, 4 ranks share the cores two to one: times say what the communication and lockstep
cost on one machine, not what more devices would give.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

# before torch: OpenMP threads that spin after each parallel region slow a shared machine
# (the ranks inherit it)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from glm5.testing.dist import run_multiprocess, values  # noqa: E402

MB = 1 << 20
NS_STEPS = 5  # torch.optim.Muon's default ns_steps


# --------------------------------------------------------------------------- setup
def model_kwargs(quick: bool) -> dict[str, Any]:
    """Overrides of the `tiny` preset (num_nextn_predict_layers=0 always)."""
    if quick:
        return {"num_nextn_predict_layers": 0}
    return {"num_nextn_predict_layers": 0, "vocab_size": 4096, "hidden_size": 256,
            "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 4,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "indexer_types": ["full", "shared", "full", "shared"],
            "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 192,
            "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
            "v_head_dim": 32}


def build_model(kw: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    torch.manual_seed(seed)
    return GLM5ForCausalLM(preset("tiny").replace(**kw)).train()


def make_trajs(n: int, vocab: int, prompt: int, completion: int) -> list[Any]:
    from glm5.rl.trajectory import Trajectory

    rng = random.Random(0)
    out = []
    for i in range(n):
        p = [rng.randrange(2, vocab) for _ in range(prompt)]
        c = [rng.randrange(2, vocab) for _ in range(completion)]
        lp = [-rng.uniform(0.5, 3.0) for _ in c]
        out.append(Trajectory(f"t{i}", f"g{i // 4}", "copy", p, c, lp, [0] * len(c),
                              advantage=rng.uniform(-1.0, 1.0), temperature=1.0))
    return out


# --------------------------------------------------------------------------- byte counting
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _split(ts: list[torch.Tensor]) -> dict[str, int]:
    """Bytes of the local pieces: of DTensors (sharded) and of plain tensors (whole)."""
    sh = sum(_nbytes(t) for t in ts if hasattr(t, "to_local"))
    whole = sum(_nbytes(t) for t in ts if not hasattr(t, "to_local"))
    return {"sharded": sh, "whole": whole, "total": sh + whole}


def trainer_bytes(trainer: Any) -> dict[str, Any]:
    params = list(trainer.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for o in trainer.optimizers for st in o.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)]
    out = {"params": _split(params), "grads": _split(grads), "optimizer_state": _split(state)}
    out["params_grads_optimizer"] = sum(out[k]["total"] for k in
                                        ("params", "grads", "optimizer_state"))
    out["fsdp_unsharded_storage"] = _fsdp_unsharded(trainer.model)
    for name in ("ref", "teacher"):  # copies the trainer may keep (none in this bench's config)
        m = getattr(trainer, name)
        out[name] = None if m is None else sum(_nbytes(p) for p in m.parameters())
    return out


def _fsdp_unsharded(model: torch.nn.Module) -> int | None:
    """Bytes of FSDP2's all-gather output storage still allocated (0 once resharded), None
    without FSDP (or if torch's internals moved)."""
    total, seen = 0, False
    try:
        for m in model.modules():
            if not hasattr(m, "_get_fsdp_state"):
                continue
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in (group.fsdp_params if group is not None else ()):
                seen = True
                for t in fp.all_gather_outputs:
                    total += t.untyped_storage().nbytes()
    except (AttributeError, RuntimeError):
        return None
    return total if seen else None


def _dict_bytes(d: dict[str, torch.Tensor] | None) -> int:
    return 0 if not d else sum(_nbytes(t) for t in d.values())


def publisher_bytes(pub: Any) -> dict[str, int]:
    """Snapshot bytes a publisher holds on this rank (a GatheredPublisher's rank 0 also keeps
    the last gathered whole state, `_view.sd`)."""
    from glm5.rl.sharded_sync import GatheredPublisher, ShardedPublisher

    if isinstance(pub, ShardedPublisher):
        return {"snapshot": _dict_bytes(pub._snap), "gathered_state": 0}
    if isinstance(pub, GatheredPublisher):
        return {"snapshot": 0 if pub._pub is None else _dict_bytes(pub._pub._snap),
                "gathered_state": _dict_bytes(pub._view.sd)}
    return {"snapshot": _dict_bytes(pub._snap), "gathered_state": 0}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _barrier(group: Any = None) -> None:
    import torch.distributed as dist

    if dist.is_initialized():  # a world of 1 has no process group
        dist.barrier(group=group)


# --------------------------------------------------------------------------- sharded NS
def _sharded_ns(g: torch.Tensor, coeffs: tuple[float, float, float], steps: int, eps: float,
                group: Any, comm_only: bool = False) -> torch.Tensor:
    """Newton–Schulz on the row shard ``g`` [r_i, c] of a row-sharded matrix: with
    A = X^T X (a [c, c] all-reduce of the ranks' X_i^T X_i), a X + b A X... becomes
    X_i <- a X_i + X_i (b A + c A^2) — the same polynomial as torch's (which, for a wide
    matrix, squares X X^T instead). bf16 arithmetic like torch's; the Gram matrices are
    reduced in fp32 (gloo). ``comm_only``: the all-reduces alone, on zeros of those sizes."""
    import torch.distributed as dist

    a, b, c = coeffs
    cols = g.shape[1]
    if comm_only:
        dist.all_reduce(torch.zeros(1), group=group)
        for _ in range(steps):
            dist.all_reduce(torch.zeros(cols, cols), group=group)
        return g
    x = g.bfloat16()
    sq = x.float().pow(2).sum().reshape(1)
    dist.all_reduce(sq, group=group)
    x = x / sq.sqrt().clamp(min=eps).bfloat16()
    for _ in range(steps):
        gram = (x.mT @ x).float()
        dist.all_reduce(gram, group=group)
        gram = gram.bfloat16()
        x = torch.addmm(x, x, torch.addmm(gram, gram, gram, beta=b, alpha=c), beta=a)
    return x


def _muon_matrices(trainer: Any) -> tuple[Any, list[torch.Tensor]]:
    opt = trainer.optimizers[0]
    return opt, [p for g in opt.param_groups for p in g["params"] if p.grad is not None]


def _time_muon(trainer: Any, reps: int, world: int, group: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.optim._muon import _zeropower_via_newtonschulz

    opt, mats = _muon_matrices(trainer)
    gr = opt.param_groups[0]
    coeffs, eps = gr["ns_coefficients"], gr["eps"]
    shapes = [tuple(p.shape) for p in mats]
    out: dict[str, Any] = {"optimizer": type(opt).__name__, "matrices": len(mats),
                           "matrix_elements": sum(r * c for r, c in shapes)}

    def timed(fn: Any) -> list[float]:
        ts = []
        for _ in range(reps):
            _barrier(group)
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return ts

    out["step_s"] = timed(opt.step)
    if world == 1:
        return out
    grads = [_local(p.grad) for p in mats]

    def sharded(comm_only: bool) -> None:
        for g in grads:
            _sharded_ns(g, coeffs, NS_STEPS, eps, group, comm_only)

    me, owner = dist.get_rank(), opt.owner

    def owner_comm() -> None:
        """WholeMatrixMuon's collectives alone: each matrix's rows gathered to its owner, the
        rows scattered back (padded to equal chunks, as FSDP pads)."""
        for p in mats:
            loc = _local(p.grad)
            chunk = -(-p.shape[0] // world)
            pad = torch.zeros((chunk, *p.shape[1:]), dtype=loc.dtype)
            pad[:loc.shape[0]] = loc
            got = [torch.empty_like(pad) for _ in range(world)] if owner[p] == me else None
            dist.gather(pad, got, dst=owner[p])
            out = torch.empty_like(pad)
            dist.scatter(out, got, src=owner[p])

    def owner_batched() -> None:
        """The first design, for comparison: every update all-gathered to every rank, each
        owner orthogonalises its matrices, the results broadcast whole."""
        fulls = [p.grad.full_tensor() for p in mats]
        us = [_zeropower_via_newtonschulz(f, coeffs, NS_STEPS, eps).to(f.dtype).contiguous()
              if owner[p] == me else torch.empty_like(f) for p, f in zip(mats, fulls)]
        for p, u in zip(mats, us):
            dist.broadcast(u, src=owner[p])

    out["owner_comm_s"] = timed(owner_comm)
    out["owner_batched_s"] = timed(owner_batched)
    out["sharded_ns_comm_s"] = timed(lambda: sharded(True))
    out["sharded_ns_s"] = timed(lambda: sharded(False))
    # the sharded NS against torch's on the whole matrix: the largest tall and wide matrices
    errs = {}
    for kind, pick in (("tall", lambda s: s[0] > s[1]), ("wide", lambda s: s[0] <= s[1])):
        cand = [i for i, s in enumerate(shapes) if pick(s)]
        if not cand:
            continue
        i = max(cand, key=lambda j: shapes[j][0] * shapes[j][1])
        full = mats[i].grad.full_tensor()
        want = _zeropower_via_newtonschulz(full, coeffs, NS_STEPS, eps).float()
        got = _sharded_ns(grads[i], coeffs, NS_STEPS, eps, group).float()
        rows = torch.tensor([got.shape[0]])
        every = [torch.zeros_like(rows) for _ in range(world)]
        dist.all_gather(every, rows, group=group)
        start = sum(int(r) for r in every[:dist.get_rank(group)])
        ref = want[start:start + got.shape[0]]
        errs[kind] = {"shape": list(shapes[i]), "max_abs_err": float((got - ref).abs().max()),
                      "ref_max_abs": float(ref.abs().max())}
    out["sharded_ns_vs_torch"] = errs
    # payload bytes per Muon step (fp32): gather-to-owner moves each whole update (all-gather)
    # and each NS result (broadcast); the sharded NS all-reduces NS_STEPS [c, c] Gram matrices
    out["gather_broadcast_payload_bytes"] = sum(2 * r * c * 4 for r, c in shapes)
    out["gram_allreduce_payload_bytes"] = sum(NS_STEPS * c * c * 4 + 4 for r, c in shapes)
    # per rank, ring model: all-gather and broadcast ~(N-1)/N of the matrix each, all-reduce
    # 2(N-1)/N of the Gram matrix
    f = (world - 1) / world
    out["gather_broadcast_wire_bytes_per_rank"] = int(f * out["gather_broadcast_payload_bytes"])
    out["gram_allreduce_wire_bytes_per_rank"] = int(2 * f * out["gram_allreduce_payload_bytes"])
    return out


# --------------------------------------------------------------------------- one rank
def _checksum_digest(sums: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()[:16]


def rank_main(ctx: Any, opt_name: str, kw: dict[str, Any], a: dict[str, Any]) -> dict:
    rss_start = peak_rss_mb()
    from torch.distributed.device_mesh import init_device_mesh

    from glm5.engine.weight_sync import WeightReceiver, state_checksums
    from glm5.rl.config import TrainerConfig
    from glm5.rl.sharded_sync import make_publisher
    from glm5.rl.trainer import GRPOTrainer
    from glm5.rl.trainer_ranks import dp_slice

    torch.set_num_threads(1)
    world, rank = ctx.world_size, ctx.rank
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    group = None if mesh is None else mesh.get_group()
    cfg = TrainerConfig(optimizer=opt_name, lr=1e-3, muon_lr=2e-2,
                        micro_batch_size=a["micro_batch"])
    trainer = GRPOTrainer(build_model(kw), cfg, mesh=mesh)
    vocab = trainer.model.config.vocab_size
    trajs = make_trajs(a["trajectories"], vocab, a["prompt_len"], a["completion_len"])
    mine = trajs[dp_slice(len(trajs), rank, world)]
    out: dict[str, Any] = {"rank": rank, "trajectories": len(mine),
                           "peak_rss_mb_start": rss_start}

    step_s = []
    for _ in range(1 + a["steps"]):
        _barrier()
        t0 = time.perf_counter()
        trainer.train_step(mine)
        step_s.append(time.perf_counter() - t0)
    out["step_s"] = step_s[1:]
    out["bytes"] = trainer_bytes(trainer)
    out["peak_rss_mb_after_steps"] = peak_rss_mb()
    if opt_name == "muon":
        out["muon"] = _time_muon(trainer, a["opt_steps"], world, group)

    # ------------------------------------------------------------ publishing
    if world == 1:
        sd0 = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        routes: list[str] = ["one_process"]
        pubs = {"one_process": make_publisher(trainer.model, "xor", None)}
    else:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        sd0 = get_model_state_dict(trainer.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        routes = ["shards", "gathered"]
        pubs = {r: make_publisher(trainer.model, "xor", r, group) for r in routes}
    rx = {}
    if rank == 0:
        for r in routes:
            m = build_model(kw, seed=1234)  # other weights: the update must bring them over
            m.load_state_dict(sd0)
            rx[r] = WeightReceiver(m, version=0)
    del sd0
    pub_rows: dict[str, list[dict]] = {r: [] for r in routes}
    for k in range(a["publish_steps"]):
        trainer.train_step(mine)
        for r in (routes if k % 2 == 0 else routes[::-1]):  # neither route always goes first
            _barrier()
            t0 = time.perf_counter()
            up = pubs[r].publish()
            row: dict[str, Any] = {"publish_s": time.perf_counter() - t0}
            if rank == 0:
                t1 = time.perf_counter()
                wire = up.to_bytes()
                row.update(nbytes=up.nbytes, wire_bytes=len(wire), tensors=len(up.tensors),
                           to_bytes_s=time.perf_counter() - t1)
                t1 = time.perf_counter()
                rx[r].apply(up)
                row["apply_s"] = time.perf_counter() - t1
            pub_rows[r].append(row)
    out["publish"] = pub_rows
    out["publisher_bytes"] = {r: publisher_bytes(p) for r, p in pubs.items()}
    published = {r: p.checksums() for r, p in pubs.items()}  # collective (shards: gathers)
    if rank == 0:
        sums = {r: state_checksums(rx[r].model) for r in routes}
        out["receivers"] = {r: {"version": rx[r].version, "digest": _checksum_digest(sums[r]),
                                "equals_published": sums[r] == published[r]}
                            for r in routes}
        out["routes_same_weights"] = all(sums[r] == sums[routes[0]] for r in routes)
    out["peak_rss_mb_end"] = peak_rss_mb()
    return out


# --------------------------------------------------------------------------- the parent
def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def _slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank)]


def summarize(opt: str, world: int, got: list[dict], wall_s: float) -> dict[str, Any]:
    r0 = got[0]
    row: dict[str, Any] = {"optimizer": opt, "world": world, "wall_s": round(wall_s, 1),
                           "trajectories_per_rank": [g["trajectories"] for g in got],
                           "step_s_median": _med(_slowest([g["step_s"] for g in got])),
                           "step_s_per_rank": [[round(t, 4) for t in g["step_s"]] for g in got]}
    row["bytes_per_rank"] = [g["bytes"] for g in got]
    row["publisher_bytes_per_rank"] = [g["publisher_bytes"] for g in got]
    row["peak_rss_mb_per_rank"] = [{"start": round(g["peak_rss_mb_start"], 1),
                                    "after_steps": round(g["peak_rss_mb_after_steps"], 1),
                                    "end": round(g["peak_rss_mb_end"], 1)} for g in got]
    pgo = [g["bytes"]["params_grads_optimizer"] for g in got]
    row["params_grads_optimizer_max_rank"] = max(pgo)
    if "muon" in r0:
        mu: dict[str, Any] = {k: v for k, v in r0["muon"].items() if not k.endswith("_s")}
        for k in ("step_s", "owner_comm_s", "owner_batched_s", "sharded_ns_comm_s",
                  "sharded_ns_s"):
            if k in r0["muon"]:
                mu[k + "_median"] = _med(_slowest([g["muon"][k] for g in got]))
        mu["sharded_ns_vs_torch_per_rank"] = [g["muon"].get("sharded_ns_vs_torch") for g in got]
        mu.pop("sharded_ns_vs_torch", None)
        row["muon"] = mu
    pub = {}
    for route in r0["publish"]:
        rows0 = r0["publish"][route]
        pub[route] = {
            "publish_s_median": _med(_slowest([[x["publish_s"] for x in g["publish"][route]]
                                               for g in got])),
            "nbytes": [x["nbytes"] for x in rows0], "wire_bytes": [x["wire_bytes"] for x in rows0],
            "tensors": [x["tensors"] for x in rows0],
            "to_bytes_s_median": _med([x["to_bytes_s"] for x in rows0]),
            "apply_s_median": _med([x["apply_s"] for x in rows0]),
            "receiver": r0["receivers"][route]}
    row["publish"] = pub
    row["routes_same_weights"] = r0["routes_same_weights"]
    return row


def _machine() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                   check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "unknown"


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(rows: list[dict]) -> str:
    base = {r["optimizer"]: r["params_grads_optimizer_max_rank"] for r in rows
            if r["world"] == 1}
    cols = ["opt", "N", "params+grads+opt / rank (MiB)", "vs N=1",
            "publisher snapshot rank 0 (MiB)", "RSS rank 0 start/after steps (MiB)",
            "train_step (s)", "Muon opt.step (s)", "owner comm (s)", "all-gather variant (s)",
            "sharded NS comm (s)", "sharded NS (s)", "publish (s)", "update nbytes (MiB)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        pgo = r["params_grads_optimizer_max_rank"]
        mu = r.get("muon", {})
        pubs = r["publish"]
        snap = "; ".join(f"{k}: {(v[0]['snapshot'] + v[0]['gathered_state']) / MB:.1f}"
                         for k, v in _by_route(r["publisher_bytes_per_rank"]).items())
        rss = r["peak_rss_mb_per_rank"][0]
        cells = [r["optimizer"], str(r["world"]), f"{pgo / MB:.2f}",
                 f"{pgo / base.get(r['optimizer'], pgo):.3f}", snap,
                 f"{rss['start']:.0f} / {rss['after_steps']:.0f}", f"{r['step_s_median']:.3f}"]
        cells += [_f(mu.get(k + "_median")) for k in
                  ("step_s", "owner_comm_s", "owner_batched_s", "sharded_ns_comm_s",
                   "sharded_ns_s")]
        cells.append("; ".join(f"{k}: {v['publish_s_median']:.3f}" for k, v in pubs.items()))
        cells.append("; ".join(f"{k}: {v['nbytes'][0] / MB:.1f}" for k, v in pubs.items()))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _by_route(per_rank: list[dict]) -> dict[str, list[dict]]:
    return {route: [pr[route] for pr in per_rank] for route in per_rank[0]}


def _conclusion(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        mu = r.get("muon")
        if not mu or r["world"] == 1:
            continue
        gb, ar = mu["gather_broadcast_payload_bytes"], mu["gram_allreduce_payload_bytes"]
        oc, sc = mu["owner_comm_s_median"], mu["sharded_ns_comm_s_median"]
        out.append(
            f"Muon N={r['world']}: communication: gather-to-owner (gather + scatter of "
            f"each matrix, {gb / MB:.1f} MiB payload) {oc:.3f} s vs sharded NS ({NS_STEPS} "
            f"[cols, cols] all-reduces per matrix, {ar / MB:.1f} MiB payload, x{ar / gb:.2f}) "
            f"{sc:.3f} s -> {'gather-to-owner' if oc <= sc else 'sharded NS'} moves less; "
            f"whole step: WholeMatrixMuon {mu['step_s_median']:.3f} s, the all-gather + "
            f"broadcast variant {mu['owner_batched_s_median']:.3f} s, sharded NS "
            f"{mu['sharded_ns_s_median']:.3f} s")
    for r in rows:
        p = r["publish"]
        if "shards" in p:
            s, g = p["shards"], p["gathered"]
            out.append(f"{r['optimizer']} N={r['world']}: publish shards "
                       f"{s['publish_s_median']:.3f} s vs gathered "
                       f"{g['publish_s_median']:.3f} s (x{g['publish_s_median'] / max(s['publish_s_median'], 1e-9):.2f}); "
                       f"nbytes {s['nbytes'][0]} vs {g['nbytes'][0]}, to_bytes "
                       f"{s['wire_bytes'][0]} vs {g['wire_bytes'][0]}; same new weights: "
                       f"{r['routes_same_weights']}")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the plain tiny preset, worlds 1 and 2, one timed step")
    ap.add_argument("--worlds", type=int, nargs="+", default=None)
    ap.add_argument("--optimizers", nargs="+", default=["muon", "adamw"])
    ap.add_argument("--steps", type=int, default=None, help="timed train steps (after 1 warm-up)")
    ap.add_argument("--opt-steps", type=int, default=None, help="timed Muon optimizer steps")
    ap.add_argument("--publish-steps", type=int, default=None)
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--completion-len", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per world")
    a = ap.parse_args(argv)
    q = a.quick
    worlds = a.worlds or ([1, 2] if q else [1, 2, 4])
    args = {"steps": a.steps or (1 if q else 3), "opt_steps": a.opt_steps or (1 if q else 2),
            "publish_steps": a.publish_steps or (1 if q else 4),
            "trajectories": a.trajectories, "prompt_len": a.prompt_len,
            "completion_len": a.completion_len, "micro_batch": a.micro_batch}
    kw = model_kwargs(q)
    m = build_model(kw)
    n_params = sum(p.numel() for p in m.parameters())
    rows = []
    load_start = os.getloadavg()
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    for opt in a.optimizers:
        for n in worlds:
            t0 = time.perf_counter()
            got = values(run_multiprocess(rank_main, n, a.timeout, opt, kw, args, env=env))
            rows.append(summarize(opt, n, got, time.perf_counter() - t0))
            print(f"{opt} N={n}: step {rows[-1]['step_s_median']:.3f} s, "
                  f"{rows[-1]['params_grads_optimizer_max_rank'] / MB:.2f} MiB/rank "
                  f"({rows[-1]['wall_s']} s)", flush=True)
    report = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + list(
            sys.argv[1:] if argv is None else argv)),
        "machine": _machine(), "cpu_cores": os.cpu_count(), "torch": torch.__version__,
        # other work on the machine: the times are noisy when these exceed the core count
        "load_average_1_5_15": {"start": [round(x, 2) for x in load_start],
                                "end": [round(x, 2) for x in os.getloadavg()]},
        "threads_per_rank": 1, "backend": "gloo (FSDP2, cpu)",
        "model": {"preset": "tiny", "overrides": kw, "parameters": n_params,
                  "parameter_bytes": sum(p.numel() * p.element_size() for p in m.parameters())},
        "batch": {"trajectories": a.trajectories, "prompt_len": a.prompt_len,
                  "completion_len": a.completion_len, "micro_batch": a.micro_batch},
        "repeats": args, "rows": rows, "conclusions": _conclusion(rows),
        "not_sharded": [
            "a gathered publisher's snapshot and its last gathered whole state (rank 0: 2 x "
            "the model)", "the one-process publisher (N = 1) snapshot",
            "transients not held after a step: FSDP2's all-gathered layer parameters during "
            "forward/backward, WholeMatrixMuon's whole update and NS result per matrix "
            "(in peak RSS, not in the byte counts)",
            "scalar optimizer state (AdamW's step counts) and torch/python's own RSS"]}
    print(_table(rows))
    for c in report["conclusions"]:
        print("-", c)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
