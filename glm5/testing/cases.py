"""Input generators ("strategies") per op.

Every generator draws a *tier* first, then shapes within it:

* ``edge``  — the corner cases: T = 1, S < k, rows with no valid key, −1 indices, empty
  groups, non-contiguous inputs, tiny and large magnitudes, exact ties;
* ``tile``  — past the first tile of every shipped kernel: hundreds of keys (Triton BLOCK_S 64,
  BLOCK_K 32, BLOCK_T 16, BLOCK_V 128), head dims that are and are not multiples of the tiles;
* ``model`` — GLM-5's real shapes at small T: MQA attention 64 heads x 576/512 over 2048
  selected keys, the indexer's 32 heads x 128, the MLA prolog's 6144 -> 2048 / 512 + 64
  projections (alternating with DeepSeek-V3's 7168 -> 1536, the sizes torch_npu's MLA prolog
  documents), 256 experts choosing 8, the hidden size and the MoE intermediate size;
* ``large`` — thousands: S and K up to 2048-4500, T past the cpu kernels' 64-query blocks,
  rows past the torch-path thresholds of quant_linear (384) and moe_experts (1024 routed rows);
* ``huge``  — past the largest blocks: S > 8192 (the TVM indexer's key tile), k rows larger
  than the TVM sparse-attention key-block size (its multi-pass path), a 154,880-word vocabulary.

A profile (``PROFILES``) names the tiers a run cycles through: ``glm5 parity`` gives example
``i`` the tier ``tiers[i % len(tiers)]``, so every run of at least ``len(tiers)`` examples
reaches every tier; hypothesis draws the tier (and shrinks towards ``edge``). ``default`` is
what ``glm5 parity`` runs; ``quick`` (edge, tile, model) keeps interpreted backends fast;
``smoke`` (edge, tile) is for unit tests of interpreted kernels; ``full`` is ``default`` with
100 examples, for vendors.

A generator is written once against a small `Draw` interface, so the same definition drives
hypothesis (`HypothesisDraw`, used by the pytest plugin, with shrinking) and the `glm5 parity`
CLI (`RandomDraw`, no hypothesis needed at runtime). Tensors come from a torch.Generator seeded
by a drawn integer; shapes, flags and magnitudes are drawn so that they shrink.

This module is the entry: the draw interface and profiles live in `glm5.testing.case_draw`,
the generators by op family in `cases_norm` (row-wise ops), `cases_dsa` (indexer, top-k,
attention, MLA prolog), `cases_moe` (MoE and quantization) and `cases_rl` (RL losses).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.testing import cases_dsa, cases_moe, cases_norm, cases_rl
from glm5.testing.case_draw import (  # noqa: F401  (the kit's names, importable from here too)
    DEFAULT_PROFILE, GLM5, PROFILE_EXAMPLES, PROFILES, TIERS, Draw, HypothesisDraw, Maker,
    RandomDraw)

# The dtypes a kernel declaring `dtypes=None` is exercised with.
DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

# op name -> its input generator.
GENERATORS: dict[str, Callable[[Draw, torch.dtype], dict[str, Any]]] = {
    "rms_norm": cases_norm.gen_rms_norm,
    "layer_norm": cases_norm.gen_layer_norm,
    "rope": cases_norm.gen_rope,
    "silu_mul": cases_norm.gen_silu_mul,
    "lightning_indexer": cases_dsa.gen_lightning_indexer,
    "topk_indices": cases_dsa.gen_topk_indices,
    "indexer_topk": cases_dsa.gen_indexer_topk,
    "indexer_topk_fp8": cases_dsa.gen_indexer_topk_fp8,
    "paged_indexer_topk": cases_dsa.gen_paged_indexer_topk,
    "paged_indexer_topk_fp8": cases_dsa.gen_paged_indexer_topk_fp8,
    "sparse_attention": cases_dsa.gen_sparse_attention,
    "attention": cases_dsa.gen_attention,
    "mla_prolog": cases_dsa.gen_mla_prolog,
    "moe_route": cases_moe.gen_moe_route,
    "moe_experts": cases_moe.gen_moe_experts,
    "quantize_per_token": cases_moe.gen_quantize_per_token,
    "quant_linear": cases_moe.gen_quant_linear,
    "moe_experts_quant": cases_moe.gen_moe_experts_quant,
    "token_logprobs": cases_rl.gen_token_logprobs,
    "grpo_advantages": cases_rl.gen_grpo_advantages,
    "policy_loss": cases_rl.gen_policy_loss,
}


def case_dtypes(op: Any, kernel_dtypes: frozenset[torch.dtype] | None) -> list[torch.dtype]:
    """Dtypes to exercise: those the kernel claims within those the op allows for its dispatch
    argument (defaults when the kernel claims any)."""
    arg = next(p for p in op.tensor_params if p.name == op.dispatch_arg)
    allowed = arg.dtypes or frozenset(DEFAULT_DTYPES)
    claimed = kernel_dtypes if kernel_dtypes is not None else frozenset(DEFAULT_DTYPES)
    out = [dt for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
           if dt in allowed and dt in claimed]
    if not out and kernel_dtypes is None:
        out = [dt for dt in (torch.float32, torch.float64) if dt in allowed][:1]
    return out


def example_seed(seed: int, op: str, dtype: torch.dtype, i: int) -> int:
    """A stable per-example seed (no Python hash randomisation)."""
    h = 0
    for ch in f"{op}/{dtype}/{i}":
        h = (h * 131 + ord(ch)) % (2**61 - 1)
    return (seed * 1_000_003 + h) % (2**63)


def example(op: str, dtype: torch.dtype, seed: int, i: int,
            profile: str = DEFAULT_PROFILE) -> dict[str, Any]:
    """Example ``i`` of (op, dtype) for a run with ``seed`` under ``profile``: its tier is the
    profile's i-th (cycling)."""
    tiers = PROFILES[profile]
    draw = RandomDraw(example_seed(seed, op, dtype, i), tier=tiers[i % len(tiers)], tiers=tiers,
                      index=i)
    return GENERATORS[op](draw, dtype)


__all__ = ["GENERATORS", "PROFILES", "TIERS", "Draw", "RandomDraw", "HypothesisDraw",
           "case_dtypes", "example", "example_seed"]
