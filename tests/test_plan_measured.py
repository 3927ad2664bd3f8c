"""The planner against reality: for each parallel layout the model runs (tensor parallel with
all-reduce, FlashComm, FlashComm with int8 gathers; expert parallel with replicated tokens;
expert parallel with data-parallel attention), the bytes `glm5.deploy.plan.layer_comm` predicts
for each decoder layer equal, exactly and collective by collective, the bytes the collectives
moved while the `tiny` model ran across 2 and 4 gloo processes (`glm5.parallel.count_bytes`).

What is compared, per rank and per layer: the list of (collective, link bytes) the model issued
in that layer (tagged by a forward pre-hook on the layer) against ``layer_comm`` for that
layer's kind (dense / MoE), the layer's token count (FlashComm pads it to a multiple of tp),
the activations' dtype (fp32 here; the planner's default is bf16) and, for the all-to-all,
the routing the router really produced (`route_pairs` of every rank's expert ids, captured by
a forward hook on the router): the uniform-routing figure is an expectation, not a count.
Every byte count is an integer. The counted side also checks itself: each call's ops_comm cost
against the buffer torch.distributed really moved (int8: codes + scales; all-to-all: the rows
for other ranks). And ``layer_comm`` at bf16 equals what `plan()` reports per layer.

Planted bugs (the planner without FlashComm padding, without the int8 scales, counting the
all-to-all rows a rank keeps) must make the comparison fail.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch

from glm5.testing.dist import DistPool, values

CASES = {  # name: (tp, ep, dp_attention, flashcomm, comm_quant, weights); sizes are the world's
    "tp": ("n", 1, False, False, None, "float"),
    "tp+flashcomm": ("n", 1, False, True, None, "float"),
    "tp+flashcomm-int8": ("n", 1, False, True, "int8", "float"),
    "ep": (1, "n", False, False, None, "float"),
    "ep+dp-attention": (1, "n", True, False, None, "float"),
    # quantized weights whose activations are quantized per token: every row-parallel linear
    # all-gathers each token's max |x| (glm5.parallel.layouts.RowParallelQuantLinear)
    "tp-w8a8": ("n", 1, False, False, None, "w8a8"),
    "tp+flashcomm-w4a8": ("n", 1, False, True, None, "w4a8"),
    "ep-w8a8": (1, "n", False, False, None, "w8a8"),
    "ep+dp-attention-w4a8": (1, "n", True, False, None, "w4a8"),
    "tp-w8a16": ("n", 1, False, False, None, "w8a16"),  # float activations: nothing more
}
TOKENS = (5, 8)  # sequence lengths: 5 is not a multiple of 2 or 4 (FlashComm pads), 8 is


def _option(fc: bool, quant: str | None) -> str:
    return "allreduce" if not fc else ("flashcomm-int8" if quant else "flashcomm")


def _count(ctx, cases: dict, tokens: tuple[int, ...]) -> dict:
    """On every rank: for each case and sequence length, run the parallel tiny model once under
    `count_bytes` and return each layer's calls and (dp attention) each layer's expert ids."""
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM
    from glm5.parallel import comm
    from glm5.parallel.layouts import ParallelConfig, parallelize

    torch.set_num_threads(1)
    n = ctx.world_size
    cfg = preset("tiny").replace(num_nextn_predict_layers=0)
    out: dict = {}
    tmp = tempfile.mkdtemp(prefix=f"glm5-plan-measured-{ctx.rank}-")
    for name, (tp, ep, dp, fc, quant, weights) in cases.items():
        tp, ep = (n if tp == "n" else tp), (n if ep == "n" else ep)
        torch.manual_seed(0)
        m = GLM5ForCausalLM(cfg).eval()
        if weights != "float":  # quantized as `glm5 quantize` does it, loaded whole
            from glm5.core.checkpoint import load_model
            from glm5.deploy.quantize import quantize_checkpoint

            src, dst = os.path.join(tmp, "float"), os.path.join(tmp, weights)
            if not os.path.exists(src):
                m.save_pretrained(src)
            if not os.path.exists(dst):
                quantize_checkpoint(src, dst, weights)
            m = load_model(dst).eval()
        lay = ParallelConfig.from_context(ctx, tp=tp, ep=ep, dp_attention=dp, flashcomm=fc,
                                          flashcomm_min_tokens=0, comm_quant=quant)
        parallelize(m, lay)
        for seq in tokens:
            g = torch.Generator().manual_seed(seq)
            # one sequence per rank group: with dp attention each rank runs its own
            ids = torch.randint(0, cfg.vocab_size, (n, seq), generator=g)
            mine = ids[ctx.rank:ctx.rank + 1] if dp else ids[:1]
            routes: dict[int, list] = {}
            hooks = []
            with comm.count_bytes() as rec:
                for i, layer in enumerate(m.model.layers):
                    def pre(_mod, _args, i=i):
                        rec.scope = i
                    hooks.append(layer.register_forward_pre_hook(pre))
                    gate = getattr(layer.mlp, "gate", None)
                    if gate is not None:
                        def got(_mod, _inp, o, i=i):
                            routes[i] = o[1].tolist()
                        hooks.append(gate.register_forward_hook(got))
                try:
                    with torch.no_grad():
                        m(mine)
                finally:
                    for h in hooks:
                        h.remove()
            out[(name, seq)] = {
                "tokens": mine.numel(),
                "calls": [(c.scope, c.op, c.group_size, c.rank, c.link_bytes, c.wire_bytes,
                           c.quant) for c in rec.calls],
                "routes": routes,
            }
    return out


@pytest.fixture(scope="module")
def counted() -> dict:
    """{world size: per-rank results of `_count`}, one pool per size (about 10 s in all)."""
    res = {}
    for n in (2, 4):
        with DistPool(n, comm_timeout_s=60) as pool:
            res[n] = values(pool.run(_count, CASES, TOKENS, timeout_s=120))
    return res


def _cfg():
    from glm5.core.config import preset

    return preset("tiny").replace(num_nextn_predict_layers=0)


def planned(n: int, case: str, seq: int, per_rank: list[dict]) -> list[list[list[tuple]]]:
    """[rank][layer] -> the planner's [(collective, link bytes)] for this case."""
    from glm5.deploy.plan import layer_comm, route_pairs

    cfg = _cfg()
    tp, ep, dp, fc, quant, weights = CASES[case]
    tp, ep = (n if tp == "n" else tp), (n if ep == "n" else ep)
    L = cfg.num_hidden_layers
    res = per_rank
    out = []
    for r in range(n):
        rows = []
        for i in range(L):
            moe = cfg.mlp_layer_types[i] == "sparse"
            pairs = None
            if dp and moe:
                pairs = route_pairs([torch.tensor(res[s][(case, seq)]["routes"][i])
                                     for s in range(n)], cfg.n_routed_experts, ep)
            rows.append(layer_comm(cfg, tp, ep, res[r][(case, seq)]["tokens"],
                                   _option(fc, quant), moe=moe, dp_attention=dp,
                                   last=i == L - 1, dtype=torch.float32, pairs=pairs, rank=r,
                                   quant=None if weights == "float" else weights))
        out.append(rows)
    return out


