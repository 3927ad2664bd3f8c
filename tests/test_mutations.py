"""Mutation suite: the conformance kit tests itself.

Two kinds of kernels, all written against the public plugin API only (a ``glm5.Backend`` with
``@backend.kernel(op, dtypes=...)``) and judged by ``run_parity`` exactly as a vendor's kernel is:

* **mutants** — kernels with one planted bug a real kernel could ship (a softmax scale 1% off, a
  tile-boundary slip that drops the last key, ties broken the wrong way, a wrong layout ...).
  The kit must FAIL every one of them in every dtype it is registered for.
* **right kernels computed differently** — online/blockwise softmax, reversed summation order,
  P rounded to bf16/fp16 before the PV product, a different stable sort, chunked top-k merges,
  per-token loops, reciprocal multiplies ... The kit must PASS them in every dtype.

Every kernel behaves like a real kernel of the dtype it is called with: it upcasts to fp32,
computes, and returns its outputs in the dtypes the op contract gives (``OpDef.outputs``).
Each hand-written kernel with mutation knobs is also registered with no knob set as a right
kernel, so a mutant that is caught is caught for its planted bug, not for its base.

The last test prints the mutation score (caught/total per dtype) through the terminal-summary
hook of tests/conftest.py (shown with ``-q`` too) and asserts it is 100%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import glm5
from glm5.ir.catalog import OPS
from glm5.ir.fp8 import e4m3_rows, quantize_rows_e4m3
from glm5.ir.signature import dtype_name
from glm5.testing.parity import Row, run_parity

# How hard the kit is asked, in one place: the kit's quick profile (edge, tile and GLM-5's real
# model shapes; the large/huge tiers only add oracle time here) and the base seed. A mutant
# gets 12 examples (four passes over the tiers, every `cover` flag of the generators - head
# layout, rope layout, scheme, TIS, tie mode - rotated through), and stops at its first failing
# one; a right kernel runs 3 (one pass), which is where the suite spends its time.
PARITY = {"seed": 0, "profile": "quick"}
EXAMPLES = {"fail": 12, "pass": 3}

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
FLOATS = (F32, BF16, F16)
LOW = (BF16, F16)
NEG_INF = float("-inf")
LOG2E = 1.0 / math.log(2.0)


def ref(op: str) -> Callable[..., Any]:
    """The op's reference (dtype-generic); mutants call it on fp32 inputs and cast its outputs
    to the contract's dtypes, as an fp32-math kernel would."""
    return OPS[op].reference


# --------------------------------------------------------------------------- case registry
@dataclass(frozen=True)
class Case:
    name: str
    op: str
    fn: Callable[..., Any]
    dtypes: tuple[torch.dtype, ...]
    expect: str  # "fail" (mutant) | "pass" (right kernel)


MUTANTS: list[Case] = []
GOOD: list[Case] = []


def mutant(name: str, op: str, fn: Callable[..., Any], dtypes=FLOATS) -> None:
    MUTANTS.append(Case(name, op, fn, tuple(dtypes), "fail"))


def good(name: str, op: str, fn: Callable[..., Any], dtypes=FLOATS) -> None:
    GOOD.append(Case(name, op, fn, tuple(dtypes), "pass"))


# =========================================================================== norm ops
def rms_norm_k(x, weight, eps, *, eps_mode="inside", one_plus_weight=False):
    xf = x.float()
    ms = xf.pow(2).mean(-1, keepdim=True)
    if eps_mode == "inside":
        r = torch.rsqrt(ms + eps)
    elif eps_mode == "outside":  # x / (sqrt(ms) + eps)
        r = 1.0 / (ms.sqrt() + eps)
    else:  # "ignored"
        r = torch.rsqrt(ms)
    w = weight.float()
    return (xf * r * ((1.0 + w) if one_plus_weight else w)).to(x.dtype)


def rms_norm_transformers(x, weight, eps):
    """As transformers' RMSNorm: 1/sqrt in fp32, x*rsqrt rounded to the input dtype, then the
    weight product in the input dtype (two roundings)."""
    xf = x.float()
    r = 1.0 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * (xf * r).to(x.dtype)


good("rms_norm_fp32", "rms_norm", rms_norm_k)
good("rms_norm_transformers_style", "rms_norm", rms_norm_transformers)
mutant("rms_norm_eps_outside_sqrt", "rms_norm",
       lambda x, w, eps: rms_norm_k(x, w, eps, eps_mode="outside"))
mutant("rms_norm_eps_ignored", "rms_norm",
       lambda x, w, eps: rms_norm_k(x, w, eps, eps_mode="ignored"))
mutant("rms_norm_one_plus_weight", "rms_norm",  # Gemma's (1 + w) convention applied by mistake
       lambda x, w, eps: rms_norm_k(x, w, eps, one_plus_weight=True))


def layer_norm_k(x, weight, bias, eps, *, unbiased=False):
    xf = x.float()
    var, mean = torch.var_mean(xf, dim=-1, keepdim=True, unbiased=unbiased)
    return ((xf - mean) * torch.rsqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)


good("layer_norm_var_mean", "layer_norm", layer_norm_k)
mutant("layer_norm_unbiased_variance", "layer_norm",
       lambda x, w, b, eps: layer_norm_k(x, w, b, eps, unbiased=True))


