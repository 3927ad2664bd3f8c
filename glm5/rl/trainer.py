"""The GRPO trainer: token logprobs through the op IR, the clipped surrogate with truncated
importance sampling, a token mean over the whole batch with gradient accumulation, Muon for
matrices and AdamW for the rest, the DSA indexer frozen, optional KL to a reference policy and
cross-stage distillation from a frozen teacher.

Per token t of a completion (ops.policy_loss):
    ratio = exp(logp - old_logp), clipped to [1 - clip_low, 1 + clip_high] ([0.8, 1.25]),
    w_TIS = min(exp(old_logp - rollout_logp), tis_cap) (the engine sampled the token),
    loss_t = max(-ratio A, -clip(ratio) A) * w_TIS,
with A the trajectory's group-normalised advantage (ops.grpo_advantages) times its staleness
weight. old_logp is the trainer's own logprob before this batch's first update, so the ratio
is exactly 1 on the first of `ppo_epochs` updates. The loss is the mean over every completion
token of the batch, however it is split into micro-batches.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from glm5 import ops
from glm5.rl.config import TrainerConfig
from glm5.rl.trajectory import Trajectory


@dataclass
class PackedBatch:
    """Trajectories as one right-padded batch. input_ids [B, L] (prompt + completion minus the
    last token), rows [N] (flat b * L + position of the hidden state that predicts each
    completion token), targets [N] int32, rollout_logp [N], adv [N] (advantage × weight),
    owner [N] (which trajectory)."""

    input_ids: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor
    rollout_logp: torch.Tensor
    adv: torch.Tensor
    owner: torch.Tensor
    temperature: float

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())


def pack(trajs: Sequence[Trajectory], weights: Sequence[float] | None = None,
         pad_id: int = 0, device: torch.device | str = "cpu") -> PackedBatch:
    """Pack trajectories (all sampled at one temperature) for one forward pass."""
    if not trajs:
        raise ValueError("glm5 rl pack: trajs expected at least one trajectory")
    temps = {t.temperature for t in trajs}
    if len(temps) != 1:
        raise ValueError(f"glm5 rl pack: trajs expected one sampling temperature, got "
                         f"{sorted(temps)}")
    weights = [1.0] * len(trajs) if weights is None else list(weights)
    if len(weights) != len(trajs):
        raise ValueError(f"glm5 rl pack: weights expected {len(trajs)} values, got "
                         f"{len(weights)}")
    L = max(t.num_tokens for t in trajs) - 1
    ids = torch.full((len(trajs), max(L, 1)), pad_id, dtype=torch.long)
    rows, tg, rl, adv, own = [], [], [], [], []
    for b, t in enumerate(trajs):
        seq = t.prompt_ids + t.completion_ids
        ids[b, :len(seq) - 1] = torch.tensor(seq[:-1])
        P = len(t.prompt_ids)
        sampled = t.sampled  # tokens the environment inserted are context, not trained on
        for j in sampled:
            rows.append(b * ids.shape[1] + P + j - 1)
            tg.append(t.completion_ids[j])
            rl.append(t.logprobs[j])
        adv += [t.advantage * weights[b]] * len(sampled)
        own += [b] * len(sampled)
    f = torch.float32
    return PackedBatch(ids.to(device), torch.tensor(rows, dtype=torch.long, device=device),
                       torch.tensor(tg, dtype=torch.int32, device=device),
                       torch.tensor(rl, dtype=f, device=device),
                       torch.tensor(adv, dtype=f, device=device),
                       torch.tensor(own, dtype=torch.long, device=device), temps.pop())


def dp_slice(n: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` trajectories: sizes differ by at most one."""
    q, r = divmod(n, world)
    start = rank * q + min(rank, r)
    return slice(start, start + q + (rank < r))


def _empty_batch(device: torch.device | str = "cpu") -> PackedBatch:
    """One token of context predicting one token, advantage 0: a data-parallel rank's forward
    and backward that contribute nothing (its loss share is 0) but pair FSDP's collectives."""
    i64, d = torch.zeros(1, dtype=torch.long, device=device), device
    return PackedBatch(i64.view(1, 1), i64, torch.zeros(1, dtype=torch.int32, device=d),
                       torch.zeros(1, device=d), torch.zeros(1, device=d), i64, 1.0)