def counted_per_layer(n: int, case: str, seq: int, per_rank: list[dict]) -> list[list[list]]:
    """[rank][layer] -> the counted [(collective, link bytes)], in the order issued."""
    L = _cfg().num_hidden_layers
    return [[[(c[1], c[4]) for c in r[(case, seq)]["calls"] if c[0] == i] for i in range(L)]
            for r in per_rank]


def mismatches(n: int, per_rank: list[dict]) -> list[str]:
    """Every (case, length, rank, layer) where counted != planned."""
    bad = []
    for case in CASES:
        for seq in TOKENS:
            got = counted_per_layer(n, case, seq, per_rank)
            want = planned(n, case, seq, per_rank)
            for r in range(n):
                for i, (g, w) in enumerate(zip(got[r], want[r])):
                    if g != w:
                        bad.append(f"{case} seq {seq} rank {r} layer {i}: counted {g} planned "
                                   f"{w}")
    return bad


@pytest.mark.parametrize("n", [2, 4])
def test_counted_bytes_equal_the_planned_bytes_per_layer(counted, n):
    res = counted[n]
    assert mismatches(n, res) == []
    for case in CASES:
        for seq in TOKENS:
            got = counted_per_layer(n, case, seq, res)
            for r in range(n):
                calls = [b for layer in got[r] for _, b in layer]
                assert calls, (case, seq, r)  # every layout communicates
                assert all(float(b).is_integer() for b in calls), (case, seq, calls)
                # every call was served by torch.distributed and accounted there
                assert all(c[5] is not None for c in res[r][(case, seq)]["calls"])
                assert all(c[0] is not None for c in res[r][(case, seq)]["calls"])


