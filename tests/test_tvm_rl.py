"""The cpu backend's RL kernels (glm5/kernels/tvm/rl.py): token_logprobs, policy_loss (forward and
their own backward kernels) and grpo_advantages, against the float64 reference and its autograd
(the vjp), directly and through `glm5.ops` (the cpu kernel and its backward serve the call).

Forwards are judged by the conformance kit (`assert_matches`). The kit's table has no entry for
gradients, so the two gradient error models below derive one, in the kit's bound form and
constants (`glm5.testing.tolerances.bound`: MARGIN u(out)|r| + LAMBDA u(fp32 | fp64) acc +
floor): each docstring is the derivation of its ``acc`` term; there is no tolerance of its own
here. The kernels run through the cpu backend's own build context (its compile cache: a kernel
whose source changed is rebuilt, its key holds the source's hash).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

pytest.importorskip("tvm")

from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import glm5  # noqa: E402
from glm5 import ops  # noqa: E402
from glm5.backends import selection  # noqa: E402
from glm5.backends.cpu import context as cpu_context  # noqa: E402
from glm5.ir.numerics import LAMBDA, ErrorTerms, acc_dtype, sqrt_n, unit_roundoff  # noqa: E402
from glm5.kernels.tvm import rl  # noqa: E402
from glm5.testing.compare import assert_matches, upcast  # noqa: E402
from glm5.testing.tolerances import bound  # noqa: E402

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
I32 = torch.int32
TLP = glm5.get_op("token_logprobs")
PL = glm5.get_op("policy_loss")


@pytest.fixture
def strict(monkeypatch):
    """A reference fallback is an error (the cpu kernels must serve every call)."""
    monkeypatch.setenv("GLM5_STRICT", "1")
    monkeypatch.delenv("GLM5_BACKEND", raising=False)


def _assert_grad(name: str, got: torch.Tensor | None, ref: torch.Tensor, acc: torch.Tensor,
                 dtype: torch.dtype, work: torch.dtype) -> float:
    """|got - ref| within the kit's bound with error terms ``acc`` (float64, like ``ref``);
    ``dtype``: the dtype the gradient must have. Returns the worst error / bound."""
    assert got is not None, f"{name}: expected a gradient, got None"
    assert got.dtype == dtype and got.shape == ref.shape, (
        f"{name}: expected a {dtype} gradient of shape {tuple(ref.shape)}, got {got.dtype} "
        f"{tuple(got.shape)}")
    got, ref, acc = got.detach(), ref.detach(), acc.detach()
    b = bound(ref, ErrorTerms(acc=acc), dtype, work)
    err = (got.double() - ref).abs()
    assert bool(torch.isfinite(got).all()), f"{name}: non-finite gradient entries"
    bad = err > b
    if bool(bad.any()):
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: |err| {float(err[i]):.3g} > bound {float(b[i]):.3g} at {list(i)} (got "
            f"{float(got[i]):.6g}, float64 vjp {float(ref[i]):.6g}; worst error/bound "
            f"{float((err / b).max()):.3g})")
    return float((err / b).max()) if err.numel() else 0.0


# --------------------------------------------------------------------------- token_logprobs
def tlp_grad_acc(h, w, tg, temp, g_lp, g_ent):
    """``acc`` terms (units of LAMBDA u(fp32)) of (grad_h [T, D], grad_w [V, D]) of
    token_logprobs with upstream gradients g_lp, g_ent [T] (float64; zeros for none).

    Derivation, following the kernel's backward (rl.token_logprobs_backward) and the op's
    forward error model (`token_logprobs_error`, whose logp / entropy terms are reused):
    - logits z = (h / temp) w^T: dz_v = sqrt(D) |h||w_v| / temp + 2 |z_v| (as the forward);
    - lse = z_t - logp from the forward's outputs: dz_t + the logp term + |lse| + |logp|
      (the subtraction, logp's own rounding); E z = lse - entropy: d_lse + the entropy term +
      |Ez| + |entropy|;
    - p_v = exp(z_v - lse) (fexp: 2 ulp): p_v (dz_v + d_lse + |z_v - lse| + 2), and fexp
      flushes results below fp32's smallest normal to 0: that much absolute, here divided by
      LAMBDA u(fp32) (these units);
    - c_v = g_lp + g_ent (z_v - Ez): |g_ent| (dz_v + d_Ez + 2 |z_v - Ez|) + |c_v|;
    - dL/dz_v = G_v = -p_v c_v + g_lp [v = t]: dp_v |c_v| + p_v dc_v + p_v |c_v| + [v = t] |G_t|;
    - grad_h = G w / temp, fp32 sums over V: dG |w| / temp + sqrt(V) |G||w| / temp + |grad_h|;
    - grad_w = G^T (h / temp), fp32 sums over T: dG^T |h / temp| + (sqrt(T) + 1) |G|^T |h / temp|.
    """
    T, D = h.shape
    V = w.shape[0]
    a = h / temp
    z = a @ w.T
    lse = torch.logsumexp(z, -1)
    p = torch.exp(z - lse[:, None])
    ez = (p * z).sum(-1)
    logp = z.gather(1, tg.long()[:, None]).squeeze(1) - lse
    ent = lse - ez
    o64 = {"h": h, "w_vocab": w, "targets": tg, "temperature": temp}
    fwd = TLP.error(o64, (logp, ent), F32)
    dz = sqrt_n(D) * (h.abs() @ w.abs().T) / abs(temp) + 2.0 * z.abs()
    onehot = torch.zeros(T, V, dtype=F64).scatter_(1, tg.long()[:, None], 1.0)
    d_lse = (dz * onehot).sum(-1) + fwd["logp"].acc + lse.abs() + logp.abs()
    d_ez = d_lse + fwd["entropy"].acc + ez.abs() + ent.abs()
    dev = z - ez[:, None]
    c = g_lp[:, None] + g_ent[:, None] * dev
    G = -p * c + g_lp[:, None] * onehot
    flushed = torch.finfo(F32).smallest_normal / (LAMBDA * unit_roundoff(F32))
    dp = p * (dz + d_lse[:, None] + (z - lse[:, None]).abs() + 2.0) + flushed
    dc = g_ent.abs()[:, None] * (dz + d_ez[:, None] + 2.0 * dev.abs()) + c.abs()
    dG = dp * c.abs() + p * dc + p * c.abs() + onehot * G.abs()
    acc_h = (dG @ w.abs() + sqrt_n(V) * (G.abs() @ w.abs())) / abs(temp) + (G @ w).abs() / temp
    acc_w = dG.T @ a.abs() + (sqrt_n(T) + 1.0) * (G.abs().T @ a.abs())
    return acc_h, acc_w


def _tlp_vjp(h, w, tg, temp, g_lp, g_ent):
    """The float64 reference's vjp: (grad_h, grad_w) for upstream g_lp / g_ent (None: that
    output takes no gradient)."""
    h64 = h.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    lp, ent = TLP.reference(h64, w64, tg, temp)
    outs, gs = [], []
    for o, g in ((lp, g_lp), (ent, g_ent)):
        if g is not None:
            outs.append(o)
            gs.append(g.double())
    gh, gw = torch.autograd.grad(outs, (h64, w64), gs)
    return gh, gw


def _small_chunks(mp: pytest.MonkeyPatch, C: int) -> None:
    """token_logprobs walks the vocabulary in chunks of exactly C rows."""
    mp.setattr(rl, "MAX_COLS", C)
    mp.setattr(rl, "MIN_COLS", C)
    mp.setattr(rl, "ALIGN_COLS", 1)


def _tlp_case(T, D, V, dtype, targets, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, D, generator=g) * scale).to(dtype)
    w = (torch.randn(V, D, generator=g) * scale).to(dtype)
    # a few rows aligned with a token: their logit is the row's max, in whichever chunk
    for t in range(min(T, 3)):
        w[(t * 7919) % V] = (h[t].float() * 2.0 / (h[t].float().norm() + 1e-3)).to(dtype)
    return h, w, torch.tensor(targets, dtype=I32)


def _check_tlp(h, w, tg, temp, g_lp, g_ent, needs=(True, True), what=""):
    """Forward (the kit) and backward (the derived bound) of the cpu kernel on one case,
    calling rl's functions directly; returns the worst gradient error / bound."""
    ctx = cpu_context
    dtype = h.dtype
    lp, ent = rl.token_logprobs(ctx, h, w, tg, temp)
    vals = {"h": h, "w_vocab": w, "targets": tg, "temperature": temp}
    assert_matches("token_logprobs", (lp, ent), vals, what=what or "forward")
    gh, gw, gt, gtemp = rl.token_logprobs_backward(
        ctx, (g_lp, g_ent), (lp, ent), (needs[0], needs[1], False, False), h, w, tg, temp)
    assert gt is None and gtemp is None, "token_logprobs backward: targets / temperature take " \
        "no gradient"
    zeros = torch.zeros(h.shape[0], dtype=F64)
    rh, rw = _tlp_vjp(h, w, tg, temp, g_lp, g_ent)
    acc_h, acc_w = tlp_grad_acc(h.double(), w.double(), tg, temp,
                                zeros if g_lp is None else g_lp.double(),
                                zeros if g_ent is None else g_ent.double())
    worst = 0.0
    if needs[0]:
        worst = max(worst, _assert_grad(f"{what} token_logprobs grad h", gh, rh, acc_h, dtype,
                                        dtype))
    else:
        assert gh is None, f"{what} token_logprobs: grad h not wanted, got a tensor"
    if needs[1]:
        worst = max(worst, _assert_grad(f"{what} token_logprobs grad w_vocab", gw, rw, acc_w,
                                        dtype, dtype))
    else:
        assert gw is None, f"{what} token_logprobs: grad w_vocab not wanted, got a tensor"
    return worst


