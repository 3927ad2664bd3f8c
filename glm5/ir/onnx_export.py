"""ONNX export of glm5 ops: each op is an ONNX function in domain ``glm5`` (opset 1) whose body
uses standard ONNX ops (opset 18), so onnxruntime's CPU provider runs it.

Two ways to use it with ``torch.onnx.export(..., dynamo=True)`` (checked with torch 2.13,
onnxscript 0.7, onnxruntime 1.32):

- ``torch.onnx.export(model, args, dynamo=True, custom_translation_table=translation_table())``
  gives a model of standard ONNX ops only. The glm5 bodies are traced in place (a nested glm5
  function becomes a call that torch inlines): torch 2.13's exporter always runs the onnxscript
  version converter (``export_compat`` passes an ``opset_version``, 20 by default), and that pass
  inlines every model-local function, as does ``optimize=True``. So no ``glm5`` function
  survives this path.
- ``export(model, args, ...)`` (this module) keeps the ops as ONNX functions: the translation
  (``translation_table(keep_functions=True)``) emits one opaque ``glm5::<op>`` node per op, which
  the version converter and optimizer leave alone, and ``attach_functions`` then adds the
  function bodies (and the glm5 functions they call) to the model.

Ops covered: rms_norm, layer_norm, rope, silu_mul, attention, lightning_indexer, topk_indices,
indexer_topk, indexer_topk_fp8, sparse_attention, moe_route, moe_experts, mla_prolog. Quant, RL
and paged ops are not.

mla_prolog mutates ``kv_cache``. torch.export functionalises it into
``higher_order.auto_functionalized_v2(glm5.mla_prolog, ..., _all_bases=[kv_cache])`` whose extra
output is the updated cache. torch 2.13's ONNX exporter cannot translate that node whatever the
table says (it converts the OpOverload argument as if it were an FX node: KeyError), so
``functionalize(ep)`` replaces it by ``glm5_onnx.mla_prolog`` (no mutation, fourth output = the
updated cache), which translates to ``glm5::mla_prolog`` (the cache write is a ``ScatterND`` of
the rows with ``slot >= 0``). ``export`` does this itself; with plain ``torch.onnx.export`` pass
``functionalize(torch.export.export(model, args))`` instead of the module. torch's exporter keeps
only user outputs as graph outputs: the updated cache is an output of the ONNX model only if the
module returns the cache tensor (input or buffer) it wrote into; otherwise the write is dropped.
A buffer cache becomes an initializer: ONNX has no state, each run starts from the exported
cache.

Differences from the eager kernels (the reference semantics are kept):
- every op materialises its full intermediates ([T, S] scores, [T, H, S] indexer dots, dense
  [E, T, *] expert activations): an exported graph is a portable oracle, not a fast kernel;
- ``moe_experts`` runs every expert on every token and weights the results by a [T, E] routing
  matrix built from ``ids`` (-1 ignored);
- math runs in float32 (float64 for float64 inputs) as in the references; outputs are cast back;
- float attributes (eps, scale, routed_scaling) are float32 in ONNX: a float64 export carries
  them to ~6e-8 relative, not to float64 precision.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any, Callable, Iterator, Sequence, TypeVar, Union

import onnx
import onnx_ir as ir
import onnxscript
import torch
from onnxscript import BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, INT32, INT64
from onnxscript import opset18 as op

from glm5.ir import library

DOMAIN = "glm5"
VERSION = 1
GLM5 = onnxscript.values.Opset(DOMAIN, VERSION)

TFloat = TypeVar("TFloat", bound=Union[FLOAT16, FLOAT, DOUBLE, BFLOAT16])
TFloat2 = TypeVar("TFloat2", bound=Union[FLOAT16, FLOAT, DOUBLE, BFLOAT16])
TFloat3 = TypeVar("TFloat3", bound=Union[FLOAT16, FLOAT, DOUBLE, BFLOAT16])
TAcc = TypeVar("TAcc", bound=Union[FLOAT, DOUBLE])
TAcc2 = TypeVar("TAcc2", bound=Union[FLOAT, DOUBLE])
TIdx = TypeVar("TIdx", bound=Union[INT32, INT64])
TIdx2 = TypeVar("TIdx2", bound=Union[INT32, INT64])

TCache = TypeVar("TCache", bound=Union[FLOAT16, FLOAT, DOUBLE, BFLOAT16])

NEG_INF = float("-inf")
_F32 = 1  # onnx.TensorProto.FLOAT
_F64 = 11  # onnx.TensorProto.DOUBLE
# In the bodies: Cast(to=7) is INT64, Cast(to=6) is INT32.

# Function bodies are written in onnxscript. Rules kept so each body also runs eagerly under
# torch's tracer (the inlining path): constants through op.Constant/CastLike, no Python literals
# in tensor arithmetic, no comparison operators on tensors, every multi-output op unpacked.


# --------------------------------------------------------------------------- norm / position
@onnxscript.script(GLM5, default_opset=op)
def rms_norm(x: TFloat, weight: TFloat2, eps: float, acc: int) -> TFloat:
    """x * rsqrt(mean(x^2, -1) + eps) * weight in the accumulation dtype `acc`."""
    xf = op.Cast(x, to=acc)
    ms = op.ReduceMean(op.Mul(xf, xf), op.Constant(value_ints=[-1]), keepdims=1)
    e = op.CastLike(op.Constant(value_float=eps), xf)
    y = op.Mul(op.Mul(xf, op.Reciprocal(op.Sqrt(op.Add(ms, e)))), op.Cast(weight, to=acc))
    return op.CastLike(y, x)


@onnxscript.script(GLM5, default_opset=op)
def layer_norm(x: TFloat, weight: TFloat2, bias: TFloat3, eps: float, acc: int) -> TFloat:
    """LayerNorm over the last dim in the accumulation dtype."""
    xf = op.Cast(x, to=acc)
    y, _mean, _inv = op.LayerNormalization(
        xf, op.Cast(weight, to=acc), op.Cast(bias, to=acc), axis=-1, epsilon=eps
    )
    return op.CastLike(y, x)


@onnxscript.script(GLM5, default_opset=op)
def rope(x: TFloat, cos: TFloat2, sin: TFloat2, interleaved: bool, acc: int) -> TFloat:
    """Rotary embedding of x[T, ..., R] by cos/sin[T, R/2]; interleaved or NeoX pairs."""
    shape = op.Shape(x)
    t = op.Shape(x, start=0, end=1)
    r = op.Shape(x, start=-1)
    x3 = op.Reshape(op.Cast(x, to=acc), op.Concat(t, op.Constant(value_ints=[-1]), r, axis=0))
    c = op.Unsqueeze(op.Cast(cos, to=acc), op.Constant(value_ints=[1]))  # [T, 1, R/2]
    s = op.Unsqueeze(op.Cast(sin, to=acc), op.Constant(value_ints=[1]))
    if interleaved:
        x4 = op.Reshape(x3, op.Constant(value_ints=[0, 0, -1, 2]))  # [T, M, R/2, 2]
        a4, b4 = op.Split(x4, axis=-1, num_outputs=2)
        a = op.Squeeze(a4, op.Constant(value_ints=[-1]))
        b = op.Squeeze(b4, op.Constant(value_ints=[-1]))
        ra = op.Unsqueeze(op.Sub(op.Mul(a, c), op.Mul(b, s)), op.Constant(value_ints=[-1]))
        rb = op.Unsqueeze(op.Add(op.Mul(b, c), op.Mul(a, s)), op.Constant(value_ints=[-1]))
        y3 = op.Concat(ra, rb, axis=-1)
    else:
        a, b = op.Split(x3, axis=-1, num_outputs=2)
        y3 = op.Concat(op.Sub(op.Mul(a, c), op.Mul(b, s)), op.Add(op.Mul(b, c), op.Mul(a, s)),
                       axis=-1)
    return op.CastLike(op.Reshape(y3, shape), x)


@onnxscript.script(GLM5, default_opset=op)
def silu_mul(x: TFloat, acc: int) -> TFloat:
    """silu(x[..., :I]) * x[..., I:]."""
    a, b = op.Split(op.Cast(x, to=acc), axis=-1, num_outputs=2)
    return op.CastLike(op.Mul(op.Mul(a, op.Sigmoid(a)), b), x)


# --------------------------------------------------------------------------- DSA
@onnxscript.script(GLM5, default_opset=op)
def lightning_indexer(q: TFloat, k: TFloat2, w: TFloat3, k_start: TIdx, k_end: TIdx2,
                      acc: int) -> TAcc:
    """scores[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) on k_start <= s < k_end, else -inf."""
    dots = op.MatMul(op.Cast(q, to=acc), op.Transpose(op.Cast(k, to=acc), perm=[1, 0]))
    wt = op.Unsqueeze(op.Cast(w, to=acc), op.Constant(value_ints=[1]))  # [T, 1, Hi]
    scores = op.Squeeze(op.MatMul(wt, op.Relu(dots)), op.Constant(value_ints=[1]))  # [T, S]
    n = op.Squeeze(op.Shape(k, start=0, end=1))
    pos = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
    ks = op.Unsqueeze(op.Cast(k_start, to=7), op.Constant(value_ints=[1]))
    ke = op.Unsqueeze(op.Cast(k_end, to=7), op.Constant(value_ints=[1]))
    valid = op.And(op.GreaterOrEqual(pos, ks), op.Less(pos, ke))
    return op.Where(valid, scores, op.CastLike(op.Constant(value_float=NEG_INF), scores))


@onnxscript.script(GLM5, default_opset=op)
def topk_indices(scores: TFloat, k: int, acc: int) -> INT32:
    """k largest finite scores per row, descending, ties to the smaller index, -1 tail."""
    sf = op.Cast(scores, to=acc)
    finite = op.Not(op.Or(op.IsInf(sf), op.IsNaN(sf)))
    keyed = op.Where(finite, sf, op.CastLike(op.Constant(value_float=NEG_INF), sf))
    kk = op.Reshape(op.Constant(value_int=k), op.Constant(value_ints=[1]))
    n = op.Shape(scores, start=1, end=2)
    vals, ind = op.TopK(keyed, op.Min(kk, n), axis=-1, largest=1, sorted=1)
    idx = op.Where(op.IsInf(vals), op.Constant(value_int=-1), ind)
    pad = op.Max(op.Sub(kk, n), op.Constant(value_ints=[0]))
    pads = op.Concat(op.Constant(value_ints=[0, 0, 0]), pad, axis=0)
    return op.Cast(op.Pad(idx, pads, op.Constant(value_int=-1)), to=6)


@onnxscript.script(GLM5, default_opset=op)
def indexer_topk(q: TFloat, k: TFloat2, w: TFloat3, k_start: TIdx, k_end: TIdx2, topk: int,
                 acc: int) -> INT32:
    """Composite: topk_indices(lightning_indexer(q, k, w, k_start, k_end), topk)."""
    scores = lightning_indexer(q, k, w, k_start, k_end, acc=acc)
    return topk_indices(scores, k=topk, acc=acc)


@onnxscript.script(GLM5, default_opset=op)
def e4m3_rows(x: TFloat, acc: int) -> TAcc:
    """x quantized per row to e4m3 as `glm5.ir.fp8` does, dequantized into `acc`: the scale
    s = 2^ceil(log2(max(amax, 1e-4) / 448)) and the codes rounded to nearest even, in fp32 on x
    cast to fp32. No float8 type (opset 19) is needed: e4m3 rounding is x / s rounded to 4
    significant bits (steps of 2^-9 below 2^-6), all exact fp32 arithmetic; Log only guesses
    each power of two, which the two comparisons after it correct."""
    xf = op.Cast(x, to=1)
    two = op.Constant(value_float=2.0)
    one = op.Constant(value_float=1.0)
    ln2 = op.Log(two)
    amax = op.Max(op.ReduceMax(op.Abs(xf), op.Constant(value_ints=[-1]), keepdims=1),
                  op.Constant(value_float=1e-4))
    r = op.Div(amax, op.Constant(value_float=448.0))
    s = op.Pow(two, op.Ceil(op.Div(op.Log(r), ln2)))
    half = op.Div(s, two)
    s = op.Where(op.GreaterOrEqual(half, r), half, s)  # s = the least power of two >= r
    s = op.Where(op.Less(s, r), op.Mul(s, two), s)
    y = op.Div(xf, s)
    a = op.Abs(y)
    e = op.Floor(op.Div(op.Log(a), ln2))  # e = floor(log2 |y|): 2^e <= |y| < 2^(e+1)
    e = op.Where(op.Greater(op.Pow(two, e), a), op.Sub(e, one), e)
    e = op.Where(op.LessOrEqual(op.Pow(two, op.Add(e, one)), a), op.Add(e, one), e)
    e = op.Max(e, op.Constant(value_float=-6.0))  # subnormals: steps of 2^-9
    ulp = op.Pow(two, op.Sub(e, op.Constant(value_float=3.0)))
    q = op.Mul(op.Mul(op.Round(op.Div(y, ulp)), ulp), s)
    return op.Cast(q, to=acc)


@onnxscript.script(GLM5, default_opset=op)
def indexer_topk_fp8(q: TFloat, k: TFloat2, w: TFloat3, k_start: TIdx, k_end: TIdx2,
                     topk: int, acc: int) -> INT32:
    """indexer_topk on q and k quantized per row to e4m3 (and dequantized, exactly). Calls
    glm5 functions one level deep only: torch's inlining path does not resolve deeper ones."""
    qe = e4m3_rows(q, acc=acc)
    ke = e4m3_rows(k, acc=acc)
    scores = lightning_indexer(qe, ke, op.Cast(w, to=acc), k_start, k_end, acc=acc)
    return topk_indices(scores, k=topk, acc=acc)