@pytest.mark.parametrize("n", [2, 4])
def test_the_counts_are_the_buffers_really_moved(counted, n):
    """The ops_comm cost of each call against the buffer torch.distributed was handed: a ring
    all-reduce 2 (n-1)/n of it, a reduce-scatter (n-1)/n, an all-gather (n-1) times this
    rank's part (int8: the codes and fp32 scales themselves), an all-to-all exactly the rows
    split off for other ranks."""
    kinds = set()
    for r in counted[n]:
        for key, v in r.items():
            for scope, op, size, rank, lb, wire, quant in v["calls"]:
                assert size == n
                kinds.add((op, quant))
                factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
                          "all_gather": n - 1, "all_to_all": 1}[op]
                assert lb == factor * wire, (key, op, quant, lb, wire)
    assert kinds == {("all_reduce", None), ("reduce_scatter", None), ("all_gather", None),
                     ("all_gather", "int8"), ("all_to_all", None)}


def test_the_flashcomm_case_pads_and_the_a2a_case_is_uneven(counted):
    """The cases exercise what they are meant to: 5 tokens pad (tp 2: 6, tp 4: 8), and the real
    routing sends different row counts to different ranks."""
    r0 = counted[4][0][("tp+flashcomm", 5)]
    rs = [c for c in r0["calls"] if c[1] == "reduce_scatter"]
    assert rs and rs[0][4] == 3 / 4 * 8 * 64 * 4  # [8 padded tokens, 64] fp32
    from glm5.deploy.plan import route_pairs

    cfg = _cfg()
    i = cfg.mlp_layer_types.index("sparse")
    M = route_pairs([torch.tensor(counted[4][s][("ep+dp-attention", 5)]["routes"][i])
                     for s in range(4)], cfg.n_routed_experts, 4)
    assert len({c for row in M for c in row}) > 1, M


def test_planted_bugs_are_caught(counted, monkeypatch):
    """The comparison fails for a planner that forgets FlashComm's padding, the int8 scales, or
    counts the all-to-all rows a rank keeps."""
    import glm5.deploy.flashcomm as fcm
    import glm5.deploy.plan_comm as plan_mod
    import glm5.ir.ops_comm as oc

    res = counted[4]
    assert mismatches(4, res) == []
    with monkeypatch.context() as mp:
        mp.setattr(fcm, "padded_tokens", lambda t, n: t)
        mp.setattr(plan_mod, "padded_tokens", lambda t, n: t)
        bad = mismatches(4, res)
        assert bad and all("flashcomm" in b and "seq 5" in b for b in bad), bad
    with monkeypatch.context() as mp:
        mp.setattr(oc, "SCALE_BYTES", 0)
        bad = mismatches(4, res)
        assert bad and all("flashcomm-int8" in b for b in bad), bad
    a2a = oc.get_comm_op("all_to_all")
    selfish = dataclasses.replace(
        a2a, link_bytes=lambda shape, dtype, n, send_counts=(), rank=0:
        a2a.link_bytes(shape, dtype, n, send_counts=send_counts, rank=-1))
    with monkeypatch.context() as mp:
        mp.setattr(plan_mod, "get_comm_op", lambda name: selfish if name == "all_to_all"
                   else oc.get_comm_op(name))
        bad = mismatches(4, res)
        assert bad and all("dp-attention" in b for b in bad), bad
    assert mismatches(4, res) == []