@pytest.mark.parametrize("C,ragged", [(7, 3), (23, 5), (37, 1)])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_token_logprobs_chunk_edges(dtype, C, ragged):
    """V spans 3 chunks and a ragged last one; C below, above and not a multiple of VL = 16;
    T = 19 (not a multiple of 16); targets on the first and last column of every chunk and on
    the last vocabulary row; temperature 0.7."""
    V = 3 * C + ragged
    assert C % rl.VL != 0 and V % C != 0
    edges = sorted({v for v0 in range(0, V, C) for v in (v0, min(v0 + C, V) - 1)} | {V - 1})
    T = 19
    targets = [edges[t % len(edges)] for t in range(T)]
    h, w, tg = _tlp_case(T, 24, V, dtype, targets, seed=C)
    g = torch.Generator().manual_seed(C + 1)
    g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    with pytest.MonkeyPatch.context() as mp:
        _small_chunks(mp, C)
        assert rl.chunk_cols(T, 24, V, dtype != F32) == C
        _check_tlp(h, w, tg, 0.7, g_lp, g_ent, what=f"C={C} V={V} {dtype}")


@pytest.mark.parametrize("grads", ["logp", "entropy"])
@pytest.mark.parametrize("needs", [(True, False), (False, True)])
def test_token_logprobs_one_output_one_input(grads, needs):
    """A gradient on logp only / entropy only (the other output's is None), for h only / for
    w_vocab only; 4 chunks, the last ragged."""
    C, V, T = 16, 53, 11
    h, w, tg = _tlp_case(T, 9, V, F32, [0, 15, 16, 31, 32, 47, 48, 52, 52, 3, 20], seed=5)
    g = torch.randn(T, generator=torch.Generator().manual_seed(6))
    with pytest.MonkeyPatch.context() as mp:
        _small_chunks(mp, C)
        _check_tlp(h, w, tg, 1.3, g if grads == "logp" else None,
                   g if grads == "entropy" else None, needs, what=f"grad on {grads} only")