@onnxscript.script(GLM5, default_opset=op)
def masked_softmax_pv(sc: TAcc, mask: BOOL, v: TAcc2) -> tuple[TAcc, TAcc]:
    """softmax(sc) over the last axis where mask (broadcast), times v, and the natural-log lse;
    a row with no valid key gives 0 and lse -inf. Shared by the two attention functions."""
    sc = op.Where(mask, sc, op.CastLike(op.Constant(value_float=NEG_INF), sc))
    m = op.ReduceMax(sc, op.Constant(value_ints=[-1]), keepdims=1)
    zf = op.CastLike(op.Constant(value_float=0.0), sc)
    m = op.Where(op.IsInf(m), zf, m)
    e = op.Exp(op.Sub(sc, m))
    total = op.ReduceSum(e, op.Constant(value_ints=[-1]), keepdims=1)
    lse = op.Add(op.Log(total), m)
    p = op.Div(e, op.Where(op.Equal(total, zf), op.CastLike(op.Constant(value_float=1.0), sc),
                           total))
    return op.MatMul(p, v), lse


@onnxscript.script(GLM5, default_opset=op)
def sparse_attention(q: TFloat, k: TFloat2, v: TFloat3, idx: TIdx, scale: float,
                     acc: int) -> tuple[TFloat, TAcc]:
    """Softmax attention of q[t, h] over the rows idx[t] (-1 = none) of k/v[S, Hk, *]."""
    qf = op.Cast(q, to=acc)
    t = op.Shape(q, start=0, end=1)
    h = op.Shape(q, start=1, end=2)
    d = op.Shape(q, start=2)
    hk = op.Shape(k, start=1, end=2)
    q4 = op.Reshape(qf, op.Concat(t, hk, op.Constant(value_ints=[-1]), d, axis=0))  # [T,Hk,g,D]
    i64 = op.Cast(idx, to=7)
    zero = op.Constant(value_int=0)
    valid = op.GreaterOrEqual(i64, zero)  # [T, K]
    safe = op.Max(i64, zero)
    kg = op.Transpose(op.Gather(op.Cast(k, to=acc), safe, axis=0), perm=[0, 2, 3, 1])  # [T,Hk,D,K]
    vg = op.Transpose(op.Gather(op.Cast(v, to=acc), safe, axis=0), perm=[0, 2, 1, 3])  # [T,Hk,K,Dv]
    sc = op.Mul(op.MatMul(q4, kg), op.CastLike(op.Constant(value_float=scale), qf))
    mask = op.Unsqueeze(valid, op.Constant(value_ints=[1, 2]))  # [T, 1, 1, K]
    o, lse = masked_softmax_pv(sc, mask, vg)
    out = op.Reshape(o, op.Concat(t, h, op.Constant(value_ints=[-1]), axis=0))
    return op.CastLike(out, q), op.Reshape(lse, op.Concat(t, h, axis=0))


