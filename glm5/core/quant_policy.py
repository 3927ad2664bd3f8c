"""Which tensors of a GLM-5 checkpoint a quantization scheme touches, and why the others stay in
high precision. The one definition used by the quantizer, the quantized loader and the planner.

Names are transformers checkpoint names (`model.layers.3.self_attn.q_a_proj.weight`,
`model.layers.3.mlp.experts.17.down_proj.weight`) or glm5 module names (`...mlp.experts.
gate_up_proj`); both match the same rules.
"""

from __future__ import annotations

import re

# (regex searched in the tensor name, why the tensor is kept in high precision)
HIGH_PRECISION: tuple[tuple[str, str], ...] = (
    (r"embed_tokens\.", "embedding rows are gathered, not multiplied: no matmul to speed up, and "
     "per-row quantization error lands directly in every hidden state"),
    (r"(^|\.)lm_head\.|shared_head\.head\.", "the vocabulary projection sets the logits: "
     "quantizing it moves top-1 and sampling probabilities directly"),
    (r"\.mlp\.gate\.weight$", "the router's logits pick the experts; a small error flips "
     "which of 256 experts run (a discrete change), and it is 0.01% of the parameters"),
    (r"e_score_correction_bias", "the fp32 routing bias is added to sigmoid scores of O(1e-2) "
     "differences: it must stay fp32"),
    (r"norm", "RMSNorm/LayerNorm gains are vectors (no matmul) and scale every channel"),
    (r"indexer\.weights_proj\.", "the indexer head weights (scale factors folded in) weight "
     "the ReLU head sum that ranks tokens for top-k; kept fp32 as in the reference model"),
    (r"kv_b_proj\.", "kv_b_proj is consumed as per-head absorbed matrices W_UK / W_UV "
     "(batched matmuls over the latent, not a linear) in decode; 0.15% of the parameters"),
)
_RULES = tuple((re.compile(p), why) for p, why in HIGH_PRECISION)
_MATRIX = re.compile(r"(\.weight|experts\.gate_up_proj|experts\.down_proj)$")


def high_precision_reason(name: str) -> str | None:
    """Why `name` is kept in high precision, or None when a scheme quantizes it."""
    for pat, why in _RULES:
        if pat.search(name):
            return why
    if not _MATRIX.search(name):
        return "not a weight matrix (biases and buffers stay in high precision)"
    return None


def is_quantized(name: str) -> bool:
    """True when a quantization scheme replaces the weight `name` with packed codes + scales."""
    return high_precision_reason(name) is None
