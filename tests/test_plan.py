"""`glm5 plan`: golden figures computed by hand on the tiny preset, every chip answering for
glm-5, the does-not-fit path with its suggestion, TP/EP scaling, JSON round trip, errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glm5.cli import main as cli_main
from glm5.deploy.chips import CHIPS, get_chip
from glm5.core.config import preset
from glm5.deploy.info import count_params, kv_cache_per_token
from glm5.deploy.plan import (
    INDEX_PAGE_SIZE,
    Layout,
    PlanError,
    _candidates,
    expert_load,
    memory,
    phase_cost,
    plan,
    tensor_bytes,
    weight_bytes,
)
from glm5.ir.quant_formats import SCHEMES

TINY = preset("tiny")
GLM5 = preset("glm-5")


def _op(phase: dict, label: str) -> dict:
    return next(r for r in phase["ops"] if r["label"] == label)


# --------------------------------------------------------------------------- golden, by hand
def test_tiny_decode_golden_w8a8():
    """tiny: D=64, Rq=48, E=8, k=2, I=32, 3 layers (1 dense, 2 MoE), batch 2 at context 16."""
    p = plan(TINY, "h200", "w8a8", batch=2, context=16)
    d = p["decode"]
    # q_a_proj as quant_linear: M=2, N=48, K=64 per layer, 3 layers.
    # flops 2*M*N*K; bytes = x bf16 (2*64*2=256) * (1 + N/K) + int8 codes 48*64 + fp32 scales 48*4
    q = _op(d, "q_a_proj")
    assert q["op"] == "quant_linear" and q["dtype"] == "int8" and q["calls"] == 3
    assert q["flops"] == 3 * 2 * 2 * 48 * 64
    assert q["bytes"] == 3 * (256 * (1 + 48 / 64) + 48 * 64 + 48 * 4)
    # routed experts: slots = 2 tokens * k=2 = 4; touched = ceil(8 * (1 - (1 - 2/8)^2)) = 4.
    # flops per slot 6*D*I + 4*I; bytes = x [4, 64] bf16 read + written (2*512), codes of the
    # 4 touched experts 4 * (2I*D + D*I) int8 plus their fp32 per-channel scales 4 * (2I + D),
    # 8 bytes of id+weight per slot.
    m = _op(d, "moe_experts_quant")
    assert m["calls"] == 2
    assert m["flops"] == 2 * 4 * (6 * 64 * 32 + 4 * 32)
    assert m["bytes"] == 2 * (2 * 4 * 64 * 2 + 4 * (64 * 64 + 64 * 32 + 4 * (64 + 64))
                              + 8 * 4)
    # lm_head stays bf16 (quant_policy): 2 tokens x V=128 x D=64
    lm = _op(d, "lm_head")
    assert lm["op"] == "matmul" and lm["dtype"] == "bf16"
    assert lm["flops"] == 2 * 2 * 128 * 64
    assert lm["bytes"] == 2 * (128 * 64 + 2 * 64 + 2 * 128)
    # context 16 > index_topk 8: the two 'full' layers run the indexer, once per sequence
    assert _op(d, "indexer_topk")["calls"] == 2 * 2
    assert _op(d, "sparse_attention")["calls"] == 3
    # roofline: each op max(flops/peak, bytes/bw), summed
    ch = get_chip("h200")
    want = sum(max(r["flops"] / r["calls"] / ch.peak_flops(r["dtype"]),
                   r["bytes"] / r["calls"] / (ch.hbm_gbs * 1e9)) * r["calls"] for r in d["ops"])
    assert math.isclose(d["compute_ms"], want * 1e3, rel_tol=1e-12)
    assert d["tp_comm_ms"] == 0 and d["ep_alltoall_ms"] == 0 and d["comm_option"] == "none"
    assert math.isclose(d["tokens_per_s"], 2 / (d["total_ms"] / 1e3))


def test_tensor_bytes_by_hand():
    name = "model.layers.1.mlp.experts.gate_up_proj"  # [E=8, 2I=64, D=64]
    shape = (8, 64, 64)
    assert tensor_bytes(name, shape, SCHEMES["w4a8"]) == 8 * (64 * 32 + 64 * 1 * 4)
    assert tensor_bytes(name, shape, SCHEMES["w6a12"]) == 8 * (64 * 48 + 64 * 1 * 4)
    assert tensor_bytes(name, shape, SCHEMES["w8a16"]) == 8 * (64 * 64 + 64 * 4)
    assert tensor_bytes(name, shape, None) == 8 * 64 * 64 * 2
    # K=200 is not a multiple of 128: 2 groups, int4 codes padded to 100 bytes per row
    assert tensor_bytes("model.layers.0.mlp.down_proj.weight", (10, 200),
                        SCHEMES["w4a8"]) == 10 * 100 + 10 * 2 * 4
    # kept in high precision by quant_policy
    assert tensor_bytes("model.layers.0.self_attn.kv_b_proj.weight", (96, 32),
                        SCHEMES["w4a8"]) == 96 * 32 * 2
    assert tensor_bytes("model.layers.1.mlp.gate.weight", (8, 64), SCHEMES["w8a8"]) == 8 * 64 * 4


def test_weight_bytes_bf16_by_hand():
    """bf16 = 2 bytes per element, except the fp32 router (weight + bias) and indexer head
    weights: 2 MoE layers x (8*64 + 8) and 2 full-indexer layers x (2*64) elements at 4 bytes."""
    wb = weight_bytes(TINY, None)
    fp32 = 2 * (8 * 64 + 8) + 2 * (2 * 64)
    assert wb["params"] == count_params(TINY)["total_params"]
    assert wb["total"] == 2 * wb["params"] + 2 * fp32
    assert wb["quantized_params"] == 0
    # every scheme is smaller than bf16, and w4a8 < w6a12 < w8a8 == w8a16
    t = {s: weight_bytes(TINY, SCHEMES[s])["total"] for s in SCHEMES}
    assert t["w4a8"] < t["w6a12"] < t["w8a8"] == t["w8a16"] < wb["total"]


def test_counts_match_info_for_glm5_with_mtp():
    p = count_params(GLM5)
    assert weight_bytes(GLM5, None)["params"] == p["total_params"]
    assert weight_bytes(GLM5, None, mtp=True)["params"] == p["total_params"] + p["mtp_params"]


def test_kv_cache_from_info():
    lay = Layout(batch=3, context=100, tp=1, ep=1)
    ch = get_chip("h100-sxm")
    wb = weight_bytes(TINY, None)
    m = memory(TINY, ch, wb, lay, "fp8", 0.0, False)
    assert m["kv_cache_bytes_per_device"] == 3 * 100 * kv_cache_per_token(TINY)["bytes"]["fp8"]
    # tiny by hand: 3 layers x (32 + 8) latent + 2 indexer layers x 16 keys, bf16
    assert memory(TINY, ch, wb, lay, "bf16", 0.0, False)["kv_cache_bytes_per_token"] == \
        (3 * 40 + 2 * 16) * 2


# --------------------------------------------------------------------------- fp8 index cache
def test_fp8_index_cache_bytes_by_hand():
    """tiny: 3 layers x (32 + 8) latent, 2 'full' layers x a 16-value key; an fp8 key row is 16
    codes + a 4-byte scale whatever the latent's element."""
    fp8 = TINY.replace(dsa_indexer_dtype="fp8")
    kv = kv_cache_per_token(fp8)
    assert kv["bytes"] == {"bf16": 3 * 40 * 2 + 2 * (16 + 4), "fp8": 3 * 40 + 2 * (16 + 4)}
    assert kv["bytes_per_layer"] == {"bf16": 40 * 2 + 20, "fp8": 40 + 20}
    assert kv["mtp_bytes"] == {"bf16": 1 * (40 * 2 + 20), "fp8": 40 + 20}
    assert kv["elements"] == kv_cache_per_token(TINY)["elements"]  # the elements are the same
    lay, ch = Layout(batch=3, context=100, tp=1, ep=1), get_chip("h200")
    m = memory(fp8, ch, weight_bytes(fp8, None), lay, "bf16", 0.0, True)
    assert m["kv_cache_bytes_per_token"] == 3 * 40 * 2 + 2 * 20 + 40 * 2 + 20
    # GLM-5: 78 key rows of 128 values: 256 -> 132 bytes each
    g = kv_cache_per_token(GLM5.replace(dsa_indexer_dtype="fp8"))["bytes"]["bf16"]
    assert kv_cache_per_token(GLM5)["bytes"]["bf16"] - g == 78 * (256 - 132)