@onnxscript.script(GLM5, default_opset=op)
def attention(q: TFloat, k: TFloat2, v: TFloat3, k_start: TIdx, k_end: TIdx2, scale: float,
              acc: int) -> tuple[TFloat, TAcc]:
    """Dense attention over k_start[t] <= s < k_end[t] with GQA (H a multiple of Hk)."""
    qf = op.Cast(q, to=acc)
    t = op.Shape(q, start=0, end=1)
    h = op.Shape(q, start=1, end=2)
    d = op.Shape(q, start=2)
    hk = op.Shape(k, start=1, end=2)
    q4 = op.Reshape(qf, op.Concat(t, hk, op.Constant(value_ints=[-1]), d, axis=0))  # [T,Hk,g,D]
    kt = op.Transpose(op.Cast(k, to=acc), perm=[1, 2, 0])  # [Hk, D, S]
    vt = op.Transpose(op.Cast(v, to=acc), perm=[1, 0, 2])  # [Hk, S, Dv]
    sc = op.Mul(op.MatMul(q4, kt), op.CastLike(op.Constant(value_float=scale), qf))
    n = op.Squeeze(op.Shape(k, start=0, end=1))
    pos = op.Range(op.Constant(value_int=0), n, op.Constant(value_int=1))
    ks = op.Unsqueeze(op.Cast(k_start, to=7), op.Constant(value_ints=[1]))
    ke = op.Unsqueeze(op.Cast(k_end, to=7), op.Constant(value_ints=[1]))
    valid = op.And(op.GreaterOrEqual(pos, ks), op.Less(pos, ke))  # [T, S]
    mask = op.Unsqueeze(valid, op.Constant(value_ints=[1, 2]))  # [T, 1, 1, S]
    o, lse = masked_softmax_pv(sc, mask, vt)
    out = op.Reshape(o, op.Concat(t, h, op.Constant(value_ints=[-1]), axis=0))
    return op.CastLike(out, q), op.Reshape(lse, op.Concat(t, h, axis=0))


