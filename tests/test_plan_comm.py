"""`glm5 plan` communication: every formula against numbers worked out by hand (ring all-reduce,
reduce-scatter / all-gather, padding to TP, int8 gather bytes with scales, the residual/norm work
FlashComm moves to the token shard, the threshold where the FlashComm and all-reduce time lines
cross), the ``--comm`` choice feeding the step time, and the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from glm5.cli import main as cli_main
from glm5.deploy.chips import Chip, get_chip
from glm5.core.config import preset
from glm5.deploy.plan import (
    PlanError,
    all_to_all_link_bytes,
    choose_comm,
    flashcomm_threshold,
    padded_tokens,
    plan,
    sync_ops,
    sync_point,
    tp_collectives,
)
from glm5.ir.ops_comm import get_comm_op

TINY = preset("tiny")
# round numbers: HBM 1000 GB/s = 1e12 B/s, link 100 GB/s each way = 1e11 B/s; peaks so high that
# every elementwise op is bandwidth-bound; a latency whose crossings fall between integers
TOY = Chip(name="toy", vendor="test", backend="reference", memory_gb=1, hbm_gbs=1000,
           bf16_tflops=1000, int8_tops=2000, link_gbs=100, link_bidirectional=False,
           link_name="toy-link", collective_latency_us=10.3025)


# --------------------------------------------------------------------------- collectives
def test_padded_tokens():
    assert [padded_tokens(t, 4) for t in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
    assert padded_tokens(7, 1) == 7


def test_collective_link_bytes_by_hand():
    """hidden 10, tp 4, 5 tokens: B = 5 * 10 * 2 = 100 bytes of bf16."""
    # ring all-reduce: 2 (n-1)/n B = 2 * 3/4 * 100
    assert tp_collectives(10, 4, 5, "allreduce") == [("all_reduce", 150.0)]
    # FlashComm pads 5 -> 8 tokens: reduce-scatter 3/4 * 160; all-gather of 2-token shards
    # (n-1) * 40 = 3/4 of the gathered 160
    assert tp_collectives(10, 4, 5, "flashcomm") == [("reduce_scatter", 120.0),
                                                     ("all_gather", 120.0)]
    # int8 gather: 8 tokens x (10 code bytes + 4 scale bytes) = 112 gathered, 3/4 of it sent;
    # the reduce-scatter stays bf16
    assert tp_collectives(10, 4, 5, "flashcomm-int8") == [("reduce_scatter", 120.0),
                                                          ("all_gather", 84.0)]
    assert tp_collectives(10, 1, 5, "flashcomm") == []


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_flashcomm_moves_the_all_reduce_bytes_when_no_padding(n):
    """Without padding RS + AG send exactly the ring all-reduce's 2 (n-1)/n B."""
    T, D = 3 * n, 7
    (_, ar), = tp_collectives(D, n, T, "allreduce")
    assert ar == pytest.approx(2 * (n - 1) / n * T * D * 2, rel=1e-15)
    (_, rs), (_, ag) = tp_collectives(D, n, T, "flashcomm")
    assert rs == pytest.approx((n - 1) / n * T * D * 2, rel=1e-15)
    assert ag == pytest.approx(rs, rel=1e-15) and rs + ag == pytest.approx(ar, rel=1e-15)


def test_all_to_all_uniform_matches_the_op_cost():
    assert all_to_all_link_bytes(800.0, 4) == 600.0 and all_to_all_link_bytes(800.0, 1) == 0.0
    # the all_to_all op with equal counts: 2 rows of 50 bf16 to each of 3 other ranks
    op = get_comm_op("all_to_all")
    assert op.link_bytes((8, 50), torch.bfloat16, 4, send_counts=[2, 2, 2, 2], rank=1) == \
        all_to_all_link_bytes(8 * 50 * 2, 4)


def test_sync_ops_by_hand():
    """5 tokens, hidden 10, tp 4: all-reduce works on 5 rows, FlashComm on 8/4 = 2."""
    def by_label(ops):
        return {o.label: (o.flops, o.bytes) for o in ops}

    ar = by_label(sync_ops(10, 1e-5, 4, 5, "allreduce", "norm"))
    # residual add: t*D flops, 3 tensors of t*D bf16; rms_norm OpDef: 4 t D flops, x read +
    # y written + the bf16 weight
    assert ar == {"residual_add": (50.0, 300.0), "norm": (200.0, 220.0)}
    fc = by_label(sync_ops(10, 1e-5, 4, 5, "flashcomm", "norm"))
    assert fc == {"residual_add": (20.0, 120.0), "norm": (80.0, 100.0)}
    q = by_label(sync_ops(10, 1e-5, 4, 5, "flashcomm-int8", "norm"))
    # quantize_per_token on the 2-row shard: 3 t D flops, bf16 in + int8 out + fp32 scales;
    # dequantize the 8 gathered rows: codes + scales in, bf16 out
    assert q["comm_quant_int8"] == (60.0, 40.0 + 20.0 + 8.0)
    assert q["comm_dequant_int8"] == (80.0, 80.0 + 32.0 + 160.0)
    # tp 1 (or no reduction): the whole tokens
    assert by_label(sync_ops(10, 1e-5, 1, 5, "none", "norm")) == ar


