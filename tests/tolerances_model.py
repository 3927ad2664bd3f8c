"""Model-level tolerances: comparisons that are not one op against its oracle (whole-model
logits of two implementations, fp32 training gradients against a float64 run). Op-level checks
ask the conformance kit (glm5.testing.compare.judge / assert_matches) instead; nothing in this
module applies to a single op. One named constant per quantity, each with its derivation."""

from __future__ import annotations

import torch

# Bound on |glm5 - other| for whole-model fp32 logits (transformers' model, onnxruntime running
# the exported graph, another backend, incremental decoding vs a full forward, a quantized model
# vs its dequantized twin), relative to the reference's largest |logit|: used as rtol and, times
# that scale, as atol. A tiny model's logits sit behind 3 decoder blocks (plus the MTP block for
# MTP logits): ~10 chained fp32 matmuls each, reductions of length <= 2 * hidden = 128, 6 RMSNorms
# on the way. fp32 rounds at u = 2^-24 (6e-8) per op; with random-walk growth over K-term
# reductions (~sqrt(K) u) and ~40 chained ops the relative error is ~40 * sqrt(128) * u ~ 3e-5 at
# worst and ~1e-6 typically (measured 4e-7 .. 9e-7 for transformers parity). 1e-4 keeps that
# worst case inside; planted bugs (a dropped norm, a swapped concat, a shifted token) move the
# logits by 5e-2 .. 2 of the scale, at least 500x the bound (tests/test_mtp_oracle.py holds
# the MTP logits to it too).
LOGIT_TOL = 1e-4

# The same model and the same kernels, only the order of fp32 sums changed (key-block passes of
# the cpu sparse attention, query chunks): each reordered K-term sum moves by ~sqrt(K) u
# relative, K <= 2 * hidden = 128, through the ~40 chained ops above without the cross-kernel
# differences (library GEMMs against reference einsums, other reduction trees) that LOGIT_TOL
# allows for: 40 * sqrt(128) * u / 10 ~ 3e-6 -> 1e-5, a tenth of LOGIT_TOL.
REORDER_LOGIT_TOL = 1e-5

# Tie guard, not a tolerance: a DSA top-k boundary whose two scores differ by less than this
# (relative to the query's largest score) could be ordered differently by two correct fp32
# implementations; such inputs are skipped over (seeds advance). fp32 indexer scores are sums of
# Hi = 8 heads of Di-term dots: ~sqrt(Di) * Hi * u ~ 4e-6 relative apart at worst -> 1e-5.
# (tests/test_mtp_oracle.py uses it too.)
NEAR_TIE_REL = 1e-5

# fp32 training gradients against the same model run in float64 (test_model_training), per
# parameter tensor. The backward doubles the forward's chain (~80 chained fp32 ops, reductions of
# K <= 128 features and, for weight gradients, of B * T tokens): ~80 * sqrt(128) * u ~ 5e-5
# relative, more where a gradient entry is a cancelling sum. Measured (T = 6 and 20): worst
# relative error 1.1e-4 on entries above 1% of their tensor's largest |gradient|, worst absolute
# error 1.8e-6 of that largest |gradient|. GRAD_RTOL = 1e-3 holds the relative error with 10x
# headroom; entries that cancel to ~0 (no meaningful relative error) are held absolutely at
# GRAD_ATOL_REL of the tensor's largest |gradient| (LOGIT_TOL's convention), 50x the measured.
GRAD_RTOL = 1e-3
GRAD_ATOL_REL = 1e-4


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, tol: float = LOGIT_TOL,
                        what: str = "logits") -> float:
    """|got - ref| <= tol * |ref| + tol * max|ref| elementwise (the convention of LOGIT_TOL);
    returns max|got - ref| / max|ref|, which that bound keeps <= 2 * tol."""
    scale = float(ref.abs().max())
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{what} (tol {tol:g} of max |ref| {scale:.3g}):\n{m}")
    return float((got.double() - ref.double()).abs().max()) / max(scale, 1e-300)