# --------------------------------------------------------------------------- MoE
@onnxscript.script(GLM5, default_opset=op)
def moe_route(logits: TAcc, bias: TAcc2, top_k: int, n_group: int, topk_group: int,
              norm_topk_prob: bool, routed_scaling: float, acc: int) -> tuple[TAcc, INT32]:
    """Sigmoid router with correction bias, group limit, normalisation and scaling."""
    s = op.Sigmoid(op.Cast(logits, to=acc))
    sel = op.Add(s, op.Cast(bias, to=acc))
    one_d = op.Constant(value_ints=[1])
    # Group limit, branch-free (n_group == 1 keeps every expert): group score = sum of the
    # top-2 of each group, keep the topk_group best groups, others -inf.
    ng = op.Reshape(op.Constant(value_int=n_group), one_d)
    t = op.Shape(sel, start=0, end=1)
    grouped = op.Reshape(sel, op.Concat(t, ng, op.Constant(value_ints=[-1]), axis=0))
    two = op.Min(op.Constant(value_ints=[2]), op.Shape(grouped, start=2))
    top2, _i2 = op.TopK(grouped, two, axis=-1, largest=1, sorted=1)
    gscore = op.ReduceSum(top2, op.Constant(value_ints=[-1]), keepdims=0)  # [T, ng]
    ntg = op.Min(op.Reshape(op.Constant(value_int=topk_group), one_d), ng)
    _gv, keep = op.TopK(gscore, ntg, axis=-1, largest=1, sorted=1)
    zf = op.CastLike(op.Constant(value_float=0.0), gscore)
    of = op.CastLike(op.Constant(value_float=1.0), gscore)
    gmask = op.ScatterElements(op.Expand(zf, op.Shape(gscore)), keep,
                               op.Expand(of, op.Shape(keep)), axis=1)
    keepm = op.Unsqueeze(op.Greater(gmask, zf), op.Constant(value_ints=[-1]))
    sel = op.Reshape(op.Where(keepm, grouped, op.CastLike(op.Constant(value_float=NEG_INF), sel)),
                     op.Shape(sel))
    kk = op.Reshape(op.Constant(value_int=top_k), one_d)
    _v, ids = op.TopK(sel, kk, axis=-1, largest=1, sorted=1)
    w = op.GatherElements(s, ids, axis=1)
    # divide by (sum + 1e-20) when norm_topk_prob, else by 1 (exactly)
    nf = op.CastLike(op.Constant(value_int=norm_topk_prob), s)
    total = op.Add(op.ReduceSum(w, op.Constant(value_ints=[-1]), keepdims=1),
                   op.CastLike(op.Constant(value_float=1e-20), s))
    denom = op.Add(op.Mul(nf, total), op.Sub(op.CastLike(op.Constant(value_float=1.0), s), nf))
    w = op.Mul(op.Div(w, denom), op.CastLike(op.Constant(value_float=routed_scaling), s))
    return w, op.Cast(ids, to=6)


