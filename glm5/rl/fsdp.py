"""The RL trainer's model across data-parallel ranks: FSDP2 sharding and Muon on whole
matrices.

`shard_model(model, mesh)` applies `torch.distributed.fsdp.fully_shard` to each decoder layer
and to the root: parameters, gradients and optimizer state live as row shards (DTensor
``Shard(0)``) on the data-parallel ranks; a forward all-gathers a layer's parameters and a
backward reduce-scatters its gradients (the mean over ranks: the whole batch's loss).

Muon orthogonalises each weight matrix's momentum with Newton–Schulz; torch.optim.Muon on row
shards would orthogonalise each shard alone (measured: a 9e-4 error after one step at lr 1e-2
on `tiny`, against ~1e-6 for AdamW). `WholeMatrixMuon` keeps torch's update exactly: the
momentum is elementwise, so each rank keeps and updates its own rows of it (sharded like the
parameter: DCP saves and reshards it like any FSDP optimizer state). Each matrix has an owner
rank (round-robin over the matrices by decreasing size); the ranks' rows of its Nesterov update
are gathered to the owner only, every owner runs torch.optim._muon's Newton–Schulz on all its
matrices (the ranks' work side by side), and scatters each rank's rows of the result back;
every rank applies its rows (decoupled weight decay and the adjusted learning rate as torch
applies them). Why not a sharded Newton–Schulz (an all-reduce of the Gram matrix per
iteration): bench/rl_ranks.py measured it 2.7x the bytes and 3-4x the compute at `tiny` widths
(docs/rl.md, "The trainer on several ranks").
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz


def shard_model(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2 over ``mesh`` (a 1-D DeviceMesh of the data-parallel ranks): each decoder layer
    (and each MTP block) its own unit, then the root (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    for m in model.mtp or ():
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # The trainer calls model.hidden_states (not forward) and then the LM head's weight itself
    # (glm5.rl.trainer.token_logprobs): registered, the root's parameters are gathered for it
    # and stay whole after it (the root does not reshard after forward), and their gradients,
    # the head's included, are reduce-scattered at the end of backward (measured: every grad
    # within 3e-8 of the single process at 2 ranks; unregistered, embedding fails on DTensors).
    register_fsdp_forward_method(model, "hidden_states")
    # FSDP warns that hidden_states returns a view (an in-place op on it would skip the
    # pre-backward hook): its consumers (trainer.completion_hidden, the MTP head) only read it
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


_MUON_DEFAULTS = {k: v for k, v in torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))])
                  .defaults.items()}


class WholeMatrixMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update on whole matrices of FSDP2-sharded (or plain) 2-D parameters;
    the same hyperparameters and defaults as torch.optim.Muon. ``owner``: parameter -> the
    global rank that runs its Newton-Schulz."""

    def __init__(self, params: Iterable[torch.nn.Parameter], **kw: Any) -> None:
        unknown = set(kw) - set(_MUON_DEFAULTS)
        if unknown:
            raise TypeError(f"glm5 WholeMatrixMuon: unexpected arguments {sorted(unknown)}")
        super().__init__(params, {**_MUON_DEFAULTS, **kw})
        ps = [p for g in self.param_groups for p in g["params"]]
        for p in ps:
            if p.dim() != 2:
                raise ValueError(f"glm5 WholeMatrixMuon: parameters expected 2-D matrices, got "
                                 f"shape {list(p.shape)}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        order = sorted(range(len(ps)), key=lambda i: (-ps[i].numel(), i))
        self.owner = {ps[i]: k % world for k, i in enumerate(order)}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("glm5 WholeMatrixMuon: closure is not supported")
        work = []  # (parameter, its group, this rank's rows of its Nesterov update)
        for group in self.param_groups:
            mom = group["momentum"]
            for p in group["params"]:
                if p.grad is None:  # every rank sees the same None (FSDP reduces grads)
                    continue
                g = p.grad
                st = self.state[p]
                if "momentum_buffer" not in st:  # sharded like the parameter (DCP reshards it)
                    st["momentum_buffer"] = torch.zeros_like(g)
                buf = st["momentum_buffer"]
                # the momentum is elementwise: each rank updates its own rows
                buf.lerp_(g, 1 - mom)
                upd = g.lerp(buf, mom) if group["nesterov"] else buf
                if isinstance(p, DTensor):
                    work.append((p, group, upd.to_local()))
                else:
                    self._apply(p, group, self._orthogonalise(upd, group))
        if not work:
            return
        pg = work[0][0].device_mesh.get_group()
        me, world = dist.get_rank(pg), dist.get_world_size(pg)
        # 1. each matrix's rows to its owner (a gather: only the owner holds the whole matrix)
        whole: dict[int, torch.Tensor] = {}
        for k, (p, _, local) in enumerate(work):
            owner, chunk = self.owner[p] % world, -(-p.shape[0] // world)
            got = [torch.empty((chunk, *p.shape[1:]), dtype=local.dtype, device=local.device)
                   for _ in range(world)] if me == owner else None
            dist.gather(_pad_rows(local, chunk), got, dst=dist.get_global_rank(pg, owner),
                        group=pg)
            if me == owner:
                whole[k] = torch.cat(got)[:p.shape[0]]
        # 2. every owner orthogonalises its matrices: the ranks' Newton-Schulz run side by side
        for k, m in whole.items():
            whole[k] = self._orthogonalise(m, work[k][1])
        # 3. each rank's rows of the result back from the owner
        for k, (p, group, local) in enumerate(work):
            owner, chunk = self.owner[p] % world, -(-p.shape[0] // world)
            out = torch.empty((chunk, *p.shape[1:]), dtype=local.dtype, device=local.device)
            parts = list(_pad_rows(whole.pop(k), chunk * world).split(chunk)) \
                if me == owner else None
            dist.scatter(out, parts, src=dist.get_global_rank(pg, owner), group=pg)
            self._apply(p, group, out[:local.shape[0]])

    @staticmethod
    def _orthogonalise(m: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        u = _zeropower_via_newtonschulz(m, group["ns_coefficients"], group["ns_steps"],
                                        group["eps"])
        return u.to(m.dtype).contiguous()  # NS transposes tall matrices: a view gloo cannot send

    @staticmethod
    def _apply(p: torch.Tensor, group: dict[str, Any], u: torch.Tensor) -> None:
        """torch.optim.Muon's decoupled weight decay and adjusted step, on this rank's rows."""
        lr, wd = group["lr"], group["weight_decay"]
        adj = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
        local = p.to_local() if isinstance(p, DTensor) else p
        local.mul_(1 - lr * wd)
        local.add_(u, alpha=-adj)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (FSDP's shards of one tensor differ by up
    to a row; gather and scatter need equal sizes)."""
    if t.shape[0] == rows:
        return t.contiguous()
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out