def test_fp8_index_cache_matches_the_engine_pool():
    """The planner's bytes per token are what the serving engine's pool allocates a token (one
    page of one row), for both indexer dtypes, with and without the MTP layer."""
    from glm5.core.model import GLM5ForCausalLM
    from glm5.engine.engine import EngineConfig
    from glm5.engine.kv_pool import KVPool

    assert INDEX_PAGE_SIZE == EngineConfig().page_size
    for dt in ("bf16", "fp8"):
        cfg = TINY.replace(dsa_indexer_dtype=dt)
        model = GLM5ForCausalLM(cfg).to(torch.bfloat16)
        kv = kv_cache_per_token(cfg)
        assert KVPool.page_bytes(model, 1) == kv["bytes"]["bf16"], dt
        assert KVPool.page_bytes(model, 1, mtp=True) == kv["bytes"]["bf16"] + \
            kv["mtp_bytes"]["bf16"], dt


def test_fp8_indexer_cost():
    """The fp8 indexer: the paged fp8 op's cost (pages of INDEX_PAGE_SIZE rows of 128 codes +
    a scale) at the chip's FP8 rate; chips without one run it at their BF16 rate."""
    kw = dict(batch=1, context=32768, tp=8, ep=8, suggest=False)
    bf, f8 = plan(GLM5, "h200", "w4a8", **kw), plan(GLM5, "h200", "w4a8", indexer_dtype="fp8",
                                                    **kw)
    assert f8["inputs"]["indexer_dtype"] == "fp8" and bf["inputs"]["indexer_dtype"] == "bf16"
    op = _op(f8["decode"], "indexer_topk_fp8")
    assert op["op"] == "paged_indexer_topk_fp8" and op["dtype"] == "fp8" and op["calls"] == 78
    assert "indexer_topk" not in {r["label"] for r in f8["decode"]["ops"]}
    # one decode query over 32768 keys = 512 pages: q bf16 32x128, w fp32 32, seq + k_len
    # int32, block table 512 int32, keys 32768 x 132, the 2048 selected int32
    per_call = 32 * 128 * 2 + 32 * 4 + 4 + 4 + 512 * 4 + 32768 * 132 + 2048 * 4
    assert op["bytes"] == 78 * per_call
    assert op["flops"] == 78 * (32768 * (2 * 32 * 128 + 3 * 32 + 1) + 2048)
    wr = _op(f8["decode"], "indexer_key_cache_write")
    assert wr["bytes"] == 78 * (128 + 4) == _op(bf["decode"], "indexer_key_cache_write")[
        "bytes"] * 132 / 256
    # prefill is compute-bound: the FP8 rate (2x BF16 on H200) halves the indexer's time
    h200 = get_chip("h200")
    pre = _op(f8["prefill"], "indexer_topk_fp8")
    assert pre["bound"] == "compute"
    assert pre["ms"] == pytest.approx(pre["flops"] / h200.peak_flops("fp8") * 1e3)
    assert h200.peak_flops("fp8") == pytest.approx(2 * h200.peak_flops("bf16"), rel=1e-3)
    assert pre["ms"] < 0.6 * _op(bf["prefill"], "indexer_topk")["ms"]
    # Ascend 910B has no FP8 matrix rate: the decomposition dequantizes, BF16 peak
    a = get_chip("ascend-910b")
    assert a.fp8_tflops is None and a.peak_flops("fp8") == a.peak_flops("bf16")
    asc = plan(GLM5, "ascend-910b", "w4a8", indexer_dtype="fp8", **kw)
    pre = _op(asc["prefill"], "indexer_topk_fp8")
    assert pre["ms"] == pytest.approx(pre["flops"] / a.peak_flops("bf16") * 1e3)
    # a model whose config already says fp8 is costed so without the option
    assert plan(GLM5.replace(dsa_indexer_dtype="fp8"), "h200", "w4a8", **kw) == f8
    with pytest.raises(PlanError, match="'indexer_dtype' expected one of bf16, fp8"):
        plan(TINY, "h200", "bf16", batch=1, context=16, indexer_dtype="int8")