@onnxscript.script(GLM5, default_opset=op)
def moe_experts(x: TFloat, ids: TIdx, weights: TFloat2, w13: TFloat, w2: TFloat,
                acc: int) -> TFloat:
    """y[t] = sum_j weights[t,j] w2[e] silu_mul(w13[e] x[t]), e = ids[t,j]; -1 skipped.

    Dense over all E experts: a [T, E] routing matrix holds the summed weight of each expert.
    """
    xf = op.Cast(x, to=acc)
    ne = op.Squeeze(op.Shape(w13, start=0, end=1))
    experts = op.Range(op.Constant(value_int=0), ne, op.Constant(value_int=1))  # [E]
    hit = op.Equal(op.Unsqueeze(op.Cast(ids, to=7), op.Constant(value_ints=[-1])), experts)
    wk = op.Unsqueeze(op.Cast(weights, to=acc), op.Constant(value_ints=[-1]))  # [T, k, 1]
    route = op.ReduceSum(op.Mul(op.CastLike(hit, xf), wk), op.Constant(value_ints=[1]),
                         keepdims=0)  # [T, E]
    hidden = op.MatMul(xf, op.Transpose(op.Cast(w13, to=acc), perm=[0, 2, 1]))  # [E, T, 2I]
    a, b = op.Split(hidden, axis=-1, num_outputs=2)
    act = op.Mul(op.Mul(a, op.Sigmoid(a)), b)
    out = op.MatMul(act, op.Transpose(op.Cast(w2, to=acc), perm=[0, 2, 1]))  # [E, T, D]
    rt = op.Unsqueeze(op.Transpose(route, perm=[1, 0]), op.Constant(value_ints=[-1]))  # [E,T,1]
    y = op.ReduceSum(op.Mul(out, rt), op.Constant(value_ints=[0]), keepdims=0)
    return op.CastLike(y, x)


# --------------------------------------------------------------------------- MLA
@onnxscript.script(GLM5, default_opset=op)
def mla_prolog(x: TFloat, w_qa: TFloat, g_qa: TFloat2, w_qb: TFloat, w_kva: TFloat,
               g_kva: TFloat2, w_uk: TFloat, cos: TFloat3, sin: TFloat3, kv_cache: TCache,
               slots: TIdx, eps: float, absorb: bool,
               acc: int) -> tuple[TFloat, TFloat, TFloat, TCache]:
    """MLA preprocessing; the fourth output is kv_cache with rows [ckv | k_pe] written at
    slots[t] (slot -1 skipped), i.e. the functional form of the in-place cache write."""
    xf = op.Cast(x, to=acc)
    c_q = rms_norm(op.MatMul(xf, op.Transpose(op.Cast(w_qa, to=acc), perm=[1, 0])), g_qa,
                   eps=eps, acc=acc)
    q = op.MatMul(c_q, op.Transpose(op.Cast(w_qb, to=acc), perm=[1, 0]))
    t = op.Shape(x, start=0, end=1)
    h = op.Shape(w_uk, start=0, end=1)
    dn = op.Shape(w_uk, start=1, end=2)
    rkv = op.Shape(w_uk, start=2, end=3)
    big = op.Constant(value_ints=[9223372036854775807])
    zero_d = op.Constant(value_ints=[0])
    q3 = op.Reshape(q, op.Concat(t, h, op.Constant(value_ints=[-1]), axis=0))  # [T, H, Dn+Dr]
    ax2 = op.Constant(value_ints=[2])
    q_nope = op.Slice(q3, zero_d, dn, ax2)
    q_pe = rope(op.Slice(q3, dn, big, ax2), cos, sin, interleaved=1, acc=acc)
    if absorb:
        qa = op.MatMul(op.Transpose(q_nope, perm=[1, 0, 2]), op.Cast(w_uk, to=acc))  # [H,T,Rkv]
        q_main = op.Transpose(qa, perm=[1, 0, 2])
    else:
        q_main = op.Identity(q_nope)
    kv = op.MatMul(xf, op.Transpose(op.Cast(w_kva, to=acc), perm=[1, 0]))  # [T, Rkv + Dr]
    ax1 = op.Constant(value_ints=[1])
    ckv = rms_norm(op.Slice(kv, zero_d, rkv, ax1), g_kva, eps=eps, acc=acc)
    k_pe = rope(op.Slice(kv, rkv, big, ax1), cos, sin, interleaved=1, acc=acc)
    rows = op.Concat(ckv, k_pe, axis=1)
    sl = op.Cast(slots, to=7)
    keep = op.GreaterOrEqual(sl, op.Constant(value_int=0))
    kept = op.Unsqueeze(op.Compress(sl, keep, axis=0), ax1)  # [T', 1]
    # Compress before the cast: opset-18 Compress has no bfloat16
    new_cache = op.ScatterND(kv_cache, kept, op.CastLike(op.Compress(rows, keep, axis=0), kv_cache))
    return op.CastLike(q_main, x), op.CastLike(q_pe, x), op.CastLike(c_q, x), new_cache


