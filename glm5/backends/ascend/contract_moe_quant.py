"""CPU emulators of torch_npu's quantization, matmul and MoE ops: ``npu_dynamic_quant``,
``npu_quant_matmul`` (int8 per-token path), ``npu_weight_quant_batchmatmul`` (int8 weights),
``npu_grouped_matmul`` (non-quantized), ``npu_swiglu`` and ``npu_moe_gating_top_k``.

Exposed through :mod:`glm5.backends.ascend.contract` (the ``torch_npu`` stand-in); see its
docstring for the emulation rules. Per-op contracts and sources are in each function's docstring.
Integer products are exact (float64 accumulation of int8 x int8), float ones accumulate in fp32;
the rounding tie rule of ``npu_dynamic_quant`` is not documented (half-to-even is used); MoE gating
top-k is stable (ties to the smaller expert id).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from glm5.backends.ascend.contract_checks import HALF_DTYPES, fail, ints, req, tensor


# --------------------------------------------------------------------------- quantized matmuls
def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """Emulates ``torch_npu.npu_dynamic_quant`` -> ``(y int8, scale fp32 [x.shape[:-1]])``.

    Contract (torch_npu API page ``torch_npu.npu_dynamic_quant``): x fp16/bf16, dim > 1;
    per-token symmetric ``scale = rowMax(|x|) / 127``, ``y = round(x / scale)`` in fp32.
    The page does not state the rounding tie rule (half-to-even is used here) nor what an
    all-zero row gives (the emulator returns scale 0 and codes 0). Only ``dst_type`` int8 /
    None and no smooth scales are emulated.
    """
    op = "npu_dynamic_quant"
    tensor(op, "x", x, None, HALF_DTYPES)
    req(x.dim() > 1, op, "x", "a tensor of dim > 1", x.dim())
    if dst_type not in (None, torch.int8):
        raise NotImplementedError(f"contract.{op}: dst_type {dst_type} (int4) is not emulated")
    if smooth_scales is not None or group_index is not None:
        raise NotImplementedError(f"contract.{op}: smooth_scales/group_index are not emulated")
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(xf / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return y, scale


def _matrix_rhs(op: str, arg: str, t: torch.Tensor) -> None:
    # The right matrix may be a contiguous [k, n] tensor or the transpose view of a contiguous
    # [n, k] one (the pages list transposed weights as supported; NZ formats are not emulated).
    req(t.is_contiguous() or t.transpose(-1, -2).is_contiguous(), op, arg,
         "a contiguous [k, n] tensor or the transpose of a contiguous [n, k] one",
         f"strides {t.stride()}")


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                     output_dtype=None, group_sizes=None):
    """Emulates ``torch_npu.npu_quant_matmul`` for the int8 per-token path (W8A8 dynamic).

    Contract (torch_npu API page ``torch_npu.npu_quant_matmul``, Table 2; call site vllm-ascend
    ``quantization/methods/w8a8_dynamic.py``): x1 int8 [m, k], x2 int8 [k, n], last dims
    <= 65535; scale fp32/bf16 [1 or n]; pertoken_scale fp32 [m]; bias int32/bf16/fp16/fp32 [n];
    output_dtype bf16 (scale fp32/bf16) or fp16 (scale fp32). Computes
    ``(x1 @ x2 [+ int32 bias]) * scale * pertoken_scale [+ float bias]`` with an exact integer
    product. int8/int32 outputs, int64 scales, offsets, int4 (int32-packed) inputs and >2-D
    batches are documented but not emulated.
    """
    op = "npu_quant_matmul"
    tensor(op, "x1", x1, 2, (torch.int8,))
    tensor(op, "x2", x2, 2, (torch.int8,))
    _matrix_rhs(op, "x2", x2)
    m, k = x1.shape
    req(x2.shape[0] == k, op, "x2", f"k = {k} rows", list(x2.shape))
    n = x2.shape[1]
    req(k <= 65535 and n <= 65535, op, "x2", "last dims <= 65535", (k, n))
    if offset is not None or group_sizes is not None:
        raise NotImplementedError(f"contract.{op}: offset/group_sizes are not emulated")
    req(pertoken_scale is not None, op, "pertoken_scale",
         "a tensor (only the per-token path is emulated)", None)
    tensor(op, "pertoken_scale", pertoken_scale, 1, (torch.float32,))
    req(pertoken_scale.shape[0] == m, op, "pertoken_scale", f"shape [m={m}]",
         list(pertoken_scale.shape))
    req(output_dtype in HALF_DTYPES, op, "output_dtype",
         "bfloat16 or float16 with pertoken_scale", output_dtype)
    allowed = (torch.float32, torch.bfloat16) if output_dtype == torch.bfloat16 else \
        (torch.float32,)
    tensor(op, "scale", scale, 1, allowed)
    req(scale.shape[0] in (1, n), op, "scale", f"shape [1] or [n={n}]", list(scale.shape))
    acc = x1.double() @ x2.double()  # exact: |sum| < 2^53
    if bias is not None:
        tensor(op, "bias", bias, 1, (torch.int32, torch.bfloat16, torch.float16, torch.float32))
        req(bias.shape[0] == n, op, "bias", f"shape [n={n}]", list(bias.shape))
        if bias.dtype == torch.int32:
            acc = acc + bias.double()
    y = acc.float() * scale.float() * pertoken_scale[:, None]
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    return y.to(output_dtype)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None,
                                 quant_scale=None, quant_offset=None, bias=None,
                                 antiquant_group_size=0, inner_precise=0):
    """Emulates ``torch_npu.npu_weight_quant_batchmatmul`` (int8 weight, float output).

    Contract (torch_npu API page; CANN ops-nn ``aclnnWeightQuantBatchMatmulV2.md``; call site
    vllm-ascend ``quantization/methods/w8a16.py``): ``y = x @ ((weight + antiquant_offset) *
    antiquant_scale) + bias``. x fp16/bf16 [m, k]; weight int8 [k, n] (contiguous or a transpose
    view); antiquant_scale/offset of x's dtype, per channel [n] / [1, n] or per group
    [ceil(k / g), n] with ``antiquant_group_size`` g; bias [n] of x's dtype or fp32. Output x's
    dtype with fp32 accumulation. quant_scale/quant_offset (int8 output) are not emulated.
    """
    op = "npu_weight_quant_batchmatmul"
    tensor(op, "x", x, 2, HALF_DTYPES)
    tensor(op, "weight", weight, 2, (torch.int8,))
    _matrix_rhs(op, "weight", weight)
    k, n = weight.shape
    req(x.shape[1] == k, op, "weight", f"k = {x.shape[1]} rows", list(weight.shape))
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError(f"contract.{op}: output quantization is not emulated")
    tensor(op, "antiquant_scale", antiquant_scale, (1, 2), (x.dtype,))
    g = antiquant_group_size
    if g:
        req(g % 32 == 0 and 32 <= g < k, op, "antiquant_group_size",
             "a multiple of 32 in [32, k)", g)
        want = (math.ceil(k / g), n)
    else:
        want = (n,) if antiquant_scale.dim() == 1 else (1, n)
    req(tuple(antiquant_scale.shape) == want, op, "antiquant_scale", f"shape {list(want)}",
         list(antiquant_scale.shape))
    w = weight.float()
    if antiquant_offset is not None:
        tensor(op, "antiquant_offset", antiquant_offset, antiquant_scale.dim(), (x.dtype,))
        req(antiquant_offset.shape == antiquant_scale.shape, op, "antiquant_offset",
             f"the shape of antiquant_scale {list(antiquant_scale.shape)}",
             list(antiquant_offset.shape))
    off = antiquant_offset.float() if antiquant_offset is not None else None
    sc = antiquant_scale.float()
    if g:
        sc = sc.repeat_interleave(g, 0)[:k]
        off = off.repeat_interleave(g, 0)[:k] if off is not None else None
    else:
        sc = sc.reshape(1, n)
        off = off.reshape(1, n) if off is not None else None
    w = ((w + off) if off is not None else w) * sc
    y = x.float() @ w
    if bias is not None:
        tensor(op, "bias", bias, 1, (x.dtype, torch.float32))
        req(bias.shape[0] == n, op, "bias", f"shape [n={n}]", list(bias.shape))
        y = y + bias.float()
    return y.to(x.dtype)


# --------------------------------------------------------------------------- grouped matmul, swiglu
GMM_INNER_LIMIT = 65536


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    """Emulates ``torch_npu.npu_grouped_matmul`` (non-quantized) -> ``List[Tensor]``.

    Contract (torch_npu API page ``torch_npu.npu_grouped_matmul``, A2/A3 tables; MoE call sites
    vllm-ascend ``ops/fused_moe/moe_mlp.py``, ``device_op.py``):

    - ``group_type`` 0 (group along m), "single-single-single": ``x`` = [one 2-D tensor
      [M, K]] whose rows are sorted by group, ``weight`` = [one 3-D tensor [E, K, N]] (a
      transpose view of [E, N, K] is accepted), ``split_item`` 2 or 3 (one output [M, N]),
      ``group_list`` an int64 tensor of length E (at most 1024): cumulative row counts
      (``group_list_type`` 0, non-decreasing, last = M) or per-group counts (type 1,
      non-negative, sum = M, length not 1).
    - ``group_type`` -1 with ``group_list`` None: lists of 2-D x_i and weight_i, one output each
      (split_item 0/1).
    - dtypes: x and weight both fp16, bf16 or fp32 (fp32 only single-tensor); bias [N] per group
      (fp16 for fp16, fp32 for bf16/fp32). Last dims < 65536; list lengths <= 128.
    Quantized/fake-quantized paths, ``group_list_type`` 2 and ``act_type`` != 0 are documented
    but not emulated.
    """
    op = "npu_grouped_matmul"
    req(isinstance(x, (list, tuple)) and 0 < len(x) <= 128, op, "x",
         "a list of 1..128 tensors", type(x).__name__)
    req(isinstance(weight, (list, tuple)) and 0 < len(weight) <= 128, op, "weight",
         "a list of 1..128 tensors", type(weight).__name__)
    if any(v is not None for v in (scale, offset, antiquant_scale, antiquant_offset,
                                   per_token_scale, activation_input, activation_quant_scale,
                                   activation_quant_offset)):
        raise NotImplementedError(f"contract.{op}: quantized and fake-quantized paths are not "
                                  f"emulated")
    if act_type != 0:
        raise NotImplementedError(f"contract.{op}: act_type {act_type} is not emulated")
    dts = (torch.float16, torch.bfloat16, torch.float32)
    xd = x[0].dtype if isinstance(x[0], torch.Tensor) else None
    for i, t in enumerate(x):
        tensor(op, f"x[{i}]", t, 2, dts, contiguous=True)
        req(t.dtype == xd, op, f"x[{i}]", f"the dtype of x[0] ({xd})", t.dtype)
        req(t.shape[-1] < GMM_INNER_LIMIT, op, f"x[{i}]", f"a last dim < {GMM_INNER_LIMIT}",
             t.shape[-1])
    for i, t in enumerate(weight):
        tensor(op, f"weight[{i}]", t, (2, 3), (xd,))
        _matrix_rhs(op, f"weight[{i}]", t)
        req(max(t.shape[-1], t.shape[-2]) < GMM_INNER_LIMIT, op, f"weight[{i}]",
             f"dims < {GMM_INNER_LIMIT}", list(t.shape))
    req(output_dtype in (None, xd), op, "output_dtype", f"None or {xd} (non-quantized)",
         output_dtype)
    bias_dt = torch.float16 if xd == torch.float16 else torch.float32
    if group_type == 0:
        req(isinstance(group_list, torch.Tensor), op, "group_list",
             "an int64 tensor with group_type 0", type(group_list).__name__)
        tensor(op, "group_list", group_list, 1, (torch.int64,))
        req(split_item in (2, 3), op, "split_item", "2 or 3 (single output) for "
             "single-single-single", split_item)
        req(len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3, op, "weight",
             "one 3-D [E, K, N] tensor with one 2-D x (single-single-single)",
             [list(w.shape) for w in weight])
        xs, w = x[0], weight[0]
        E = w.shape[0]
        req(group_list.shape[0] == E and E <= 1024, op, "group_list",
             f"length E={E} (at most 1024 groups)", group_list.shape[0])
        req(w.shape[1] == xs.shape[1], op, "weight", f"K = {xs.shape[1]}", list(w.shape))
        gl = ints(group_list)
        if group_list_type == 0:
            req(all(v >= 0 for v in gl) and all(b >= a for a, b in zip(gl, gl[1:]))
                 and gl[-1] == xs.shape[0], op, "group_list",
                 f"a non-decreasing cumsum ending at M={xs.shape[0]} (group_list_type 0)", gl)
            ends = gl
        elif group_list_type == 1:
            req(len(gl) != 1 and all(v >= 0 for v in gl) and sum(gl) == xs.shape[0], op,
                 "group_list", f"non-negative counts summing to M={xs.shape[0]}, length not 1 "
                 f"(group_list_type 1)", gl)
            ends = list(torch.tensor(gl).cumsum(0).tolist())
        elif group_list_type == 2:
            raise NotImplementedError(f"contract.{op}: group_list_type 2 is not emulated")
        else:
            fail(op, "group_list_type", "0, 1 or 2", group_list_type)
        bs = None
        if bias is not None:
            req(len(bias) == 1, op, "bias", "one tensor like weight", len(bias))
            tensor(op, "bias[0]", bias[0], 2, (bias_dt,))
            req(tuple(bias[0].shape) == (E, w.shape[2]), op, "bias[0]", f"[{E}, {w.shape[2]}]",
                 list(bias[0].shape))
            bs = bias[0].float()
        y = torch.empty(xs.shape[0], w.shape[2], dtype=torch.float32)
        start = 0
        for e, end in enumerate(ends):
            y[start:end] = xs[start:end].float() @ w[e].float()
            if bs is not None:
                y[start:end] += bs[e]
            start = end
        return [y.to(xd)]
    if group_type in (None, -1):
        req(group_list is None, op, "group_list", "None with group_type -1/None (list inputs)",
             type(group_list).__name__)
        req(split_item in (0, 1), op, "split_item", "0 or 1 (one output per weight)",
             split_item)
        req(len(x) == len(weight), op, "x", f"{len(weight)} tensors like weight", len(x))
        outs = []
        for i, (xi, wi) in enumerate(zip(x, weight)):
            req(wi.dim() == 2 and wi.shape[0] == xi.shape[1], op, f"weight[{i}]",
                 f"a 2-D [{xi.shape[1]}, N] tensor", list(wi.shape))
            yi = xi.float() @ wi.float()
            if bias is not None:
                tensor(op, f"bias[{i}]", bias[i], 1, (bias_dt,))
                yi = yi + bias[i].float()
            outs.append(yi.to(xd))
        return outs
    if group_type == 2:
        raise NotImplementedError(f"contract.{op}: group_type 2 (k-axis) is not emulated")
    fail(op, "group_type", "-1, 0 or 2", group_type)


def npu_swiglu(x, dim=-1):
    """Emulates ``torch_npu.npu_swiglu``: ``silu(a) * b`` with ``a, b = chunk(x, 2, dim)``
    (torch_npu "PyTorch API mapping" page: native equivalent ``silu(chunk[0]) * chunk[1]``);
    x fp16/bf16/fp32, computed in fp32, output x's dtype."""
    op = "npu_swiglu"
    tensor(op, "x", x, None, (torch.float16, torch.bfloat16, torch.float32), nonempty=False)
    req(x.shape[dim] % 2 == 0, op, "x", f"an even size along dim {dim}", list(x.shape))
    a, b = x.float().chunk(2, dim)
    return (F.silu(a) * b).to(x.dtype)