def _rope_cs(x, cos, sin):
    T, R = x.shape[0], x.shape[-1]
    shape = (T,) + (1,) * (x.dim() - 2) + (R // 2,)
    return cos.float().reshape(shape), sin.float().reshape(shape)


def rope_k(x, cos, sin, interleaved, *, force_layout=None, sin_sign=1.0):
    il = interleaved if force_layout is None else force_layout
    c, s = _rope_cs(x, cos, sin)
    s = s * sin_sign
    xf = x.float()
    R = x.shape[-1]
    a, b = (xf[..., 0::2], xf[..., 1::2]) if il else (xf[..., : R // 2], xf[..., R // 2 :])
    ra, rb = a * c - b * s, b * c + a * s
    y = torch.stack((ra, rb), dim=-1).flatten(-2) if il else torch.cat((ra, rb), dim=-1)
    return y.to(x.dtype)


def rope_complex_or_rotate_half(x, cos, sin, interleaved):
    """Interleaved: complex multiplication (view_as_complex); NeoX: transformers'
    x*cos + rotate_half(x)*sin."""
    c, s = _rope_cs(x, cos, sin)
    xf = x.float()
    R = x.shape[-1]
    if interleaved:
        z = torch.view_as_complex(xf.reshape(*xf.shape[:-1], R // 2, 2).contiguous())
        y = torch.view_as_real(z * torch.complex(c, s)).flatten(-2)
    else:
        rot = torch.cat((-xf[..., R // 2 :], xf[..., : R // 2]), dim=-1)
        y = xf * torch.cat((c, c), -1) + rot * torch.cat((s, s), -1)
    return y.to(x.dtype)


good("rope_fp32", "rope", rope_k)
good("rope_complex_or_rotate_half", "rope", rope_complex_or_rotate_half)
mutant("rope_ignores_interleaved_flag", "rope",
       lambda x, c, s, il: rope_k(x, c, s, il, force_layout=False))
mutant("rope_inverse_rotation", "rope",  # sin sign flipped: rotates the wrong way
       lambda x, c, s, il: rope_k(x, c, s, il, sin_sign=-1.0))


def silu_mul_k(x, *, swap=False):
    xf = x.float()
    i = x.shape[-1] // 2
    gate, up = (xf[..., i:], xf[..., :i]) if swap else (xf[..., :i], xf[..., i:])
    return (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype)


def silu_mul_transformers(x):
    """act_fn(gate) * up as transformers' MLP: silu rounded to the dtype, product in the dtype."""
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


good("silu_mul_exp_form", "silu_mul", silu_mul_k)
good("silu_mul_transformers_style", "silu_mul", silu_mul_transformers)
mutant("silu_mul_halves_swapped", "silu_mul", lambda x: silu_mul_k(x, swap=True))


# =========================================================================== DSA ops
def indexer_k(q, k, w, k_start, k_end, *, relu=True, inclusive_end=False, key_cap=None,
              weight_inside_relu=False):
    qf, kf, wf = q.float(), k.float(), w.float()
    dots = torch.einsum("thd,sd->ths", qf, kf)
    if weight_inside_relu:
        sc = torch.relu(dots * wf[..., None]).sum(1)
    else:
        sc = torch.einsum("ths,th->ts", torch.relu(dots) if relu else dots, wf)
    s = torch.arange(k.shape[0])
    lo = k_start.long()[:, None]
    hi = k_end.long()[:, None] + (1 if inclusive_end else 0)
    if key_cap is not None:
        hi = torch.minimum(hi, lo + key_cap)
    return sc.masked_fill(~((s >= lo) & (s < hi)), NEG_INF)


def indexer_per_head(q, k, w, k_start, k_end):
    """Heads accumulated one at a time, last head first."""
    kf = k.float()
    T, H, _ = q.shape
    sc = torch.zeros(T, k.shape[0])
    for h in reversed(range(H)):
        sc += w[:, h].float()[:, None] * torch.relu(q[:, h].float() @ kf.T)
    s = torch.arange(k.shape[0])
    valid = (s >= k_start.long()[:, None]) & (s < k_end.long()[:, None])
    return sc.masked_fill(~valid, NEG_INF)


good("lightning_indexer_fp32", "lightning_indexer", indexer_k)
good("lightning_indexer_per_head_loop", "lightning_indexer", indexer_per_head)
mutant("lightning_indexer_first16_keys_only", "lightning_indexer",
       lambda q, k, w, a, b: indexer_k(q, k, w, a, b, key_cap=16))
mutant("lightning_indexer_no_relu", "lightning_indexer",
       lambda q, k, w, a, b: indexer_k(q, k, w, a, b, relu=False))
mutant("lightning_indexer_k_end_inclusive", "lightning_indexer",
       lambda q, k, w, a, b: indexer_k(q, k, w, a, b, inclusive_end=True))
mutant("lightning_indexer_weight_inside_relu", "lightning_indexer",
       lambda q, k, w, a, b: indexer_k(q, k, w, a, b, weight_inside_relu=True))


def _pad_idx(idx: torch.Tensor, k: int) -> torch.Tensor:
    T, n = idx.shape
    if n < k:
        idx = torch.cat((idx, torch.full((T, k - n), -1, dtype=idx.dtype)), dim=1)
    return idx.to(torch.int32)


def topk_lexsort(scores, k):
    """np.lexsort on (non-finite last, -score, index)."""
    T, S = scores.shape
    s = scores.float()
    fin = torch.isfinite(s)
    key = torch.where(fin, -s, torch.zeros_like(s)).numpy()
    col = np.broadcast_to(np.arange(S), (T, S))
    order = torch.from_numpy(np.lexsort((col, key, (~fin).numpy()), axis=-1).copy())
    idx = order[:, : min(k, S)]
    idx = torch.where(torch.gather(fin, 1, idx), idx, torch.full_like(idx, -1))
    return _pad_idx(idx, k)


def topk_composite_key(scores, k):
    """One unstable argsort of unique int64 keys: an order-preserving integer of -score in the
    high 32 bits, the index in the low 32 (so ties go to the smaller index by construction)."""
    T, S = scores.shape
    s = scores.float() + 0.0  # -0.0 -> +0.0: equal scores, equal keys
    fin = torch.isfinite(s)
    bits = s.masked_fill(~fin, 0.0).view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in the float value
    desc = torch.where(fin, ~key, torch.full_like(key, 2**31 - 1)).long()  # non-finite last
    order = torch.argsort((desc << 32) | torch.arange(S), dim=-1)[:, : min(k, S)]
    idx = torch.where(torch.gather(fin, 1, order), order, torch.full_like(order, -1))
    return _pad_idx(idx, k)


def topk_ties_to_larger(scores, k):
    """Ties broken to the LARGER index (stable sort of the reversed row)."""
    S = scores.shape[1]
    out = topk_lexsort(scores.flip(-1), k).long()
    return torch.where(out >= 0, S - 1 - out, out).to(torch.int32)


def topk_torch_topk(scores, k):
    """torch.topk as is: NaN counts as the largest value and -inf entries fill short rows."""
    idx = torch.topk(scores.float(), min(k, scores.shape[1]), dim=-1).indices
    return _pad_idx(idx, k)


good("topk_indices_lexsort", "topk_indices", topk_lexsort)
good("topk_indices_composite_int_key", "topk_indices", topk_composite_key)
mutant("topk_indices_ties_to_larger_index", "topk_indices", topk_ties_to_larger)
mutant("topk_indices_selects_non_finite", "topk_indices", topk_torch_topk)


def indexer_topk_k(q, k, w, k_start, k_end, topk, *, key_cap=None, rank_shift=0):
    scores = indexer_k(q, k, w, k_start, k_end, key_cap=key_cap)
    if not rank_shift:
        return topk_lexsort(scores, topk)
    ranked = topk_lexsort(scores, topk + rank_shift).clone()
    out = ranked[:, :topk].clone()
    alt = ranked[:, topk + rank_shift - 1]  # the (topk+shift)-th best, 1-based
    has = alt >= 0
    out[has, topk - 1] = alt[has]
    return out


def indexer_topk_chunked(chunk):
    """Keys scored `chunk` at a time; a running top-k merged with each chunk (a stable sort of
    [kept | new], so ties keep going to the smaller index)."""

    def kernel(q, k, w, k_start, k_end, topk):
        T, S = q.shape[0], k.shape[0]
        best_s = torch.empty(T, 0)
        best_i = torch.empty(T, 0, dtype=torch.long)
        qf, wf = q.float(), w.float()
        lo, hi = k_start.long()[:, None], k_end.long()[:, None]
        for s0 in range(0, S, chunk):
            kc = k[s0 : s0 + chunk].float()
            sc = torch.einsum("ths,th->ts", torch.relu(torch.einsum("thd,sd->ths", qf, kc)), wf)
            pos = torch.arange(s0, s0 + kc.shape[0])
            sc = sc.masked_fill(~((pos >= lo) & (pos < hi)), NEG_INF)
            cand_s = torch.cat((best_s, sc), 1)
            cand_i = torch.cat((best_i, pos.expand(T, -1)), 1)
            order = torch.sort(cand_s, dim=1, descending=True, stable=True).indices[:, :topk]
            best_s, best_i = cand_s.gather(1, order), cand_i.gather(1, order)
        idx = torch.where(torch.isfinite(best_s), best_i, torch.full_like(best_i, -1))
        return _pad_idx(idx, topk)

    return kernel


good("indexer_topk_fp32", "indexer_topk", indexer_topk_k)
good("indexer_topk_chunks_of_4_running_merge", "indexer_topk", indexer_topk_chunked(4))
good("indexer_topk_chunks_of_64_running_merge", "indexer_topk", indexer_topk_chunked(64))
mutant("indexer_topk_first16_keys_only", "indexer_topk",
       lambda q, k, w, a, b, n: indexer_topk_k(q, k, w, a, b, n, key_cap=16))
mutant("indexer_topk_k_plus_20th_for_kth", "indexer_topk",
       lambda q, k, w, a, b, n: indexer_topk_k(q, k, w, a, b, n, rank_shift=20))


def indexer_topk_fp8_k(q, k, w, k_start, k_end, topk, *, quantize=True, scales="pow2",
                       key_scales=True):
    """The fp8 indexer as its kernel computes it: e4m3 codes of q and k per row, the q scales
    folded into w, each key's head sum times its scale. Knobs: no quantization (the bf16
    indexer passed off as fp8), exact amax/448 scales instead of powers of two, one scale for
    all of k, the key scales left out."""
    if not quantize:
        return indexer_topk_k(q, k, w, k_start, k_end, topk)

    def rows(x, per_tensor=False):
        xf = x.float()
        amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
        if per_tensor:
            amax = amax.amax().expand_as(amax)
        s = amax / 448.0
        if scales == "pow2":
            s = torch.exp2(torch.ceil(torch.log2(s)))
        return (xf / s).to(torch.float8_e4m3fn).float(), s[..., 0]

    q8, sq = rows(q)
    k8, sk = rows(k, per_tensor=scales == "per_tensor")
    scores = indexer_k(q8, k8, w.float() * sq, k_start, k_end)
    if key_scales:
        scores = scores * sk[None, :]
    return topk_lexsort(scores, topk)


good("indexer_topk_fp8_folded_scales", "indexer_topk_fp8", indexer_topk_fp8_k)
good("indexer_topk_fp8_dequantized_fp32", "indexer_topk_fp8",
     lambda q, k, w, a, b, n: indexer_topk_k(e4m3_rows(q), e4m3_rows(k), w, a, b, n))
mutant("indexer_topk_fp8_not_quantized", "indexer_topk_fp8",
       lambda q, k, w, a, b, n: indexer_topk_fp8_k(q, k, w, a, b, n, quantize=False))
mutant("indexer_topk_fp8_scales_not_powers_of_two", "indexer_topk_fp8",
       lambda q, k, w, a, b, n: indexer_topk_fp8_k(q, k, w, a, b, n, scales="exact"))
mutant("indexer_topk_fp8_one_scale_for_all_keys", "indexer_topk_fp8",
       lambda q, k, w, a, b, n: indexer_topk_fp8_k(q, k, w, a, b, n, scales="per_tensor"))
mutant("indexer_topk_fp8_key_scales_left_out", "indexer_topk_fp8",
       lambda q, k, w, a, b, n: indexer_topk_fp8_k(q, k, w, a, b, n, key_scales=False))


def paged_topk_k(q, k, w, block_table, seq, k_len, page_size, topk, *, chunk=None,
                 offset=0, read_offset=0, drop_last=False, logical=False, first_table=False):
    """Per query: its sequence's logical keys gathered through the table, indexer_topk over them
    (fp32 lexsort, or a running merge of ``chunk`` keys at a time), mapped to pool rows.
    Bugs: ``offset`` shifts the row within a page (read and returned), ``read_offset`` only
    the row the key is read from (the right rows returned for the wrong scores)."""
    T = q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32)
    select = indexer_topk_chunked(chunk) if chunk else indexer_topk_k
    for t in range(T):
        b = 0 if first_table else int(seq[t])
        n = max(0, int(k_len[t]) - int(drop_last))
        if n == 0:
            continue
        j = torch.arange(n)
        base = block_table[b].long()[j // page_size] * page_size
        rows = (base + (j + offset) % page_size).clamp(min=0)
        read = (base + (j + offset + read_offset) % page_size).clamp(min=0)
        z = torch.zeros(1, dtype=torch.int32)
        sel = select(q[t:t + 1], k[read], w[t:t + 1], z, z + n, topk)[0].long()
        out[t] = sel.int() if logical else torch.where(sel >= 0, rows[sel.clamp(min=0)], -1)
    return out


def paged_topk_per_sequence(q, k, w, block_table, seq, k_len, page_size, topk):
    """One indexer_topk call per sequence over its keys up to its longest query (ranges
    [0, k_len)), the pages gathered as whole blocks of page_size rows."""
    T = q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32)
    pages = k.view(-1, page_size, k.shape[1]) if page_size and k.shape[0] else None
    for b in seq.unique().tolist():
        sel = (seq == b).nonzero()[:, 0]
        n = int(k_len[sel].max())
        if n == 0:
            continue
        ids = block_table[b, : -(-n // page_size)].long()
        keys = pages[ids].reshape(-1, k.shape[1])
        rows = (ids[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        z = torch.zeros(len(sel), dtype=torch.int32)
        got = indexer_topk_k(q[sel], keys, w[sel], z, k_len[sel], topk).long()
        out[sel] = torch.where(got >= 0, rows[got.clamp(min=0)], -1).int()
    return out


good("paged_indexer_topk_per_query_fp32", "paged_indexer_topk", paged_topk_k)
good("paged_indexer_topk_per_sequence_whole_pages", "paged_indexer_topk",
     paged_topk_per_sequence)
good("paged_indexer_topk_chunks_of_16_running_merge", "paged_indexer_topk",
     lambda *a: paged_topk_k(*a, chunk=16))
mutant("paged_indexer_topk_row_in_page_off_by_one", "paged_indexer_topk",
       lambda *a: paged_topk_k(*a, offset=1))
mutant("paged_indexer_topk_scores_read_one_row_on", "paged_indexer_topk",
       lambda *a: paged_topk_k(*a, read_offset=1))
mutant("paged_indexer_topk_last_key_dropped", "paged_indexer_topk",
       lambda *a: paged_topk_k(*a, drop_last=True))
mutant("paged_indexer_topk_logical_not_pool_rows", "paged_indexer_topk",
       lambda *a: paged_topk_k(*a, logical=True))
mutant("paged_indexer_topk_first_sequence_table_for_all", "paged_indexer_topk",
       lambda *a: paged_topk_k(*a, first_table=True))



def paged_fp8_k(q, k, k_scale, w, block_table, seq, k_len, page_size, topk, *,
                scales="row", quantize_q=True):
    """paged_indexer_topk_fp8 as its kernel computes it: q's e4m3 codes per row with the q
    scales folded into w, the pool's codes read through the table, each key's head sum times
    its pool row's scale. Bugs: ``scales`` "none" (the key scales left out), "logical" (the
    scale read at the key's logical position instead of its pool row); ``quantize_q=False``
    (q used unquantized, only the keys in fp8)."""
    if quantize_q:
        q8, sq = quantize_rows_e4m3(q)
        q8, w = q8.float(), w.float() * sq
    else:
        q8 = q.float()
    kf = k.float()
    sk = k_scale.float()
    T = q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32)
    for t in range(T):
        b, n = int(seq[t]), int(k_len[t])
        if n == 0:
            continue
        j = torch.arange(n)
        rows = block_table[b].long()[j // page_size] * page_size + j % page_size
        z = torch.zeros(1, dtype=torch.int32)
        sc = indexer_k(q8[t:t + 1], kf[rows], w[t:t + 1].float(), z, z + n)
        if scales == "row":
            sc = sc * sk[rows][None, :]
        elif scales == "logical":
            sc = sc * sk[j.clamp(max=sk.numel() - 1)][None, :]
        sel = topk_lexsort(sc, topk)[0].long()
        out[t] = torch.where(sel >= 0, rows[sel.clamp(min=0)], -1)
    return out


def paged_fp8_dequantized(q, k, k_scale, w, block_table, seq, k_len, page_size, topk):
    """Dequantize the whole pool in fp32, quantize q, then the per-query paged kernel."""
    deq = k.float() * k_scale.float()[:, None]
    return paged_topk_k(e4m3_rows(q), deq, w, block_table, seq, k_len, page_size, topk)


good("paged_indexer_topk_fp8_folded_scales", "paged_indexer_topk_fp8", paged_fp8_k)
good("paged_indexer_topk_fp8_dequantized_pool", "paged_indexer_topk_fp8", paged_fp8_dequantized)
mutant("paged_indexer_topk_fp8_key_scales_left_out", "paged_indexer_topk_fp8",
       lambda *a: paged_fp8_k(*a, scales="none"))
mutant("paged_indexer_topk_fp8_scale_at_logical_position", "paged_indexer_topk_fp8",
       lambda *a: paged_fp8_k(*a, scales="logical"))
mutant("paged_indexer_topk_fp8_q_not_quantized", "paged_indexer_topk_fp8",
       lambda *a: paged_fp8_k(*a, quantize_q=False))

# --------------------------------------------------------------------------- attention
def _dense_keys(k, v, k_start, k_end):
    """Dense attention: every query sees all S keys ([S, Hk, D], shared) under a range mask."""
    s = torch.arange(k.shape[0])
    return k, v, (s >= k_start.long()[:, None]) & (s < k_end.long()[:, None])


def _sparse_keys(k, v, idx):
    """Sparse attention: each query's rows gathered ([T, K, Hk, D]); -1 columns masked."""
    safe = idx.long().clamp(min=0)
    return k[safe], v[safe], idx >= 0


def _cols(x: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    """Keys s0:s1 of shared [K, Hk, D] or per-query [T, K, Hk, D] keys, in fp32."""
    return (x[s0:s1] if x.dim() == 3 else x[:, s0:s1]).float()


def _scores(qf, kb):
    return torch.einsum("tjgd,kjd->tjgk" if kb.dim() == 3 else "tjgd,tkjd->tjgk", qf, kb)


def _pv(p, vb):
    return torch.einsum("tjgk,kjd->tjgd" if vb.dim() == 3 else "tjgk,tkjd->tjgd", p, vb)


def _finish(acc, l, m, T, H, dtype):
    """out = acc / l and lse = m + log l; rows without a valid key give 0 and -inf."""
    empty = l == 0
    out = (acc / torch.where(empty, torch.ones_like(l), l)[..., None]).masked_fill(
        empty[..., None], 0.0)
    lse = torch.where(empty, torch.full_like(l, NEG_INF), m + torch.log(l))
    return out.reshape(T, H, -1).to(dtype), lse.reshape(T, H)


def attend_online(q, kg, vg, valid, scale, block, p_dtype=None):
    """Blockwise online softmax in fp32 (running max, rescaled sums). With ``p_dtype`` the
    probabilities are rounded to it before the PV product, as flash kernels do; the row sum l
    stays fp32."""
    T, H, D = q.shape
    Hk, Dv = kg.shape[-2], vg.shape[-1]
    qf = q.float().reshape(T, Hk, H // Hk, D)
    m = torch.full(qf.shape[:3], NEG_INF)
    l = torch.zeros(qf.shape[:3])
    acc = torch.zeros(*qf.shape[:3], Dv)
    for s0 in range(0, valid.shape[1], block):
        s1 = min(s0 + block, valid.shape[1])
        sc = (_scores(qf, _cols(kg, s0, s1)) * scale).masked_fill(
            ~valid[:, None, None, s0:s1], NEG_INF)
        m_new = torch.maximum(m, sc.amax(-1))
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_use)
        p = torch.exp(sc - m_use[..., None])
        l = l * alpha + p.sum(-1)
        pv = p.to(p_dtype).float() if p_dtype is not None else p
        acc = acc * alpha[..., None] + _pv(pv, _cols(vg, s0, s1))
        m = m_new
    return _finish(acc, l, m, T, H, q.dtype)


def attend_reversed(q, kg, vg, valid, scale, chunk=64):
    """Softmax with one global max, but the normaliser and the PV sum accumulate the keys
    from the last chunk to the first, each chunk's keys in reverse order."""
    T, H, D = q.shape
    Hk, Dv = kg.shape[-2], vg.shape[-1]
    qf = q.float().reshape(T, Hk, H // Hk, D)
    K = valid.shape[1]
    sc = (_scores(qf, _cols(kg, 0, K)) * scale).masked_fill(~valid[:, None, None, :], NEG_INF)
    m = sc.amax(-1)
    p = torch.exp(sc - torch.where(torch.isinf(m), torch.zeros_like(m), m)[..., None])
    l = torch.zeros(qf.shape[:3])
    acc = torch.zeros(*qf.shape[:3], Dv)
    for s0 in reversed(range(0, K, chunk)):
        s1 = min(s0 + chunk, K)
        pc = p[..., s0:s1].flip(-1)
        vc = _cols(vg, s0, s1).flip(0 if vg.dim() == 3 else 1)
        l = l + pc.sum(-1)
        acc = acc + _pv(pc, vc)
    return _finish(acc, l, m, T, H, q.dtype)


def _gqa_modulo(q, run):
    """Wrong GQA layout: query head h reads KV head h % Hk instead of h // (H/Hk). Done by
    permuting q's heads so the reference grouping realises the modulo mapping."""

    def kernel(hk):
        H = q.shape[1]
        perm = torch.tensor([h for j in range(hk) for h in range(H) if h % hk == j])
        out, lse = run(q[:, perm])
        inv = torch.argsort(perm)
        return out[:, inv].contiguous(), lse[:, inv].contiguous()

    return kernel


def sparse_k(q, k, v, idx, scale, *, scale_mul=1.0, key_cap=None, drop_last=False,
             wrap_minus_one=False, lse_base2=False, gqa_modulo=False):
    idx = idx.clone()
    T, K = idx.shape
    if key_cap is not None:
        idx[:, key_cap:] = -1
    if drop_last:  # the last valid column of each row is lost at a tile edge
        pos = torch.where(idx >= 0, torch.arange(K).expand(T, K), torch.full((T, K), -1))
        last = pos.amax(1)
        rows = (last >= 0).nonzero().squeeze(1)
        idx[rows, last[rows]] = -1
    if wrap_minus_one:  # idx + S for -1: the last row of k
        idx = torch.where(idx < 0, idx + k.shape[0], idx)
    run = lambda qq: ref("sparse_attention")(  # noqa: E731
        qq.float(), k.float(), v.float(), idx, scale * scale_mul)
    out, lse = _gqa_modulo(q, run)(k.shape[1]) if gqa_modulo else run(q)
    return out.to(q.dtype), (lse * LOG2E if lse_base2 else lse).float()


def attention_k(q, k, v, k_start, k_end, scale, *, scale_mul=1.0, key_cap=None,
                drop_last=False, lse_base2=False, gqa_modulo=False):
    if key_cap is not None:
        k_end = torch.minimum(k_end, k_start + key_cap)
    if drop_last:
        k_end = torch.where(k_end > k_start, k_end - 1, k_end)
    run = lambda qq: ref("attention")(  # noqa: E731
        qq.float(), k.float(), v.float(), k_start, k_end, scale * scale_mul)
    out, lse = _gqa_modulo(q, run)(k.shape[1]) if gqa_modulo else run(q)
    return out.to(q.dtype), (lse * LOG2E if lse_base2 else lse).float()


for _blk in (16, 64):
    good(f"sparse_attention_online_softmax_block{_blk}", "sparse_attention",
         lambda q, k, v, i, sc, _b=_blk: attend_online(q, *_sparse_keys(k, v, i), sc, _b))
    good(f"attention_online_softmax_block{_blk}", "attention",
         lambda q, k, v, a, b, sc, _b=_blk: attend_online(q, *_dense_keys(k, v, a, b), sc, _b))
good("sparse_attention_keys_reversed", "sparse_attention",
     lambda q, k, v, i, sc: attend_reversed(q, *_sparse_keys(k, v, i), sc))
good("attention_keys_reversed", "attention",
     lambda q, k, v, a, b, sc: attend_reversed(q, *_dense_keys(k, v, a, b), sc))
good("sparse_attention_flash_p_in_dtype", "sparse_attention",
     lambda q, k, v, i, sc: attend_online(q, *_sparse_keys(k, v, i), sc, 16, q.dtype), LOW)
good("attention_flash_p_in_dtype", "attention",
     lambda q, k, v, a, b, sc: attend_online(q, *_dense_keys(k, v, a, b), sc, 16, q.dtype), LOW)

_ATTN_MUTATIONS = {
    "softmax_scale_1pct_high": dict(scale_mul=1.01),
    "softmax_scale_5pct_high": dict(scale_mul=1.05),
    "first16_keys_only": dict(key_cap=16),
    "drops_last_valid_key": dict(drop_last=True),
    "lse_left_in_base2": dict(lse_base2=True),
    "gqa_head_modulo_layout": dict(gqa_modulo=True),
}
for _name, _kw in _ATTN_MUTATIONS.items():
    mutant(f"sparse_attention_{_name}", "sparse_attention",
           lambda q, k, v, i, sc, _kw=_kw: sparse_k(q, k, v, i, sc, **_kw))
    mutant(f"attention_{_name}", "attention",
           lambda q, k, v, a, b, sc, _kw=_kw: attention_k(q, k, v, a, b, sc, **_kw))
mutant("sparse_attention_wraps_minus_one_to_last_row", "sparse_attention",
       lambda q, k, v, i, sc: sparse_k(q, k, v, i, sc, wrap_minus_one=True))


# =========================================================================== MLA
def mla_prolog_k(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, kv_cache, slots,
                 absorb, *, interleaved=True, slot_shift=0, q_split_swapped=False,
                 dtype_intermediates=False):
    """fp32 MLA prolog; with ``dtype_intermediates`` every GEMM, norm and rope output is held
    in x's dtype, as an unfused kernel chain computes it."""
    dt = x.dtype
    H, Dn, Rkv = w_uk.shape
    Dr = cos.shape[1] * 2
    hold = (lambda t: t.to(dt).float()) if dtype_intermediates else (lambda t: t)
    xf = x.float()
    c_q = hold(rms_norm_k(hold(xf @ w_qa.float().T), g_qa, eps))
    qh = hold(c_q @ w_qb.float().T).reshape(x.shape[0], H, Dn + Dr)
    if q_split_swapped:
        q_pe, q_nope = qh[..., :Dr], qh[..., Dr:]
    else:
        q_nope, q_pe = qh[..., :Dn], qh[..., Dn:]
    q_pe = hold(rope_k(q_pe, cos, sin, interleaved))
    q_main = hold(torch.einsum("thd,hdc->thc", q_nope, w_uk.float())) if absorb else q_nope
    kv = hold(xf @ w_kva.float().T)
    ckv = hold(rms_norm_k(kv[:, :Rkv], g_kva, eps))
    k_pe = hold(rope_k(kv[:, Rkv:], cos, sin, interleaved))
    keep = slots >= 0
    rows = slots[keep].long()
    if slot_shift:  # the wrong row, kept in range (a real kernel writes past the end silently)
        rows = (rows + slot_shift) % kv_cache.shape[0]
    kv_cache[rows] = torch.cat((ckv, k_pe), -1)[keep].to(kv_cache.dtype)
    return q_main.to(dt).contiguous(), q_pe.to(dt).contiguous(), c_q.to(dt)


good("mla_prolog_fp32", "mla_prolog", mla_prolog_k)
good("mla_prolog_unfused_dtype_intermediates", "mla_prolog",
     lambda *a: mla_prolog_k(*a, dtype_intermediates=True))
mutant("mla_prolog_cache_at_slot_plus_one", "mla_prolog",
       lambda *a: mla_prolog_k(*a, slot_shift=1))
mutant("mla_prolog_neox_rope", "mla_prolog", lambda *a: mla_prolog_k(*a, interleaved=False))
mutant("mla_prolog_q_rows_pe_first", "mla_prolog",
       lambda *a: mla_prolog_k(*a, q_split_swapped=True))


# =========================================================================== MoE
def moe_route_k(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling, *,
                ties_to_larger=False, group_score="top2", weights_with_bias=False):
    s = torch.sigmoid(logits.float())
    sel = s + bias.float()
    T, E = sel.shape
    if n_group > 1:
        gr = sel.reshape(T, n_group, E // n_group)
        gs = gr.topk(2, dim=-1).values.sum(-1) if group_score == "top2" else gr.amax(-1)
        keep = torch.sort(gs, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        gmask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
        sel = gr.masked_fill(~gmask[..., None], NEG_INF).reshape(T, E)
    if ties_to_larger:
        ids = E - 1 - torch.sort(sel.flip(-1), dim=-1, descending=True, stable=True).indices
    else:
        ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices
    ids = ids[:, :top_k]
    w = torch.gather(sel if weights_with_bias else s, 1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routed_scaling, ids.to(torch.int32)


def moe_route_sorted_tuples(logits, bias, top_k, n_group, topk_group, norm_topk_prob,
                            routed_scaling):
    """One token at a time, Python sorts keyed by (-score, id)."""
    s = torch.sigmoid(logits.float())
    sel = s + bias.float()
    T, E = sel.shape
    per = E // n_group
    ids = torch.zeros(T, top_k, dtype=torch.int32)
    for t in range(T):
        row = sel[t].tolist()
        allowed = range(E)
        if n_group > 1:
            gsc = [sum(sorted(row[g * per : (g + 1) * per], reverse=True)[:2])
                   for g in range(n_group)]
            kept = sorted(range(n_group), key=lambda g: (-gsc[g], g))[:topk_group]
            allowed = [e for e in range(E) if e // per in kept]
        ids[t] = torch.tensor(sorted(allowed, key=lambda e: (-row[e], e))[:top_k])
    w = torch.gather(s, 1, ids.long())
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routed_scaling, ids


FP32 = (F32,)  # moe_route accepts fp32 logits only
good("moe_route_fp32", "moe_route", moe_route_k, FP32)
good("moe_route_per_token_sorted_tuples", "moe_route", moe_route_sorted_tuples, FP32)
mutant("moe_route_ties_to_larger_expert", "moe_route",
       lambda *a: moe_route_k(*a, ties_to_larger=True), FP32)
mutant("moe_route_weights_include_bias", "moe_route",
       lambda *a: moe_route_k(*a, weights_with_bias=True), FP32)
mutant("moe_route_group_score_max_not_top2", "moe_route",
       lambda *a: moe_route_k(*a, group_score="max"), FP32)


def moe_experts_k(x, ids, weights, w13, w2, *, use_weights=True, minus_one_as_zero=False,
                  up_gate_swapped=False, dtype_intermediates=False):
    dt = x.dtype
    T, D = x.shape
    hold = (lambda t: t.to(dt).float()) if dtype_intermediates else (lambda t: t)
    il = ids.long()
    if minus_one_as_zero:
        il = il.clamp(min=0)
    xf = x.float()
    y = torch.zeros(T, D)
    for e in torch.unique(il[il >= 0]).tolist():
        t, j = (il == e).nonzero(as_tuple=True)
        h = hold(xf[t] @ w13[e].float().T)
        i = h.shape[-1] // 2
        gate, up = (h[:, i:], h[:, :i]) if up_gate_swapped else (h[:, :i], h[:, i:])
        o = hold(F.silu(gate) * up) @ w2[e].float().T
        wt = weights[t, j].float() if use_weights else torch.ones(len(t))
        y.index_add_(0, t, o * wt[:, None])
    return y.to(dt)


def moe_experts_per_token(x, ids, weights, w13, w2):
    T, D = x.shape
    y = torch.zeros(T, D)
    for t in range(T):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = w13[e].float() @ x[t].float()
            i = h.shape[0] // 2
            y[t] += float(weights[t, j]) * (w2[e].float() @ (F.silu(h[:i]) * h[i:]))
    return y.to(x.dtype)


good("moe_experts_fp32", "moe_experts", moe_experts_k)
good("moe_experts_per_token_loop", "moe_experts", moe_experts_per_token)
good("moe_experts_dtype_intermediates", "moe_experts",
     lambda *a: moe_experts_k(*a, dtype_intermediates=True))
mutant("moe_experts_ignores_routing_weights", "moe_experts",
       lambda *a: moe_experts_k(*a, use_weights=False))
mutant("moe_experts_minus_one_is_expert_0", "moe_experts",
       lambda *a: moe_experts_k(*a, minus_one_as_zero=True))
mutant("moe_experts_w13_up_gate_swapped", "moe_experts",
       lambda *a: moe_experts_k(*a, up_gate_swapped=True))


# =========================================================================== quantization
# (weight bits, activation bits or None, grouped by 128) -- the schemes of docs/ops.md.
SCHEMES = {"w8a16": (8, None, False), "w8a8": (8, 8, False), "w4a8": (4, 8, True),
           "w6a12": (6, 12, True)}
GROUP = 128


def quantize_per_token_k(x, bits, *, qmax8=127, reciprocal=False, half_away=False):
    qmax = qmax8 if bits == 8 else 2047
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    quot = xf * (1.0 / s) if reciprocal else xf / s
    # round half away from zero (C's round()) instead of docs/ops.md's half to even
    q = (torch.sign(quot) * torch.floor(quot.abs() + 0.5) if half_away else torch.round(quot))
    q = q.clamp(-qmax, qmax)
    q = q.to(torch.int32).to(torch.int8 if bits == 8 else torch.int16)
    return q, s.squeeze(-1)


good("quantize_per_token_fp32", "quantize_per_token", quantize_per_token_k)
good("quantize_per_token_reciprocal", "quantize_per_token",
     lambda x, b: quantize_per_token_k(x, b, reciprocal=True))
mutant("quantize_per_token_rounds_half_away_from_zero", "quantize_per_token",
       lambda x, b: quantize_per_token_k(x, b, half_away=True))
mutant("quantize_per_token_qmax_128", "quantize_per_token",
       lambda x, b: quantize_per_token_k(x, b, qmax8=128))


def unpack_k(p: torch.Tensor, bits: int, K: int, int4_signed: bool = True) -> torch.Tensor:
    if bits == 8:
        return p[..., :K].to(torch.int32)
    p = p.to(torch.int32)
    if bits == 4:
        u = torch.stack((p & 0xF, (p >> 4) & 0xF), -1).reshape(*p.shape[:-1], -1)
        if int4_signed:
            u = torch.where(u >= 8, u - 16, u)
        return u[..., :K]
    b = p.reshape(*p.shape[:-1], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    u = torch.stack([(word >> (6 * j)) & 0x3F for j in range(4)], -1).reshape(*p.shape[:-1], -1)
    return torch.where(u >= 32, u - 64, u)[..., :K]


def _grouped(t: torch.Tensor) -> torch.Tensor:
    K = t.shape[-1]
    G = (K + GROUP - 1) // GROUP
    return F.pad(t, (0, G * GROUP - K)).reshape(*t.shape[:-1], G, GROUP)


def quant_linear_k(x, w_packed, w_scale, scheme, bias=None, *, quantize_act=True,
                   int4_signed=True, reciprocal=False, first_group_scale=False):
    wbits, abits, grouped = SCHEMES[scheme]
    K = x.shape[1]
    wq = unpack_k(w_packed, wbits, K, int4_signed).float()
    ws = w_scale.float()
    if grouped and first_group_scale:  # one scale per row: group 0's for every group
        ws = ws[:, :1].expand_as(ws)
    if abits is None or not quantize_act:  # float GEMM on dequantized weights
        sfull = ws.repeat_interleave(GROUP, -1)[:, :K] if grouped else ws[:, None]
        y = x.float() @ (wq * sfull).T
    else:
        xq, sx = quantize_per_token_k(x, abits, reciprocal=reciprocal)
        if grouped:  # exact integer sums per group (float64 holds them exactly)
            isum = torch.einsum("mgk,ngk->mng", _grouped(xq.double()), _grouped(wq.double()))
            y = sx[:, None] * (isum.float() * ws[None]).sum(-1)
        else:
            y = sx[:, None] * (xq.double() @ wq.double().T).float() * ws[None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


good("quant_linear_fp32", "quant_linear", quant_linear_k)
good("quant_linear_reciprocal_scale", "quant_linear",
     lambda *a: quant_linear_k(*a, reciprocal=True))
mutant("quant_linear_never_quantizes_activations", "quant_linear",
       lambda *a: quant_linear_k(*a, quantize_act=False))
mutant("quant_linear_int4_no_sign_extension", "quant_linear",
       lambda *a: quant_linear_k(*a, int4_signed=False))
mutant("quant_linear_first_group_scale_only", "quant_linear",
       lambda *a: quant_linear_k(*a, first_group_scale=True))


def moe_experts_quant_k(x, ids, weights, w13p, w13s, w2p, w2s, scheme, *, quantize_act=True,
                        per_token=False):
    dt = x.dtype
    T, D = x.shape
    y = torch.zeros(T, D)
    il = ids.long()

    def expert(e, rows):
        h = quant_linear_k(x[rows], w13p[e], w13s[e], scheme, quantize_act=quantize_act).float()
        i = h.shape[-1] // 2
        a = (F.silu(h[:, :i]) * h[:, i:]).to(dt)  # held in x's dtype (the contract)
        return quant_linear_k(a, w2p[e], w2s[e], scheme, quantize_act=quantize_act).float()

    if per_token:
        for t in range(T):
            for j in range(il.shape[1]):
                if il[t, j] >= 0:
                    y[t] += float(weights[t, j]) * expert(int(il[t, j]), [t])[0]
    else:
        for e in torch.unique(il[il >= 0]).tolist():
            t, j = (il == e).nonzero(as_tuple=True)
            y.index_add_(0, t, expert(e, t) * weights[t, j].float()[:, None])
    return y.to(dt)


good("moe_experts_quant_fp32", "moe_experts_quant", moe_experts_quant_k)
good("moe_experts_quant_per_token_loop", "moe_experts_quant",
     lambda *a: moe_experts_quant_k(*a, per_token=True))
# Not in bf16: there the contract itself rounds the activation between the two projections to
# bf16 (quant_linear's output is in x's dtype), an error of up to 0.4% per element, and skipping
# its 8-bit quantization (~0.7% rms, 12-bit: 16x less) sits inside what that rounding may do,
# so no sound bound tells the two apart. The first projection's activation is the input itself
# (exact): quant_linear_never_quantizes_activations checks that case in every dtype.
mutant("moe_experts_quant_never_quantizes_activations", "moe_experts_quant",
       lambda *a: moe_experts_quant_k(*a, quantize_act=False), dtypes=(F32, F16))


# =========================================================================== RL
VOCAB_TILE = 4096


def token_logprobs_k(h, w_vocab, targets, temperature, *, temp_mul=1.0, entropy_base2=False,
                     drops_tail_tile=False):
    """Online logsumexp over vocabulary tiles of 4096 rows, fp32."""
    T, V = h.shape[0], w_vocab.shape[0]
    hf = h.float() / (temperature * temp_mul)
    end = (V // VOCAB_TILE) * VOCAB_TILE if drops_tail_tile and V > VOCAB_TILE else V
    m = torch.full((T,), NEG_INF)
    ssum, zsum = torch.zeros(T), torch.zeros(T)
    for v0 in range(0, end, VOCAB_TILE):
        z = hf @ w_vocab[v0 : min(v0 + VOCAB_TILE, end)].float().T
        m_new = torch.maximum(m, z.amax(-1))
        alpha = torch.exp(m - m_new)
        e = torch.exp(z - m_new[:, None])
        ssum = ssum * alpha + e.sum(-1)
        zsum = zsum * alpha + (e * z).sum(-1)
        m = m_new
    zt = (hf * w_vocab[targets.long()].float()).sum(-1)
    lse = m + torch.log(ssum)
    ent = lse - zsum / ssum
    return zt - lse, (ent * LOG2E if entropy_base2 else ent)


def token_logprobs_log_softmax(h, w_vocab, targets, temperature):
    """Full [T, V] logits and torch.log_softmax, fp32."""
    lp = torch.log_softmax((h.float() @ w_vocab.float().T) / temperature, dim=-1)
    return lp.gather(1, targets.long()[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)


good("token_logprobs_online_tiles", "token_logprobs", token_logprobs_k)
good("token_logprobs_full_log_softmax", "token_logprobs", token_logprobs_log_softmax)
mutant("token_logprobs_temperature_0p5pct_off", "token_logprobs",
       lambda *a: token_logprobs_k(*a, temp_mul=1.005))
mutant("token_logprobs_entropy_in_bits", "token_logprobs",
       lambda *a: token_logprobs_k(*a, entropy_base2=True))
mutant("token_logprobs_drops_partial_last_tile", "token_logprobs",
       lambda *a: token_logprobs_k(*a, drops_tail_tile=True))


def grpo_k(rewards, group_size, std_normalize, eps, *, biased=False, batch_std=False):
    r = rewards.float().reshape(-1, group_size)
    a = r - r.mean(-1, keepdim=True)
    if std_normalize:
        sd = (r.reshape(-1).std(unbiased=not biased) if batch_std
              else r.std(-1, unbiased=not biased, keepdim=True))
        a = a / (sd + eps)
    return a.reshape(-1).to(rewards.dtype)


def grpo_two_pass(rewards, group_size, std_normalize, eps):
    """Explicit sums, and a multiply by the reciprocal of (std + eps)."""
    r = rewards.float().reshape(-1, group_size)
    mean = r.sum(-1, keepdim=True) / group_size
    a = r - mean
    if std_normalize:
        var = (a * a).sum(-1, keepdim=True) / (group_size - 1)
        a = a * (1.0 / (torch.sqrt(var) + eps))
    return a.reshape(-1).to(rewards.dtype)


good("grpo_advantages_fp32", "grpo_advantages", grpo_k)
good("grpo_advantages_two_pass_reciprocal", "grpo_advantages", grpo_two_pass)
mutant("grpo_advantages_biased_std", "grpo_advantages", lambda *a: grpo_k(*a, biased=True))
mutant("grpo_advantages_std_over_batch", "grpo_advantages",
       lambda *a: grpo_k(*a, batch_std=True))


def policy_loss_k(logp, old_logp, adv, mask, clip_low, clip_high, rollout_logp, tis_cap, *,
                  clip_high_both_sides=False, no_tis_cap=False, denom_all_tokens=False,
                  min_form=False):
    lp, olp, A = logp.float(), old_logp.float(), adv.float()
    m = mask.float()
    if min_form:  # exp(logp) * exp(-old_logp); -min(rA, clip(r)A)
        ratio = torch.exp(lp) * torch.exp(-olp)
    else:
        ratio = torch.exp(lp - olp)
    low = 1.0 - (clip_high if clip_high_both_sides else clip_low)
    cl = torch.clamp(ratio, low, 1.0 + clip_high)
    if min_form:
        per_tok = -torch.minimum(ratio * A, cl * A)
        active = (cl * A) < (ratio * A)
    else:
        unclipped, clipped = -ratio * A, -cl * A
        per_tok = torch.maximum(unclipped, clipped)
        active = clipped > unclipped
    if rollout_logp is not None:
        w = torch.exp(olp - rollout_logp.float())
        per_tok = per_tok * (w if no_tis_cap else w.clamp(max=tis_cap))
    denom = torch.tensor(float(max(len(m), 1))) if denom_all_tokens else m.sum().clamp(min=1.0)
    loss = (per_tok * m).sum() / denom
    stats = torch.stack((
        (active.float() * m).sum() / denom,
        (ratio * m).sum() / denom,
        ((olp - lp) * m).sum() / denom,
    ))
    return loss, stats


good("policy_loss_fp32", "policy_loss", policy_loss_k)
good("policy_loss_min_form_exp_product", "policy_loss",
     lambda *a: policy_loss_k(*a, min_form=True))
mutant("policy_loss_clip_high_on_both_sides", "policy_loss",
       lambda *a: policy_loss_k(*a, clip_high_both_sides=True))
mutant("policy_loss_tis_cap_not_applied", "policy_loss",
       lambda *a: policy_loss_k(*a, no_tis_cap=True))
mutant("policy_loss_mean_over_all_tokens", "policy_loss",
       lambda *a: policy_loss_k(*a, denom_all_tokens=True))


# =========================================================================== harness
_ROWS: dict[str, list[Row]] = {}  # kernels are deterministic: one parity run per case


def parity_rows(case: Case) -> list[Row]:
    if case.name not in _ROWS:
        b = glm5.Backend(f"mut_{case.name}", vendor="test", device_type="cpu", priority=5)
        b.kernel(case.op, dtypes=case.dtypes)(case.fn)
        glm5.get_registry().register(b)
        try:
            _ROWS[case.name] = run_parity(b, [case.op], examples=EXAMPLES[case.expect],
                                          **PARITY)
        finally:
            glm5.reset_registry()
    return _ROWS[case.name]


def _check_rows(case: Case, rows: list[Row]) -> None:
    want = sorted(dtype_name(d) for d in case.dtypes)
    assert sorted(r.dtype for r in rows) == want, (
        f"{case.name}: parity rows for {[r.dtype for r in rows]}, registered {want}")
    wrong = [r for r in rows if r.status != case.expect]
    if case.expect == "fail":
        detail = [f"  {r.dtype}: {r.status} after {r.examples} examples "
                  f"(max_abs_err {r.max_abs_err:.3g}, max_rel_err {r.max_rel_err:.3g}) "
                  f"{r.message}" for r in wrong]
        assert not wrong, (f"the kit let mutant {case.name} ({case.op}) through in "
                           f"{len(wrong)}/{len(rows)} dtypes:\n" + "\n".join(detail))
    else:
        detail = [f"  {r.dtype}: {r.status}: {r.message}" for r in wrong]
        assert not wrong, (f"the kit rejects right kernel {case.name} ({case.op}) in "
                           f"{len(wrong)}/{len(rows)} dtypes:\n" + "\n".join(detail))


def test_case_names_are_unique_and_ops_known():
    names = [c.name for c in MUTANTS + GOOD]
    assert len(names) == len(set(names))
    assert {c.op for c in MUTANTS + GOOD} <= set(OPS)


@pytest.mark.parametrize("case", MUTANTS, ids=lambda c: c.name)
def test_kit_fails_mutant(case: Case):
    _check_rows(case, parity_rows(case))


@pytest.mark.parametrize("case", GOOD, ids=lambda c: c.name)
def test_kit_passes_right_kernel(case: Case):
    _check_rows(case, parity_rows(case))


def mutation_report() -> tuple[str, dict[str, tuple[int, int]]]:
    dts = [dtype_name(d) for d in FLOATS]
    score = {d: [0, 0] for d in dts}
    missed = []
    for case in MUTANTS:
        rows = parity_rows(case)
        for r in rows:
            score[r.dtype][1] += 1
            score[r.dtype][0] += r.status == "fail"
        if any(r.status != "fail" for r in rows):
            missed.append((case, {r.dtype: r.status for r in rows}))
    false_fails = [(c, r) for c in GOOD for r in parity_rows(c) if r.status != "pass"]
    tot = [sum(v[0] for v in score.values()), sum(v[1] for v in score.values())]
    pct = lambda c, t: f"{c}/{t} ({100.0 * c / max(t, 1):.0f}%)"  # noqa: E731
    knob = ", ".join(f"{k}={v}" for k, v in {**PARITY, "examples": EXAMPLES}.items())
    lines = [f"mutants caught by the kit ({knob}; {len(MUTANTS)} mutants, "
             f"{len(GOOD)} right kernels)"]
    lines += [f"  {d:<9} {pct(*score[d])}" for d in dts if score[d][1]]
    lines.append(f"  {'all':<9} {pct(*tot)}")
    if missed:
        lines.append("mutants the kit lets through (per dtype: fail = caught):")
        for case, st in missed:
            cells = "  ".join(f"{d}={st.get(d, '-')}" for d in dts)
            lines.append(f"  {case.name:<52} {cells}")
    if false_fails:
        lines.append("right kernels the kit rejects:")
        for case, r in false_fails:
            lines.append(f"  {case.name} [{r.dtype}] {r.status}: {r.message}")
    return "\n".join(lines), {d: tuple(v) for d, v in score.items()}


def test_mutation_score_is_100_percent(pytestconfig):
    from conftest import MUTATION_SCORE

    text, score = mutation_report()
    pytestconfig.stash[MUTATION_SCORE] = text  # printed by tests/conftest.py, even with -q
    caught = sum(c for c, _ in score.values())
    total = sum(t for _, t in score.values())
    assert caught == total, f"mutation score {caught}/{total} < 100%\n{text}"