def test_token_logprobs_backward_without_incoming_gradients():
    """No output takes a gradient: zero gradients of the right dtype and shape."""
    h, w, tg = _tlp_case(3, 4, 10, BF16, [0, 9, 4], seed=1)
    lp, ent = rl.token_logprobs(cpu_context, h, w, tg, 1.0)
    gh, gw, _, _ = rl.token_logprobs_backward(cpu_context, (None, None), (lp, ent),
                                              (True, True, False, False), h, w, tg, 1.0)
    assert gh.dtype == BF16 and gw.dtype == BF16 and gh.shape == h.shape and gw.shape == w.shape
    assert not bool(gh.any()) and not bool(gw.any()), "token_logprobs: expected zero gradients"


@given(data=st.data())
def test_token_logprobs_matches_float64_vjp(data):
    """Drawn shapes, chunkings, targets (chunk edges likely), temperatures, dtypes and which
    gradients flow."""
    dtype = data.draw(st.sampled_from([F32, BF16, F16]), "dtype")
    C = data.draw(st.integers(1, 40), "C")
    full = data.draw(st.integers(0, 3), "full chunks")
    ragged = data.draw(st.integers(0, C - 1), "ragged")
    V = full * C + ragged
    assume(V >= 1)
    T = data.draw(st.integers(1, 20), "T")
    D = data.draw(st.integers(1, 20), "D")
    edges = sorted({v for v0 in range(0, V, C) for v in (v0, min(v0 + C, V) - 1)} | {V - 1})
    targets = data.draw(st.lists(st.one_of(st.sampled_from(edges), st.integers(0, V - 1)),
                                 min_size=T, max_size=T), "targets")
    temp = data.draw(st.sampled_from([1.0, 0.6, 1.7]), "temperature")
    which = data.draw(st.sampled_from(["both", "logp", "entropy"]), "grads")
    needs = data.draw(st.sampled_from([(True, True), (True, False), (False, True)]), "needs")
    seed = data.draw(st.integers(0, 2**16), "seed")
    h, w, tg = _tlp_case(T, D, V, dtype, targets, seed, scale=data.draw(
        st.sampled_from([0.5, 1.0, 3.0]), "scale"))
    g = torch.Generator().manual_seed(seed + 1)
    g_lp = torch.randn(T, generator=g) if which in ("both", "logp") else None
    g_ent = torch.randn(T, generator=g) if which in ("both", "entropy") else None
    with pytest.MonkeyPatch.context() as mp:
        _small_chunks(mp, C)
        _check_tlp(h, w, tg, temp, g_lp, g_ent, needs, what=f"C={C} V={V} T={T} {dtype}")