FUNCTIONS: dict[str, onnxscript.OnnxFunction] = {
    f.name: f
    for f in (rms_norm, layer_norm, rope, silu_mul, lightning_indexer, topk_indices, indexer_topk,
              indexer_topk_fp8, sparse_attention, attention, moe_route, moe_experts, mla_prolog,
              masked_softmax_pv, e4m3_rows)
}
# glm5 functions called from inside another function's body
DEPENDENCIES: dict[str, tuple[str, ...]] = {
    "indexer_topk": ("lightning_indexer", "topk_indices"),
    "indexer_topk_fp8": ("e4m3_rows", "lightning_indexer", "topk_indices"),
    "mla_prolog": ("rms_norm", "rope"),
    "sparse_attention": ("masked_softmax_pv",),
    "attention": ("masked_softmax_pv",),
}
HELPERS = ("masked_softmax_pv", "e4m3_rows")  # functions that are not glm5 ops
COVERED = tuple(n for n in FUNCTIONS if n not in HELPERS)


# --------------------------------------------------------------------------- translations
def _acc(*values: Any) -> int:
    """The accumulation dtype (TensorProto enum) of the first tensor: float64 stays float64."""
    for v in values:
        dtype = getattr(v, "dtype", None)
        if dtype is not None:
            return _F64 if dtype == ir.DataType.DOUBLE else _F32
    return _F32


_ATTR_TYPES = {
    ir.AttributeType.FLOAT: onnx.defs.OpSchema.AttrType.FLOAT,
    ir.AttributeType.INT: onnx.defs.OpSchema.AttrType.INT,
    ir.AttributeType.STRING: onnx.defs.OpSchema.AttrType.STRING,
    ir.AttributeType.FLOATS: onnx.defs.OpSchema.AttrType.FLOATS,
    ir.AttributeType.INTS: onnx.defs.OpSchema.AttrType.INTS,
}
_ALL_TENSORS = [
    f"tensor({t})" for t in ("float16", "float", "double", "bfloat16", "int32", "int64", "bool")
]
_opaque_ops: dict[str, onnxscript.values.Op] = {}


def _opaque(fn: onnxscript.OnnxFunction) -> onnxscript.values.Op:
    """An Op with fn's signature but no body: calling it under the exporter records one
    `glm5::<name>` node and no function (attach_functions adds the body afterwards)."""
    if fn.name in _opaque_ops:
        return _opaque_ops[fn.name]
    sig = fn.op_signature
    inputs, attrs = [], []
    for i, p in enumerate(sig.params):
        if isinstance(p, ir.schemas.AttributeParameter):
            attrs.append(onnx.defs.OpSchema.Attribute(p.name, _ATTR_TYPES[p.type], "",
                                                      required=True))
        else:
            inputs.append(onnx.defs.OpSchema.FormalParameter(p.name, f"T{i}"))
    outputs = [onnx.defs.OpSchema.FormalParameter(f"out{j}", f"O{j}")
               for j in range(len(sig.outputs))]
    constraints = [(f"T{i}", _ALL_TENSORS, "") for i, p in enumerate(sig.params)
                   if not isinstance(p, ir.schemas.AttributeParameter)]
    constraints += [(f"O{j}", _ALL_TENSORS, "") for j in range(len(sig.outputs))]
    schema = onnx.defs.OpSchema(fn.name, DOMAIN, VERSION, fn.__doc__ or "", inputs=inputs,
                                outputs=outputs, type_constraints=constraints, attributes=attrs)
    _opaque_ops[fn.name] = onnxscript.values.Op(GLM5, fn.name, schema)
    return _opaque_ops[fn.name]


def _caller(name: str, keep_functions: bool) -> Callable[..., Any]:
    """Call glm5 function `name` under the exporter's tracer: as an opaque node, or by tracing
    its body in place (standard ops; nested glm5 calls become functions that torch inlines)."""
    fn = FUNCTIONS[name]
    if keep_functions:
        return _opaque(fn)
    return fn.function


