"""Quantized models across processes (gloo, 2 ranks): `parallelize` and `load_parallel` on the
`tiny` preset quantized as `glm5 quantize` does it (w8a16, w8a8, w4a8, w6a12) and imported from
msModelSlim — logits within fp32 rounding of, and greedy tokens equal to, the single-process
quantized model computed in the same rank; only this rank's slice read; cuts that would split a
packed byte or a quantization group refused with the sizes; empty MoE batches in every mode
(an idle data-parallel rank still takes part in the all-to-alls)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glm5.testing.dist import DistPool, values

TOL = 2e-5  # fp32: only the order of the sums differs from the single process
# A quantized model's logits also move where fp32 rounding moves an activation across a
# rounding boundary of its per-token codes (a whole code step): rare with 8-bit codes, common
# with w6a12's 12-bit ones (the single-process w6a12 model moves ~2e-4 x max |logit| when its
# o_proj outputs get 1-ulp noise). Each check measures that sensitivity (`_jitter`) on the
# single process in the same rank and allows JITTER_MARGIN times it; the exactness of the
# parallel layers themselves is checked on equal inputs, with TOL, by
# test_row_parallel_parts_sum_to_the_whole_layer.
JITTER_MARGIN = 5.0
SCHEMES = ("w8a16", "w8a8", "w4a8", "w6a12")
LAYOUTS = {  # name: (tp, ep, dp_attention, flashcomm)
    "tp2": (2, 2, False, False),
    "tp2+flashcomm": (2, 2, False, True),
    "ep2": (1, 2, False, False),
    "ep2+dp-attention": (1, 2, True, False),
    "tp4": (4, 4, False, False),
    "ep4+dp-attention": (1, 4, True, False),
}


def _fp32_model(seed: int = 0, wide: bool = False):
    """tiny with its MTP layer (cut like the others); ``wide``: o_proj, the dense MLP's and the
    shared experts' down_proj 256 wide, so a tp2 cut keeps whole 128-wide scale groups (2 of
    them per row in the whole layer)."""
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    cfg = preset("tiny")
    if wide:
        cfg = cfg.replace(v_head_dim=64, intermediate_size=256, moe_intermediate_size=256)
    torch.manual_seed(seed)
    return GLM5ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """{"fp32", each scheme, "msmodelslim" (the raw directory), "ms-imported"} -> directory."""
    from glm5.deploy.quantize import import_msmodelslim, quantize_checkpoint
    from test_quantize import _write_msmodelslim

    d = tmp_path_factory.mktemp("dist_quant")
    _fp32_model().save_pretrained(d / "fp32")
    out = {"fp32": str(d / "fp32")}
    for s in SCHEMES:
        quantize_checkpoint(d / "fp32", d / s, s)
        out[s] = str(d / s)
    _fp32_model(wide=True).save_pretrained(d / "fp32-wide")
    for s in ("w4a8", "w6a12"):  # the grouped schemes, cut at group borders
        quantize_checkpoint(d / "fp32-wide", d / f"{s}-wide", s)
        out[f"{s}-wide"] = str(d / f"{s}-wide")
    # static W8A8 attention with a nonzero float bias on a row-parallel layer (o_proj)
    _write_msmodelslim(_fp32_model(seed=1), d / "ms", bias_layer="model.layers.1.self_attn.o_proj")
    import_msmodelslim(d / "ms", d / "ms-imported")
    out["msmodelslim"], out["ms-imported"] = str(d / "ms"), str(d / "ms-imported")
    return out


@pytest.fixture(scope="module")
def world2():
    with DistPool(2, comm_timeout_s=60) as pool:
        yield pool


def _add_biases(m) -> None:
    """Random biases (the same on every rank) on a column-parallel (q_b_proj) and two
    row-parallel quantized linears (o_proj, the dense MLP's down_proj): the row-parallel bias
    must be added once, not once per rank."""
    from glm5.core.layers import QuantLinear

    g = torch.Generator().manual_seed(7)
    layer = m.model.layers[0]
    for lin in (layer.self_attn.q_b_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert type(lin) is QuantLinear
        lin.bias = torch.randn(lin.out_features, generator=g) * 0.1


def test_four_ranks_w4a8(ckpts):
    """tp4 (one head, 16 of o_proj's 64 columns and 8 bytes of its int4 codes a rank) and
    ep4 + dp attention (2 experts a rank, one sequence a rank)."""
    with DistPool(4, comm_timeout_s=60) as pool:
        res = values(pool.run(_layouts_equal_single, ckpts["w4a8"],
                              ["tp4", "ep4+dp-attention"], False, timeout_s=240))
    for r in res:
        for name, v in r.items():
            assert _ok(v), (name, v)
            assert v["greedy_equal"], (name, v)


def _jitter(m, ids: torch.Tensor, ref: torch.Tensor) -> float:
    """max |logit change| of the single-process model ``m`` on ``ids`` when every decoder
    layer's attention and MLP outputs get relative noise of one fp32 ulp (what a different
    summation order does to them)."""
    g = torch.Generator().manual_seed(5)

    def noise(_mod, _inp, out):
        o = out[0] if isinstance(out, tuple) else out
        o = o * (1 + 2.0**-23 * torch.randn(o.shape, generator=g))
        return (o, *out[1:]) if isinstance(out, tuple) else o

    hooks = [mod.register_forward_hook(noise) for layer in m.model.layers
             for mod in (layer.self_attn, layer.mlp)]
    try:
        with torch.no_grad():
            return float((m(ids) - ref).abs().max())
    finally:
        for h in hooks:
            h.remove()


def _ok(v: dict) -> bool:
    return v["err"] <= max(TOL * max(v["scale"], 1.0), JITTER_MARGIN * v["jitter"])


def _layouts_equal_single(ctx, path: str, layouts: list[str], bias: bool) -> dict:
    """On every rank: the single-process quantized model's logits and greedy tokens on 4
    sequences of 11 tokens (5 + 4 generated), then each layout's part's (a fresh copy of the
    model cut per layout; under DP attention this rank's sequences). ``bias``: `_add_biases`."""
    from glm5.core.checkpoint import load_model
    from glm5.parallel.layouts import ParallelConfig, RowParallelQuantLinear, parallelize

    torch.set_num_threads(1)

    def fresh():
        m = load_model(path).eval()
        if bias:
            _add_biases(m)
        return m

    m = fresh()
    ids = torch.randint(0, m.config.vocab_size, (4, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, gref = m(ids), m.generate(ids[:, :5], 4)
    jitter = _jitter(m, ids, ref)
    out = {}
    for name in layouts:
        tp, ep, dp, fc = LAYOUTS[name]
        cfg = ParallelConfig.from_context(ctx, tp=tp, ep=ep, dp_attention=dp, flashcomm=fc,
                                          flashcomm_min_tokens=0)
        m = parallelize(fresh(), cfg)
        per = ids.shape[0] // ctx.world_size  # dp attention: each rank its own sequences
        rows = slice(per * ctx.rank, per * (ctx.rank + 1)) if dp else slice(None)
        with torch.no_grad():
            got, gen = m(ids[rows]), m.generate(ids[rows, :5], 4)
        out[name] = {"err": float((got - ref[rows]).abs().max()),
                     "scale": float(ref[rows].abs().max()),
                     "greedy_equal": bool((gen == gref[rows]).all()), "jitter": jitter,
                     "row_parallel_quant": sum(isinstance(x, RowParallelQuantLinear)
                                               for x in m.modules())}
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_layouts_equal_the_single_process(world2, ckpts, scheme):
    res = values(world2.run(_layouts_equal_single, ckpts[scheme], list(LAYOUTS)[:4],
                            scheme == "w8a8", timeout_s=240))
    for r in res:
        for name, v in r.items():
            assert _ok(v), (scheme, name, v)
            assert v["greedy_equal"], (scheme, name, v)
        # activation-quantizing schemes share the per-token scale across the row-parallel
        # parts (o_proj and the dense down_proj of 3 layers + MTP; shared experts under ep2)
        want = 0 if scheme == "w8a16" else 8
        assert r["tp2"]["row_parallel_quant"] == want, r["tp2"]


@pytest.mark.parametrize("scheme", ("w4a8", "w6a12"))
def test_grouped_schemes_cut_at_group_borders(world2, ckpts, scheme):
    """Row-parallel parts of 128 of K = 256: packed columns and scale columns of whole groups,
    by parallelize and by load_parallel."""
    res = values(world2.run(_layouts_equal_single, ckpts[f"{scheme}-wide"],
                            ["tp2", "ep2"], False, timeout_s=180))
    res += values(world2.run(_loaded, ckpts[f"{scheme}-wide"], ["tp2"], timeout_s=120))
    for r in res:
        for name, v in r.items():
            assert _ok(v), (scheme, name, v)
            assert v.get("greedy_equal", True), (scheme, name, v)


def _parts_sum(ctx, path: str, layout: str) -> dict[str, float]:
    """For every row-parallel quantized linear of ``layout``: max |sum over ranks of the part
    on its columns of X - the whole layer on X| / max |whole|, X random [7, K]."""
    import copy

    from glm5.core.checkpoint import load_model
    from glm5.core.layers import QuantLinear
    from glm5.parallel import comm
    from glm5.parallel.layouts import ParallelConfig, parallelize

    torch.set_num_threads(1)
    whole = load_model(path).eval()
    tp, ep, dp, fc = LAYOUTS[layout]
    m = parallelize(copy.deepcopy(whole), ParallelConfig.from_context(ctx, tp=tp, ep=ep,
                                                                      dp_attention=dp))
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, part in m.named_modules():
        w = whole.get_submodule(name)
        if not isinstance(part, QuantLinear) or part.in_features == w.in_features:
            continue
        X = torch.randn(7, w.in_features, generator=g)
        K = part.in_features
        with torch.no_grad():
            y = comm.all_reduce(part(X[:, ctx.rank * K:(ctx.rank + 1) * K]),
                                m.parallel_layout.expert_group)
            ref = w(X)
        out[name] = float((y - ref).abs().max() / ref.abs().max())
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_row_parallel_parts_sum_to_the_whole_layer(world2, ckpts, scheme):
    """On equal inputs the parts of a row-parallel quantized linear (o_proj, down_proj; the
    shared experts' under ep2) add up to the whole layer up to fp32 summation order: the
    activation scale is the whole row's, the bias is added once."""
    for path in [ckpts[scheme]] + ([ckpts[f"{scheme}-wide"]] if f"{scheme}-wide" in ckpts
                                   else []):
        for layout, n in (("tp2", 8), ("ep2", 3)):
            for r in values(world2.run(_parts_sum, path, layout, timeout_s=60)):
                assert len(r) == n and max(r.values()) <= TOL, (path, layout, r)


def _empty_moe_batches(ctx, path: str | None) -> dict:
    """ep2 + dp-attention: rank 0 runs the model on real tokens while rank 1 calls each MoE
    layer, in the same order, with 0 tokens; then every mode's MoE layers on 0 tokens."""
    from glm5.core.checkpoint import load_model
    from glm5.parallel.layouts import ParallelConfig, ParallelMoE, parallelize

    torch.set_num_threads(1)
    m = (load_model(path) if path else _fp32_model()).eval()
    D = m.config.hidden_size
    ids = torch.randint(0, m.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m(ids)
    parallelize(m, ParallelConfig.from_context(ctx, ep=2, dp_attention=True))
    moes = [layer.mlp for layer in m.model.layers if isinstance(layer.mlp, ParallelMoE)]
    calls: list[int] = []
    hooks = [moe.register_forward_hook(lambda mod, _i, _o: calls.append(id(mod)))
             for moe in moes]
    out: dict = {}
    with torch.no_grad():
        if ctx.rank == 0:
            out["err"] = float((m(ids) - ref).abs().max())
            out["scale"] = float(ref.abs().max())
        else:
            out["empty_shapes"] = [list(moe(torch.zeros(0, D)).shape) for moe in moes]
    for h in hooks:
        h.remove()
    out["calls_in_layer_order"] = calls == [id(x) for x in moes]
    shapes = {}
    for name in ("tp2", "ep2", "ep2+dp-attention"):
        tp, ep, dp, _ = LAYOUTS[name]
        mm = (load_model(path) if path else _fp32_model()).eval()
        parallelize(mm, ParallelConfig.from_context(ctx, tp=tp, ep=ep, dp_attention=dp))
        with torch.no_grad():
            shapes[name] = [list(layer.mlp(torch.zeros(0, D)).shape)
                            for layer in mm.model.layers if isinstance(layer.mlp, ParallelMoE)]
    out["all_empty"] = shapes
    return out


@pytest.mark.parametrize("scheme", ("float", "w8a8", "w4a8"))
def test_an_idle_rank_takes_part_in_the_moe_all_to_alls(world2, ckpts, scheme):
    res = values(world2.run(_empty_moe_batches, None if scheme == "float" else ckpts[scheme],
                            timeout_s=180))
    r0, r1 = res
    assert r0["err"] <= TOL * max(r0["scale"], 1.0), r0
    assert r0["calls_in_layer_order"] and r1["calls_in_layer_order"], res
    assert r1["empty_shapes"] == [[0, 64]] * 2, r1  # the 2 MoE layers of the stack
    for r in res:
        for name, shapes in r["all_empty"].items():
            assert shapes == [[0, 64]] * 2, (name, shapes)


def _others_experts_bytes(path: str, rank: int, parts: int) -> int:
    """Bytes of the routed experts (codes and scales) that rank ``rank`` of ``parts`` does not
    own, from the checkpoint's headers."""
    import re

    from glm5.core import checkpoint as ck

    files = ck._files(Path(path))
    E = 8  # tiny's routed experts
    lo, hi = rank * E // parts, (rank + 1) * E // parts
    others = {n: f for n, f in files.items()
              if (m := re.search(r"\.mlp\.experts\.(\d+)\.", n)) and
              not lo <= int(m.group(1)) < hi}
    return ck.stored_bytes(others)


def _loaded(ctx, path: str, layouts: list[str], kw: dict | None = None) -> dict:
    from glm5.core.checkpoint import load_model
    from glm5.parallel.layouts import ParallelConfig
    from glm5.parallel.loading import load_parallel

    torch.set_num_threads(1)
    kw = kw or {}
    full = load_model(path, **kw).eval()
    ids = torch.randint(0, full.config.vocab_size, (2, 7),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = full(ids)
    jitter = _jitter(full, ids, ref)
    out = {}
    for name in layouts:
        tp, ep, dp, fc = LAYOUTS[name]
        m = load_parallel(path, ParallelConfig.from_context(ctx, tp=tp, ep=ep, dp_attention=dp,
                                                            flashcomm=fc), **kw).eval()
        rows = slice(ctx.rank, ctx.rank + 1) if dp else slice(None)
        with torch.no_grad():
            got = m(ids[rows])
        out[name] = {"err": float((got - ref[rows]).abs().max()),
                     "scale": float(ref[rows].abs().max()), "jitter": jitter, **m.load_stats,
                     "others_experts_bytes": _others_experts_bytes(path, ctx.rank, 2),
                     "indexer": (m.config.dsa_indexer_dtype, m.config.dsa_indexer_hadamard),
                     "quantization": getattr(m, "quantization", {}).get("scheme")}
    return out


@pytest.mark.parametrize("which", ("w8a8", "w4a8", "w6a12", "ms-imported"))
def test_load_parallel_reads_only_this_ranks_slice_of_a_quantized_checkpoint(world2, ckpts,
                                                                            which):
    res = values(world2.run(_loaded, ckpts[which], ["tp2", "ep2+dp-attention"],
                            timeout_s=180))
    for r in res:
        for name, v in r.items():
            assert _ok(v), (which, name, v)
            if name == "tp2":
                assert v["bytes_read"] < 0.85 * v["checkpoint_bytes"], (which, name, v)
            else:  # attention is replicated: everything but the other rank's experts (4-bit
                # experts are a small part of tiny's checkpoint: 0.85 of it under w4a8)
                assert v["bytes_read"] == v["checkpoint_bytes"] - v["others_experts_bytes"], v
            assert v["quantization"] == ("mixed" if which == "ms-imported" else which), v


def test_load_parallel_indexer_options_and_msmodelslim_refusal(world2, ckpts):
    res = values(world2.run(_loaded, ckpts["w8a8"], ["tp2"],
                            {"indexer_dtype": "fp8", "indexer_hadamard": True}, timeout_s=120))
    for r in res:
        assert r["tp2"]["indexer"] == ("fp8", True), r
        assert _ok(r["tp2"]), r
    from glm5.core.checkpoint import CheckpointError
    from glm5.parallel.layouts import ParallelConfig
    from glm5.parallel.loading import load_parallel

    with pytest.raises(CheckpointError, match="glm5 load_parallel: .* is an msModelSlim "
                                              "checkpoint; convert it first"):
        load_parallel(ckpts["msmodelslim"], ParallelConfig())


def _group_split(ctx, scheme: str, v_head_dim: int) -> str:
    """o_proj with K = 4 heads x v_head_dim, quantized in ``scheme``, cut 2 ways."""
    from glm5.core.config import preset
    from glm5.core.layers import QuantLinear
    from glm5.core.model import GLM5ForCausalLM
    from glm5.parallel.layouts import ParallelConfig, ParallelError, parallelize

    cfg = preset("tiny").replace(v_head_dim=v_head_dim, num_nextn_predict_layers=0)
    m = GLM5ForCausalLM(cfg)
    for layer in m.model.layers:
        o = layer.self_attn.o_proj
        layer.self_attn.o_proj = QuantLinear(o.in_features, o.out_features, scheme)
    try:
        parallelize(m, ParallelConfig.from_context(ctx, tp=2, ep=2))
    except ParallelError as e:
        return str(e)
    return "not refused"


def test_a_cut_splitting_a_quantization_group_is_refused_with_the_sizes(world2):
    # K = 192 = one group of 128 + 64; halves of 96: [96, 192) straddles the group border
    for msg in values(world2.run(_group_split, "w4a8", 48, timeout_s=60)):
        assert "model.layers.0.self_attn.o_proj (w4a8)" in msg, msg
        assert "K=192" in msg and "2 parts of 96" in msg and "group of 128" in msg, msg
        assert "[96, 192)" in msg, msg


def test_packed_unit_and_group_rules():
    from glm5.parallel.layouts import ParallelError, _packed_cols

    # int8 per channel: any cut, packed columns = features, scales whole
    assert _packed_cols("w8a8", 96, 48, 96, 2, "l") == ((48, 96), None)
    # int4: 2 codes a byte; groups of 128 whole, or a part inside one group
    assert _packed_cols("w4a8", 512, 256, 512, 2, "l") == ((128, 256), (2, 4))
    assert _packed_cols("w4a8", 64, 32, 64, 2, "l") == ((16, 32), (0, 1))
    assert _packed_cols("w4a8", 130, 0, 130, 1, "l") == ((0, 65), (0, 2))
    # int6: 4 codes in 3 bytes; K = 300 (not a multiple of 4 nor 128) in 1 part
    assert _packed_cols("w6a12", 300, 0, 300, 1, "l") == ((0, 225), (0, 3))
    assert _packed_cols("w6a12", 256, 128, 256, 2, "l") == ((96, 192), (1, 2))
    with pytest.raises(ParallelError, match=r"l \(w6a12\): cutting K=12 input features into 2 "
                                            r"parts of 6 puts a boundary inside a packed unit "
                                            r"of 4 codes"):
        _packed_cols("w6a12", 12, 6, 12, 2, "l")
    with pytest.raises(ParallelError, match="packed unit of 2 codes"):
        _packed_cols("w4a8", 15, 0, 5, 3, "l")
    with pytest.raises(ParallelError, match=r"K=384 .* 4 parts of 96 splits a quantization "
                                            r"group of 128 \(part 1: \[96, 192\)"):
        _packed_cols("w4a8", 384, 0, 96, 4, "l")