# --------------------------------------------------------------------------- policy_loss
def _pl_near_bound(o64: dict, work: torch.dtype) -> torch.Tensor:
    """Tokens whose ratio lies within its rounding error of a clip bound without sitting on it
    exactly: a correct kernel may put them on either side (its gradient jumps there), as the
    op's error model says for clip_frac."""
    d = o64["logp"] - o64["old_logp"]
    ratio = torch.exp(d)
    dr = ratio * (d.abs() + 2.0)
    tol = LAMBDA * unit_roundoff(acc_dtype(work)) * dr
    near = torch.zeros_like(ratio, dtype=torch.bool)
    for edge in (1.0 - o64["clip_low"], 1.0 + o64["clip_high"]):
        near |= ((ratio - edge).abs() <= tol) & (ratio != edge)
    return near


def pl_grad_acc(o64: dict, g: float, work: torch.dtype) -> dict[str, torch.Tensor]:
    """``acc`` terms (units of LAMBDA u(acc)) of policy_loss's gradients for logp, old_logp,
    adv and mask, upstream gradient ``g`` of the loss.

    Derivation, following rl.policy_loss_backward: per token the gradient is s1 w m times a
    product of ratio, the advantage and the clip weights (0, 1/2, 1: exact), s1 = g / denom.
    - ratio = exp(logp - old): relative error |logp - old| + 2 (as the forward model); the TIS
      weight w likewise, |old - rollout| + 2; denom = max(sum m, 1), a sum over T:
      sqrt(T) sum|m| / denom + 1 relative for s1 (the division);
    - logp / old_logp: |g| w |m| ratio |A| / denom times (those + 5 products' roundings);
      adv: |g| w |m| max(ratio, clamp(ratio)) / denom times the same;
    - mask: s1 w per - s2 with s2 = g loss / denom (0 when sum m < 1): per = max(unclipped,
      clipped) is off by |A| ratio (|logp - old| + 2) + |per| (its product);
      s1 w per by |g| w (that + |per| (s1's + w's + 3)) / denom; s2 by |g| (the op's error
      term of the loss + |loss| (s1's + 2)) / denom; the subtraction: |grad mask|.
    """
    lp, old, A, m = (o64[k] for k in ("logp", "old_logp", "adv", "mask"))
    m = m.to(F64)
    T = lp.shape[0]
    d = lp - old
    ratio = torch.exp(d)
    lo, hi = 1.0 - o64["clip_low"], 1.0 + o64["clip_high"]
    cr = ratio.clamp(lo, hi)
    per = torch.maximum(-ratio * A, -cr * A)
    roll = o64["rollout_logp"]
    if roll is not None:
        w = torch.exp(old - roll).clamp(max=o64["tis_cap"])
        rw = (old - roll).abs() + 2.0
    else:
        w, rw = torch.ones_like(lp), torch.zeros_like(lp)
    msum = float(m.sum())
    denom = max(msum, 1.0)
    rs = sqrt_n(T) * float(m.abs().sum()) / denom + 1.0
    rr = d.abs() + 2.0
    rel = rs + rw + rr + 5.0
    s = abs(g) / denom * w
    loss, stats = PL.reference(*(o64[n] for n in PL.param_names))
    loss_acc = PL.error(o64, (loss, stats), work)["loss"].acc
    d_per = A.abs() * ratio * rr + per.abs()
    g_mask = g / denom * w * per - (g * float(loss) / denom if msum >= 1.0 else 0.0)
    acc_m = (s * (d_per + per.abs() * (rs + rw + 3.0))
             + (abs(g) * (float(loss_acc) + abs(float(loss)) * (rs + 2.0)) / denom
                if msum >= 1.0 else 0.0)
             + g_mask.abs())
    acc_lp = s * m.abs() * ratio * A.abs() * rel
    return {"logp": acc_lp, "old_logp": acc_lp, "adv": s * m.abs() * torch.maximum(ratio, cr)
            * rel, "mask": acc_m}