def _translations(keep: bool) -> dict[str, Callable[..., Any]]:
    call = {n: _caller(n, keep) for n in FUNCTIONS}

    def t_rms_norm(x, weight, eps):
        return call["rms_norm"](x, weight, eps=float(eps), acc=_acc(x))

    def t_layer_norm(x, weight, bias, eps):
        return call["layer_norm"](x, weight, bias, eps=float(eps), acc=_acc(x))

    def t_rope(x, cos, sin, interleaved):
        return call["rope"](x, cos, sin, interleaved=bool(interleaved), acc=_acc(x))

    def t_silu_mul(x):
        return call["silu_mul"](x, acc=_acc(x))

    def t_lightning_indexer(q, k, w, k_start, k_end):
        return call["lightning_indexer"](q, k, w, k_start, k_end, acc=_acc(q))

    def t_topk_indices(scores, k):
        return call["topk_indices"](scores, k=int(k), acc=_acc(scores))

    def t_indexer_topk(q, k, w, k_start, k_end, topk):
        return call["indexer_topk"](q, k, w, k_start, k_end, topk=int(topk), acc=_acc(q))

    def t_indexer_topk_fp8(q, k, w, k_start, k_end, topk):
        return call["indexer_topk_fp8"](q, k, w, k_start, k_end, topk=int(topk), acc=_acc(q))

    def t_sparse_attention(q, k, v, idx, scale):
        return call["sparse_attention"](q, k, v, idx, scale=float(scale), acc=_acc(q))

    def t_attention(q, k, v, k_start, k_end, scale):
        return call["attention"](q, k, v, k_start, k_end, scale=float(scale), acc=_acc(q))

    def t_moe_route(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling):
        return call["moe_route"](
            logits, bias, top_k=int(top_k), n_group=int(n_group), topk_group=int(topk_group),
            norm_topk_prob=bool(norm_topk_prob), routed_scaling=float(routed_scaling),
            acc=_acc(logits),
        )

    def t_moe_experts(x, ids, weights, w13, w2):
        return call["moe_experts"](x, ids, weights, w13, w2, acc=_acc(x))

    return {
        "rms_norm": t_rms_norm, "layer_norm": t_layer_norm, "rope": t_rope,
        "silu_mul": t_silu_mul, "lightning_indexer": t_lightning_indexer,
        "topk_indices": t_topk_indices, "indexer_topk": t_indexer_topk,
        "indexer_topk_fp8": t_indexer_topk_fp8,
        "sparse_attention": t_sparse_attention, "attention": t_attention,
        "moe_route": t_moe_route, "moe_experts": t_moe_experts,
        "_mla_prolog": call["mla_prolog"],
    }


_MLA_INPUTS = ("x", "w_qa", "g_qa", "w_qb", "w_kva", "g_kva", "w_uk", "cos", "sin")
_functional_op: Any = None


def functional_mla_prolog() -> Any:
    """`torch.ops.glm5_onnx.mla_prolog`: mla_prolog without mutation, returning
    (q_main, q_pe, c_q, updated kv_cache). Export-only: `functionalize` puts it in place of the
    functionalised in-place op, which torch 2.13's ONNX exporter cannot translate (its
    `auto_functionalized_v2` node carries the OpOverload as an argument, and
    `_convert_fx_arg_to_onnx_arg` fails on it with a KeyError)."""
    global _functional_op
    if _functional_op is not None:
        return _functional_op
    library.require_bound("glm5.ir.onnx_export")

    def mla_prolog_functional(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, kv_cache,
                              slots, absorb):
        cache = kv_cache.clone()
        q_main, q_pe, c_q = torch.ops.glm5.mla_prolog(
            x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, cache, slots, absorb)
        return q_main, q_pe, c_q, cache

    mla_prolog_functional = torch.library.custom_op(
        "glm5_onnx::mla_prolog", mla_prolog_functional, mutates_args=(),
        schema="(Tensor x, Tensor w_qa, Tensor g_qa, Tensor w_qb, Tensor w_kva, Tensor g_kva, "
               "Tensor w_uk, Tensor cos, Tensor sin, float eps, Tensor kv_cache, Tensor slots, "
               "bool absorb) -> (Tensor, Tensor, Tensor, Tensor)",
    )

    @mla_prolog_functional.register_fake
    def _(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, kv_cache, slots, absorb):
        q_main, q_pe, c_q = torch.ops.glm5.mla_prolog(
            x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, torch.empty_like(kv_cache),
            slots, absorb)
        return q_main, q_pe, c_q, torch.empty_like(kv_cache)

    _functional_op = torch.ops.glm5_onnx.mla_prolog.default
    return _functional_op


def _hop_cache_arg(node: torch.fx.Node) -> Any:
    """The kv_cache argument of a functionalised mla_prolog node, or None for other nodes."""
    hops = torch.ops.higher_order
    if node.op != "call_function" or not node.args:
        return None
    if node.args[0] is not torch.ops.glm5.mla_prolog.default:
        return None
    kw = node.kwargs
    if node.target is hops.auto_functionalized:
        return kw["kv_cache"]
    if node.target is hops.auto_functionalized_v2:
        if any(k.startswith("_kv_cache_") and k != "_kv_cache_base_index" for k in kw):
            raise ValueError(
                "glm5.ir.onnx_export: glm5.mla_prolog writing into a view of a larger tensor "
                "(kv_cache with size/stride/storage offset) cannot be exported; pass the whole "
                "cache tensor")
        bases = kw["_all_bases"]
        if len(bases) != 1:
            raise ValueError(
                f"glm5.ir.onnx_export: functionalised glm5.mla_prolog with {len(bases)} bases")
        return bases[kw["_kv_cache_base_index"]]
    return None