def _by_hand_seconds(T: int, option: str) -> float:
    """TOY chip, hidden 1000, tp 2: one reduction point, written out."""
    D, a = 1000, 10.3025e-6
    P = T + T % 2
    if option == "allreduce":  # one all-reduce of 2TD bytes: 2 * 1/2 of it on the link
        return a + 2 * T * D / 1e11 + (6 * T * D + 4 * T * D + 2 * D) / 1e12
    shard = P // 2
    work = (6 * shard * D + 4 * shard * D + 2 * D) / 1e12  # residual add + norm on the shard
    if option == "flashcomm":  # RS 1/2 * 2PD + AG 1 * shard * 2D
        return 2 * a + 2 * P * D / 1e11 + work
    link = P * D + shard * D + 4 * shard  # bf16 RS + the int8 shard with its scale
    work += (3 * shard * D + 4 * shard + 3 * P * D + 4 * P) / 1e12  # quantize + dequantize
    return 2 * a + link / 1e11 + work


@pytest.mark.parametrize("option", ["allreduce", "flashcomm", "flashcomm-int8"])
@pytest.mark.parametrize("T", [1, 2, 7, 1000, 2065, 2066])
def test_sync_point_time_by_hand(option, T):
    got = sync_point(TOY, 1000, 1e-5, 2, T, option)
    assert got["total_us"] == pytest.approx(_by_hand_seconds(T, option) * 1e6, rel=1e-12)
    assert got["total_us"] == pytest.approx(got["comm_us"] + got["work_us"], rel=1e-15)


def test_threshold_where_the_lines_cross():
    """bf16, by hand: FC - AR = a + 2(P-T)D/1e11 + 10(P/2 - T)D/1e12 with a = 10.3025 us, D = 1000:
    even T (P = T): a - 5e-9 T < 0 from T = 2061; odd T (one pad token): a + 2.5e-8 - 5e-9 T < 0
    from T = 2066. Between 2061 and 2065 FlashComm wins at even counts and loses at odd ones
    (padding): never slower from 2066 on.
    int8: FC8 - AR = a + (1.5PD + 2P - 2TD)/1e11 + (9.5PD + 6P - 10TD)/1e12: even T:
    a - 5.474e-9 T (< 0 from 1883); odd T: a + 2.4526e-8 - 5.474e-9 T (< 0 from 1887)."""
    assert flashcomm_threshold(TOY, 1000, 2) == 2066
    assert flashcomm_threshold(TOY, 1000, 2, "flashcomm-int8") == 1886

    def diff(T, o):
        return _by_hand_seconds(T, o) - _by_hand_seconds(T, "allreduce")

    assert diff(2060, "flashcomm") > 0 > diff(2062, "flashcomm")  # even counts cross at 2060.5
    assert diff(2065, "flashcomm") > 0 > diff(2066, "flashcomm") and diff(2067, "flashcomm") < 0
    assert diff(1885, "flashcomm-int8") > 0 > diff(1886, "flashcomm-int8")
    assert flashcomm_threshold(TOY, 1000, 1) is None


@pytest.mark.parametrize("chip, tp, option", [("h200", 8, "flashcomm"),
                                              ("ascend-910b", 4, "flashcomm-int8"),
                                              ("mtt-s4000", 2, "flashcomm")])
