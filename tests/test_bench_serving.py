"""bench/serving.py and bench/train_mtp.py at toy sizes (the `tiny` preset), so that the
scripts behind README's serving and MTP numbers keep running and keep computing what they say:
throughput is generated tokens over the run's wall time, latencies come from the delivery
times, the closed loop keeps its concurrency, the MTP loss aims two tokens ahead and trains
only the MTP layer."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))  # train_mtp imports serving as a sibling
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return sys.modules[name]


serving = _load("serving")
train_mtp = _load("train_mtp")


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("glm5").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def tiny():
    from glm5.core.config import preset

    return serving.build_model(preset("tiny"), torch.float32, "cpu", 0)


# ---------------------------------------------------------------------------- statistics
def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    xs = [float(x) for x in torch.rand(37, generator=torch.Generator().manual_seed(0))]
    for q in (0, 1, 50, 90, 99, 100):
        assert serving.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(serving.percentile([], 99))
    with pytest.raises(ValueError, match="percentile: q expected"):
        serving.percentile(xs, 101)


def test_summarize_uses_wall_time_and_delivery_gaps():
    # Two requests; wall 10 s, CPU 4 s: every other span in the data differs from both.
    a = serving.Trace(0.0, [(1.0, 1), (1.5, 1), (2.5, 2)], 2.5, "length")
    b = serving.Trace(1.0, [(4.0, 1), (5.0, 1)], 5.0, "length")
    row = serving.summarize([a, b], wall_s=10.0, cpu_s=4.0)
    assert row["tokens"] == 6 and row["requests"] == 2
    assert row["throughput"] == pytest.approx(0.6)  # 6 tokens / 10 s
    assert row["tokens_per_cpu_s"] == pytest.approx(1.5)
    # a: gaps 0.5 (1 token), 1.0 over 2 tokens -> 0.5, 0.5; b: 1.0
    assert row["itl_mean_ms"] == pytest.approx(1e3 * (0.5 + 0.5 + 0.5 + 1.0) / 4)
    assert row["itl_p99_ms"] == pytest.approx(1e3 * serving.percentile([0.5, 0.5, 0.5, 1.0], 99))
    assert row["ttft_mean_ms"] == pytest.approx(1e3 * (1.0 + 3.0) / 2)
    assert row["ttft_p99_ms"] == pytest.approx(1e3 * serving.percentile([1.0, 3.0], 99))
    with pytest.raises(ValueError, match="wall_s expected > 0"):
        serving.summarize([a], 0.0, 1.0)


# ---------------------------------------------------------------------------- engine load
def test_closed_loop_keeps_concurrency_and_times_the_whole_run(tiny):
    prompts = serving.random_prompts(5, 6, 20, tiny.config.vocab_size, 0)
    eng = serving.make_engine(tiny, num_pages=serving.pages_for(2, 30, 16), page_size=16)
    t0 = time.perf_counter()
    traces, wall, cpu = serving.closed_loop(eng, prompts, 2, 5, 4)
    elapsed = time.perf_counter() - t0
    assert len(traces) == 5 and all(t.tokens == 4 and len(t.token_ids) == 4 for t in traces)
    first, last = min(t.arrival for t in traces), max(t.finished for t in traces)
    assert last - first <= wall <= elapsed
    assert 0 < cpu
    # closed loop: two in flight from the start; each later request arrives when one finished
    assert sorted(t.arrival for t in traces)[1] < min(t.finished for t in traces)
    for t in traces[2:]:
        ended = [u.finished for u in traces if u.finished <= t.arrival]
        assert ended, "a request was added before any slot was free"
        in_flight = sum(u.arrival <= t.arrival < u.finished for u in traces)
        assert in_flight <= 2
    row = serving.summarize(traces, wall, cpu)
    assert row["throughput"] == pytest.approx(20 / wall)


def test_engine_row_throughput_is_tokens_over_run_wall(tiny):
    prompts = serving.random_prompts(6, 6, 20, tiny.config.vocab_size, 1)
    t0 = time.perf_counter()
    row = serving.engine_row(tiny, prompts, 3, 6, 5, page_size=16, breakdown=True)
    elapsed = time.perf_counter() - t0
    assert row["tokens"] == 30 and row["requests"] == 6
    assert row["throughput"] == pytest.approx(row["tokens"] / row["wall_s"])
    # the run is most of the call (a tiny engine is built in milliseconds)
    assert 0.5 * elapsed <= row["wall_s"] <= elapsed
    assert row["itl_p99_ms"] >= row["itl_mean_ms"] > 0 and row["ttft_p99_ms"] > 0
    assert row["peak_mem_kind"] == "rss_hwm_growth" and row["kv_pool_mb"] > 0
    ops = row["op_seconds"]
    assert {"sparse_attention", "rms_norm"} <= set(ops) and all(v >= 0 for v in ops.values())
    assert sum(ops.values()) <= row["wall_s"]
    assert serving.TORCH_COMPUTE in ops  # the model's own projections count as kernels
    kinds = row["step_kinds"]
    assert kinds["decode"]["steps"] + kinds["prefill"]["steps"] == row["steps"]
    assert kinds["decode"]["steps"] > 0 and kinds["prefill"]["steps"] > 0
    for k in kinds.values():
        assert 0 < k["kernel_seconds"] < k["seconds"] and 0 < k["outside_kernels"] < 1
        assert k["kernel_seconds"] == pytest.approx(sum(k["op_seconds"].values()))


def test_op_timer_times_kernels_and_leaves_nothing_behind():
    from glm5 import ops
    from glm5.backends import selection

    x, w = torch.randn(4, 64), torch.randn(64)
    ops.rms_norm(x, w, 1e-5)  # the fast path holds this signature's kernel now
    timer = serving.OpTimer()
    with timer:
        for _ in range(3):
            ops.rms_norm(x, w, 1e-5)
        torch.nn.functional.linear(x, torch.randn(8, 64))
        with pytest.raises(RuntimeError, match="wrapped_kernels: already active"):
            with selection.wrapped_kernels(lambda e: e.fn):
                pass
    got = timer.seconds["all"]
    assert got["rms_norm"] > 0 and got[serving.TORCH_COMPUTE] > 0
    before = dict(got)
    ops.rms_norm(x, w, 1e-5)
    torch.nn.functional.linear(x, torch.randn(8, 64))
    assert timer.seconds["all"] == before  # unwrapped on exit (kernels and torch functions)


def test_transformers_row(tiny, tmp_path):
    pytest.importorskip("transformers")
    tiny.save_pretrained(tmp_path / "ckpt")
    hf = serving.load_hf(str(tmp_path / "ckpt"), torch.float32, "cpu")
    assert serving.logits_gap(tiny, hf, tiny.config.vocab_size) < 1e-3  # the same weights
    prompts = serving.random_prompts(3, 5, 9, tiny.config.vocab_size, 2)
    t0 = time.perf_counter()
    row = serving.hf_row(hf, prompts, 2, 3)
    elapsed = time.perf_counter() - t0
    assert row["requests"] == 3 and row["tokens"] == 9 and row["batch"] == 2
    assert row["throughput"] == pytest.approx(9 / row["wall_s"]) and row["wall_s"] <= elapsed
    assert row["itl_mean_ms"] > 0 and row["ttft_mean_ms"] > 0


def test_grpo_prefill_counts_the_scheduler_tokens(tiny):
    r = serving.grpo_prefill(tiny, prompt_len=64, group=4, max_tokens=2, seed=0, page_size=16)
    assert r["without_cache"]["prefill_tokens"] == 4 * 64  # every sample prefills the prompt
    assert r["without_cache"]["prompt_tokens_hit"] == 0
    assert r["with_cache"]["prefill_tokens"] < 2 * 64  # the prompt once (+ a token per sample)
    assert r["reduction"] == pytest.approx(1 - r["with_cache"]["prefill_tokens"] / 256)


def test_long_prefill_windows(tiny):
    r = serving.long_prefill(tiny, chunk=16, long_len=96, n_decode=2, decode_prompt=8,
                             window=3, seed=0)
    assert r["steps"]["before"] == 3 and r["steps"]["after"] == 3
    assert r["steps"]["during"] >= 96 // 16  # one chunk per step at most
    assert r["p99_ratio"] == pytest.approx(r["itl_p99_ms_during"] / r["itl_p99_ms_before"])
    assert r["p99_ratio_after"] == pytest.approx(r["itl_p99_ms_during"] / r["itl_p99_ms_after"])
    assert r["long_ttft_s"] > 0 and r["config"] == "chunk 16"
    assert r["prefill_chunks"]["max"] == 16 and r["prefill_chunks"]["count"] >= 96 // 16
    b = serving.long_prefill(tiny, chunk=32, long_len=96, n_decode=2, decode_prompt=8,
                             window=3, seed=0, slowdown=2.0, label="default")
    assert b["config"] == "default" and b["max_decode_slowdown"] == 2.0
    assert b["prefill_chunks"]["min"] >= 1 and b["prefill_chunks"]["max"] <= 32
    md = serving.markdown({"table": [], "long_prefill": [r, b], "grpo": None,
                           "targets": serving.targets([], [], None, [r, b])})
    assert "| default | " in md and "| chunk 16 | " in md
    assert r["op_seconds"]["during"] and r["op_seconds"]["before"]


def test_targets_and_markdown():
    def row(c, thr, cpu=1.0):
        return {"system": "glm5 engine", "concurrency": c, "throughput": thr,
                "tokens_per_cpu_s": cpu}

    rows = [row(1, 10.0), row(8, 50.0), row(32, 79.0)]
    hf = [{"batch": 8, "throughput": 10.0, "tokens_per_cpu_s": 1.0}]
    grpo = {"reduction": 0.9}
    long = [{"config": "unchunked", "p99_ratio": 40.0, "long_ttft_s": 10.0},
            {"config": "default", "p99_ratio": 2.5, "long_ttft_s": 16.0},
            {"config": "chunk 32", "p99_ratio": 1.2, "long_ttft_s": 30.0}]
    t = serving.targets(rows, hf, grpo, long)
    assert t["c32_over_c1"]["value"] == pytest.approx(7.9) and t["c32_over_c1"]["pass"] is False
    assert t["c8_over_transformers_b8"]["value"] == pytest.approx(5.0)
    assert t["c8_over_transformers_b8"]["pass"] is True
    assert t["grpo_prefill_reduction"]["pass"] is True
    # the long-prompt targets are the default configuration's, against the windows before
    assert t["long_prefill_p99_ratio"]["value"] == 2.5 and t["long_prefill_p99_ratio"]["pass"]
    assert t["long_ttft_ratio"]["value"] == pytest.approx(1.6)
    assert t["long_ttft_ratio"]["pass"] is False
    assert t["long_ttft_ratio"]["by_config"]["chunk 32"] == pytest.approx(3.0)
    none = serving.targets(rows[:1], [], None, [{"config": "default", "p99_ratio": 4.0,
                                                "long_ttft_s": 1.0}])
    assert none["c32_over_c1"]["pass"] is None and none["grpo_prefill_reduction"]["pass"] is None
    assert none["long_prefill_p99_ratio"]["pass"] is False
    assert none["long_prefill_p99_ratio"]["value"] == 4.0
    assert none["long_ttft_ratio"]["pass"] is None  # no unchunked run to compare with
    # the markdown report: one verdict per target, the time shares add up to 100%
    table = [{**r, "requests": 8, "itl_mean_ms": 1.0, "itl_p99_ms": 2.0, "ttft_mean_ms": 3.0,
              "ttft_p99_ms": 4.0, "peak_mem_mb": 5.0, "peak_mem_kind": "rss_hwm_growth",
              "wall_s": 2.0, "op_seconds": {"a": 1.0, "b": 0.5}} for r in rows]
    md = serving.markdown({"table": table, "targets": t, "long_prefill": [], "grpo": None})
    assert "| throughput c=32 / c=1 | 7.90 | 1.00 | >= 8 | FAIL |" in md
    assert "| long prompt TTFT, default config / unchunked | 1.60 | — | <= 1.5 | FAIL |" in md
    assert "VmHWM" in md
    assert "- c=1: a 50%, b 25%, other 25%" in md


def test_serving_main_tiny(tmp_path):
    out = tmp_path / "s.json"
    r = serving.main(["--preset", "tiny", "--concurrency", "1,2", "--requests", "2",
                      "--prompt-len", "6,12", "--max-tokens", "3", "--skip", "hf,long",
                      "--grpo-prompt", "32", "--grpo-group", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [x["concurrency"] for x in saved["table"]] == [1, 2]
    assert saved["table"][1]["requests"] == 8  # at least 8 (and 2x the concurrency)
    assert saved["targets"]["c8_over_transformers_b8"]["pass"] is None
    assert saved["grpo"]["group"] == 2 and r["model"] == "tiny"
    assert serving.main(["--report", str(out)]) == saved
    with pytest.raises(SystemExit, match="--report expected a result JSON"):
        serving.main(["--report", str(tmp_path / "missing.json")])


def test_bad_arguments():
    with pytest.raises(SystemExit, match="--concurrency expected"):
        serving.parse_args(["--concurrency", "0,8"])
    with pytest.raises(SystemExit, match="--skip expected"):
        serving.parse_args(["--skip", "foo"])
    with pytest.raises(SystemExit, match="--glm5-shaped expected --device cuda"):
        serving.parse_args(["--glm5-shaped"])


def test_glm5_shaped_builds_on_meta():
    from glm5.deploy.info import count_params

    cfg = serving.glm5_shaped_config()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 6144, 64)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (512, 64)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 2048)
    assert (cfg.n_routed_experts, cfg.moe_intermediate_size) == (64, 2048)
    assert cfg.mlp_layer_types == ["dense", "sparse"]
    info = serving.main(["--glm5-shaped", "--device", "meta"])
    c = count_params(cfg)
    # parameters = the analytic count, less the router bias buffers (main model and MTP)
    assert info["parameters"] == (c["total_params"] - c["buffer_params"] + c["mtp_params"]
                                  - cfg.n_routed_experts * cfg.num_nextn_predict_layers)


# ---------------------------------------------------------------------------- MTP
def test_mtp_loss_targets_two_tokens_ahead(tiny, monkeypatch):
    """An oracle MTP head that answers next_id + 1 is right on every target of ids = 0, 1, 2, ...
    exactly when the targets are the tokens two ahead of the hidden state's position."""
    V = tiny.config.vocab_size
    ids = torch.arange(20)[None].repeat(2, 1)
    h = torch.zeros(2, 20, tiny.config.hidden_size)

    def oracle(hidden, next_ids, cache=None, depth=0):
        assert hidden.shape[1] == next_ids.shape[1]
        return torch.nn.functional.one_hot(next_ids + 1, V).float() * 10

    monkeypatch.setattr(tiny, "mtp_logits", oracle)
    loss, acc = train_mtp.mtp_loss(tiny, h, ids, 5)
    assert float(acc) == 1.0
    with pytest.raises(ValueError, match="first_target expected"):
        train_mtp.mtp_loss(tiny, h, ids, 1)


