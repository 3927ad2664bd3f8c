"""`indexer_topk_fp8`: the e4m3 row quantization (golden cases worked by hand), the op's
reference (the fp8 indexer, not indexer_topk up to rounding), the Triton kernel on fp8 codes
against the float64 oracle (interpreted on CPU when there is no GPU: split and persistent
launches, both merges), and the decomposition every other backend runs."""

from __future__ import annotations

import os

import pytest
import torch

import glm5
from glm5.ir.fp8 import AMAX_FLOOR, dequantize_rows_e4m3, e4m3_rows, quantize_rows_e4m3
from glm5.ir.ops_dsa import indexer_topk_fp8_ref, indexer_topk_ref
from glm5.testing.compare import assert_matches
from glm5.testing.cases import example

from engine_util import run_all

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
I32 = torch.int32


# --------------------------------------------------------------------------- quantization
def test_quantize_rows_golden():
    """Worked by hand: s = 2^ceil(log2(max(amax, 1e-4) / 448)), codes e4m3(x / s) to nearest
    even."""
    x = torch.tensor([
        [448.0, 1.0, -0.3, 0.0],      # amax / 448 = 1 exactly: s = 1; -0.3 -> -0.3125
        [900.0, 0.0, 0.0, 0.0],       # 2.009 -> s = 4; 225 -> 224 (step 16 in [128, 256))
        [0.0, 0.0, 0.0, 0.0],         # the floor: 1e-4 / 448 -> s = 2^-22
        [1e-6, 0.0, 0.0, 0.0],        # below the floor: 1e-6 * 2^22 = 4.19 -> 4.0
        [3.0, -2.5, 0.0, 0.0],        # 3 / 448 -> s = 2^-7; 384, -320
    ])
    codes, scale = quantize_rows_e4m3(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.tolist() == [1.0, 4.0, 2.0 ** -22, 2.0 ** -22, 2.0 ** -7]
    assert codes.float().tolist() == [[448.0, 1.0, -0.3125, 0.0], [224.0, 0.0, 0.0, 0.0],
                                      [0.0] * 4, [4.0, 0.0, 0.0, 0.0],
                                      [384.0, -320.0, 0.0, 0.0]]
    assert dequantize_rows_e4m3(codes, scale)[3, 0].item() == 4.0 * 2.0 ** -22
    assert AMAX_FLOOR == 1e-4


def test_quantize_rows_is_exact_and_dtype_independent():
    """bf16, fp32 and float64 copies of the same values quantize to the same codes and scales
    (the oracle and the kernels agree bit for bit); every code's magnitude is at most 448 and
    the largest reaches [224, 448] (the scale is the smallest power of two that fits);
    dequantized values are exact in fp32."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3, 128, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
         ).bfloat16()
    c16, s16 = quantize_rows_e4m3(x)
    for dt in (torch.float32, torch.float64):
        c, s = quantize_rows_e4m3(x.to(dt))
        assert torch.equal(c.view(torch.uint8), c16.view(torch.uint8)) and torch.equal(s, s16)
    top = c16.float().abs().amax(-1)
    assert (top <= 448).all() and (top >= 224).all()
    assert torch.equal(e4m3_rows(x, torch.float64), e4m3_rows(x).double())
    rel = (e4m3_rows(x) - x.float()).abs() / x.float().abs().amax(-1, keepdim=True)
    assert rel.max() <= 2.0 ** -4  # half a step of e4m3's 3-bit mantissa, at the row's top


# --------------------------------------------------------------------------- the op
def _ranges(T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(T, dtype=I32), torch.full((T,), S, dtype=I32)


def test_op_is_the_fp8_indexer_not_indexer_topk():
    """Keys whose scores differ by less than e4m3's resolution tie after quantization (then
    the smaller index first), so the fp8 op and indexer_topk order them differently."""
    q = torch.ones(1, 1, 1)
    k = torch.tensor([[1.0], [1.03]])  # 1.03 * 2^8 = 263.7 -> 256: both keys dequantize to 1
    w = torch.ones(1, 1)
    ks, ke = _ranges(1, 2)
    assert indexer_topk_ref(q, k, w, ks, ke, 2).tolist() == [[1, 0]]
    assert indexer_topk_fp8_ref(q, k, w, ks, ke, 2).tolist() == [[0, 1]]
    assert glm5.ops.indexer_topk_fp8(q, k, w, ks, ke, 2).tolist() == [[0, 1]]


def _case(T, S, Hi, Di, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, Hi, Di, generator=g) * torch.rand(T, Hi, 1, generator=g) * 4).to(dtype)
    k = (torch.randn(S, Di, generator=g) * torch.rand(S, 1, generator=g) * 4).to(dtype)
    w = torch.randn(T, Hi, generator=g).to(dtype)
    ks = torch.randint(0, max(S // 3, 1), (T,), generator=g).to(I32)
    ke = torch.maximum(ks, torch.randint(0, S + 1, (T,), generator=g).to(I32))
    return {"q": q, "k": k, "w": w, "k_start": ks, "k_end": ke}


@pytest.mark.parametrize("op", ["indexer_topk_fp8", "paged_indexer_topk_fp8"])
def test_cpu_backend_serves_the_fp8_ops(op, monkeypatch):
    """The cpu backend serves both fp8 ops with its own kernels (q and k quantized by the TVM
    port of the op's quantizer, `glm5.kernels.tvm.fp8_rows`; the paged op's pool rows
    dequantized batch by batch), then the TVM selection; under GLM5_STRICT=1 (a reference
    fallback raises) both within the op's bound on the kit's cases (ties, duplicated keys,
    fresh pages with scale 0 included)."""
    mode = "native"
    pytest.importorskip("tvm")
    from glm5.backends import selection
    from glm5.ir.catalog import OPS

    monkeypatch.setenv("GLM5_STRICT", "1")
    with glm5.use_backend("cpu"):
        plan = selection.resolve(OPS[op], "cpu", torch.bfloat16)
        assert plan.mode == mode and (mode != "native" or plan.served_by == "cpu"), plan
        for dtype in (torch.float32, torch.bfloat16, torch.float16):  # fp16: widened, exact
            for i in range(6):
                vals = example(op, dtype, 3, i, "smoke")
                got = getattr(glm5.ops, op)(**vals)
                assert_matches(op, got, vals, what=f"cpu {dtype} case {i}")


# --------------------------------------------------------------------------- Triton kernel
def _triton(overrides: dict | None = None):
    from glm5.kernels.triton import indexer

    def tuning(op):
        return {**indexer.DEFAULTS.get(op, {}), **(overrides or {})}

    return {op: (fn, ok) for op, fn, _, ok in indexer.kernels(tuning)}


@pytest.mark.skipif(not INTERP, reason="interpreted on CPU tensors (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("over", [
    {},  # one launch, rank merges (interpreted default)
    {"BLOCK_S": 16, "BLOCK_T": 16, "BLOCK_D": 16, "MERGE": "sort"},  # many tiles, bitonic
    {"BLOCK_S": 16, "TARGET_PROGRAMS_INTERPRETED": 64, "SPLIT_MIN_KEYS": 16},  # split top-k
    {"BLOCK_S": 16, "grid": "persistent", "programs": 3},  # a persistent grid
])
def test_triton_kernel_matches_the_oracle(over):
    fn, _ = _triton(over)["indexer_topk_fp8"]
    for i, (T, S, Hi, Di, topk, dtype) in enumerate((
            (5, 70, 2, 16, 6, torch.bfloat16), (9, 130, 3, 40, 17, torch.float32),
            (2, 200, 4, 32, 64, torch.bfloat16), (17, 33, 1, 8, 40, torch.float16))):
        vals = {**_case(T, S, Hi, Di, dtype, seed=i), "topk": topk}
        got = fn(vals["q"], vals["k"], vals["w"], vals["k_start"], vals["k_end"], topk)
        assert got.dtype == I32 and got.shape == (T, topk)
        assert_matches("indexer_topk_fp8", got, vals, what=f"{over} case {i}")


@pytest.mark.skipif(not INTERP, reason="interpreted on CPU tensors (TRITON_INTERPRET=1)")
def test_triton_kernel_needs_the_key_scales():
    """The check is not blind to the per-key scales: the kernel run on the same codes and
    folded weights without them (every key scale taken as 1) selects wrongly."""
    from glm5.kernels.triton import indexer

    p = indexer.DEFAULTS["indexer_topk_fp8"]
    vals = {**_case(6, 90, 2, 16, torch.bfloat16, seed=7), "topk": 12}
    q8, sq = quantize_rows_e4m3(vals["q"])
    k8, sk = quantize_rows_e4m3(vals["k"])
    assert sk.unique().numel() > 1
    args = (q8, k8, vals["w"].float() * sq)
    right = indexer._topk(p, "indexer_topk_fp8", *args, sk, vals["k_start"], vals["k_end"],
                          12, None)
    assert_matches("indexer_topk_fp8", right, vals, what="with the key scales")
    wrong = indexer._topk(p, "indexer_topk_fp8", *args, None, vals["k_start"], vals["k_end"],
                          12, None)
    with pytest.raises(AssertionError):
        assert_matches("indexer_topk_fp8", wrong, vals, what="without the key scales")


def test_fp8_dots_where_tl_dot_takes_e4m3(monkeypatch):
    """Served where Triton's dot takes e4m3 operands: interpreted, or an NVIDIA GPU from sm_89;
    refused on a CPU tensor outside the interpreter and on other accelerators (the op then
    decomposes)."""
    from glm5.kernels.triton import indexer

    monkeypatch.setattr(indexer, "interpreted", lambda: True)
    assert indexer.fp8_dots(torch.device("cpu"))
    monkeypatch.setattr(indexer, "interpreted", lambda: False)
    assert not indexer.fp8_dots(torch.device("cpu"))
    assert not indexer.fp8_dots(torch.device("meta"))
    for cap, ok in (((9, 0), True), ((8, 9), True), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=cap: c)
        assert indexer.fp8_dots(torch.device("cuda", 0)) == ok, cap


# --------------------------------------------------------------------------- the model option
def test_model_selects_with_the_fp8_indexer(monkeypatch):
    """`dsa_indexer_dtype="fp8"`: every sparse layer's selection is `indexer_topk_fp8` on the
    indexer's q, keys and weights (each call's result is the op's, judged by the oracle), the
    forward and generate run under GLM5_STRICT=1 on the cpu backend, and the config round trips
    through its transformers-format dict."""
    pytest.importorskip("tvm")
    from glm5.core.config import GLM5Config, preset
    from glm5.core.model import GLM5ForCausalLM

    monkeypatch.setenv("GLM5_STRICT", "1")
    cfg = preset("tiny").replace(dsa_indexer_dtype="fp8")
    assert GLM5Config.from_hf_dict(cfg.to_hf_dict()).dsa_indexer_dtype == "fp8"
    torch.manual_seed(0)
    m = GLM5ForCausalLM(cfg).eval()
    calls, inside = [], []
    real, real_bf16 = glm5.ops.indexer_topk_fp8, glm5.ops.indexer_topk

    def spy(q, k, w, k_start, k_end, topk):
        inside.append(1)
        out = real(q, k, w, k_start, k_end, topk)
        inside.pop()
        calls.append(({"q": q, "k": k, "w": w, "k_start": k_start, "k_end": k_end,
                       "topk": topk}, out))
        return out

    def bf16(*args):  # only as the fp8 op's decomposition (the cpu backend's form)
        assert inside, "the model called the bf16 indexer_topk"
        return real_bf16(*args)

    monkeypatch.setattr(glm5.ops, "indexer_topk_fp8", spy)
    monkeypatch.setattr(glm5.ops, "indexer_topk", bf16)
    ids = torch.randint(0, 128, (1, 20))  # 20 tokens > index_topk (8): sparse layers select
    with torch.no_grad(), glm5.use_backend("cpu"):
        logits = m(ids)
        assert bool(torch.isfinite(logits).all())
        assert m.generate(ids, 2).shape == (1, 22)
    assert calls
    for vals, out in calls:
        assert_matches("indexer_topk_fp8", out, vals, what="model call")


def test_fp8_indexer_option_is_refused_where_not_built():
    """Block selection has no fp8 indexer: it refuses the option by name; an unknown value is
    refused. (The planner costs it: tests/test_plan.py.)"""
    from glm5.core.config import ConfigError, preset

    with pytest.raises(ConfigError, match="dsa_indexer_dtype expected 'bf16' or 'fp8'"):
        preset("tiny").replace(dsa_indexer_dtype="int8")
    with pytest.raises(ConfigError, match="dsa_indexer_dtype 'fp8' expected dsa_selection"):
        preset("tiny").replace(dsa_indexer_dtype="fp8", dsa_selection="block")


# --------------------------------------------------------------------------- paged fp8 cache
PAGED = ("q", "k", "k_scale", "w", "block_table", "seq", "k_len", "page_size", "topk")


def _paged_args(v: dict) -> tuple:
    return tuple(v[n] for n in PAGED)


def test_paged_fp8_reference_is_the_paged_indexer_on_the_dequantized_pool():
    """The op's reference is paged_indexer_topk on e4m3(q) and k * k_scale (exact), on the
    kit's paged cases."""
    from glm5.ir.ops_dsa import paged_indexer_topk_fp8_ref, paged_indexer_topk_ref

    for i in range(4):
        v = example("paged_indexer_topk_fp8", torch.float32, 5, i, "smoke")
        deq = dequantize_rows_e4m3(v["k"], v["k_scale"])
        want = paged_indexer_topk_ref(e4m3_rows(v["q"]), deq, v["w"], v["block_table"],
                                      v["seq"], v["k_len"], v["page_size"], v["topk"])
        assert torch.equal(paged_indexer_topk_fp8_ref(*_paged_args(v)), want)