def completion_hidden(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """The final normed hidden states [N, D] that predict each completion token."""
    h = model.model.norm(model.hidden_states(batch.input_ids))
    return h.reshape(-1, h.shape[-1])[batch.rows]


def token_logprobs(model: torch.nn.Module, batch: PackedBatch
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp [N], entropy [N], hidden [N, D]) of the batch's completion tokens."""
    h = completion_hidden(model, batch)
    lp, ent = ops.token_logprobs(h, model.lm_head.weight, batch.targets, batch.temperature)
    return lp, ent, h


def build_optimizers(model: torch.nn.Module, cfg: TrainerConfig, sharded: bool = False
                     ) -> list[torch.optim.Optimizer]:
    """Muon for the hidden weight matrices; AdamW for embeddings, the LM head, norms and biases
    (and for everything with optimizer: adamw). Frozen parameters are left out. ``sharded``
    (FSDP2 parameters): Muon on whole matrices (`glm5.rl.fsdp.WholeMatrixMuon`)."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden_matrix = (p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name)
        (matrices if cfg.optimizer == "muon" and hidden_matrix else rest).append(p)
    opts: list[torch.optim.Optimizer] = []
    if matrices:
        if sharded:
            from glm5.rl.fsdp import WholeMatrixMuon  # lazy: torch.distributed's tensor types

            muon = WholeMatrixMuon
        else:
            muon = torch.optim.Muon
        opts.append(muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                         adjust_lr_fn="match_rms_adamw"))
    if rest:
        decay = [p for p in rest if p.dim() >= 2]
        no_decay = [p for p in rest if p.dim() < 2]
        opts.append(torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=tuple(cfg.betas)))
    if not opts:
        raise ValueError("glm5 rl trainer: the model has no trainable parameter")
    return opts


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    m = copy.deepcopy(model).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


class GRPOTrainer:
    """Trains ``model`` in place on batches of finished trajectories (advantages set)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig,
                 teacher: torch.nn.Module | None = None, total_steps: int = 0,
                 mesh: Any = None) -> None:
        """``mesh`` (a 1-D DeviceMesh of the data-parallel ranks; None: one process): the model
        (and the reference / teacher copies) are sharded with FSDP2 (`glm5.rl.fsdp`), each
        rank trains on its own trajectories and the update is the whole batch's."""
        self.model, self.cfg, self.mesh = model, cfg, mesh
        if cfg.freeze_indexer:
            model.freeze_indexer()
        model.train()
        self.ref = _frozen_copy(model) if cfg.kl_coef > 0 else None
        self.teacher = None
        if cfg.distill.enabled:
            self.teacher = _frozen_copy(teacher if teacher is not None else model)
        if mesh is not None:
            from glm5.rl.fsdp import shard_model  # lazy: torch.distributed's FSDP

            for m in (model, self.ref, self.teacher):
                if m is not None:
                    shard_model(m, mesh)
        self.optimizers = build_optimizers(model, cfg, sharded=mesh is not None)
        self.total_steps = total_steps
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, self._lr_factor)
                           for o in self.optimizers]
        self.step_count = 0

    def _lr_factor(self, step: int) -> float:
        """The learning-rate multiplier at trainer step ``step`` (cosine: 1 -> min_lr_ratio
        over total_steps, then min_lr_ratio)."""
        cfg = self.cfg
        if cfg.lr_schedule == "constant" or self.total_steps <= 0:
            return 1.0
        x = min(step / self.total_steps, 1.0)
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * x))

    # ------------------------------------------------------------------ one update
    def train_step(self, trajs: Sequence[Trajectory], weights: Sequence[float] | None = None
                   ) -> dict[str, float]:
        """One batch: `ppo_epochs` optimizer steps over micro-batches; returns its metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        chunks = [list(range(i, min(i + cfg.micro_batch_size, len(trajs))))
                  for i in range(0, len(trajs), cfg.micro_batch_size)]
        w = [1.0] * len(trajs) if weights is None else list(weights)
        batches = [pack([trajs[i] for i in c], [w[i] for i in c], device=self.model.device)
                   for c in chunks]
        total = self._all_sum(float(sum(b.num_tokens for b in batches)))
        if total == 0:
            raise ValueError("glm5 rl trainer: the batch has no completion token")
        real = len(batches)
        if self.mesh is not None:
            # FSDP's collectives pair up forward by forward: a rank with fewer micro-batches
            # (or none) runs empty ones, whose loss counts 0 (`_empty_batch`)
            batches += [_empty_batch(self.model.device)] * (self._all_max(real) - real)
        old = None
        if cfg.ppo_epochs > 1:
            with torch.no_grad():
                old = [token_logprobs(self.model, b)[0] for b in batches]
        sums: dict[str, float] = {}
        for epoch in range(cfg.ppo_epochs):
            for o in self.optimizers:
                o.zero_grad(set_to_none=True)
            for i, b in enumerate(batches):
                m = self._micro(b, None if old is None else old[i],
                                b.num_tokens / total if i < real else 0.0)
                if epoch == 0:  # an empty micro-batch adds its keys (every rank reduces
                    w = b.num_tokens / total if i < real else 0.0  # the same) but no value
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + (v * w if w else 0.0)
            params = [p for p in self.model.parameters() if p.requires_grad]
            gnorm = torch.nn.utils.clip_grad_norm_(
                params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            if hasattr(gnorm, "full_tensor"):  # sharded grads: the norm is a DTensor
                gnorm = gnorm.full_tensor()
            if epoch == 0:
                sums = self._all_sum_dict(sums)
                sums["grad_norm"] = float(gnorm)
            if not math.isfinite(float(gnorm)):
                raise FloatingPointError(f"glm5 rl trainer: step {self.step_count}: the gradient "
                                         f"norm is {float(gnorm)}; the update was skipped")
            for o in self.optimizers:
                o.step()
        self.step_count += 1
        for sch in self.schedulers:
            sch.step()
        sums["lr_factor"] = self._lr_factor(self.step_count)
        self._maybe_refresh_teacher()
        sums["tokens"] = float(total)
        sums["trajectories"] = self._all_sum(float(len(trajs)))
        sums["train_s"] = time.perf_counter() - t0
        return sums

    def _all_sum(self, v: float) -> float:
        if self.mesh is None:
            return v
        t = torch.tensor([v], dtype=torch.float64)
        torch.distributed.all_reduce(t, group=self.mesh.get_group())
        return float(t)

    def _all_sum_dict(self, d: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks (one all-reduce; every rank has the same keys)."""
        if self.mesh is None:
            return d
        keys = sorted(d)
        t = torch.tensor([d[k] for k in keys], dtype=torch.float64)
        torch.distributed.all_reduce(t, group=self.mesh.get_group())
        return dict(zip(keys, t.tolist()))

    def _all_max(self, v: int) -> int:
        t = torch.tensor([v], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX,
                                     group=self.mesh.get_group())
        return int(t)

    def _micro(self, b: PackedBatch, old: torch.Tensor | None, share: float) -> dict[str, float]:
        cfg = self.cfg
        lp, ent, h = token_logprobs(self.model, b)
        old_lp = lp.detach() if old is None else old
        mask = torch.ones_like(lp)
        if cfg.ratio_base == "rollout":
            # the ratio is taken against the policy that sampled the token (the engine's
            # logprob) and clipped there: stale tokens get the trust region; no TIS on top
            loss, stats = ops.policy_loss(lp, b.rollout_logp, b.adv, mask,
                                          clip_low=cfg.clip_low, clip_high=cfg.clip_high)
        else:
            loss, stats = ops.policy_loss(lp, old_lp, b.adv, mask, clip_low=cfg.clip_low,
                                          clip_high=cfg.clip_high,
                                          rollout_logp=b.rollout_logp, tis_cap=cfg.tis_cap)
        stats = stats.detach()
        out = {"policy_loss": float(loss.detach()), "entropy": float(ent.detach().mean()),
               "clip_frac": float(stats[0]), "mean_ratio": float(stats[1]),
               "approx_kl": float(stats[2]),
               "tis_weight": float(torch.exp(old_lp - b.rollout_logp).clamp(max=cfg.tis_cap)
                                   .mean()),
               "rollout_mismatch": float((old_lp - b.rollout_logp).abs().mean())}
        total = loss
        if self.ref is not None:
            with torch.no_grad():
                ref_lp = token_logprobs(self.ref, b)[0]
            d = ref_lp - lp  # k3: exp(d) - d - 1 >= 0, unbiased for KL(pi || ref)
            kl = (torch.exp(d) - d - 1.0).mean()
            total = total + cfg.kl_coef * kl
            out["kl_ref"] = float(kl.detach())
        if self.teacher is not None:
            dist = self.distill_loss(h, b)
            total = total + cfg.distill.weight * dist
            out["distill_kl"] = float(dist.detach())
        # FSDP averages the ranks' gradients; each rank's loss is its share of the whole
        # batch's token mean, so the sum is wanted: x ranks (a divide factor of 1 would need
        # PREMUL_SUM, which gloo lacks)
        (total * share * (1 if self.mesh is None else self.mesh.size())).backward()
        out["loss"] = float(total.detach())
        return out

    def distill_loss(self, h: torch.Tensor, b: PackedBatch) -> torch.Tensor:
        """KL(teacher || student) at the distillation temperature, averaged over the completion
        tokens; h [N, D] the student's normed hidden states."""
        tau = self.cfg.distill.temperature
        with torch.no_grad():
            th = completion_hidden(self.teacher, b)
            t_logp = F.log_softmax(F.linear(th, self.teacher.lm_head.weight).float() / tau, -1)
        s_logp = F.log_softmax(F.linear(h, self.model.lm_head.weight).float() / tau, -1)
        return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()

    def _maybe_refresh_teacher(self) -> None:
        every = self.cfg.distill.refresh_every
        if self.teacher is not None and every and self.step_count % every == 0:
            self.teacher.load_state_dict(self.model.state_dict())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(),
                "optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers],
                "ref": None if self.ref is None else self.ref.state_dict(),
                "teacher": None if self.teacher is None else self.teacher.state_dict(),
                "step": self.step_count}

    def save_sharded(self, path: str) -> None:
        """A torch.distributed.checkpoint of the trainer (model, optimizers, schedulers, step;
        the reference and the teacher): each rank writes its shards; `load_sharded` reads it
        at any number of ranks (1 included). Collective when sharded."""
        import torch.distributed.checkpoint as dcp  # lazy: torch.distributed
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizers)
        sd: dict[str, Any] = {"model": msd, "optim": osd, "step": self.step_count,
                              "schedulers": [s.state_dict() for s in self.schedulers]}
        for name in ("ref", "teacher"):
            m = getattr(self, name)
            if m is not None:
                sd[name] = get_model_state_dict(m)
        with warnings.catch_warnings():  # one process: no_dist is meant, not "assumed"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(sd, checkpoint_id=path, no_dist=self.mesh is None,
                     process_group=None if self.mesh is None else self.mesh.get_group())

    def load_sharded(self, path: str) -> None:
        """Resume from `save_sharded`'s checkpoint, whatever the number of ranks that wrote
        it."""
        import torch.distributed.checkpoint as dcp  # lazy: torch.distributed
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_state_dict,
                                                             set_model_state_dict,
                                                             set_state_dict)

        msd, osd = get_state_dict(self.model, self.optimizers)
        sd: dict[str, Any] = {"model": msd, "optim": osd, "step": 0,
                              "schedulers": [s.state_dict() for s in self.schedulers]}
        for name in ("ref", "teacher"):
            m = getattr(self, name)
            if m is not None:
                sd[name] = get_model_state_dict(m)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=path, no_dist=self.mesh is None,
                     process_group=None if self.mesh is None else self.mesh.get_group())
        set_state_dict(self.model, self.optimizers, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        for name in ("ref", "teacher"):
            m = getattr(self, name)
            if m is not None:
                set_model_state_dict(m, sd[name])
        for sch, s in zip(self.schedulers, sd["schedulers"]):
            sch.load_state_dict(s)
        self.step_count = int(sd["step"])

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        if len(sd["optimizers"]) != len(self.optimizers):
            raise ValueError(f"glm5 rl trainer: the checkpoint has {len(sd['optimizers'])} "
                             f"optimizers, this trainer {len(self.optimizers)} (another "
                             f"trainer.optimizer setting?)")
        for o, s in zip(self.optimizers, sd["optimizers"]):
            o.load_state_dict(s)
        for sch, s in zip(self.schedulers, sd["schedulers"]):
            sch.load_state_dict(s)
        if self.ref is not None and sd["ref"] is not None:
            self.ref.load_state_dict(sd["ref"])
        if self.teacher is not None and sd["teacher"] is not None:
            self.teacher.load_state_dict(sd["teacher"])
        self.step_count = int(sd["step"])