def test_train_mtp_changes_only_the_mtp_layer():
    from glm5.core.config import preset

    m = serving.build_model(preset("tiny"), torch.float32, "cpu", 3)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    ids = train_mtp.greedy_continuations(m, serving.random_prompts(4, 6, 6, 128, 0), 10)
    assert ids.shape == (4, 16)
    r = train_mtp.train_mtp(m, ids, 6, steps=3, batch=2, lr=1e-2, max_seconds=60, seed=0)
    assert r["steps"] == 3 and [c["step"] for c in r["curve"]] == [0, 2]
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("mtp.") for n in changed)
    assert any(".eh_proj." in n for n in changed)


def test_train_mtp_main_tiny(tmp_path):
    out = tmp_path / "m.json"
    r = train_mtp.main(["--preset", "tiny", "--seqs", "4", "--prompt-len", "6", "--gen-len",
                        "8", "--steps", "3", "--batch", "2", "--eval-prompts", "2",
                        "--eval-tokens", "5", "--eval-concurrency", "1", "--rounds", "1",
                        "--out", str(tmp_path / "ckpt"), "--json", str(out)])
    saved = json.loads(out.read_text())
    assert (tmp_path / "ckpt" / "config.json").exists()
    assert set(saved["eval"]) == {"held_out", "training_prompts"}
    by_k = saved["eval"]["held_out"][0]["by_k"]
    assert set(by_k) == {"0", "1"} and by_k["1"]["identical_to_k0"] is True
    assert 0 <= by_k["1"]["acceptance"] <= 1 and by_k["0"]["acceptance"] is None
    assert by_k["1"]["speedup"] == pytest.approx(by_k["1"]["throughput"]
                                                 / by_k["0"]["throughput"])
    assert saved["train"]["steps"] == 3 and r["checkpoint"] == str(tmp_path / "ckpt")
    assert saved["eval"]["held_out"][0]["requests"] == 2  # max(4, 2c) capped by the set
    assert 0 <= saved["eval"]["training_prompts"][0]["offline_draft_accuracy"] <= 1