def test_quantized_cases_gather_activation_scales(counted):
    """The quantized cases do issue the activation-scale gathers the planner adds: [tokens, 1]
    fp32 all-gathers, 2 per TP layer (o_proj, down_proj), 1 per MoE layer under replicated-
    token EP (the shared expert), none with DP attention or float activations."""
    res = counted[2][0]
    L = _cfg().num_hidden_layers
    n_moe = _cfg().mlp_layer_types.count("sparse")
    for case, want in (("tp-w8a8", 2 * L), ("tp+flashcomm-w4a8", 2 * L), ("ep-w8a8", n_moe),
                       ("ep+dp-attention-w4a8", 0), ("tp-w8a16", 0), ("tp", 0)):
        calls = res[(case, 5)]["calls"]
        scales = [c for c in calls if c[1] == "all_gather" and c[4] == 1 * 4 * 5]
        assert len(scales) == want, (case, len(scales))


def test_planted_no_activation_scale_gathers_is_caught(counted, monkeypatch):
    import glm5.deploy.plan_comm as plan_mod

    with monkeypatch.context() as mp:
        mp.setattr(plan_mod, "act_scale_gathers", lambda *a: ((), 1))
        bad = mismatches(2, counted[2])
    assert bad and all(c in ("tp-w8a8", "tp+flashcomm-w4a8", "ep-w8a8")
                       for c in {b.split(" seq")[0] for b in bad}), bad


@pytest.mark.parametrize("option", ["allreduce", "flashcomm"])
def test_quantized_layer_comm_is_what_plan_reports(option):
    """With w8a8 the plan's per-layer TP figure plus its activation-scale gathers is
    ``layer_comm(quant="w8a8")``."""
    from glm5.core.config import preset
    from glm5.deploy.plan import layer_comm, plan

    cfg = preset("tiny")
    cm = plan(cfg, "h200", "w8a8", batch=3, context=16, tp=2, ep=2, comm=option)["prefill"][
        "comm"]
    T = cm["tokens_per_tp_group"]
    for k in cm["kinds"]:
        got = layer_comm(cfg, 2, 2, T, option, moe=k["kind"] == "moe", quant="w8a8")
        act = k["act_scale_gathers"]
        assert act is not None and act["all_gathers"] == 2
        assert sum(b for _, b in got) == k["tp"][option]["link_bytes"] + act["link_bytes"]
    assert cm["act_scale_link_bytes"] > 0


@pytest.mark.parametrize("option", ["allreduce", "flashcomm", "flashcomm-int8"])
def test_layer_comm_is_what_plan_reports(option):
    """``layer_comm`` (bf16) per layer is the plan's own per-layer figure: the two TP reduction
    points of its comm section, plus the stack-end gather on the last layer; the uniform
    all-to-all of an MoE layer is the plan's EP figure."""
    from glm5.core.config import preset
    from glm5.deploy.plan import layer_comm, plan

    cfg = preset("tiny")
    p = plan(cfg, "h200", "bf16", batch=3, context=16, tp=2, ep=2, comm=option)["prefill"]
    cm = p["comm"]
    T = cm["tokens_per_tp_group"]
    for k in cm["kinds"]:
        want = k["tp"][option]["link_bytes"]
        got = layer_comm(cfg, 2, 2, T, option, moe=k["kind"] == "moe")
        assert sum(b for _, b in got) == want and len(got) == len(k["tp"][option]
                                                                   ["collectives"])
        assert k["ep_alltoall"] is None  # ep = tp: the MoE output rides the TP reduction
    if option != "allreduce":
        last = layer_comm(cfg, 2, 2, T, option, moe=True, last=True)
        assert last[-1] == ("all_gather", cm["stack_end_gather"]["link_bytes"])  # no MTP
    d = plan(cfg, "h200", "bf16", batch=4, context=16, ep=2)["decode"]["comm"]
    moe = next(k for k in d["kinds"] if k["kind"] == "moe")
    got = layer_comm(cfg, 1, 2, d["tokens_per_tp_group"], moe=True, dp_attention=True)
    assert [c for c, _ in got] == moe["ep_alltoall"]["collectives"]
    assert sum(b for _, b in got) == moe["ep_alltoall"]["link_bytes"]
    r = plan(cfg, "h200", "bf16", batch=4, context=16, ep=2, dp_attention=False)["decode"]
    moe = next(k for k in r["comm"]["kinds"] if k["kind"] == "moe")
    assert layer_comm(cfg, 1, 2, 4, moe=True) == [("all_reduce",
                                                   moe["ep_allreduce"]["link_bytes"])]
