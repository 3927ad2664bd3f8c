"""RL ops: token_logprobs (chunked over the vocabulary), grpo_advantages, policy_loss."""

from __future__ import annotations

import torch

from glm5.ir.numerics import LAMBDA, ErrorTerms, sqrt_n, unit_roundoff
from glm5.ir.opdef import OpDef, check_index_range, require, value_checks
from glm5.ir.cost import tensor_bytes
from glm5.ir.ops_norm import acc_of
from glm5.ir.signature import FLOAT_DTYPES, INDEX_DTYPES, OutArg, TensorArg, scalar

VOCAB_CHUNK = 4096  # the reference never holds more than [T, VOCAB_CHUNK] logits

POLICY_STATS = ("clip_frac", "mean_ratio", "approx_kl")  # order of policy_loss's stats output


# --------------------------------------------------------------------------- token_logprobs
def token_logprobs_ref(h, w_vocab, targets, temperature):
    acc = acc_of(h)
    T = h.shape[0]
    V = w_vocab.shape[0]
    hf = h.to(acc) / temperature
    m = torch.full((T,), float("-inf"), dtype=acc, device=h.device)
    ssum = torch.zeros(T, dtype=acc, device=h.device)  # sum exp(z - m)
    zsum = torch.zeros(T, dtype=acc, device=h.device)  # sum exp(z - m) * z
    tgt = torch.zeros(T, dtype=acc, device=h.device)
    tl = targets.long()
    for v0 in range(0, V, VOCAB_CHUNK):
        z = hf @ w_vocab[v0 : v0 + VOCAB_CHUNK].to(acc).T  # [T, C]
        m_new = torch.maximum(m, z.max(-1).values)
        alpha = torch.exp(m - m_new)
        e = torch.exp(z - m_new[:, None])
        ssum = ssum * alpha + e.sum(-1)
        zsum = zsum * alpha + (e * z).sum(-1)
        m = m_new
        inside = (tl >= v0) & (tl < v0 + z.shape[1])
        picked = torch.gather(z, 1, (tl - v0).clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
        tgt = torch.where(inside, picked, tgt)
    lse = m + torch.log(ssum)
    return tgt - lse, lse - zsum / ssum


def token_logprobs_error(o, r, work):
    """Logits z = (h / temperature) W^T are fp32 sums over D of exact input products: each
    z_v is off by at most dz_v ~ sqrt(D) |h||W_v| / T + 2|z_v| (acc); no rounding to the working
    dtype (logits in bf16 would be the classic rollout/trainer mismatch). logp = z_t - lse:
    dz_t + max_v dz_v, the fp32 sum of V exponentials (sqrt(V)) and the log (acc). entropy =
    lse - sum_v p z: a perturbation dz moves it by at most max dz sum_v p|z - Ez|, plus the fp32
    sums over V (sqrt(V) (sum_v p|z| + 1))."""
    h, W, tgt, temp = o["h"], o["w_vocab"], o["targets"].long(), o["temperature"]
    T, D = h.shape
    V = W.shape[0]
    zmax = torch.zeros(T, dtype=torch.float64)
    zt = torch.zeros(T, dtype=torch.float64)
    # Pass 1: lse and the largest logit error; pass 2 (same chunks): sum p|z - Ez|, sum p|z|.
    m = torch.full((T,), float("-inf"), dtype=torch.float64)
    ssum = torch.zeros(T, dtype=torch.float64)
    chunk = 8 * VOCAB_CHUNK  # the oracle's own passes: fewer, wider chunks
    for v0 in range(0, V, chunk):
        Wc = W[v0:v0 + chunk]
        z = h @ Wc.T / temp
        dz = sqrt_n(D) * (h.abs() @ Wc.abs().T) / abs(temp) + 2.0 * z.abs()
        zmax = torch.maximum(zmax, dz.max(-1).values)
        inside = (tgt >= v0) & (tgt < v0 + z.shape[1])
        pick = torch.gather(dz, 1, (tgt - v0).clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
        zt = torch.where(inside, pick, zt)
        m_new = torch.maximum(m, z.max(-1).values)
        ssum = ssum * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(-1)
        m = m_new
    lse = m + torch.log(ssum)
    mean_z = lse - r[1]  # sum_v p z
    spread = torch.zeros(T, dtype=torch.float64)
    pabs = torch.zeros(T, dtype=torch.float64)
    for v0 in range(0, V, chunk):
        z = h @ W[v0:v0 + chunk].T / temp
        p = torch.exp(z - lse[:, None])
        spread += (p * (z - mean_z[:, None]).abs()).sum(-1)
        pabs += (p * z.abs()).sum(-1)
    logp = ErrorTerms(acc=zt + zmax + sqrt_n(V) + lse.abs())
    ent = ErrorTerms(acc=zmax * spread + sqrt_n(V) * (pabs + 1.0) + lse.abs())
    return {"logp": logp, "entropy": ent}


def _tlp_check(a, s) -> None:
    require(a["w_vocab"].dtype == a["h"].dtype, "token_logprobs", "w_vocab",
            f"the dtype of h ({a['h'].dtype})", a["w_vocab"].dtype)
    require(s["V"] >= 1, "token_logprobs", "w_vocab", "at least one vocabulary row", s["V"])
    check_index_range("token_logprobs", "targets", a["targets"], 0, s["V"], "(vocabulary ids)")
    t = a["targets"]
    if t.numel() and value_checks(t) and bool((t == -1).any()):
        require(False, "token_logprobs", "targets", f"ids in [0, {s['V']})", -1)


TOKEN_LOGPROBS = OpDef(
    name="token_logprobs",
    summary="log_softmax(h W^T / temperature)[t, targets[t]] and the row entropy, chunked over V",
    params=(
        TensorArg("h", ("T", "D")),
        TensorArg("w_vocab", ("V", "D")),
        TensorArg("targets", ("T",), INDEX_DTYPES),
        scalar("temperature", float, minimum=0.0, exclusive_minimum=True),
    ),
    outputs=(OutArg("logp", ("T",), "acc"), OutArg("entropy", ("T",), "acc")),
    reference=token_logprobs_ref,
    cost=lambda a, s: (
        2.0 * s["T"] * s["V"] * s["D"] + 6.0 * s["T"] * s["V"],
        tensor_bytes(a["h"], a["w_vocab"]) + 12.0 * s["T"],
    ),
    error=token_logprobs_error,
    check=_tlp_check,
    category="rl",
)


# --------------------------------------------------------------------------- grpo_advantages
def grpo_advantages_ref(rewards, group_size, std_normalize, eps=1e-6):
    acc = acc_of(rewards)
    r = rewards.to(acc).reshape(-1, group_size)
    a = r - r.mean(-1, keepdim=True)
    if std_normalize:
        a = a / (r.std(-1, unbiased=True, keepdim=True) + eps)
    return a.reshape(-1).to(rewards.dtype)


def grpo_advantages_error(o, r, work):
    """adv: the group mean is an fp32 sum over the group (sqrt(g) mean|r|), r - mean one more
    rounding, the unbiased std an fp32 sum of squares (relative sqrt(g) + 4), the division one
    rounding (acc); an intermediate (r - mean, the std) may be rounded to the working dtype
    (mid |adv|). Constant groups with std_normalize are ill-conditioned by design: the mean's
    rounding divided by eps."""
    rw, g, std, eps = o["rewards"], o["group_size"], o["std_normalize"], o["eps"]
    rg = rw.reshape(-1, g)
    mu = rg.mean(-1, keepdim=True)
    dev = (rg - mu).abs() + sqrt_n(g) * rg.abs().mean(-1, keepdim=True)
    adv = r[0].reshape(-1, g).abs()
    if std:
        sd = rg.std(-1, unbiased=True, keepdim=True)
        acc = dev / (sd + eps) + (sqrt_n(g) + 4.0) * adv * sd / (sd + eps)
        mid = 2.0 * adv
    else:
        acc, mid = dev, adv
    return {"adv": ErrorTerms(mid=mid.reshape(-1), acc=acc.reshape(-1))}


def _grpo_check(a, s) -> None:
    g = a["group_size"]
    require(s["N"] % g == 0, "grpo_advantages", "group_size", f"a divisor of N={s['N']}", g)
    if a["std_normalize"]:
        require(g >= 2, "grpo_advantages", "group_size",
                ">= 2 with std_normalize (unbiased std)", g)


GRPO_ADVANTAGES = OpDef(
    name="grpo_advantages",
    summary="per consecutive group: (r - mean) / (std + eps) (unbiased std) or r - mean",
    params=(
        TensorArg("rewards", ("N",)),
        scalar("group_size", int, minimum=1),
        scalar("std_normalize", bool),
        scalar("eps", float, default=1e-6, minimum=0.0),
    ),
    outputs=(OutArg("adv", ("N",), "like:rewards"),),
    reference=grpo_advantages_ref,
    cost=lambda a, s: (5.0 * s["N"], 2 * tensor_bytes(a["rewards"])),
    error=grpo_advantages_error,
    check=_grpo_check,
    category="rl",
)


# --------------------------------------------------------------------------- policy_loss
def policy_loss_ref(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.25, rollout_logp=None,
                    tis_cap=2.0):
    # the contract's accumulation dtype (OpDef.acc_dtype): float64 when any input is
    acc = max((acc_of(t) for t in (logp, old_logp, adv, mask, rollout_logp)
               if t is not None and t.is_floating_point()), key=lambda d: d.itemsize)
    lp, olp, A = logp.to(acc), old_logp.to(acc), adv.to(acc)
    m = mask.to(acc)
    ratio = torch.exp(lp - olp)
    unclipped = -ratio * A
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * A
    per_tok = torch.maximum(unclipped, clipped)
    if rollout_logp is not None:
        w = torch.exp(olp - rollout_logp.to(acc)).clamp(max=tis_cap).detach()
        per_tok = per_tok * w
    denom = m.sum().clamp(min=1.0)
    loss = (per_tok * m).sum() / denom
    with torch.no_grad():
        clip_frac = ((clipped > unclipped).to(acc) * m).sum() / denom
        mean_ratio = (ratio * m).sum() / denom
        approx_kl = ((olp - lp) * m).sum() / denom
        stats = torch.stack((clip_frac, mean_ratio, approx_kl))
    return loss, stats


def policy_loss_error(o, r, work):
    """All fp32 from exact inputs. ratio = exp(logp - old): the difference and the exp round
    (d ratio ~ ratio (|logp - old| + 2)); the TIS weight likewise; per-token terms |adv| ratio w;
    the masked sums over T are fp32 (sqrt(T)). loss: the above, summed. stats: clip_frac counts
    tokens where the clipped term exceeds the unclipped: a token whose ratio lies within its
    error of 1 - clip_low or 1 + clip_high may count either way (a step of mask/denom each);
    mean_ratio and approx_kl as the loss."""
    lp, olp, A = o["logp"], o["old_logp"], o["adv"]
    m = o["mask"].to(torch.float64)
    d = (lp - olp)
    ratio = torch.exp(d)
    dr = ratio * (d.abs() + 2.0)
    unclipped = -ratio * A
    clipped = -torch.clamp(ratio, 1.0 - o["clip_low"], 1.0 + o["clip_high"]) * A
    per = torch.maximum(unclipped, clipped)
    w = torch.ones_like(ratio)
    dw = torch.zeros_like(ratio)
    if o["rollout_logp"] is not None:
        dd = olp - o["rollout_logp"]
        w = torch.exp(dd).clamp(max=o["tis_cap"])
        dw = w * (dd.abs() + 2.0)
    T = lp.shape[0]
    denom = float(m.sum().clamp(min=1.0))
    tok = (A.abs() * dr * w + per.abs() * dw) * m.abs()
    loss = ((tok.sum() + (sqrt_n(T) + 1.0) * (per * w * m).abs().sum()) / denom
            + r[0].abs())
    u = unit_roundoff(torch.float32)
    # A ratio this close (in units of its error) to a clip edge may fall on either side.
    lo, hi = 1.0 - o["clip_low"], 1.0 + o["clip_high"]
    near = ((ratio - lo).abs() <= LAMBDA * u * dr) | ((ratio - hi).abs() <= LAMBDA * u * dr)
    frac_step = float((m.abs() * near).sum()) / denom
    mean_ratio = float(((dr + (sqrt_n(T) + 1.0) * ratio) * m.abs()).sum()) / denom
    kl = float(((sqrt_n(T) + 2.0) * d.abs() * m.abs()).sum()) / denom
    stats = ErrorTerms(acc=torch.tensor([0.0, mean_ratio, kl], dtype=torch.float64)
                       + r[1].abs(),
                       step=torch.tensor([frac_step, 0.0, 0.0], dtype=torch.float64))
    return {"loss": ErrorTerms(acc=loss), "stats": stats}


def _pl_check(a, s) -> None:
    require(0.0 <= a["clip_low"] < 1.0, "policy_loss", "clip_low", "a value in [0, 1)",
            a["clip_low"])
    require(a["clip_high"] >= 0.0, "policy_loss", "clip_high", "a value >= 0", a["clip_high"])
    require(a["tis_cap"] > 0.0, "policy_loss", "tis_cap", "a value > 0", a["tis_cap"])


POLICY_LOSS = OpDef(
    name="policy_loss",
    summary="clipped PPO/GRPO surrogate, optional truncated importance sampling, masked token mean",
    params=(
        TensorArg("logp", ("T",)),
        TensorArg("old_logp", ("T",)),
        TensorArg("adv", ("T",)),
        TensorArg("mask", ("T",), FLOAT_DTYPES | {torch.bool}),
        scalar("clip_low", float, default=0.2),
        scalar("clip_high", float, default=0.25),
        TensorArg("rollout_logp", ("T",), optional=True),
        scalar("tis_cap", float, default=2.0),
    ),
    outputs=(
        OutArg("loss", (), "acc"),
        OutArg("stats", (3,), "acc", differentiable=False),
    ),
    reference=policy_loss_ref,
    cost=lambda a, s: (
        12.0 * s["T"],
        tensor_bytes(a["logp"], a["old_logp"], a["adv"], a["mask"], a["rollout_logp"]),
    ),
    error=policy_loss_error,
    check=_pl_check,
    category="rl",
)

OPS = (TOKEN_LOGPROBS, GRPO_ADVANTAGES, POLICY_LOSS)
