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


def test_cpu_backend_runs_the_decomposition(monkeypatch):
    """The cpu backend has no fp8 kernel: under GLM5_STRICT=1 (a reference fallback raises)
    the op runs as indexer_topk on the dequantized inputs, within the op's bound on the kit's
    cases (ties and duplicated keys included)."""
    pytest.importorskip("tvm")
    monkeypatch.setenv("GLM5_STRICT", "1")
    with glm5.use_backend("cpu"):
        for dtype in (torch.float32, torch.bfloat16):
            for i in range(6):
                vals = example("indexer_topk_fp8", dtype, 3, i, "smoke")
                got = glm5.ops.indexer_topk_fp8(**vals)
                assert_matches("indexer_topk_fp8", got, vals, what=f"cpu {dtype} case {i}")


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
    """Block selection and the paged engine / planner have no fp8 indexer: each refuses the
    option by name; an unknown value is refused."""
    from glm5.core.config import ConfigError, preset
    from glm5.core.model import GLM5ForCausalLM
    from glm5.core.plan import PlanError, check_inputs
    from glm5.engine.engine import LLMEngine

    with pytest.raises(ConfigError, match="dsa_indexer_dtype expected 'bf16' or 'fp8'"):
        preset("tiny").replace(dsa_indexer_dtype="int8")
    with pytest.raises(ConfigError, match="dsa_indexer_dtype 'fp8' expected dsa_selection"):
        preset("tiny").replace(dsa_indexer_dtype="fp8", dsa_selection="block")
    cfg = preset("tiny").replace(dsa_indexer_dtype="fp8")
    with pytest.raises(ValueError, match="supports dsa_indexer_dtype='bf16'"):
        LLMEngine(GLM5ForCausalLM(cfg).eval())
    with pytest.raises(PlanError, match="dsa_indexer_dtype 'bf16'"):
        check_inputs(cfg, 1, 1024, 1, 1)