# --------------------------------------------------------------------------- MoE gating
def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0,
                         renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """Emulates ``torch_npu.npu_moe_gating_top_k`` -> ``(y, expert_idx int32, norm_out fp32)``.

    Contract (torch_npu API page ``torch_npu.npu_moe_gating_top_k`` and its "equivalent
    computation logic"): x [T, E] fp16/bf16/fp32 with E <= 2048; bias [E] of x's dtype;
    ``norm_type`` 0 softmax / 1 sigmoid (the page's parameter text states the reverse, its
    equivalent code and vllm-ascend's DeepSeek call (norm_type=1 with a correction bias) use
    1 = sigmoid; the code is followed); ``sel = norm + bias``; with ``group_count`` > 1 the
    groups (E / group_count > 2 experts each, ceil32(E / group_count) * group_count <= 2048)
    are scored by their max (``group_select_mode`` 0) or top-2 sum (1), the best ``k_group``
    kept (stable: ties to the smaller group), others -inf; ``expert_idx`` = stable top-k of
    sel (ties to the smaller id), ``1 <= k <= E / group_count * k_group``;
    ``y = norm[idx]``, divided by ``(sum + eps)`` **only for sigmoid** (norm_type 1), times
    ``routed_scaling_factor``, in x's dtype. ``renorm`` must be 0. ``norm_out`` is the fp32
    normalised x when ``out_flag``; otherwise the page calls it invalid and the emulator fills
    it with NaN so that reading it shows.
    """
    op = "npu_moe_gating_top_k"
    tensor(op, "x", x, 2, (torch.float16, torch.bfloat16, torch.float32))
    T, E = x.shape
    req(E <= 2048, op, "x", "E <= 2048 experts", E)
    req(renorm == 0, op, "renorm", "0 (the only supported value)", renorm)
    req(norm_type in (0, 1), op, "norm_type", "0 (softmax) or 1 (sigmoid)", norm_type)
    req(group_select_mode in (0, 1), op, "group_select_mode", "0 (max) or 1 (top-2 sum)",
         group_select_mode)
    req(group_count > 0 and E % group_count == 0, op, "group_count", f"a divisor of E={E}",
         group_count)
    per = E // group_count
    if group_count > 1:
        req(per > 2, op, "group_count", "groups of more than 2 experts", per)
        req(math.ceil(per / 32) * 32 * group_count <= 2048, op, "group_count",
             "ceil32(E / group_count) * group_count <= 2048", group_count)
    req(1 <= k_group <= group_count, op, "k_group", f"in [1, group_count={group_count}]",
         k_group)
    req(1 <= k <= per * k_group, op, "k", f"in [1, E/group_count*k_group={per * k_group}]", k)
    if bias is not None:
        tensor(op, "bias", bias, 1, (x.dtype,))
        req(bias.shape[0] == E, op, "bias", f"shape [E={E}]", list(bias.shape))
    xf = x.float()
    norm = torch.softmax(xf, -1) if norm_type == 0 else torch.sigmoid(xf)
    sel = norm + bias.float() if bias is not None else norm.clone()
    if group_count > 1:
        g = sel.reshape(T, group_count, per)
        gscore = g.amax(-1) if group_select_mode == 0 else \
            torch.sort(g, dim=-1, descending=True).values[..., :2].sum(-1)
        keep = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :k_group]
        mask = torch.ones(T, group_count, dtype=torch.bool).scatter_(1, keep, False)
        sel = g.masked_fill(mask[..., None], float("-inf")).reshape(T, E)
    idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
    y = norm.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    norm_out = norm if out_flag else torch.full_like(norm, float("nan"))
    return y.to(x.dtype), idx.to(torch.int32), norm_out