def test_threshold_is_the_last_loss_plus_one(chip, tp, option):
    """Brute force over token counts on real chip figures (glm-5 hidden 6144): FlashComm is
    slower just below the threshold and never slower from it to 1.5x it."""
    ch, D = get_chip(chip), 6144
    thr = flashcomm_threshold(ch, D, tp, option)
    assert thr is not None and thr > tp

    def loses(T):
        return (sync_point(ch, D, 1e-5, tp, T, option)["total_us"]
                > sync_point(ch, D, 1e-5, tp, T, "allreduce")["total_us"])

    assert loses(thr - 1)
    assert not any(loses(T) for T in range(thr, thr + thr // 2))


def test_threshold_never_when_flashcomm_cannot_win():
    """A per-collective latency so large that 2^40 tokens of saved norm work do not repay it."""
    huge = dataclasses.replace(TOY, name="slow", collective_latency_us=1e9)
    assert flashcomm_threshold(huge, 16, 2) is None
    with pytest.raises(PlanError, match="'option'"):
        flashcomm_threshold(TOY, 16, 2, "allreduce")


def test_choose_comm():
    assert choose_comm("auto", 8, 99, 100) == "allreduce"
    assert choose_comm("auto", 8, 100, 100) == "flashcomm"
    assert choose_comm("auto", 8, 10 ** 9, None) == "allreduce"
    assert choose_comm("flashcomm-int8", 8, 1, 100) == "flashcomm-int8"
    assert choose_comm("flashcomm", 1, 10 ** 6, 100) == "none"
    with pytest.raises(PlanError, match="'comm'"):
        choose_comm("nccl", 8, 1, 1)


# --------------------------------------------------------------------------- in the plan
FAST = dataclasses.replace(get_chip("h200"), name="h200-lowlat", collective_latency_us=0.01)


def _tiny(comm, **kw):
    args = dict(batch=2, context=128, tp=2, ep=2, comm=comm)
    args.update(kw)
    return plan(TINY, FAST, "bf16", **args)


def test_auto_uses_the_threshold_per_phase():
    p = _tiny("auto")
    thr = flashcomm_threshold(FAST, TINY.hidden_size, 2)
    d, f = p["decode"]["comm"], p["prefill"]["comm"]
    assert d["thresholds"]["flashcomm"] == thr
    # the case covers both sides: 2 decode tokens, 256 prefill tokens per TP group
    assert d["tokens_per_tp_group"] < thr <= f["tokens_per_tp_group"]
    assert p["decode"]["comm_option"] == "allreduce" and p["prefill"]["comm_option"] == "flashcomm"


def test_step_time_uses_the_chosen_option():
    """Same plan, three options: the op list differs only by the residual/norm work of the two
    reduction points per layer, and the TP time is the section's collectives."""
    ps = {o: _tiny(o, batch=3, mtp=True) for o in ("allreduce", "flashcomm", "flashcomm-int8")}
    n_layers = TINY.num_hidden_layers + TINY.num_nextn_predict_layers
    for phase in ("decode", "prefill"):
        ph = {o: p[phase] for o, p in ps.items()}
        kinds = ph["allreduce"]["comm"]["kinds"]
        assert {k["kind"]: k["layers"] for k in kinds} == {"dense": 1, "moe": 2, "mtp": 1}
        per = kinds[0]["tp"]
        for o in ("flashcomm", "flashcomm-int8"):
            assert ph[o]["comm_option"] == o
            saved_ms = n_layers * (per["allreduce"]["work_us"] - per[o]["work_us"]) / 1e3
            assert ph["allreduce"]["compute_ms"] - ph[o]["compute_ms"] == \
                pytest.approx(saved_ms, rel=1e-9)
            # FlashComm gathers the residual stream once more at the end of each stack
            end = ph[o]["comm"]["stack_end_gather"]
            assert end["all_gathers"] == 2
            assert ph[o]["tp_comm_ms"] == pytest.approx(
                (n_layers * per[o]["comm_us"] + end["us"]) / 1e3, rel=1e-12)
        assert ph["allreduce"]["tp_comm_ms"] == pytest.approx(
            n_layers * per["allreduce"]["comm_us"] / 1e3, rel=1e-12)
        for o, r in ph.items():
            assert r["total_ms"] == pytest.approx(r["compute_ms"] + r["tp_comm_ms"]
                                                  + r["ep_alltoall_ms"], rel=1e-12)
            # tp 2 = ep 2: the experts are split over the TP group, whose ranks hold the same
            # tokens; the model sums the MoE output in the TP reduction, no all-to-all
            assert r["ep_alltoall_ms"] == 0 and r["comm"]["ep_link_bytes"] == 0
    # decode: 3 sequences on tp 2 (1 attention group) pad to 4; the shard holds 2 of them,
    # so the residual stream a device keeps halves
    d = ps["flashcomm"]["decode"]["comm"]
    assert d["tokens_per_tp_group"] == 3 and d["padded_tokens"] == 4
    per = d["kinds"][0]["tp"]
    assert per["flashcomm"]["norm_tokens"] == 2 and per["allreduce"]["norm_tokens"] == 3
    assert per["flashcomm"]["residual_bytes"] == 2 * 64 * 2
    labels = {r["label"]: r["calls"] for r in ps["flashcomm-int8"]["decode"]["ops"]}
    assert labels["comm_quant_int8"] == labels["comm_dequant_int8"] == 2 * n_layers
    assert "comm_quant_int8" not in {r["label"] for r in ps["flashcomm"]["decode"]["ops"]}


def test_ep_alltoall_by_hand():
    """tiny decode, batch 4 on tp 1 x ep 2 (two attention groups): each device owns 2 tokens and
    sends each to k = 2 experts, as the model does (glm5.parallel.layouts.ParallelMoE): the
    pair counts (2 int64, one to the other rank: 8 bytes), the dispatch of 2 * 2 rows of
    64 bf16 and the combine back (half off-device each: 256 bytes), and the pairs' int64 expert
    ids (half of 4 * 8 bytes: 16). Before the planner was checked against counted bytes it had
    only the dispatch and the combine (2 * 256 bytes)."""
    p = plan(TINY, "h200", "bf16", batch=4, context=16, ep=2)
    cm = p["decode"]["comm"]
    moe = next(k for k in cm["kinds"] if k["kind"] == "moe")
    link = 1 / 2 * 2 * 2 * 64 * 2
    parts = [8.0, link, 1 / 2 * 2 * 2 * 8, link]
    assert moe["ep_alltoall"]["collectives"] == ["all_to_all"] * 4
    assert moe["ep_alltoall"]["link_bytes"] == sum(parts) == 536.0
    assert moe["ep_alltoall"]["us"] == pytest.approx(sum(6 + b / 450e9 * 1e6 for b in parts),
                                                     rel=1e-12)
    assert moe["tp"] is None and p["decode"]["comm_option"] == "none"
    assert p["decode"]["ep_alltoall_ms"] == pytest.approx(2 * moe["ep_alltoall"]["us"] / 1e3)
    assert next(k for k in cm["kinds"] if k["kind"] == "dense")["ep_alltoall"] is None


def test_ep_replicated_tokens_by_hand():
    """tiny decode, batch 4 on tp 1 x ep 2 with replicated tokens (no data-parallel attention):
    every device runs the 4 tokens, and each MoE layer all-reduces its [4, 64] bf16 output over
    the 2 ranks: 2 * 1/2 * 512 bytes; no all-to-all, the KV cache of all 4 sequences each."""
    p = plan(TINY, "h200", "bf16", batch=4, context=16, ep=2, dp_attention=False)
    d = p["decode"]
    moe = next(k for k in d["comm"]["kinds"] if k["kind"] == "moe")
    assert moe["ep_alltoall"] is None and moe["ep_allreduce"]["link_bytes"] == 512.0
    assert p["layout"]["dp"] == 1 and p["layout"]["local_batch"] == 4
    assert d["ep_allreduce_link_bytes"] == 2 * 512.0 and d["ep_alltoall_ms"] == 0
    assert d["total_ms"] == pytest.approx(d["compute_ms"] + d["ep_allreduce_ms"], rel=1e-12)
    with pytest.raises(PlanError, match="dp_attention"):
        plan(TINY, "h200", "bf16", batch=4, context=16, tp=2, ep=4, dp_attention=False)


def test_plan_rejects_flashcomm_without_tp():
    with pytest.raises(PlanError, match="'comm' expected allreduce or auto with tp 1"):
        plan(TINY, "h200", "bf16", batch=1, context=16, comm="flashcomm")
    with pytest.raises(PlanError, match="'comm' expected one of"):
        plan(TINY, "h200", "bf16", batch=1, context=16, tp=2, comm="int4")


# --------------------------------------------------------------------------- CLI
def test_cli_comm_flag_json_and_text(capsys):
    base = ["plan", "--preset", "tiny", "--chip", "h200", "--batch", "3", "--context", "32",
            "--tp", "2"]
    assert cli_main(base + ["--comm", "FlashComm-Int8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["comm"] == "flashcomm-int8"
    assert doc["decode"]["comm_option"] == doc["prefill"]["comm_option"] == "flashcomm-int8"
    assert doc["decode"]["comm"]["padded_tokens"] == 4
    assert cli_main(base) == 0  # default auto: tiny's threshold on h200 is far above 96 tokens
    out = capsys.readouterr().out
    assert "communication per device (NVLink 4: 450 GB/s each way, 6 us per collective, " \
           "estimate)" in out
    assert "decode, 3 tokens per TP group (padded to 4)" in out
    assert "step times use: decode allreduce, prefill allreduce (--comm auto)" in out
    thr = flashcomm_threshold(get_chip("h200"), 64, 2)
    assert f"FlashComm beats all-reduce from {thr:,} tokens per TP group" in out


@pytest.mark.parametrize("argv, msg", [
    (["--comm", "nccl"], "--comm expected one of allreduce, flashcomm, flashcomm-int8, auto"),
    (["--comm", "flashcomm"], "--comm expected allreduce or auto with tp 1"),
])
def test_cli_comm_errors(argv, msg, capsys):
    assert cli_main(["plan", "--preset", "tiny", "--chip", "h200", "--context", "64"]
                    + argv) == 2
    assert msg in capsys.readouterr().err
