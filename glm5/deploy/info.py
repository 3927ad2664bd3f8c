"""Analytic model size figures from a `GLM5Config`: parameter counts and KV-cache bytes.

Nothing is allocated; every count is a closed-form product of config fields. The module
structure counted is transformers' `GlmMoeDsaForCausalLM` (tensor names below are its
state-dict names), so `total_params` equals the number of elements that model saves:
every `nn.Parameter` plus the persistent buffer `mlp.gate.e_score_correction_bias`
(one float per routed expert per MoE layer). The rotary `inv_freq` buffers are
non-persistent (not saved, derived from the config) and are not counted.

Definitions (docs/model.md, "glm5 info"):

* ``total_params`` -- the main model without MTP: embed_tokens + every decoder layer +
  final norm + lm_head (0 when ``tie_word_embeddings``; the embedding matrix is counted once).
* ``active_params`` -- elements used to produce one token: ``total_params`` with each MoE
  layer's routed experts counted for ``num_experts_per_tok`` of ``n_routed_experts``.
  Embeddings and lm_head are included; MTP is not.
* ``mtp_params`` -- ``num_nextn_predict_layers`` MTP blocks as stored in DeepSeek-V3 / GLM-5
  checkpoints (``model.layers.{num_hidden_layers + i}``): enorm, hnorm, eh_proj, one full
  decoder block of the MoE type with its own indexer, and shared_head.norm. The MTP block's
  embedding and output head are the main model's (shared), so they are not counted here.
* KV cache per token -- per layer the MLA latent (kv_lora_rank + qk_rope_head_dim) and, on
  layers that run an indexer (``indexer_types[i] == "full"``), the indexer key
  (index_head_dim). Bytes for 2-byte (bf16) and 1-byte (fp8) elements; quantization scales
  are not included, except the fp8 index cache's (``dsa_indexer_dtype = "fp8"``: every key
  row is index_head_dim e4m3 codes + one fp32 scale, whatever the latent's element).
"""

from __future__ import annotations

from typing import Any

from glm5.core.config import GLM5Config
from glm5.core.index_cache import FP8_KEY_SCALE_BYTES, index_key_row_bytes  # noqa: F401  (the cache owns its row layout)

#: element sizes in bytes for the KV-cache figures
KV_DTYPES = {"bf16": 2, "fp8": 1}


# --------------------------------------------------------------------------- per-module counts
def _linear(n_in: int, n_out: int, bias: bool = False) -> int:
    return n_in * n_out + (n_out if bias else 0)


def attention_params(cfg: GLM5Config) -> dict[str, int]:
    """One layer's MLA projections and norms (`self_attn.*`, indexer excluded)."""
    h, nh, b = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    return {
        "q_a_proj": _linear(h, cfg.q_lora_rank, b),
        "q_a_layernorm": cfg.q_lora_rank,
        "q_b_proj": _linear(cfg.q_lora_rank, nh * cfg.qk_head_dim),
        "kv_a_proj_with_mqa": _linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, b),
        "kv_a_layernorm": cfg.kv_lora_rank,
        "kv_b_proj": _linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
        "o_proj": _linear(nh * cfg.v_head_dim, h, b),
    }


def indexer_params(cfg: GLM5Config) -> dict[str, int]:
    """One DSA indexer (`self_attn.indexer.*`); layers with indexer_types 'shared' have none."""
    d, n = cfg.index_head_dim, cfg.index_n_heads
    return {
        "wq_b": _linear(cfg.q_lora_rank, n * d),
        "wk": _linear(cfg.hidden_size, d),
        "k_norm": 2 * d,  # LayerNorm weight + bias
        "weights_proj": _linear(cfg.hidden_size, n),
    }


def dense_mlp_params(cfg: GLM5Config, intermediate: int | None = None) -> dict[str, int]:
    h, i = cfg.hidden_size, cfg.intermediate_size if intermediate is None else intermediate
    return {"gate_proj": h * i, "up_proj": h * i, "down_proj": i * h}


def moe_params(cfg: GLM5Config) -> dict[str, int]:
    """One MoE block (`mlp.*` of a 'sparse' layer)."""
    h, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    return {
        "gate.weight": e * h,
        "gate.e_score_correction_bias": e,  # persistent buffer (saved), not an nn.Parameter
        "experts": e * 3 * h * i,  # gate_up_proj [E, 2I, H] + down_proj [E, H, I]
        "shared_experts": sum(dense_mlp_params(cfg, i * cfg.n_shared_experts).values()),
    }


def _routed_active(cfg: GLM5Config) -> int:
    return cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def decoder_layer_params(cfg: GLM5Config, mlp: str, indexer: bool) -> int:
    """One `GlmMoeDsaDecoderLayer` (`mlp` 'dense' or 'sparse')."""
    n = sum(attention_params(cfg).values()) + 2 * cfg.hidden_size
    n += sum(indexer_params(cfg).values()) if indexer else 0
    n += sum((moe_params(cfg) if mlp == "sparse" else dense_mlp_params(cfg)).values())
    return n


