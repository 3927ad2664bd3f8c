"""RL ops: token_logprobs (chunked over the vocabulary), grpo_advantages, policy_loss."""

from __future__ import annotations

import torch

from glm5.ir.opdef import OpDef, check_index_range, has_data, require
from glm5.ir.ops_norm import _bytes, acc_of
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


def _tlp_check(a, s) -> None:
    require(a["w_vocab"].dtype == a["h"].dtype, "token_logprobs", "w_vocab",
            f"the dtype of h ({a['h'].dtype})", a["w_vocab"].dtype)
    require(s["V"] >= 1, "token_logprobs", "w_vocab", "at least one vocabulary row", s["V"])
    check_index_range("token_logprobs", "targets", a["targets"], 0, s["V"], "(vocabulary ids)")
    t = a["targets"]
    if has_data(t) and t.numel() and bool((t == -1).any()):
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
        _bytes(a["h"], a["w_vocab"]) + 12.0 * s["T"],
    ),
    tolerance="logprob",
    reduce_len=lambda a, s: max(s["D"], s["V"]),
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
    cost=lambda a, s: (5.0 * s["N"], 2 * _bytes(a["rewards"])),
    tolerance="elementwise",
    reduce_len=lambda a, s: a["group_size"],
    check=_grpo_check,
    category="rl",
)


# --------------------------------------------------------------------------- policy_loss
def policy_loss_ref(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.25, rollout_logp=None,
                    tis_cap=2.0):
    acc = acc_of(logp)
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
        _bytes(a["logp"], a["old_logp"], a["adv"], a["mask"], a["rollout_logp"]),
    ),
    tolerance="elementwise",
    reduce_len=lambda a, s: s["T"],
    check=_pl_check,
    category="rl",
)

OPS = (TOKEN_LOGPROBS, GRPO_ADVANTAGES, POLICY_LOSS)