def test_paged_fp8_value_checks():
    """Key scales must be finite and >= 0 (a negative scale does not commute with the ReLU);
    the paged checks name this op."""
    v = example("paged_indexer_topk_fp8", torch.float32, 0, 1, "smoke")
    op = glm5.get_op("paged_indexer_topk_fp8")
    op.validate((), v)
    for bad in (-1.0, float("nan"), float("inf")):
        sc = v["k_scale"].clone()
        sc[3] = bad
        with pytest.raises(ValueError, match=r"paged_indexer_topk_fp8: argument 'k_scale' "
                                             r"expected finite entries >= 0, got k_scale\[3\]"):
            op.validate((), {**v, "k_scale": sc})
    with pytest.raises(ValueError, match="paged_indexer_topk_fp8: argument 'seq'"):
        op.validate((), {**v, "seq": v["seq"] + 100})
    with pytest.raises(TypeError, match="k"):
        op.validate((), {**v, "k": v["k"].float()})


def _paged_fp8_case(seed: int = 0) -> dict:
    """The integer paged case of test_triton_dsa_moe (several sequences per block, a shared
    prefix, an empty sequence, pages crossing chunks) with the pool quantized per row: codes of
    {-1, 0, 1} keys are exact, so every score is an exact integer (many ties) and any correct
    kernel returns exactly the reference. Row scales differ (some rows x 4) so a kernel that
    ignores them, or reads them at the logical position, selects otherwise."""
    from test_triton_dsa_moe import _paged_case

    v = _paged_case(torch.float32, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k = v["k"] * torch.where(torch.rand(v["k"].shape[0], 1, generator=g) < 0.3, 4.0, 1.0)
    codes, scale = quantize_rows_e4m3(k)
    assert scale.unique().numel() > 1
    return {**v, "k": codes, "k_scale": scale, "topk": 6}


@pytest.mark.skipif(not INTERP, reason="interpreted on CPU tensors (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("over,kit", [
    ({"BLOCK_S": 16, "BLOCK_T": 16, "BLOCK_D": 16, "MERGE": "rank"}, True),
    ({"BLOCK_S": 16, "BLOCK_T": 16, "BLOCK_D": 16, "MERGE": "sort"}, True),
    ({"BLOCK_S": 16, "TARGET_PROGRAMS_INTERPRETED": 64, "SPLIT_MIN_KEYS": 16}, False),  # split
    ({"BLOCK_S": 16, "grid": "persistent", "programs": 3}, False),
])
def test_triton_paged_fp8_kernel(over, kit):
    """Exactly the reference on the integer case (ties to the smaller logical position, the
    empty sequence all -1), and (``kit``: the split and persistent launches' many programs
    take minutes interpreted there) within the op's bound on the kit's cases."""
    fn, ok = _triton(over)["paged_indexer_topk_fp8"]
    v = _paged_fp8_case()
    assert ok(*_paged_args(v))
    ref = glm5.get_op("paged_indexer_topk_fp8").reference(*_paged_args(v))
    got = fn(*_paged_args(v))
    assert torch.equal(got, ref), got
    for i, dtype in enumerate((torch.float32, torch.bfloat16) if kit else ()):
        vals = example("paged_indexer_topk_fp8", dtype, 11, i, "smoke")
        got = fn(*_paged_args(vals))
        assert_matches("paged_indexer_topk_fp8", got, vals, what=f"{over} case {i}")