def _pl_vjp(values: dict, g: float, dtype: torch.dtype | None = None) -> dict:
    """The reference's vjp for loss gradient ``g``: in float64 on upcast inputs (the oracle),
    or in ``dtype`` (the reference run in the kernel's own dtype)."""
    v = upcast(values) if dtype is None else {
        k: (x.detach().to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
            else x) for k, x in values.items()}
    names = [n for n in ("logp", "old_logp", "adv", "mask")
             if v[n].is_floating_point()]
    for n in names:
        v[n] = v[n].detach().clone().requires_grad_(True)
    loss, _ = PL.reference(*(v[n] for n in PL.param_names))
    grads = torch.autograd.grad(loss, [v[n] for n in names], torch.tensor(g, dtype=loss.dtype),
                                allow_unused=True)
    return {n: (gr if gr is not None else torch.zeros_like(v[n])) for n, gr in zip(names, grads)}


def _check_pl(values: dict, g: float, what: str = "", same_dtype_ref: bool = False) -> None:
    """Forward (the kit) and backward (the derived bound) of the cpu kernel on one case; with
    ``same_dtype_ref`` also against the reference's autograd in the kernel's own dtype."""
    ctx = cpu_context
    args = [values[n].detach() if isinstance(values[n], torch.Tensor) else values[n]
            for n in PL.param_names]
    loss, stats = rl.policy_loss(ctx, *args)
    assert_matches("policy_loss", (loss, stats), values, what=what or "forward")
    needs = tuple(isinstance(a, torch.Tensor) and a.is_floating_point() and
                  n != "rollout_logp" for n, a in zip(PL.param_names, args))
    res = rl.policy_loss_backward(ctx, (torch.tensor(g, dtype=loss.dtype), None), (loss, stats),
                                  needs, *args)
    assert len(res) == len(PL.param_names), f"{what} policy_loss backward: expected " \
        f"{len(PL.param_names)} entries (one per argument), got {len(res)}"
    got = dict(zip(PL.param_names, res))
    assert got["rollout_logp"] is None, f"{what} policy_loss: rollout_logp takes no gradient " \
        f"(the TIS weight is constant)"
    work = PL.dispatch_dtype(values)
    acc_work = acc_dtype(PL.acc_dtype(values))
    o64 = upcast(values)
    accs = pl_grad_acc(o64, g, acc_work)
    refs = [_pl_vjp(values, g)]
    if same_dtype_ref:
        refs.append(_pl_vjp(values, g, PL.acc_dtype(values)))
    for ref in refs:
        for n, r in ref.items():
            _assert_grad(f"{what} policy_loss grad {n}", got[n], r.double(), accs[n],
                         values[n].dtype, work if acc_work != F64 else F64)
    if not values["mask"].is_floating_point():
        assert got["mask"] is None, f"{what} policy_loss: a bool mask takes no gradient"


def _pl_values(lp, old, adv, mask, roll=None, clip_low=0.2, clip_high=0.25, cap=2.0):
    return {"logp": lp, "old_logp": old, "adv": adv, "mask": mask, "clip_low": clip_low,
            "clip_high": clip_high, "rollout_logp": roll, "tis_cap": cap}


MASKS = ("ones", "random", "bool", "zeros", "fraction")