def functionalize(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Make the in-place glm5.mla_prolog of an ExportedProgram exportable to ONNX.

    Functionalises the program (`run_decompositions({})`: no op is decomposed) and replaces each
    `auto_functionalized[_v2](glm5.mla_prolog, ...)` by `glm5_onnx.mla_prolog`, whose fourth
    output is the updated cache (same getitem layout). A program without mla_prolog is returned
    unchanged."""
    has = any(n.op == "call_function" and n.target is torch.ops.glm5.mla_prolog.default
              for n in ep.graph.nodes)
    if has:
        ep = ep.run_decompositions({})
    target = functional_mla_prolog()
    graph = ep.graph
    changed = False
    for node in list(graph.nodes):
        cache = _hop_cache_arg(node)
        if cache is None:
            continue
        kw = node.kwargs
        args = tuple(kw[n] for n in _MLA_INPUTS) + (kw["eps"], cache, kw["slots"], kw["absorb"])
        with graph.inserting_before(node):
            new = graph.call_function(target, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed = True
    if changed:
        ep.graph_module.recompile()
    return ep


def translation_table(keep_functions: bool = False) -> dict[Any, Callable[..., Any]]:
    """`custom_translation_table` for `torch.onnx.export(..., dynamo=True)`.

    keep_functions=False: every glm5 op is traced to standard ONNX ops (a self-contained model
    with any torch.onnx.export call). keep_functions=True: every glm5 op becomes one
    `glm5::<op>` node whose function body is *not* yet in the model: call
    `attach_functions(onnx_program.model)` after export (as `export` does).
    """
    library.require_bound("glm5.ir.onnx_export")

    t = _translations(keep_functions)
    table: dict[Any, Callable[..., Any]] = {
        getattr(torch.ops.glm5, name).default: fn
        for name, fn in t.items() if not name.startswith("_")
    }
    mla = t["_mla_prolog"]

    def t_mla_prolog_functional(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, kv_cache,
                                slots, absorb):
        return mla(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, kv_cache, slots,
                   eps=float(eps), absorb=bool(absorb), acc=_acc(x))

    table[functional_mla_prolog()] = t_mla_prolog_functional
    return table


# --------------------------------------------------------------------------- functions
def function_protos(names: Sequence[str] | None = None) -> list[onnx.FunctionProto]:
    """FunctionProtos (domain glm5) of the given ops and of the glm5 functions they call."""
    todo = list(FUNCTIONS if names is None else names)
    seen: list[str] = []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n not in FUNCTIONS:
            raise KeyError(f"glm5.ir.onnx_export: no ONNX function for op {n!r}")
        seen.append(n)
        todo.extend(DEPENDENCIES.get(n, ()))
    return [FUNCTIONS[n].to_function_proto() for n in sorted(seen)]


def _glm5_node_types(graph: ir.Graph) -> set[str]:
    found: set[str] = set()
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.domain == DOMAIN:
            found.add(node.op_type)
    return found


def attach_functions(model: ir.Model) -> ir.Model:
    """Add (in place) the glm5 function bodies called by the graph of `model`, and the glm5
    opset import. The functions import the default ONNX domain at the model's version (the
    bodies use ops whose semantics are unchanged from opset 18 up to 20+)."""
    used = _glm5_node_types(model.graph)
    if not used:
        return model
    default_version = model.opset_imports.get("", 18)
    for proto in function_protos(sorted(used)):
        fn = ir.serde.deserialize_function(proto)
        fn.opset_imports[""] = default_version
        model.functions[fn.identifier()] = fn
    model.opset_imports[DOMAIN] = VERSION
    return model


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Silence torch.export / torch.onnx while exporting: stdout prints, warnings and logs below
    ERROR (e.g. "torchvision is not installed" from the registry)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for lg in loggers:
                lg.setLevel(logging.ERROR)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export(model: torch.nn.Module | torch.export.ExportedProgram, args: tuple = (), *,
           kwargs: dict[str, Any] | None = None, dynamic_shapes: Any = None,
           keep_functions: bool = True, quiet: bool = True,
           on_step: Callable[[str], None] | None = None, **onnx_kwargs: Any) -> Any:
    """Export to ONNX with the glm5 translations; returns torch's ONNXProgram.

    Captures `model` with `torch.export.export` (unless it is an ExportedProgram already),
    `functionalize`s the in-place mla_prolog, then runs `torch.onnx.export(ep, dynamo=True,
    custom_translation_table=...)`. keep_functions=True keeps each glm5 op as one node calling
    an ONNX function of domain glm5 (bodies attached after export); False gives standard ops
    only. quiet silences the exporter's prints, warnings and logs. Other keyword arguments go to
    torch.onnx.export (e.g. optimize, opset_version). ``on_step(name)`` is called as each of
    the steps in `EXPORT_STEPS` starts (a progress bar's hook)."""
    step = on_step or (lambda _name: None)
    onnx_kwargs.setdefault("verbose", False)
    table = dict(onnx_kwargs.pop("custom_translation_table", None) or {})
    table.update(translation_table(keep_functions))
    with quiet_export() if quiet else contextlib.nullcontext():
        step(EXPORT_STEPS[0])
        if isinstance(model, torch.export.ExportedProgram):
            ep = model
        else:
            ep = torch.export.export(model, tuple(args), kwargs=kwargs,
                                     dynamic_shapes=dynamic_shapes)
        ep = functionalize(ep)
        step(EXPORT_STEPS[1])
        prog = torch.onnx.export(ep, tuple(args), kwargs=kwargs, dynamo=True,
                                 custom_translation_table=table, **onnx_kwargs)
    step(EXPORT_STEPS[2])
    if keep_functions:
        attach_functions(prog.model)
    return prog


#: the steps `export` reports to ``on_step``, in order
EXPORT_STEPS = ("capture (torch.export)", "translate to ONNX", "attach glm5 functions")


__all__ = [
    "COVERED", "DOMAIN", "EXPORT_STEPS", "FUNCTIONS", "GLM5", "VERSION", "attach_functions",
    "export", "function_protos", "functional_mla_prolog", "functionalize", "quiet_export",
    "translation_table",
]