@pytest.mark.skipif(not INTERP, reason="interpreted on CPU tensors (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("bug", ["no key scales", "scales at the logical position"])
def test_triton_paged_fp8_kernel_planted_bugs(bug):
    """The exact check above is not blind to the key scales: the kernel's launcher run without
    them, or with the scales laid out by logical position instead of pool row, differs from
    the reference."""
    from glm5.kernels.triton import indexer

    p = {**indexer.DEFAULTS["paged_indexer_topk_fp8"], "BLOCK_S": 16, "BLOCK_T": 16,
         "BLOCK_D": 16}
    v = _paged_fp8_case()
    q8, sq = quantize_rows_e4m3(v["q"])
    sk = None
    if bug == "scales at the logical position":  # row r's scale taken from sequence 0's r-th
        rows = torch.tensor([int(v["block_table"][0, j // 4]) * 4 + j % 4
                             for j in range(v["k_scale"].numel()) if j // 4 < 6])
        sk = v["k_scale"].clone()
        sk[: rows.numel()] = v["k_scale"][rows]
    got = indexer._paged_topk(p, "paged_indexer_topk_fp8", q8, v["k"], v["w"] * sq, sk,
                              v["block_table"], v["seq"], v["k_len"], 4, 6, None)
    ref = glm5.get_op("paged_indexer_topk_fp8").reference(*_paged_args(v))
    assert not torch.equal(got, ref)
    right = indexer._paged_topk(p, "paged_indexer_topk_fp8", q8, v["k"], v["w"] * sq,
                                v["k_scale"], v["block_table"], v["seq"], v["k_len"], 4, 6,
                                None)
    assert torch.equal(right, ref)


def test_fp8_pool_layout_and_bytes():
    """With dsa_indexer_dtype='fp8' the engine's pool holds each indexer layer's keys as e4m3
    codes + an fp32 scale per row (MTP layers too), page_bytes counts Di + 4 bytes a key row
    (2 Di in bf16), and copy_page copies codes and scales."""
    from glm5.core.config import preset
    from glm5.core.index_cache import FP8Keys
    from glm5.core.model import GLM5ForCausalLM
    from glm5.engine.kv_pool import KVPool

    torch.manual_seed(0)
    cfg = preset("tiny")
    m16 = GLM5ForCausalLM(cfg).bfloat16().eval()
    m8 = GLM5ForCausalLM(cfg.replace(dsa_indexer_dtype="fp8")).bfloat16().eval()
    pool = KVPool(m8, 4, 2, mtp=True)
    keys = [c for c in pool.index_keys + pool.mtp_index_keys if c is not None]
    assert keys and pool.mtp_index_keys and all(isinstance(c, FP8Keys) for c in keys)
    c = keys[0]
    assert c.codes.dtype == torch.float8_e4m3fn and c.scale.dtype == torch.float32
    assert c.codes.shape == (pool.latent[0].shape[0], cfg.index_head_dim)
    Di, n_keys = cfg.index_head_dim, len(keys)
    layers = len(pool.latent) + len(pool.mtp_latent)
    lat = layers * cfg.kv_cache_dim * 2
    assert KVPool.page_bytes(m8, 2, mtp=True) == (lat + n_keys * (Di + 4)) * 2
    assert KVPool.page_bytes(m16, 2, mtp=True) == (lat + n_keys * 2 * Di) * 2
    assert pool.nbytes() == KVPool.page_bytes(m8, 2, mtp=True) // 2 * pool.latent[0].shape[0]
    src = torch.randn(2, Di)
    from glm5.core.index_cache import write_index_keys

    write_index_keys(c, torch.tensor([2, 3]), src)
    pool.copy_page(1, 0)
    codes, scale = quantize_rows_e4m3(src.bfloat16())
    assert torch.equal(c.codes[:2].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(c.scale[:2], scale)


def test_engine_with_the_fp8_cache_is_generate_with_the_fp8_indexer(monkeypatch):
    """A tiny fp8-indexer model in the paged engine (chunked prefill, prefix reuse, pages of 4
    shuffled by the allocator, MTP drafts) gives model.generate's greedy tokens (the flat cache
    and indexer_topk_fp8): the keys are quantized once when written, from the model's dtype, to
    the codes indexer_topk_fp8 makes. Every sparse selection goes through
    paged_indexer_topk_fp8 (each call judged by the oracle), never the bf16 paged op."""
    pytest.importorskip("tvm")
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams

    torch.manual_seed(0)
    m = GLM5ForCausalLM(preset("tiny").replace(dsa_indexer_dtype="fp8")).float().eval()
    calls = []
    real = glm5.ops.paged_indexer_topk_fp8

    def spy(*args):  # the pool is written after the call: its state now is kept
        out = real(*args)
        calls.append(({n: a.clone() if isinstance(a, torch.Tensor) else a
                       for n, a in zip(PAGED, args)}, out))
        return out

    def bf16(*args):
        raise AssertionError("the engine called the bf16 paged_indexer_topk")

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (5, 12, 17, 30)]
    prompts.append(prompts[3][:24] + [9, 9, 9])  # a prefix hit of whole pages
    with torch.no_grad(), glm5.use_backend("cpu"):
        want = [m.generate(torch.tensor([p]), 6)[0, len(p):].tolist() for p in prompts]
        monkeypatch.setattr(glm5.ops, "paged_indexer_topk_fp8", spy)
        monkeypatch.setattr(glm5.ops, "paged_indexer_topk", bf16)
        for k in (0, 1):
            eng = LLMEngine(m, EngineConfig(page_size=4, num_pages=96, chunk_size=8,
                                            max_num_batched_tokens=32,
                                            num_speculative_tokens=k))
            sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            assert [o.token_ids for o in run_all(eng, prompts, sp)] == want, k
    assert len(calls) > 10
    for vals, out in calls[::3]:
        assert_matches("paged_indexer_topk_fp8", out, vals, what="engine call")


def test_checkpoint_loads_with_the_fp8_indexer(tmp_path, monkeypatch):
    """`load_model(..., indexer_dtype="fp8")`, `glm5.LLM(dir, indexer_dtype="fp8")` and
    `glm5 serve --indexer-dtype fp8` run a bf16-indexer checkpoint with the fp8 indexer and its
    fp8 key cache (the same weights); LLM's greedy tokens are the fp8 model's `generate`; a bad
    value and the option on a built model are refused by name."""
    pytest.importorskip("tvm")
    from glm5.cli import main
    from glm5.core import checkpoint
    from glm5.core.config import ConfigError, preset
    from glm5.core.index_cache import FP8Keys
    from glm5.core.model import GLM5ForCausalLM
    from glm5.engine.sampling import SamplingParams

    torch.manual_seed(0)
    GLM5ForCausalLM(preset("tiny")).float().eval().save_pretrained(tmp_path)
    m8 = checkpoint.load_model(tmp_path, torch.float32, indexer_dtype="fp8").eval()
    assert m8.config.dsa_indexer_dtype == "fp8"
    assert checkpoint.load_model(tmp_path).config.dsa_indexer_dtype == "bf16"
    with pytest.raises(ConfigError, match="dsa_indexer_dtype expected 'bf16' or 'fp8'"):
        checkpoint.load_model(tmp_path, indexer_dtype="int4")
    prompt = torch.randint(2, 128, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with glm5.use_backend("cpu"), torch.no_grad():
        want = m8.generate(torch.tensor([prompt]), 5)[0, 20:].tolist()
        llm = glm5.LLM(str(tmp_path), dtype=torch.float32, indexer_dtype="fp8", page_size=4,
                       num_pages=32)
        assert all(isinstance(c, FP8Keys) for c in llm.engine.pool.index_keys if c is not None)
        out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0,
                                                    ignore_eos=True))
    assert out[0].token_ids == want
    with pytest.raises(TypeError, match="'indexer_dtype' expected only with a checkpoint"):
        glm5.LLM(m8, indexer_dtype="fp8")
    seen = {}

    def fake_load(path, dtype=None, device="cpu", indexer_dtype=None, indexer_hadamard=None):
        seen["indexer_dtype"] = indexer_dtype
        raise checkpoint.CheckpointError("stopped by the test")

    monkeypatch.setattr(checkpoint, "load_model", fake_load)
    assert main(["serve", str(tmp_path), "--port", "0", "--indexer-dtype", "fp8"]) != 0
    assert seen == {"indexer_dtype": "fp8"}