def _mask(kind: str, T: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(T, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(T, dtype=dtype)
    if kind == "bool":
        return torch.rand(T, generator=g) > 0.3
    if kind == "random":
        return (torch.rand(T, generator=g) > 0.3).to(dtype)
    return (torch.rand(T, generator=g) * 0.5).to(dtype)  # fractional weights, sum may be < 1


@given(data=st.data())
def test_policy_loss_matches_float64_vjp(data):
    """Drawn ratios (some exactly 1: ties, some clipped), with and without TIS, clip bounds
    including 0 (a tie on the bound), every mask kind, fp32 / bf16 / fp16 / fp64."""
    dtype = data.draw(st.sampled_from([F32, BF16, F16, F64]), "dtype")
    T = data.draw(st.integers(1, 24), "T")
    seed = data.draw(st.integers(0, 2**16), "seed")
    clip_low = data.draw(st.sampled_from([0.0, 0.2]), "clip_low")
    clip_high = data.draw(st.sampled_from([0.0, 0.25, 0.28]), "clip_high")
    tis = data.draw(st.booleans(), "tis")
    kind = data.draw(st.sampled_from(MASKS), "mask")
    g = torch.Generator().manual_seed(seed)
    old = (torch.rand(T, generator=g) * -4.0).to(dtype)
    d = torch.randn(T, generator=g) * 0.4
    tie = torch.rand(T, generator=g) < 0.3
    lp = torch.where(tie, old, (old.double() + d).to(dtype))
    adv = (torch.randn(T, generator=g) * 2.0).to(dtype)
    roll = (old.double() + torch.randn(T, generator=g) * 0.6).to(dtype) if tis else None
    vals = _pl_values(lp, old, adv, _mask(kind, T, dtype, g), roll, clip_low, clip_high,
                      data.draw(st.sampled_from([2.0, 1.2]), "tis_cap"))
    assume(not bool(_pl_near_bound(upcast(vals), PL.acc_dtype(vals)).any()))
    _check_pl(vals, data.draw(st.sampled_from([1.0, -0.37, 2.5]), "g"),
              what=f"{dtype} T={T} mask={kind} tis={tis}")


@pytest.mark.parametrize("tis", [False, True])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_policy_loss_ties_at_the_clip_bounds(dtype, tis):
    """Ratios exactly at a clip bound (clip 0: the bound is 1 = exp(0)) and exactly inside
    (unclipped = clipped): torch.maximum splits a tie's gradient in halves and torch.clamp
    passes its bounds, so the whole gradient reaches logp. Compared with the reference's
    autograd in the same dtype and in float64."""
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.25], dtype=dtype)
    lp = old.clone()  # ratio 1 everywhere: on the bound 1 - 0 and inside [1, 1.25]
    adv = torch.tensor([1.0, -2.0, 0.5, -0.75, 3.0, -1.0], dtype=dtype)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], dtype=dtype)
    roll = (old - torch.tensor([0.1, -0.3, 0.0, 0.9, -0.2, 0.05], dtype=dtype)) if tis else None
    for clip_low, clip_high in ((0.0, 0.25), (0.2, 0.0), (0.0, 0.0), (0.2, 0.25)):
        vals = _pl_values(lp, old, adv, mask, roll, clip_low, clip_high)
        _check_pl(vals, 1.0, what=f"clip ({clip_low}, {clip_high})", same_dtype_ref=True)
        # by hand: d loss / d logp = -A w m / sum(m) (the two halves add up)
        args = [vals[n] for n in PL.param_names]
        loss, stats = rl.policy_loss(cpu_context, *args)
        g_lp = rl.policy_loss_backward(cpu_context, (torch.ones((), dtype=loss.dtype), None),
                                       (loss, stats), (True,) * 4 + (False,) * 4, *args)[0]
        w = torch.exp(old - roll).clamp(max=2.0) if tis else torch.ones_like(old)
        want = -adv * w * mask / mask.sum()
        torch.testing.assert_close(g_lp, want, rtol=4 * unit_roundoff(dtype), atol=0.0,
                                   msg=lambda m: f"policy_loss grad logp at ties: {m}")


