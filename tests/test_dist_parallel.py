"""The model across processes (gloo, 2 and 4 ranks): tensor parallel, expert parallel with
replicated tokens, data-parallel attention + expert parallel (all-to-all), FlashComm and its
int8 gathers, sharded checkpoint loading — logits and greedy tokens against the single-process
model computed in the same rank."""

from __future__ import annotations

import pytest
import torch

from glm5.testing.dist import DistPool, values

TOL = 2e-5  # fp32: only the order of the sums differs from the single process (~1e-7 seen)


def _model(preset_name: str, seed: int = 0):
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    cfg = preset(preset_name).replace(num_nextn_predict_layers=0)
    torch.manual_seed(seed)
    return GLM5ForCausalLM(cfg).eval()


def _check(ctx, preset_name: str, tp: int, ep: int, dp_attention: bool, flashcomm: bool,
           comm_quant: str | None, batch: int, seq: int, new: int) -> dict:
    """On every rank: the whole model's logits / greedy tokens, then this rank's part's."""
    from glm5.parallel.layouts import ParallelConfig, parallelize

    torch.set_num_threads(1)
    m = _model(preset_name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.config.vocab_size, (batch, seq), generator=g)
    with torch.no_grad():
        ref = m(ids)
        gref = m.generate(ids[:, : seq // 2], new) if new else None
        fq = _fake_int8_gathers(m, ids) if comm_quant == "int8" else None
    cfg = ParallelConfig.from_context(ctx, tp=tp, ep=ep, dp_attention=dp_attention,
                                      flashcomm=flashcomm, flashcomm_min_tokens=0,
                                      comm_quant=comm_quant)
    parallelize(m, cfg)
    rows = slice(None)
    if dp_attention:  # each rank runs its own sequences
        per = batch // ctx.world_size
        rows = slice(ctx.rank * per, (ctx.rank + 1) * per)
    with torch.no_grad():
        out = m(ids[rows])
        gen = m.generate(ids[rows, : seq // 2], new) if new else None
    return {"err": float((out - ref[rows]).abs().max()),
            "scale": float(ref[rows].abs().max()),
            "greedy_equal": gen is None or bool((gen == gref[rows]).all()),
            "err_vs_fake_quant": None if fq is None else float((out - fq[rows]).abs().max()),
            "params": sum(p.numel() for p in m.parameters())}


def _fake_int8_gathers(m, ids):
    """The single-process model with what FlashComm's int8 all-gather does to the inputs of
    attention and of the MLP: per-token int8 codes and scales, dequantized."""
    import glm5.ops

    def qdq(_mod, _inp, out):
        q, s = glm5.ops.quantize_per_token(out.reshape(-1, out.shape[-1]), 8)
        return (q.to(torch.float32) * s.reshape(-1, 1)).to(out.dtype).reshape(out.shape)

    hooks = [mod.register_forward_hook(qdq) for layer in m.model.layers
             for mod in (layer.input_layernorm, layer.post_attention_layernorm)]
    try:
        return m(ids)
    finally:
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module")
def world2():
    with DistPool(2, comm_timeout_s=60) as pool:
        yield pool


@pytest.fixture(scope="module")
def world4():
    with DistPool(4, comm_timeout_s=60) as pool:
        yield pool


def _run(pool, *args, timeout_s=180):
    return values(pool.run(_check, *args, timeout_s=timeout_s))


CASES = {  # name: (tp, ep, dp_attention, flashcomm)
    "tp": (None, 1, False, False),
    "tp+flashcomm": (None, 1, False, True),
    "ep": (1, None, False, False),
    "dp-attention+ep": (1, None, True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_the_single_process(world2, case):
    tp, ep, dp, fc = CASES[case]
    n = 2
    res = _run(world2, "tiny", tp or n, ep or n, dp, fc, None, 4, 11, 5)
    for r in res:
        assert r["err"] <= TOL * max(r["scale"], 1.0), (case, r)
        assert r["greedy_equal"], (case, r)


@pytest.mark.parametrize("case", list(CASES))
def test_four_ranks_equal_the_single_process(world4, case):
    tp, ep, dp, fc = CASES[case]
    n = 4
    # 3 sequences of 5 tokens: 15 tokens, not a multiple of 4 (FlashComm pads)
    batch, seq = (4, 10) if dp else (3, 10)
    res = _run(world4, "tiny", tp or n, ep or n, dp, fc, None, batch, seq, 4)
    for r in res:
        assert r["err"] <= TOL * max(r["scale"], 1.0), (case, r)
        assert r["greedy_equal"], (case, r)
    if case == "tp":  # every rank holds less than the whole model
        whole = sum(p.numel() for p in _model("tiny").parameters())
        assert all(r["params"] < whole for r in res)


def test_small_preset_tp2_and_dp_attention_ep2(world2):
    for args in ((2, 2, False, True), (1, 2, True, False)):
        for r in _run(world2, "small", *args, None, 2, 8, 3, timeout_s=300):
            assert r["err"] <= TOL * max(r["scale"], 1.0), (args, r)
            assert r["greedy_equal"], (args, r)


def test_small_preset_ep4_with_and_without_dp_attention(world4):
    for dp in (False, True):
        for r in _run(world4, "small", 1, 4, dp, False, None, 4, 8, 3, timeout_s=300):
            assert r["err"] <= TOL * max(r["scale"], 1.0), (dp, r)
            assert r["greedy_equal"], (dp, r)


# max |logit error| / max |logit| of int8 FlashComm gathers against the fp32 model for THESE
# shapes (tiny, 4 x 11 tokens, 2 ranks: 0.087 measured). Not a general bound: in a random-init
# model the error comes from expert-routing and DSA top-k choices the rounding flips (small at
# 512 tokens: 0.45; docs/distributed.md); the exactness check below is the general one.
INT8_BUDGET = 0.15


def test_flashcomm_int8_gathers_are_per_token_int8_and_within_budget(world2):
    res = _run(world2, "tiny", 2, 2, False, True, "int8", 4, 11, 0)
    for r in res:
        rel = r["err"] / r["scale"]
        assert 1e-4 < rel <= INT8_BUDGET, r  # quantized (not exact), within the budget
        # exactly the per-token int8 quantization of the gathered inputs, nothing else: up to
        # a code flipped where the shard's sum order moves a value across a rounding boundary
        assert r["err_vs_fake_quant"] <= 0.05 * r["err"], r


def _loaded(ctx, path: str, tp: int, ep: int, dp_attention: bool) -> dict:
    from glm5.core.checkpoint import load_model
    from glm5.parallel.loading import load_parallel
    from glm5.parallel.layouts import ParallelConfig

    torch.set_num_threads(1)
    cfg = ParallelConfig.from_context(ctx, tp=tp, ep=ep, dp_attention=dp_attention)
    m = load_parallel(path, cfg)
    full = load_model(path)
    ids = torch.randint(0, full.config.vocab_size, (ctx.world_size, 7),
                        generator=torch.Generator().manual_seed(3))
    rows = slice(ctx.rank, ctx.rank + 1) if dp_attention else slice(None)
    with torch.no_grad():
        err = float((m(ids[rows]) - full(ids)[rows]).abs().max())
    return {"err": err, **m.load_stats}


def test_sharded_loading_reads_only_this_ranks_slice(world2, tmp_path):
    _model("tiny").save_pretrained(tmp_path / "ckpt")
    for args in ((2, 2, False), (1, 2, True)):
        res = values(world2.run(_loaded, str(tmp_path / "ckpt"), *args, timeout_s=120))
        for r in res:
            assert r["err"] <= 1e-5, (args, r)
            assert r["bytes_read"] < 0.85 * r["checkpoint_bytes"], (args, r)


def test_bad_layouts_are_refused():
    from glm5.parallel.layouts import ParallelConfig, ParallelError

    with pytest.raises(ParallelError, match="flashcomm expected tp > 1"):
        ParallelConfig(flashcomm=True)
    with pytest.raises(ParallelError, match="dp_attention needs an ep_group"):
        ParallelConfig(dp_attention=True)
    with pytest.raises(ParallelError, match="comm_quant"):
        ParallelConfig(comm_quant="fp4")


def _engine_tp(ctx, tp: int, flashcomm: bool) -> list[list[int]]:
    """Every rank runs the same engine with the same requests (SPMD): the TP model's steps run
    in lockstep and every rank samples the same tokens."""
    from glm5.parallel.layouts import ParallelConfig, parallelize
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams

    torch.set_num_threads(1)

    def run(model) -> list[list[int]]:
        eng = LLMEngine(model, EngineConfig(max_num_seqs=4, page_size=16, num_pages=64, seed=0))
        prompts = [[5, 9, 2, 7], [3, 3, 8], [1, 4, 1, 5, 9, 2, 6]]
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.8, seed=i))
        done = {o.request_id: o.token_ids for o in eng.run_to_completion() if o.finished}
        return [done[f"r{i}"] for i in range(len(prompts))]

    ref = run(_model("tiny"))
    m = parallelize(_model("tiny"), ParallelConfig.from_context(
        ctx, tp=tp, ep=tp, flashcomm=flashcomm, flashcomm_min_tokens=8))
    return [ref, run(m)]


@pytest.mark.parametrize("flashcomm", [False, True])
def test_the_serving_engine_runs_a_tensor_parallel_model_in_lockstep(world2, flashcomm):
    for ref, got in values(world2.run(_engine_tp, 2, flashcomm, timeout_s=120)):
        assert got == ref


def test_flashcomm_threshold_comes_from_the_planner():
    from glm5.deploy.chips import get_chip
    from glm5.deploy.plan import flashcomm_threshold
    from glm5.parallel.layouts import flashcomm_min_tokens_for

    t = flashcomm_min_tokens_for("h200", 6144, 8)
    assert t == flashcomm_threshold(get_chip("h200"), 6144, 8) and 1 < t < 10_000
    assert flashcomm_min_tokens_for("h200", 6144, 8, int8=True) <= t
    assert flashcomm_min_tokens_for("h200", 6144, 1) == 2**62  # tp 1: never