# --------------------------------------------------------------------------- public API
def count_params(cfg: GLM5Config) -> dict[str, Any]:
    """Analytic parameter counts (ints) for `cfg`; see the module docstring for definitions.

    Returns ``total_params``, ``active_params``, ``mtp_params``, ``mtp_active_params``,
    ``buffer_params`` (the e_score_correction_bias elements inside ``total_params``),
    ``components`` (model-wide totals per component; they sum to ``total_params``),
    ``per_layer`` (one layer's modules) and ``mtp`` (one MTP block's modules).
    """
    h, v = cfg.hidden_size, cfg.vocab_size
    n_sparse = sum(t == "sparse" for t in cfg.mlp_layer_types)
    n_dense = cfg.num_hidden_layers - n_sparse
    n_full = sum(t == "full" for t in cfg.indexer_types)

    attn, idx, dense, moe = (attention_params(cfg), indexer_params(cfg), dense_mlp_params(cfg),
                             moe_params(cfg))
    L = cfg.num_hidden_layers
    components = {
        "embed_tokens": v * h,
        "lm_head": 0 if cfg.tie_word_embeddings else v * h,
        "attention": L * sum(attn.values()),
        "indexer": n_full * sum(idx.values()),
        "dense_mlp": n_dense * sum(dense.values()),
        "moe_router": n_sparse * moe["gate.weight"],
        "moe_router_bias": n_sparse * moe["gate.e_score_correction_bias"],
        "routed_experts": n_sparse * moe["experts"],
        "shared_experts": n_sparse * moe["shared_experts"],
        "layer_norms": L * 2 * h,
        "final_norm": h,
    }
    total = sum(components.values())
    active = total - components["routed_experts"] + n_sparse * _routed_active(cfg)

    mtp_mlp = "sparse" if n_sparse else "dense"
    mtp_block = {
        "enorm": h,
        "hnorm": h,
        "eh_proj": _linear(2 * h, h),
        "decoder_layer": decoder_layer_params(cfg, mtp_mlp, indexer=True),
        "shared_head.norm": h,
    }
    per_mtp = sum(mtp_block.values())
    per_mtp_active = per_mtp - (moe["experts"] - _routed_active(cfg) if mtp_mlp == "sparse"
                                else 0)
    k = cfg.num_nextn_predict_layers
    return {
        "total_params": total,
        "active_params": active,
        "mtp_params": k * per_mtp,
        "mtp_active_params": k * per_mtp_active,
        "buffer_params": components["moe_router_bias"],
        "components": components,
        "per_layer": {
            "attention": attn,
            "indexer": idx,
            "dense_mlp": dense,
            "moe": moe,
            "layer_norms": {"input_layernorm": h, "post_attention_layernorm": h},
        },
        "mtp": mtp_block,
        "layers": {
            "total": L, "dense": n_dense, "sparse": n_sparse,
            "indexer_full": n_full, "indexer_shared": L - n_full, "mtp": k,
        },
    }


def kv_cache_per_token(cfg: GLM5Config) -> dict[str, Any]:
    """KV-cache elements and bytes per token of context (batch 1), main model only.

    Every layer caches the MLA latent (kv_lora_rank + qk_rope_head_dim); layers with
    indexer_types 'full' also cache the indexer key (index_head_dim). 'shared' layers reuse an
    earlier layer's top-k and keep no indexer key. The MTP block(s) would add
    ``mtp_elements`` (``mtp_bytes``) more when speculative decoding runs them (not in the
    totals). Bytes per element size of :data:`KV_DTYPES`; with ``dsa_indexer_dtype = "fp8"``
    every indexer key row takes :func:`index_key_row_bytes` (codes + scale) in both columns.
    """
    latent, ikey = cfg.kv_cache_dim, cfg.index_head_dim
    n_full = sum(t == "full" for t in cfg.indexer_types)
    elements = cfg.num_hidden_layers * latent + n_full * ikey
    fp8_keys = cfg.dsa_indexer_dtype == "fp8"
    key_bytes = {k: index_key_row_bytes(ikey, s, fp8_keys) for k, s in KV_DTYPES.items()}
    mtp = cfg.num_nextn_predict_layers
    return {
        "latent_per_layer": latent,
        "indexer_key_per_layer": ikey,
        "elements_per_layer": latent + ikey,
        "layers": cfg.num_hidden_layers,
        "indexer_layers": n_full,
        "elements": elements,
        "indexer_dtype": cfg.dsa_indexer_dtype,
        "indexer_key_bytes": key_bytes,
        "bytes": {k: cfg.num_hidden_layers * latent * s + n_full * key_bytes[k]
                  for k, s in KV_DTYPES.items()},
        "bytes_per_layer": {k: latent * s + key_bytes[k] for k, s in KV_DTYPES.items()},
        "mtp_elements": mtp * (latent + ikey),
        "mtp_bytes": {k: mtp * (latent * s + key_bytes[k]) for k, s in KV_DTYPES.items()},
    }


def model_info(cfg: GLM5Config) -> dict[str, Any]:
    """`glm5 info` as a JSON-serializable dict: headline counts, breakdown, KV cache, shape."""
    p, kv = count_params(cfg), kv_cache_per_token(cfg)
    return {
        "total_params": p["total_params"],
        "active_params": p["active_params"],
        "mtp_params": p["mtp_params"],
        "kv_cache_bytes_per_token": kv["bytes"],
        "params": p,
        "kv_cache_per_token": kv,
        "config": {
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "n_routed_experts": cfg.n_routed_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "n_shared_experts": cfg.n_shared_experts,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
            "dsa_selection": cfg.dsa_selection,
        },
    }