@pytest.mark.parametrize("mask", [[0.0, 0.0, 0.0, 0.0], [0.25, 0.75, 0.0, 0.0],
                                  [0.25, 0.5, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_policy_loss_mask_gradient_and_the_denominator_clamp(mask, dtype):
    """A float mask that needs a gradient, with sum(mask) 0, exactly 1 (torch.clamp passes its
    bound: the loss's term reaches the mask), below 1 (clamped: none does) and above 1."""
    lp = torch.tensor([-1.0, -0.7, -2.2, -0.1], dtype=dtype)
    old = torch.tensor([-1.2, -0.3, -2.0, -0.6], dtype=dtype)
    adv = torch.tensor([0.5, -1.5, 2.0, 1.0], dtype=dtype)
    m = torch.tensor(mask, dtype=dtype, requires_grad=True)
    vals = _pl_values(lp, old, adv, m)
    assert not bool(_pl_near_bound(upcast(vals), dtype).any())
    _check_pl(vals, 1.0, what=f"mask {mask}", same_dtype_ref=True)
    if not any(mask):
        loss, _ = rl.policy_loss(cpu_context, *(vals[n] for n in PL.param_names))
        assert float(loss) == 0.0, "policy_loss with an all-zero mask: expected loss 0"


def test_policy_loss_float64_rewards_and_long_input():
    """float64 everywhere (the RL loop's rewards) over more than one BLOCK of tokens, then fp32
    logprobs with the rest in float64."""
    T = rl.BLOCK + 37
    g = torch.Generator().manual_seed(11)
    old = torch.rand(T, generator=g, dtype=F64) * -3.0
    lp = old + torch.randn(T, generator=g, dtype=F64) * 0.3
    vals = _pl_values(lp, old, torch.randn(T, generator=g, dtype=F64),
                      (torch.rand(T, generator=g) > 0.2).to(F64),
                      old + torch.randn(T, generator=g, dtype=F64) * 0.5)
    assert not bool(_pl_near_bound(upcast(vals), F64).any())
    _check_pl(vals, -0.5, what="float64, T > BLOCK")
    # fp32 logprobs with float64 advantages: the contract's accumulation (and output) dtype is
    # float64 as soon as one input is; logp's gradient comes back in fp32
    vals = {**vals, "logp": lp.float()}
    assert PL.acc_dtype(vals) == F64
    assert not bool(_pl_near_bound(upcast(vals), F64).any())
    _check_pl(vals, -0.5, what="fp32 logp, float64 rest")


# --------------------------------------------------------------------------- grpo_advantages
@given(data=st.data())
def test_grpo_advantages_matches_float64(data):
    dtype = data.draw(st.sampled_from([F32, F64, BF16]), "dtype")
    std = data.draw(st.booleans(), "std_normalize")
    G = data.draw(st.integers(2 if std else 1, 6), "group_size")
    NG = data.draw(st.integers(1, 5), "groups")
    eps = data.draw(st.sampled_from([1e-6, 0.5]), "eps")
    seed = data.draw(st.integers(0, 2**16), "seed")
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(NG, G, generator=gen, dtype=F64) * 3.0
    const = torch.rand(NG, generator=gen) < 0.3
    r[const] = r[const][:, :1]  # constant groups: advantage 0 up to the mean's rounding
    r = r.reshape(-1).to(dtype)
    vals = {"rewards": r, "group_size": G, "std_normalize": std, "eps": eps}
    got = rl.grpo_advantages(cpu_context, r, G, std, eps)
    assert_matches("grpo_advantages", got, vals, what=f"{dtype} G={G} std={std}")


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("std", [True, False])
def test_grpo_advantages_group_of_two_and_constant_groups(dtype, std):
    r = torch.tensor([1.0, 3.0, 0.5, 0.5, -2.0, 4.0, 7.0, 7.0], dtype=dtype)
    got = rl.grpo_advantages(cpu_context, r, 2, std, 1e-6)
    # deviations from the group means 2 and 1: -1, 1 and -3, 3; unbiased stds sqrt(2), sqrt(18)
    d1, d3 = ((math.sqrt(2.0) + 1e-6), (math.sqrt(18.0) + 1e-6)) if std else (1.0, 1.0)
    want = torch.tensor([-1 / d1, 1 / d1, 0.0, 0.0, -3 / d3, 3 / d3, 0.0, 0.0], dtype=F64)
    assert got.dtype == dtype
    assert_matches("grpo_advantages", want, {"rewards": r.double(), "group_size": 2,
                                             "std_normalize": std, "eps": 1e-6}, dtype=F64)
    assert_matches("grpo_advantages", got, {"rewards": r, "group_size": 2,
                                            "std_normalize": std, "eps": 1e-6})
    # 0.5 and 7.0 are exact: the constant groups come out exactly 0
    assert got[2:4].tolist() == [0.0, 0.0] and got[6:8].tolist() == [0.0, 0.0], \
        f"grpo_advantages: constant groups expected exactly 0, got {got.tolist()}"


# --------------------------------------------------------------------------- public path
@pytest.fixture
def spy(monkeypatch):
    """Counts calls of rl's forward and backward functions (the cpu backend's kernel rows call
    them by name) and records the ``needs`` each backward got."""
    calls: Counter = Counter()
    needs: dict[str, list] = {}

    def wrap(name):
        real = getattr(rl, name)

        def f(*args, **kw):
            calls[name] += 1
            if name.endswith("_backward"):
                needs.setdefault(name, []).append(tuple(args[3]))
            return real(*args, **kw)

        monkeypatch.setattr(rl, name, f)

    for name in ("token_logprobs", "token_logprobs_backward", "policy_loss",
                 "policy_loss_backward", "grpo_advantages"):
        wrap(name)
    return calls, needs


@pytest.mark.parametrize("dtype,wants,which", [
    (F32, (True, True), "both"), (F32, (True, False), "logp"), (F32, (False, True), "entropy"),
    (BF16, (True, True), "both"), (BF16, (True, False), "entropy"),
    (F16, (False, True), "logp")])
def test_ops_token_logprobs_uses_the_cpu_kernel_and_its_backward(strict, spy, dtype, wants,
                                                                  which):
    """Through glm5.ops with requires_grad on h and / or w_vocab and a loss on both outputs or
    one: the cpu kernel serves the forward, its backward the gradients (asked only for what
    requires grad), within the bound of the float64 vjp; 4 chunks, the last ragged."""
    calls, needs = spy
    C, V, T, temp = 10, 34, 7, 0.8
    h, w, tg = _tlp_case(T, 12, V, dtype, [0, 9, 10, 19, 20, 33, 5], seed=3)
    h.requires_grad_(wants[0])
    w.requires_grad_(wants[1])
    values = {"h": h, "w_vocab": w, "targets": tg, "temperature": temp}
    assert selection.kernel_for(TLP, values) == ("cpu", "native"), \
        "token_logprobs: expected the cpu kernel to serve the call"
    assert selection.backward_for(TLP, (h, w, tg, temp)) is not None, \
        "token_logprobs: expected the cpu kernel to have a backward"
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    g_lp, g_ent = (g_lp if which != "entropy" else None), (g_ent if which != "logp" else None)
    with pytest.MonkeyPatch.context() as mp:
        _small_chunks(mp, C)
        lp, ent = ops.token_logprobs(h, w, tg, temp)
        sum((o * go).sum() for o, go in ((lp, g_lp), (ent, g_ent)) if go is not None).backward()
    assert calls["token_logprobs"] == 1 and calls["token_logprobs_backward"] == 1, \
        f"token_logprobs: expected the cpu forward and backward once each, got {dict(calls)}"
    assert needs["token_logprobs_backward"] == [(*wants, False, False)], \
        f"token_logprobs backward: expected needs {(*wants, False, False)}, got {needs}"
    assert_matches("token_logprobs", (lp.detach(), ent.detach()),
                   {**values, "h": h.detach(), "w_vocab": w.detach()})
    rh, rw = _tlp_vjp(h, w, tg, temp, g_lp, g_ent)
    zeros = torch.zeros(T, dtype=F64)
    acc_h, acc_w = tlp_grad_acc(h.detach().double(), w.detach().double(), tg, temp,
                                zeros if g_lp is None else g_lp.double(),
                                zeros if g_ent is None else g_ent.double())
    if wants[0]:
        _assert_grad("ops.token_logprobs grad h", h.grad, rh, acc_h, dtype, dtype)
    if wants[1]:
        _assert_grad("ops.token_logprobs grad w_vocab", w.grad, rw, acc_w, dtype, dtype)
    assert (h.grad is None) != wants[0] and (w.grad is None) != wants[1]


@pytest.mark.parametrize("tis", [False, True])
@pytest.mark.parametrize("float_mask", [False, True])
def test_ops_policy_loss_uses_the_cpu_kernel_and_its_backward(strict, spy, tis, float_mask):
    calls, needs = spy
    lp = torch.tensor([-1.0, -0.7, -2.2, -0.1, -0.9], requires_grad=True)
    old = torch.tensor([-1.0, -0.3, -2.0, -0.6, -1.4], requires_grad=True)
    adv = torch.tensor([0.5, -1.5, 2.0, 1.0, -0.25], requires_grad=True)
    mask = (torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5], requires_grad=True) if float_mask
            else torch.tensor([True, True, False, True, True]))
    roll = torch.tensor([-1.1, -0.2, -2.5, -0.6, -1.0]) if tis else None
    vals = _pl_values(lp, old, adv, mask, roll)
    assert selection.kernel_for(PL, vals) == ("cpu", "native"), \
        "policy_loss: expected the cpu kernel to serve the call"
    loss, stats = ops.policy_loss(lp, old, adv, mask, rollout_logp=roll)
    (2.0 * loss).backward()
    assert calls["policy_loss"] == 1 and calls["policy_loss_backward"] == 1, \
        f"policy_loss: expected the cpu forward and backward once each, got {dict(calls)}"
    assert needs["policy_loss_backward"] == [(True, True, True, float_mask, False, False,
                                              False, False)]
    vals = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in vals.items()}
    assert_matches("policy_loss", (loss.detach(), stats.detach()), vals)
    ref = _pl_vjp(vals, 2.0)
    accs = pl_grad_acc(upcast(vals), 2.0, F32)
    for n, t in (("logp", lp), ("old_logp", old), ("adv", adv), ("mask", mask)):
        if t.is_floating_point():
            _assert_grad(f"ops.policy_loss grad {n}", t.grad, ref[n], accs[n], F32, F32)
    assert float_mask or mask.grad is None


def test_ops_grpo_advantages_served_by_the_cpu_kernel(strict, spy):
    calls, _ = spy
    r = torch.tensor([1.0, 2.0, 4.0, 0.0, 0.0, 3.0], dtype=F64)
    vals = {"rewards": r, "group_size": 3, "std_normalize": True, "eps": 1e-6}
    assert selection.kernel_for(glm5.get_op("grpo_advantages"), vals) == ("cpu", "native")
    assert_matches("grpo_advantages", ops.grpo_advantages(r, 3, True), vals)
    assert calls["grpo_advantages"] == 1
