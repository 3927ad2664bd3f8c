"""TVM (llvm, host CPU) kernel for `moe_route` (docs/ops.md, MoE): the sigmoid router with the
correction bias, the optional group limit, and the normalised, scaled top-k weights.

One work item per token (``T.parallel``; below ``SERIAL_MAX`` logits a build with the token
loop ``T.serial``, `tirlib.serial`), fp32 throughout, for ``logits[T, E]``, ``bias[E]``:

1. ``s[t, e] = 1 / (1 + exp(−logits[t, e]))`` (libm's expf through llvm, as torch's sigmoid
   computes it), kept in a host-allocated ``s[T, E]`` for the weights;
2. with ``n_group > 1``: each group's score is the sum of its two largest ``s + bias`` (what the
   reference's sort takes), and a group is kept when its (score, −index) key is at least the
   ``topk_group``-th largest key — ties go to the smaller group index, as the reference's stable
   sort orders them;
3. ``top_k`` passes over the experts of the kept groups, each taking the largest (score,
   −index) key below the previous pass's, so ties go to the smaller expert id: the op's order
   rule, exactly. No comparison sort: ``top_k · E`` comparisons a token (8 · 256 for GLM-5);
4. weights ``s[ids]``, divided by their sum + 1e-20 when ``norm_topk_prob``, times
   ``routed_scaling``.

E, T, top_k and the group count are symbolic: one build serves every shape.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.tvm.tirlib import cached, serial

REV = 1  # bump when the generated code changes (part of the build-cache key)


def build_route(serial: bool = False) -> Any:
    """``moe_route(logits[T, E], bias[E], s[T, E], gs[T, G], w[T, K], ids[T, K], topk_group,
    norm, scaling)``: ``s`` and ``gs`` are scratch (sigmoid scores, group scores); G = 1 means
    no group limit."""
    from tvm.script import tirx as T

    rows = T.serial if serial else T.parallel  # the token loop (`tirlib.serial`)

    @T.prim_func
    def moe_route(l_h: T.handle, b_h: T.handle, s_h: T.handle, g_h: T.handle, w_h: T.handle,
                  i_h: T.handle, topk_group: T.int32, norm: T.int32, scaling: T.float32):
        T.func_attr({"global_symbol": "moe_route", "tirx.noalias": True})
        Tn = T.int32()
        E = T.int32()
        G = T.int32()
        K = T.int32()
        # align=4: the bias comes from a checkpoint and need not sit on TVM's default 64-byte
        # boundary (aligned vector loads of a misaligned buffer fault)
        L = T.match_buffer(l_h, (Tn, E), "float32", align=4)
        Bs = T.match_buffer(b_h, (E,), "float32", align=4)
        S = T.match_buffer(s_h, (Tn, E), "float32")
        GS = T.match_buffer(g_h, (Tn, G), "float32")
        W = T.match_buffer(w_h, (Tn, K), "float32")
        ID = T.match_buffer(i_h, (Tn, K), "int32")
        for t in rows(Tn):
            # fv/fi: the key of the last group kept (value, index); pv/pi: the key of the
            # expert the previous pass took; bv/bi: the best key found in the current pass
            # (bi = -1: none yet)
            fv = T.alloc_buffer((1,), "float32", scope="local")
            fi = T.alloc_buffer((1,), "int32", scope="local")
            bv = T.alloc_buffer((1,), "float32", scope="local")
            bi = T.alloc_buffer((1,), "int32", scope="local")
            pv = T.alloc_buffer((1,), "float32", scope="local")
            pi = T.alloc_buffer((1,), "int32", scope="local")
            m1 = T.alloc_buffer((1,), "float32", scope="local")
            m2 = T.alloc_buffer((1,), "float32", scope="local")
            tot = T.alloc_buffer((1,), "float32", scope="local")
            for e in range(E):
                S[t, e] = T.float32(1) / (T.float32(1) + T.exp(-L[t, e]))
            # the kept groups: keys >= the topk_group-th largest (fv, fi); with G = 1 the
            # one group is kept (fv = -inf, fi = G)
            fv[0] = T.float32(float("-inf"))
            fi[0] = G
            if G > 1:
                for g in range(G):
                    m1[0] = T.float32(float("-inf"))
                    m2[0] = T.float32(float("-inf"))
                    for j in range(E // G):
                        v = S[t, g * (E // G) + j] + Bs[g * (E // G) + j]
                        if v > m1[0]:
                            m2[0] = m1[0]
                            m1[0] = v
                        elif v > m2[0]:
                            m2[0] = v
                    GS[t, g] = m1[0] + m2[0]
                fv[0] = T.float32(float("inf"))
                fi[0] = -1
                for _r in range(topk_group):
                    bi[0] = -1
                    bv[0] = T.float32(float("-inf"))
                    for g in range(G):
                        below = GS[t, g] < fv[0] or (GS[t, g] == fv[0] and g > fi[0])
                        if below and (bi[0] < 0 or GS[t, g] > bv[0]):
                            bv[0] = GS[t, g]
                            bi[0] = g
                    fv[0] = bv[0]
                    fi[0] = bi[0]
            # top_k passes over the experts of the kept groups, keys strictly decreasing
            bv[0] = T.float32(float("inf"))
            bi[0] = -1
            tot[0] = T.float32(0)
            for j in range(K):
                pv[0] = bv[0]
                pi[0] = bi[0]
                bi[0] = -1
                bv[0] = T.float32(float("-inf"))
                for e in range(E):
                    v = S[t, e] + Bs[e]
                    g = e // (E // G)
                    kept = G == 1 or GS[t, g] > fv[0] or (GS[t, g] == fv[0] and g <= fi[0])
                    below = v < pv[0] or (v == pv[0] and e > pi[0])
                    if kept and below and (bi[0] < 0 or v > bv[0]):
                        bv[0] = v
                        bi[0] = e
                ID[t, j] = bi[0]
                W[t, j] = S[t, bi[0]]
                tot[0] = tot[0] + W[t, j]
            for j in range(K):
                if norm != 0:
                    W[t, j] = W[t, j] / (tot[0] + T.float32(1e-20)) * scaling
                else:
                    W[t, j] = W[t, j] * scaling

    return moe_route


def moe_route(context: Callable[[], Any], logits: torch.Tensor, bias: torch.Tensor,
              top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
              routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32, bias [E] fp32 -> (weights [T, top_k] fp32, ids [T, top_k] int32)."""
    T_, E = logits.shape
    w = torch.empty(T_, top_k, dtype=torch.float32)
    ids = torch.empty(T_, top_k, dtype=torch.int32)
    if T_ == 0 or top_k == 0:
        return w, ids
    ctx = context()
    ser = serial("moe_route", T_ * E)
    fn = cached(ctx, ("moe_route", REV, ser),
                lambda: ctx.kernel("moe_route", {"rev": REV, "serial": ser},
                                   lambda: build_route(ser), "moe_route"))
    s = torch.empty(T_, E, dtype=torch.float32)
    gs = torch.empty(T_, max(n_group, 1), dtype=torch.float32)
    fn(logits.contiguous(), bias.contiguous(), s, gs, w, ids, int(topk_group),
       int(bool(norm_topk_prob)), float(routed_scaling))
    return w, ids


def _supports(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling) -> bool:
    return (logits.dtype == torch.float32 and bias.dtype == torch.float32
            and logits.device.type == "cpu" and bias.device.type == "cpu"
            and logits.dim() == 2 and logits.numel() < 2**31)


def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    """Rows for the cpu backend: (op, fn, dtypes, supports)."""
    return [("moe_route",
             lambda logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling:
             moe_route(context, logits, bias, top_k, n_group, topk_group, norm_topk_prob,
                       routed_scaling),
             (torch.float32,), _supports)]