def test_fp8_indexer_cli(capsys):
    assert cli_main(["plan", "--preset", "glm-5", "--chip", "h200", "--quant", "w4a8",
                     "--batch", "32", "--context", "32768", "--tp", "2", "--ep", "8",
                     "--indexer-dtype", "FP8"]) == 0
    out = capsys.readouterr().out
    assert "indexer fp8" in out and "indexer_topk_fp8" in out


# --------------------------------------------------------------------------- model choices
def test_dense_range_uses_attention_and_prefill_is_chunked():
    short = plan(TINY, "h200", "bf16", batch=1, context=8)  # range fits index_topk=8
    labels = {r["label"] for r in short["decode"]["ops"]}
    assert "attention" in labels and "sparse_attention" not in labels
    assert "indexer_topk" not in labels and "mla_prolog" in labels
    glm = plan(GLM5, "h200", "w4a8", batch=1, context=3000, tp=8, ep=8, suggest=False)
    pre = glm["prefill"]
    # 3000 tokens = chunks of 1024: 3 indexer calls per full layer (78 layers, all full)
    assert _op(pre, "indexer_topk")["calls"] == 78 * 3
    assert _op(glm["decode"], "indexer_topk")["calls"] == 78
    # decode is absorbed (MQA over the latent cache): no kv_b expansion
    assert "kv_b_proj(expand)" not in {r["label"] for r in glm["decode"]["ops"]}


