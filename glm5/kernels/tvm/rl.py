"""cpu kernels for the RL ops (docs/ops.md, RL): `token_logprobs` (forward and backward),
`policy_loss` (forward and backward) and `grpo_advantages`.

token_logprobs, ``h[T, D]``, ``w_vocab[V, D]``: the vocabulary is walked in chunks of
``chunk_cols(T, D, V)`` rows (at most ``MAX_COLS``, fewer when ``[T, C]`` fp32 logits would pass
``SCRATCH_BYTES``): the chunk's logits ``z = (h / temperature) w_chunkᵀ`` come from one fp32
``torch.mm`` (MKL / oneDNN; bf16 / fp16 weights are widened a chunk at a time, exactly) into a
reused ``[T, C]`` buffer, then one TVM pass per row (``lse_chunk``) updates the running
``(max m, Σ exp(z − m), Σ exp(z − m)·z, target logit)`` of the online logsumexp: the chunk's
max, then ``fexp(z − m_new)`` summed in ``VL`` fp32 lanes, the old sums rescaled by
``exp(m_old − m_new)``. logp = z_t − lse, entropy = lse − Σ p z. No ``[T, V]`` tensor exists.

Its backward (``token_logprobs_backward``) takes lse and E[z] from the forward's outputs (lse =
z_t − logp with z_t recomputed from the target rows, E z = lse − entropy) and walks the same
chunks: the chunk's logits again (one GEMM), then one TVM pass per row (``softmax_grad``)
turns them in place into ``dL/dz = −p (g_logp + g_ent (z − E z)) + g_logp [v = target]`` with
``p = fexp(z − lse)``, then ``grad_h += dL/dz · w_chunk / temperature`` and ``grad_w[chunk] =
dL/dzᵀ · h / temperature`` (two GEMMs; each is skipped when its gradient is not wanted).

policy_loss: one pass over the tokens in ``BLOCK``-token blocks (``T.parallel``), each block
writing its five masked sums (loss terms, mask, clipped tokens, ratio, old − new) to a
``[blocks, 5]`` partials buffer that the host adds up; the backward is one elementwise pass
with torch.maximum's and torch.clamp's derivative conventions (a tie splits the gradient in
halves; the clamp passes its bounds). grpo_advantages: one work item per group (mean, the
unbiased std from the deviations, the normalised advantages).

Arithmetic is fp32 for fp32 / bf16 / fp16 calls (inputs widened exactly) and fp64 for
policy_loss / grpo_advantages called in float64 (the RL loop's rewards are float64), as the
contract's accumulation dtype says. Lengths are symbolic: one build per kernel (and dtype).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.tvm.tirlib import cached, fexp

REV = 1  # bump when the generated code changes (part of the build-cache key)
VL = 16  # fp32 lanes per vector (one AVX-512 / two AVX2 registers)

# token_logprobs' vocabulary chunk: at most MAX_COLS rows of w_vocab, fewer when the [T, C]
# fp32 logits (or a widened [C, D] weight chunk) would pass SCRATCH_BYTES; never below
# MIN_COLS. Multiples of ALIGN_COLS.
MAX_COLS = 8192
MIN_COLS = 256
ALIGN_COLS = 64
SCRATCH_BYTES = 64 * 2**20

BLOCK = 4096  # policy_loss: tokens per work item (its partial sums)

LOGPROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOSS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
F32, F64 = torch.float32, torch.float64


# --------------------------------------------------------------------------- builders
def build_lse_chunk() -> Any:
    """``lse_chunk(z[T, C], tgt[T], st[T, 4], v0)``: fold one chunk of logits (vocabulary rows
    v0 .. v0 + C) into each row's running state st = (max, Σ exp(z − max), Σ exp(z − max)·z,
    target logit)."""
    from tvm.script import tirx as T

    @T.prim_func
    def lse_chunk(z_h: T.handle, t_h: T.handle, s_h: T.handle, v0: T.int32):
        T.func_attr({"global_symbol": "lse_chunk", "tirx.noalias": True})
        Tn = T.int32()
        C = T.int32()
        # align=4: the chunk's rows start wherever C puts them
        Z = T.match_buffer(z_h, (Tn, C), "float32", align=4)
        TG = T.match_buffer(t_h, (Tn,), "int32", align=4)
        ST = T.match_buffer(s_h, (Tn, 4), "float32", align=4)
        for t in T.parallel(Tn):
            mx = T.alloc_buffer((VL,), "float32", scope="local")
            es = T.alloc_buffer((VL,), "float32", scope="local")
            ez = T.alloc_buffer((VL,), "float32", scope="local")
            r = T.alloc_buffer((4,), "float32", scope="local")  # chunk max, Σe, Σe·z, m_new
            # pass 1: the chunk's max
            for ll in T.vectorized(VL):
                mx[ll] = T.float32(float("-inf"))
            for c in range(C // VL):
                for ll in T.vectorized(VL):
                    mx[ll] = T.max(mx[ll], Z[t, c * VL + ll])
            r[0] = T.float32(float("-inf"))
            for ll in T.unroll(VL):
                r[0] = T.max(r[0], mx[ll])
            for j in range(C % VL):
                r[0] = T.max(r[0], Z[t, C // VL * VL + j])
            r[3] = T.max(ST[t, 0], r[0])
            # pass 2: Σ exp(z − m_new) and Σ exp(z − m_new)·z
            for ll in T.vectorized(VL):
                es[ll] = T.float32(0)
                ez[ll] = T.float32(0)
            for c in range(C // VL):
                for ll in T.vectorized(VL):
                    es[ll] = es[ll] + fexp(T, Z[t, c * VL + ll] - r[3])
                    ez[ll] = ez[ll] + fexp(T, Z[t, c * VL + ll] - r[3]) * Z[t, c * VL + ll]
            r[1] = T.float32(0)
            r[2] = T.float32(0)
            for ll in T.unroll(VL):
                r[1] = r[1] + es[ll]
                r[2] = r[2] + ez[ll]
            for j in range(C % VL):
                r[1] = r[1] + fexp(T, Z[t, C // VL * VL + j] - r[3])
                r[2] = r[2] + fexp(T, Z[t, C // VL * VL + j] - r[3]) * Z[t, C // VL * VL + j]
            # rescale the running sums to the new max (exp(−inf) = 0 on the first chunk)
            ST[t, 1] = ST[t, 1] * fexp(T, ST[t, 0] - r[3]) + r[1]
            ST[t, 2] = ST[t, 2] * fexp(T, ST[t, 0] - r[3]) + r[2]
            ST[t, 0] = r[3]
            if TG[t] >= v0 and TG[t] < v0 + C:
                ST[t, 3] = Z[t, TG[t] - v0]

    return lse_chunk


def build_softmax_grad() -> Any:
    """``softmax_grad(z[T, C], tgt[T], rs[T, 4], v0)``: z (one chunk's logits) becomes dL/dz
    in place, rs = (lse, E z, g_logp, g_entropy) per row."""
    from tvm.script import tirx as T

    @T.prim_func
    def softmax_grad(z_h: T.handle, t_h: T.handle, r_h: T.handle, v0: T.int32):
        T.func_attr({"global_symbol": "softmax_grad", "tirx.noalias": True})
        Tn = T.int32()
        C = T.int32()
        Z = T.match_buffer(z_h, (Tn, C), "float32", align=4)
        TG = T.match_buffer(t_h, (Tn,), "int32", align=4)
        RS = T.match_buffer(r_h, (Tn, 4), "float32", align=4)
        for t in T.parallel(Tn):
            for c in range(C // VL):
                for ll in T.vectorized(VL):
                    Z[t, c * VL + ll] = -fexp(T, Z[t, c * VL + ll] - RS[t, 0]) * (
                        RS[t, 2] + RS[t, 3] * (Z[t, c * VL + ll] - RS[t, 1]))
            for j in range(C // VL * VL, C):
                Z[t, j] = -fexp(T, Z[t, j] - RS[t, 0]) * (RS[t, 2] + RS[t, 3] * (Z[t, j]
                                                                                  - RS[t, 1]))
            if TG[t] >= v0 and TG[t] < v0 + C:
                Z[t, TG[t] - v0] = Z[t, TG[t] - v0] + RS[t, 2]

    return softmax_grad


def _exp(T: Any, x: Any, dt: str) -> Any:
    """exp in the kernel's arithmetic: the vectorisable fexp (fp32), libm's exp (fp64)."""
    return fexp(T, x) if dt == "float32" else T.exp(x)


def build_policy_loss(dt: str, tis: bool) -> Any:
    """``policy_loss(lp, old, adv, mask, roll, parts[NB, 5], lo, hi, cap)``: per block of
    BLOCK tokens the masked sums of (per-token loss · w, mask, clipped, ratio, old − lp).
    ``roll`` is read only when ``tis``."""
    from tvm.script import tirx as T

    @T.prim_func
    def policy_loss(l_h: T.handle, o_h: T.handle, a_h: T.handle, m_h: T.handle,
                    r_h: T.handle, p_h: T.handle, lo: T.float64, hi: T.float64,
                    cap: T.float64):
        T.func_attr({"global_symbol": "policy_loss", "tirx.noalias": True})
        Tn = T.int32()
        NB = T.int32()
        LP = T.match_buffer(l_h, (Tn,), dt, align=4)
        OL = T.match_buffer(o_h, (Tn,), dt, align=4)
        A = T.match_buffer(a_h, (Tn,), dt, align=4)
        M = T.match_buffer(m_h, (Tn,), dt, align=4)
        R = T.match_buffer(r_h, (Tn,), dt, align=4)
        P = T.match_buffer(p_h, (NB, 5), dt, align=4)
        for b in T.parallel(NB):
            acc = T.alloc_buffer((5,), dt, scope="local")
            v = T.alloc_buffer((4,), dt, scope="local")  # ratio, unclipped, clipped, per-token
            for k in range(5):
                acc[k] = T.Cast(dt, 0)
            for i in range(b * BLOCK, T.min(b * BLOCK + BLOCK, Tn)):
                v[0] = _exp(T, LP[i] - OL[i], dt)
                v[1] = -v[0] * A[i]
                v[2] = -T.min(T.max(v[0], T.Cast(dt, T.float64(1) - lo)),
                              T.Cast(dt, T.float64(1) + hi)) * A[i]
                v[3] = T.max(v[1], v[2])
                if tis:
                    v[3] = v[3] * T.min(_exp(T, OL[i] - R[i], dt), T.Cast(dt, cap))
                acc[0] = acc[0] + v[3] * M[i]
                acc[1] = acc[1] + M[i]
                acc[2] = acc[2] + T.Select(v[2] > v[1], M[i], T.Cast(dt, 0))
                acc[3] = acc[3] + v[0] * M[i]
                acc[4] = acc[4] + (OL[i] - LP[i]) * M[i]
            for k in range(5):
                P[b, k] = acc[k]

    return policy_loss


def build_policy_loss_backward(dt: str, tis: bool) -> Any:
    """``policy_loss_bwd(lp, old, adv, mask, roll, g_lp, g_adv, g_mask, lo, hi, cap, s1,
    s2)``: per token, s1 = dL_out / denom and s2 = dL_out · loss / denom (0 when the denominator
    is the clamp's 1): g_lp = s1 w m (d per/d ratio) ratio (g_old = −g_lp), g_adv = s1 w m
    (d per/d adv), g_mask = s1 w per − s2."""
    from tvm.script import tirx as T

    @T.prim_func
    def policy_loss_bwd(l_h: T.handle, o_h: T.handle, a_h: T.handle, m_h: T.handle,
                        r_h: T.handle, gl_h: T.handle, ga_h: T.handle, gm_h: T.handle,
                        lo: T.float64, hi: T.float64, cap: T.float64, s1: T.float64,
                        s2: T.float64):
        T.func_attr({"global_symbol": "policy_loss_bwd", "tirx.noalias": True})
        Tn = T.int32()
        LP = T.match_buffer(l_h, (Tn,), dt, align=4)
        OL = T.match_buffer(o_h, (Tn,), dt, align=4)
        A = T.match_buffer(a_h, (Tn,), dt, align=4)
        M = T.match_buffer(m_h, (Tn,), dt, align=4)
        R = T.match_buffer(r_h, (Tn,), dt, align=4)
        GL = T.match_buffer(gl_h, (Tn,), dt, align=4)
        GA = T.match_buffer(ga_h, (Tn,), dt, align=4)
        GM = T.match_buffer(gm_h, (Tn,), dt, align=4)
        for b in T.parallel((Tn + BLOCK - 1) // BLOCK):
            # ratio, clamp(ratio), unclipped, clipped, w, weight of unclipped, of clipped
            v = T.alloc_buffer((7,), dt, scope="local")
            for i in range(b * BLOCK, T.min(b * BLOCK + BLOCK, Tn)):
                # the clamp's bounds as torch takes them: 1 -/+ clip in double, then rounded
                lo_ = T.Cast(dt, T.float64(1) - lo)
                hi_ = T.Cast(dt, T.float64(1) + hi)
                v[0] = _exp(T, LP[i] - OL[i], dt)
                v[1] = T.min(T.max(v[0], lo_), hi_)
                v[2] = -v[0] * A[i]
                v[3] = -v[1] * A[i]
                v[4] = T.Cast(dt, 1)
                if tis:
                    v[4] = T.min(_exp(T, OL[i] - R[i], dt), T.Cast(dt, cap))
                # torch.maximum: the larger side takes the gradient, a tie splits it in halves
                v[5] = T.Select(v[2] > v[3], T.Cast(dt, 1),
                                T.Select(v[2] == v[3], T.Cast(dt, 0.5), T.Cast(dt, 0)))
                v[6] = T.Select(v[3] > v[2], T.Cast(dt, 1),
                                T.Select(v[2] == v[3], T.Cast(dt, 0.5), T.Cast(dt, 0)))
                # torch.clamp passes the gradient inside its bounds, the bounds included
                GL[i] = T.Cast(dt, s1) * v[4] * M[i] * (
                    -A[i] * (v[5] + T.Select(v[0] >= lo_ and v[0] <= hi_, v[6],
                                             T.Cast(dt, 0)))) * v[0]
                GA[i] = T.Cast(dt, s1) * v[4] * M[i] * (-(v[0] * v[5] + v[1] * v[6]))
                GM[i] = T.Cast(dt, s1) * v[4] * T.max(v[2], v[3]) - T.Cast(dt, s2)

    return policy_loss_bwd


def build_grpo(dt: str, std: bool) -> Any:
    """``grpo(r[G, g], adv[G, g], eps)``: one work item per group."""
    from tvm.script import tirx as T

    @T.prim_func
    def grpo(r_h: T.handle, a_h: T.handle, eps: T.float64):
        T.func_attr({"global_symbol": "grpo", "tirx.noalias": True})
        NG = T.int32()
        G = T.int32()
        R = T.match_buffer(r_h, (NG, G), dt, align=4)
        A = T.match_buffer(a_h, (NG, G), dt, align=4)
        for n in T.parallel(NG):
            s = T.alloc_buffer((2,), dt, scope="local")  # mean, then 1 / (std + eps)
            s[0] = T.Cast(dt, 0)
            for j in range(G):
                s[0] = s[0] + R[n, j]
            s[0] = s[0] / T.Cast(dt, G)
            if std:
                s[1] = T.Cast(dt, 0)
                for j in range(G):
                    s[1] = s[1] + (R[n, j] - s[0]) * (R[n, j] - s[0])
                s[1] = T.sqrt(s[1] / T.Cast(dt, G - 1)) + T.Cast(dt, eps)
                for j in range(G):
                    A[n, j] = (R[n, j] - s[0]) / s[1]
            else:
                for j in range(G):
                    A[n, j] = R[n, j] - s[0]

    return grpo


def _fn(context: Callable[[], Any], op: str, symbol: str, build: Callable[[], Any],
        **key: Any) -> Callable[..., Any]:
    ctx = context()
    k = {"fn": symbol, "vl": VL, "rev": REV, "block": BLOCK, **key}  # one build per symbol
    return cached(ctx, (op, symbol, tuple(sorted(key.items()))),
                  lambda: ctx.kernel(op, k, build, symbol))


# --------------------------------------------------------------------------- token_logprobs
def chunk_cols(T_: int, D: int, V: int, widen: bool) -> int:
    """Vocabulary rows per chunk: ``MAX_COLS``, fewer when the [T, C] fp32 logits (or, for
    bf16 / fp16 weights, the widened [C, D] chunk) would pass ``SCRATCH_BYTES``; at least
    ``MIN_COLS``, a multiple of ``ALIGN_COLS``, never more than V."""
    per_col = 4 * max(T_, D if widen else 0, 1)
    c = max(MIN_COLS, min(MAX_COLS, SCRATCH_BYTES // per_col)) // ALIGN_COLS * ALIGN_COLS
    return max(1, min(c, V))


def _w32(w: torch.Tensor, v0: int, c: int) -> torch.Tensor:
    """Rows v0 .. v0 + c of the vocabulary as fp32 (bf16 / fp16 widen exactly)."""
    wc = w[v0: v0 + c]
    return wc if wc.dtype == F32 else wc.to(F32)


def token_logprobs(context: Callable[[], Any], h: torch.Tensor, w_vocab: torch.Tensor,
                   targets: torch.Tensor, temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D], w_vocab [V, D] (fp32 / bf16 / fp16), targets [T] int32 -> (logp [T],
    entropy [T]) fp32."""
    T_, D = h.shape
    V = w_vocab.shape[0]
    if T_ == 0:
        return torch.empty(0, dtype=F32), torch.empty(0, dtype=F32)
    step = _fn(context, "token_logprobs", "lse_chunk", build_lse_chunk)
    hf = h.to(F32) / temperature  # the reference's order: h / temperature, then the product
    tg = targets.to(torch.int32).contiguous()
    st = torch.zeros(T_, 4, dtype=F32)
    st[:, 0] = float("-inf")
    C = chunk_cols(T_, D, V, w_vocab.dtype != F32)
    buf = torch.empty(T_ * C, dtype=F32)
    for v0 in range(0, V, C):
        c = min(C, V - v0)
        z = buf[: T_ * c].view(T_, c)
        torch.mm(hf, _w32(w_vocab, v0, c).T, out=z)
        step(z, tg, st, v0)
    lse = st[:, 0] + torch.log(st[:, 1])
    return st[:, 3] - lse, lse - st[:, 2] / st[:, 1]


def token_logprobs_backward(context: Callable[[], Any], grads: tuple, outputs: tuple,
                            needs: tuple, h: torch.Tensor, w_vocab: torch.Tensor,
                            targets: torch.Tensor, temperature: float) -> tuple:
    """(grad_h, grad_w_vocab, None, None) of token_logprobs (see the module docstring)."""
    g_lp, g_ent = grads
    logp, ent = outputs
    T_, D = h.shape
    V = w_vocab.shape[0]
    want_h, want_w = needs[0], needs[1]
    gh = torch.zeros(T_, D, dtype=F32) if want_h else None
    gw = torch.empty(w_vocab.shape, dtype=w_vocab.dtype) if want_w else None  # every row set
    if T_ == 0 or (g_lp is None and g_ent is None):
        return (gh.to(h.dtype) if gh is not None else None), \
            (gw.zero_() if gw is not None else None), None, None
    fn = _fn(context, "token_logprobs", "softmax_grad", build_softmax_grad)
    hf = h.to(F32) / temperature
    tg = targets.to(torch.int32).contiguous()
    # lse = z_t - logp (z_t from the target rows), E z = lse - entropy; then the incoming
    # gradients (zero where an output gets none)
    zt = (hf * w_vocab[tg.long()].to(F32)).sum(-1)
    rs = torch.empty(T_, 4, dtype=F32)
    rs[:, 0] = zt - logp.to(F32)
    rs[:, 1] = rs[:, 0] - ent.to(F32)
    rs[:, 2] = 0.0 if g_lp is None else g_lp.to(F32)
    rs[:, 3] = 0.0 if g_ent is None else g_ent.to(F32)
    C = chunk_cols(T_, D, V, w_vocab.dtype != F32)
    buf = torch.empty(T_ * C, dtype=F32)
    for v0 in range(0, V, C):
        c = min(C, V - v0)
        z = buf[: T_ * c].view(T_, c)
        wc = _w32(w_vocab, v0, c)
        torch.mm(hf, wc.T, out=z)
        fn(z, tg, rs, v0)  # z is dL/dz now
        if gh is not None:
            gh.addmm_(z, wc)
        if gw is not None:
            if gw.dtype == F32 and gw.is_contiguous():
                torch.mm(z.T, hf, out=gw[v0: v0 + c])
            else:
                gw[v0: v0 + c] = torch.mm(z.T, hf)
    if gh is not None:
        gh = (gh / temperature).to(h.dtype)
    return gh, gw, None, None


# --------------------------------------------------------------------------- policy_loss
def _acc(*ts: torch.Tensor | None) -> torch.dtype:
    return F64 if any(t is not None and t.dtype == F64 for t in ts) else F32


def _as(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return x.to(dt).contiguous()


def policy_loss(context: Callable[[], Any], logp: torch.Tensor, old_logp: torch.Tensor,
                adv: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float,
                rollout_logp: torch.Tensor | None, tis_cap: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (loss [], stats [3] = clip_frac, mean_ratio, approx_kl) in the accumulation dtype."""
    acc = _acc(logp, old_logp, adv, mask, rollout_logp)
    name = "float64" if acc == F64 else "float32"
    tis = rollout_logp is not None
    T_ = logp.shape[0]
    lp, ol, a, m = (_as(x, acc) for x in (logp, old_logp, adv, mask))
    r = _as(rollout_logp, acc) if tis else lp
    nb = max(1, -(-T_ // BLOCK))
    parts = torch.zeros(nb, 5, dtype=acc)
    if T_:
        fn = _fn(context, "policy_loss", "policy_loss",
                 lambda: build_policy_loss(name, tis), dtype=name, tis=tis)
        fn(lp, ol, a, m, r, parts, float(clip_low), float(clip_high), float(tis_cap))
    s = parts.sum(0)
    denom = s[1].clamp(min=1.0)
    return s[0] / denom, torch.stack((s[2] / denom, s[3] / denom, s[4] / denom))


def policy_loss_backward(context: Callable[[], Any], grads: tuple, outputs: tuple,
                         needs: tuple, logp: torch.Tensor, old_logp: torch.Tensor,
                         adv: torch.Tensor, mask: torch.Tensor, clip_low: float,
                         clip_high: float, rollout_logp: torch.Tensor | None,
                         tis_cap: float) -> tuple:
    """Gradients for logp, old_logp, adv and a floating mask (the TIS weight is constant:
    rollout_logp gets none), as the vjp of the reference gives them."""
    g_loss = grads[0]
    loss = outputs[0]
    acc = _acc(logp, old_logp, adv, mask, rollout_logp)
    name = "float64" if acc == F64 else "float32"
    tis = rollout_logp is not None
    T_ = logp.shape[0]
    lp, ol, a, m = (_as(x, acc) for x in (logp, old_logp, adv, mask))
    r = _as(rollout_logp, acc) if tis else lp
    msum = float(m.sum())
    denom = max(msum, 1.0)
    gl_ = float(g_loss) if g_loss is not None else 0.0
    s1 = gl_ / denom
    s2 = gl_ * float(loss) / denom if msum >= 1.0 else 0.0
    g_lp, g_a, g_m = (torch.empty(T_, dtype=acc) for _ in range(3))
    if T_:
        fn = _fn(context, "policy_loss", "policy_loss_bwd",
                 lambda: build_policy_loss_backward(name, tis), dtype=name, tis=tis)
        fn(lp, ol, a, m, r, g_lp, g_a, g_m, float(clip_low), float(clip_high),
           float(tis_cap), s1, s2)
    out: list[Any] = [None] * 8
    if needs[0]:
        out[0] = g_lp.to(logp.dtype)
    if needs[1]:
        out[1] = (-g_lp).to(old_logp.dtype)
    if needs[2]:
        out[2] = g_a.to(adv.dtype)
    if needs[3] and mask.is_floating_point():
        out[3] = g_m.to(mask.dtype)
    return tuple(out)


# --------------------------------------------------------------------------- grpo_advantages
def grpo_advantages(context: Callable[[], Any], rewards: torch.Tensor, group_size: int,
                    std_normalize: bool, eps: float) -> torch.Tensor:
    """rewards [N] -> adv [N] in rewards' dtype (fp32 arithmetic, fp64 for float64)."""
    acc = _acc(rewards)
    name = "float64" if acc == F64 else "float32"
    N = rewards.shape[0]
    r = _as(rewards, acc).view(-1, group_size)
    a = torch.empty_like(r)
    if N:
        std = bool(std_normalize)
        fn = _fn(context, "grpo_advantages", "grpo", lambda: build_grpo(name, std),
                 dtype=name, std=std)
        fn(r, a, float(eps))
    return a.view(-1).to(rewards.dtype)


# --------------------------------------------------------------------------- rows
def _cpu(*ts: Any) -> bool:
    return all(t.device.type == "cpu" for t in ts if isinstance(t, torch.Tensor))


def _tlp_supports(h, w_vocab, targets, temperature) -> bool:
    return (h.dtype in LOGPROB_DTYPES and w_vocab.dtype == h.dtype and _cpu(h, w_vocab, targets)
            and h.shape[0] * min(MAX_COLS, w_vocab.shape[0]) < 2**31
            and w_vocab.shape[0] < 2**31)


def _pl_supports(logp, old_logp, adv, mask, clip_low, clip_high, rollout_logp, tis_cap) -> bool:
    return _cpu(logp, old_logp, adv, mask, rollout_logp) and logp.shape[0] < 2**31 - BLOCK


def _grpo_supports(rewards, group_size, std_normalize, eps) -> bool:
    return _cpu(rewards) and rewards.shape[0] < 2**31


def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    """Rows for the cpu backend: (op, fn, dtypes, supports); their backwards: `backwards`."""
    return [
        ("token_logprobs", lambda h, w_vocab, targets, temperature: token_logprobs(
            context, h, w_vocab, targets, temperature), LOGPROB_DTYPES, _tlp_supports),
        ("policy_loss", lambda logp, old_logp, adv, mask, clip_low, clip_high, rollout_logp,
         tis_cap: policy_loss(context, logp, old_logp, adv, mask, clip_low, clip_high,
                              rollout_logp, tis_cap), LOSS_DTYPES, _pl_supports),
        ("grpo_advantages", lambda rewards, group_size, std_normalize, eps: grpo_advantages(
            context, rewards, group_size, std_normalize, eps), LOSS_DTYPES, _grpo_supports),
    ]


def backwards(context: Callable[[], Any]) -> dict[str, Callable[..., tuple]]:
    """The backward of each row that has one (see `glm5.Backend.kernel`): grpo_advantages has
    none (the RL loop never differentiates it; autograd takes its reference's vjp)."""
    return {
        "token_logprobs": lambda grads, outputs, needs, *args: token_logprobs_backward(
            context, grads, outputs, needs, *args),
        "policy_loss": lambda grads, outputs, needs, *args: policy_loss_backward(
            context, grads, outputs, needs, *args),
    }
