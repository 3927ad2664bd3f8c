"""The one tolerance table of the conformance kit, keyed by (op class, dtype, quant scheme).

A kernel output ``y`` passes against the float64 oracle ``r`` when, elementwise,

    |y - r| <= rtol * |r| + atol * sqrt(n) * max(|r|)

where ``n`` is the op's reduction length (``OpDef.reduce_len``) and ``max(|r|)`` the largest
magnitude of that output (so inputs of any scale are judged alike). Non-finite values must sit
at the same places with the same value (−inf lse of an empty row, −inf outside a key range).

``dtype`` is the dtype the kernel was called with (the op's dispatch dtype). eps values:
bf16 2^-7 = 7.8e-3, fp16 2^-10 = 9.8e-4, fp32 2^-23 = 1.2e-7.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float  # per sqrt(reduction length), relative to the output's largest magnitude
    why: str
    floor: float = 0.0  # absolute floor: the dtype's subnormal spacing (set by lookup)

    def text(self) -> str:
        return f"rtol={self.rtol:.1e} atol={self.atol:.1e}*sqrt(n)*max|ref|"

    def bound(self, ref: torch.Tensor, n: int) -> torch.Tensor:
        scale = ref.abs().amax() if ref.numel() else ref.new_tensor(0.0)
        scale = torch.clamp(scale, min=torch.finfo(torch.float64).tiny)
        return self.rtol * ref.abs() + self.atol * math.sqrt(max(n, 1)) * scale + self.floor


F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
ANY_SCHEME = "*"

# (op class, dtype, scheme) -> Tolerance. Every entry says why.
TABLE: dict[tuple[str, torch.dtype, str], Tolerance] = {
    # ---- elementwise: rope, silu_mul, grpo_advantages, policy_loss
    ("elementwise", F64, ANY_SCHEME): Tolerance(1e-12, 1e-14, "float64 against itself: only reassociation"),
    ("elementwise", F32, ANY_SCHEME): Tolerance(2e-6, 2e-7, "a few fp32 roundings (exp/sigmoid ~1 ulp each)"),
    ("elementwise", BF16, ANY_SCHEME): Tolerance(8e-3, 4e-3, "one bf16 rounding of the output (1/2 ulp) plus one inside"),
    ("elementwise", F16, ANY_SCHEME): Tolerance(1e-3, 5e-4, "one fp16 rounding of the output plus one inside"),
    # ---- norm: rms_norm, layer_norm (a mean over D, then an elementwise scale)
    ("norm", F64, ANY_SCHEME): Tolerance(1e-12, 1e-14, "float64 against itself"),
    ("norm", F32, ANY_SCHEME): Tolerance(4e-6, 1e-7, "fp32 mean over D (error ~eps*sqrt(D)) and rsqrt"),
    ("norm", BF16, ANY_SCHEME): Tolerance(1.6e-2, 2e-3, "bf16 output rounding (1/2 ulp) and bf16 weight product"),
    ("norm", F16, ANY_SCHEME): Tolerance(2e-3, 2.5e-4, "fp16 output rounding and fp16 weight product"),
    # ---- matmul: lightning_indexer, moe_experts, mla_prolog (fp32 accumulation over n)
    ("matmul", F64, ANY_SCHEME): Tolerance(1e-11, 1e-13, "float64 against itself: summation order"),
    ("matmul", F32, ANY_SCHEME): Tolerance(2e-5, 2e-6, "fp32 accumulation: error grows ~eps*sqrt(n)"),
    ("matmul", BF16, ANY_SCHEME): Tolerance(2e-2, 4e-3, "bf16 rounding of intermediates between GEMMs (2 ulp) + fp32 sums"),
    ("matmul", F16, ANY_SCHEME): Tolerance(3e-3, 5e-4, "fp16 rounding of intermediates between GEMMs + fp32 sums"),
    # ---- attention: attention, sparse_attention (QK^T, softmax, PV; lse in fp32)
    ("attention", F64, ANY_SCHEME): Tolerance(1e-11, 1e-13, "float64 against itself"),
    ("attention", F32, ANY_SCHEME): Tolerance(2e-5, 2e-6, "fp32 QK^T over Dqk, online-softmax rescaling, PV over K"),
    ("attention", BF16, ANY_SCHEME): Tolerance(2e-2, 4e-3, "P rounded to bf16 before PV (as flash kernels do) + output rounding"),
    ("attention", F16, ANY_SCHEME): Tolerance(3e-3, 5e-4, "P rounded to fp16 before PV + output rounding"),
    # ---- logprob: token_logprobs (logits over V, online logsumexp, fp32 outputs)
    ("logprob", F64, ANY_SCHEME): Tolerance(1e-11, 1e-13, "float64 against itself"),
    ("logprob", F32, ANY_SCHEME): Tolerance(2e-5, 2e-6, "fp32 logits (sum over D) and logsumexp over V"),
    ("logprob", BF16, ANY_SCHEME): Tolerance(1e-2, 2e-3, "logits may be formed from bf16 operands with fp32 sums"),
    ("logprob", F16, ANY_SCHEME): Tolerance(2e-3, 5e-4, "logits from fp16 operands with fp32 sums"),
    # ---- quant: quantize_per_token, quant_linear, moe_experts_quant. Integer sums are exact;
    # what remains is the fp32 product of scales and, for low-precision activations, the
    # rounding of the activation before it is quantized (a code may move by one).
    ("quant", F64, ANY_SCHEME): Tolerance(1e-9, 1e-11, "exact integer sums, float64 scale products"),
    ("quant", F32, ANY_SCHEME): Tolerance(1e-5, 1e-6, "exact integer sums; fp32 scale products and group sums"),
    ("quant", BF16, ANY_SCHEME): Tolerance(3e-2, 8e-3, "bf16 output rounding; bf16 intermediates may move a code by one"),
    ("quant", F16, ANY_SCHEME): Tolerance(4e-3, 2e-3, "fp16 output rounding; fp16 intermediates move 12-bit codes by one"),
    ("quant", F32, "w8a16"): Tolerance(2e-5, 2e-6, "float GEMM on dequantized weights, fp32 accumulation"),
}
# Selection ops (topk_indices, indexer_topk, moe_route) are compared by the scores of what was
# selected (see compare.py): two scores closer than the "tie" tolerance of the score-producing
# class are a tie, and either member may be chosen.
SELECTION_SCORE_CLASS = {
    "topk_indices": "elementwise",
    "indexer_topk": "matmul",
    "moe_route": "elementwise",
}


def lookup(op_class: str, dtype: torch.dtype, scheme: str | None = None) -> Tolerance:
    """The tolerance for (class, dtype, scheme); the scheme-specific entry wins over '*'."""
    # Results below the normal range are held in subnormals: two spacings of slack there.
    floor = 2.0 * torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    if scheme is not None and (op_class, dtype, scheme) in TABLE:
        return replace(TABLE[(op_class, dtype, scheme)], floor=floor)
    try:
        return replace(TABLE[(op_class, dtype, ANY_SCHEME)], floor=floor)
    except KeyError:
        raise KeyError(
            f"glm5.testing: no tolerance for class {op_class!r} dtype {dtype}; "
            f"classes: {sorted({k[0] for k in TABLE})}"
        ) from None