def test_expert_load_by_hand():
    # glm-5 decode, batch 32: 256 * (1 - (248/256)^32) = 163.5 -> 164 experts of 256 slots
    assert expert_load(256, 8, 32, 1) == (256, 164)
    # ep 8: 32 experts per rank, 32 * 0.6386 = 20.4 -> 21 of ceil(32*8/8) = 32 slots
    assert expert_load(256, 8, 32, 8) == (32, 21)
    # batch 1: exactly k experts
    assert expert_load(256, 8, 1, 1) == (8, 8)


@given(E=st.sampled_from([8, 64, 256]), k=st.integers(1, 8), tokens=st.integers(1, 4096),
       ep=st.sampled_from([1, 2, 4, 8]))
def test_expert_load_bounds(E, k, tokens, ep):
    k = min(k, E)
    slots, touched = expert_load(E, k, tokens, ep)
    assert slots == math.ceil(tokens * k / ep)
    assert 1 <= touched <= min(slots, E // ep)
    if tokens * k >= 40 * E:  # every expert is hit with near certainty
        assert touched == E // ep


# --------------------------------------------------------------------------- every chip
@pytest.mark.parametrize("chip", list(CHIPS))
def test_every_chip_answers_for_glm5(chip):
    import glm5

    ch = get_chip(chip)
    assert ch.backend in glm5.get_registry().backends  # a real glm5 backend serves it
    for f in ("memory_gb", "hbm_gbs", "bf16_tflops", "int8_tops", "link_gbs",
              "collective_latency_us"):
        assert getattr(ch, f) > 0 and ch.sources[f], f
        assert f not in ch.estimates or "estimate" in ch.sources[f]
    # an FP8 rate or, where there is none, a source saying why
    assert (ch.fp8_tflops is None or ch.fp8_tflops > 0) and ch.sources["fp8_tflops"]
    p = plan(GLM5, chip, "w4a8", batch=1, context=8192)
    assert not p["memory"]["fits"]  # 744 B parameters fit on no single chip here
    s = p["suggestion"]
    assert s is not None
    fit = plan(GLM5, chip, "w4a8", batch=1, context=8192, tp=s["tp"], ep=s["ep"])
    assert fit["memory"]["fits"] and fit["suggestion"] is None
    d = fit["decode"]
    assert 0 < d["total_ms"] < 1e4 and d["tokens_per_s"] > 0
    assert fit["prefill"]["time_s"] > d["total_ms"] / 1e3


def test_quant_peak_dtypes():
    for q, dt in (("w8a8", "int8"), ("w4a8", "int8"), ("w8a16", "bf16"), ("w6a12", "bf16")):
        p = plan(TINY, "h100-sxm", q, batch=1, context=16)
        assert _op(p["decode"], "o_proj")["dtype"] == dt
        assert _op(p["decode"], "sparse_attention")["dtype"] == "bf16"


# --------------------------------------------------------------------------- does not fit
def test_does_not_fit_reports_shortfall_and_smallest_layout():
    p = plan(GLM5, "mtt-s4000", "bf16", batch=4, context=32768)
    m = p["memory"]
    assert not m["fits"]
    assert m["shortfall_bytes"] == pytest.approx(m["needed_bytes"] - m["capacity_bytes"])
    s = p["suggestion"]
    ch, wb = get_chip("mtt-s4000"), weight_bytes(GLM5, None)
    reserve = 0.1 * ch.memory_bytes
    # no layout with fewer devices fits
    for tp, ep in _candidates(GLM5):
        lay = Layout(4, 32768, tp, ep)
        if lay.devices < s["devices"]:
            assert not memory(GLM5, ch, wb, lay, "bf16", reserve, False)["fits"]
    assert memory(GLM5, ch, wb, Layout(4, 32768, s["tp"], s["ep"]), "bf16", reserve,
                  False)["fits"]


def test_does_not_fit_text(capsys):
    assert cli_main(["plan", "--preset", "glm-5", "--chip", "ascend-910b", "--quant", "w8a8",
                     "--batch", "1", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "short by" in out and "smallest layout that fits" in out
    assert "max(flops / peak_flops" in out


# --------------------------------------------------------------------------- TP / EP scaling
def test_tp_ep_scaling():
    ch, wb = get_chip("h200"), weight_bytes(GLM5, SCHEMES["w4a8"])
    w = {}
    for tp, ep in [(1, 1), (2, 2), (4, 4), (8, 8), (1, 8), (8, 1)]:
        lay = Layout(8, 8192, tp, ep)
        w[tp, ep] = memory(GLM5, ch, wb, lay, "bf16", 0.0, False)
    per = [w[n, n]["weights_bytes_per_device"] for n in (1, 2, 4, 8)]
    assert per == sorted(per, reverse=True) and len(set(per)) == 4
    cls = wb["by_class"]
    assert w[8, 8]["weights_bytes_per_device"] == pytest.approx(
        cls["replicated"] + cls["tp"] / 8 + cls["experts"] / 8)
    # the MLA latent is not split by head: TP keeps every sequence's cache on each rank, while
    # attention data parallelism (tp 1, ep 8: 8 groups of 1 sequence) divides it
    assert w[8, 8]["kv_cache_bytes_per_device"] == w[1, 1]["kv_cache_bytes_per_device"]
    assert w[1, 8]["kv_cache_bytes_per_device"] == w[1, 1]["kv_cache_bytes_per_device"] / 8
    # expert weights split over every device either way
    assert w[8, 1]["weights_bytes_per_device"] == w[8, 8]["weights_bytes_per_device"]


def test_communication_only_with_parallelism():
    one = plan(GLM5, "h100-sxm", "w4a8", batch=16, context=4096, tp=8, ep=8, suggest=False)
    d = one["decode"]
    ch = get_chip("h100-sxm")
    # 16 tokens is below the FlashComm threshold: ring all-reduces, 2 per layer of
    # [16 tokens, 6144] bf16: 2(N-1)/N of it sent per device, each 6 us + bytes / (900/2 GB/s)
    assert d["comm_option"] == "allreduce"
    link = 2 * 7 / 8 * 16 * 6144 * 2
    # w4a8 quantizes activations per token: the row-parallel o_proj and down_proj each gather
    # every token's max |x| first (one fp32 per token from each of the 7 others)
    act = 7 * 16 * 4
    assert d["tp_comm_link_bytes"] == 2 * 78 * (link + act)
    assert d["comm"]["act_scale_link_bytes"] == 2 * 78 * act
    assert d["tp_comm_ms"] == pytest.approx(2 * 78 * (6e-6 + link / 450e9 + 6e-6 + act / 450e9)
                                            * 1e3)
    # ep == tp: the experts are split over the TP group and the MoE output rides the layer's
    # TP reduction (no all-to-all), as glm5.parallel.layouts runs it
    assert d["ep_alltoall_ms"] == 0 and ch.link_gbs_per_direction == 450
    assert d["total_ms"] == pytest.approx(d["compute_ms"] + d["tp_comm_ms"]
                                          + d["ep_alltoall_ms"])
    # a bigger batch amortises the weight reads: more tokens/s
    big = plan(GLM5, "h100-sxm", "w4a8", batch=64, context=4096, tp=8, ep=8, suggest=False)
    assert big["decode"]["tokens_per_s"] > d["tokens_per_s"]


# --------------------------------------------------------------------------- CLI
def test_cli_json_round_trip(capsys):
    argv = ["plan", "--preset", "tiny", "--chip", "mlu590", "--quant", "w6a12", "--batch", "3",
            "--context", "40", "--tp", "2", "--ep", "4", "--mtp", "--json"]
    assert cli_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    want = plan(TINY, "mlu590", "w6a12", batch=3, context=40, tp=2, ep=4, mtp=True)
    assert doc["source"] == {"preset": "tiny"}
    del doc["source"]
    assert doc == json.loads(json.dumps(want))
    assert doc["layout"]["devices"] == 4 and doc["layout"]["dp"] == 2
    assert doc["chip"]["estimates"]  # mlu590 figures are estimates, and say so


def test_cli_model_dir(tmp_path, capsys):
    TINY.save_pretrained(tmp_path)
    assert cli_main(["plan", "--model", str(tmp_path), "--chip", "h200", "--context", "64",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == {"model": str(tmp_path)}


@pytest.mark.parametrize("argv, msg", [
    (["--chip", "b200"], "--chip expected one of"),
    (["--quant", "fp4"], "--quant expected one of"),
    (["--batch", "0"], "--batch expected a positive integer"),
    (["--context", "300000"], "--context expected <= max_position_embeddings=202752"),
    (["--tp", "3"], "--tp expected a divisor of num_attention_heads=64"),
    (["--ep", "3"], "--ep expected a divisor of n_routed_experts=256"),
    (["--tp", "4", "--ep", "2", "--batch", "-1"], "--batch"),
    (["--kv-dtype", "int4"], "--kv-dtype expected one of"),
    (["--indexer-dtype", "int8"], "--indexer-dtype expected one of bf16, fp8"),
    (["--reserve-gb", "-1"], "--reserve-gb expected a non-negative"),
])
def test_cli_errors_name_the_argument(argv, msg, capsys):
    base = ["plan", "--preset", "glm-5", "--chip", "h200"]
    assert cli_main(base + argv) == 2
    assert msg in capsys.readouterr().err


def test_errors_in_api():
    with pytest.raises(PlanError, match="'ep' expected a multiple or a divisor"):
        plan(TINY.replace(num_attention_heads=6, num_key_value_heads=6), "h200", "bf16",
             batch=1, context=16, tp=3, ep=2)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("glm-6")
    with pytest.raises(PlanError, match="'phase'"):
        phase_cost(TINY, get_chip("h200"), None, Layout(1, 16, 1, 1), "train")
