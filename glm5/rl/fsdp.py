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
parameter: DCP saves and reshards it like any FSDP optimizer state); the Nesterov update is
gathered whole, each matrix's owner rank (round-robin over the matrices by decreasing size, so
the Newton–Schulz work spreads evenly) runs torch.optim._muon's Newton–Schulz on it and
broadcasts the result, and every rank applies its rows (decoupled weight decay and the adjusted
learning rate as torch applies them).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
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
        me = dist.get_rank() if dist.is_initialized() else 0
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
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
                if not isinstance(p, DTensor):
                    u = _zeropower_via_newtonschulz(upd, group["ns_coefficients"],
                                                    group["ns_steps"], group["eps"])
                    local = p
                else:
                    full = upd.full_tensor()  # Newton-Schulz needs the whole matrix
                    owner = self.owner[p]
                    if owner == me:
                        u = _zeropower_via_newtonschulz(full, group["ns_coefficients"],
                                                        group["ns_steps"], group["eps"])
                        # NS transposes tall matrices: a view gloo cannot send
                        u = u.to(full.dtype).contiguous()
                    else:
                        u = torch.empty_like(full)
                    dist.broadcast(u, src=owner)
                    u = DTensor.from_local(u, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                           run_check=False).redistribute(
                        p.device_mesh, p.placements).to_local()
                    local = p.to_local()
                adj = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
                local.mul_(1 - lr * wd)
                local.add_(u, alpha=-adj)
