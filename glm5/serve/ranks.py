"""`glm5 serve` over several ranks: tensor parallel (``--tp``), expert parallel (``--ep``) and
expert parallel with data-parallel attention (``--ep N --dp-attention``) — the deployment side.

Every rank (a process started by torchrun; `glm5 serve` starts them) joins the world
(`join`), loads its part of the checkpoint (`load_rank_model`: `glm5.parallel.loading`, only its
slice) and builds its own `LLMEngine` over it. Rank 0 answers HTTP with its engine behind a
`glm5.engine.lockstep.RankFront` (`front`); the others `follow` it (the rounds, the routing,
the faults: glm5/engine/lockstep.py), and with ``--allow-weight-updates`` each applies RL
weight updates to its own cut (`weights`: glm5/serve/rank_weights.py). Rank 0 writes its pid
where the `glm5 serve` command looks for it (`announce_rank0`), so that SIGINT / SIGTERM
reach the rank that drains.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glm5.engine import lockstep
from glm5.engine.engine import LLMEngine
from glm5.engine.lockstep import RankDiverged, RankLost  # noqa: F401  (importable from here)
from glm5.parallel import get_context, init_distributed
from glm5.parallel.layouts import ParallelConfig, ParallelMoE
from glm5.parallel.loading import load_parallel
from glm5.serve.rank_weights import RankWeights, RankWeightsError  # noqa: F401  (as above)

PIDFILE_ENV = "GLM5_SERVE_PIDFILE"  # where rank 0 writes its pid (glm5 serve signals it)


class ServeLayoutError(ValueError):
    """Parallel settings of `glm5 serve` that cannot work (the message names the argument)."""


@dataclass(frozen=True)
class ServeLayout:
    """How the ranks split the model: ``tp`` tensor-parallel ranks (experts split over them
    too), or ``ep`` expert-parallel ranks (tp 1) with ``dp_attention`` (each rank its own
    requests); ``flashcomm`` (with tp > 1) replaces the TP all-reduce by a reduce-scatter /
    all-gather from ``flashcomm_min_tokens`` tokens per forward on."""

    tp: int = 1
    ep: int = 1
    dp_attention: bool = False
    flashcomm: bool = False
    flashcomm_min_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ServeLayoutError(f"argument {name!r} expected an int >= 1, got {v!r}")
        if self.tp > 1 and self.ep not in (1, self.tp):
            raise ServeLayoutError(f"argument 'ep' expected 1 or tp={self.tp} with tp > 1 (the "
                                   f"experts are split over the TP ranks), got {self.ep}")
        if self.dp_attention and (self.tp > 1 or self.ep < 2):
            raise ServeLayoutError("argument 'dp_attention' expected with ep > 1 and tp 1 (each "
                                   "expert-parallel rank runs attention on its own requests)")
        if self.flashcomm and self.tp < 2:
            raise ServeLayoutError("argument 'flashcomm' expected with tp > 1 (it replaces the "
                                   "tensor-parallel all-reduce)")
        m = self.flashcomm_min_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ServeLayoutError(f"argument 'flashcomm_min_tokens' expected an int >= 0, got "
                                   f"{m!r}")

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return self.tp if self.tp > 1 else self.ep

    def describe(self) -> str:
        if self.tp > 1:
            return f"tp {self.tp}" + (" + flashcomm" if self.flashcomm else "")
        if self.ep > 1:
            return f"ep {self.ep}" + (" + dp-attention" if self.dp_attention else "")
        return "one process"


# --------------------------------------------------------------------------- joining
def join(layout: ServeLayout, timeout_s: float | None = None) -> tuple[Any, bool]:
    """Join the world torchrun started (`glm5.parallel.init_distributed`), or take the one
    this process joined already (`glm5.parallel.get_context`); its size must be the
    layout's. Returns the `DistContext` and whether this call made it (then the caller
    destroys it)."""
    ctx = get_context()
    made = ctx is None
    if made:
        ctx = init_distributed(timeout_s=timeout_s)
    if ctx.world_size != layout.world:
        ws = ctx.world_size
        if made:
            ctx.destroy()
        raise ServeLayoutError(f"argument 'tp'/'ep': the layout ({layout.describe()}) needs "
                               f"{layout.world} ranks; this world has {ws} (torchrun "
                               f"--nproc-per-node x --nnodes)")
    return ctx, made


def load_rank_model(model_dir: str | Path, layout: ServeLayout, ctx: Any,
                    dtype: torch.dtype | None, **load_options: Any) -> torch.nn.Module:
    """This rank's part of the checkpoint (only its slice is read)."""
    kw: dict[str, Any] = {"flashcomm": layout.flashcomm}
    if layout.flashcomm_min_tokens is not None:
        kw["flashcomm_min_tokens"] = layout.flashcomm_min_tokens
    pc = ParallelConfig.from_context(ctx, tp=layout.tp, ep=layout.ep,
                                     dp_attention=layout.dp_attention, **kw)
    opts = {k: v for k, v in load_options.items() if v is not None}
    return load_parallel(model_dir, pc, dtype, device=ctx.device, **opts)


def check_engine(engine: LLMEngine, layout: ServeLayout) -> None:
    """Settings a rank's engine cannot serve under ``layout``."""
    if layout.dp_attention and engine.config.num_speculative_tokens:
        raise ServeLayoutError("argument 'num_speculative_tokens' expected 0 with dp_attention "
                               "(a drafting step runs the MTP layer's MoE where the other ranks "
                               "run the main model's: their all-to-alls would not pair)")


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The main model's routed MoE modules, in forward order (the ones that communicate)."""
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, ParallelMoE)]


def announce_rank0() -> None:
    """Rank 0 serves from now on: its pid where `glm5 serve` looks for it (to hand it
    SIGINT / SIGTERM)."""
    path = os.environ.get(PIDFILE_ENV)
    if path:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, path)


def weights(engine: LLMEngine) -> RankWeights:
    """This rank's side of RL weight updates (`glm5.serve.rank_weights`); every rank builds
    it (collective). Raises `RankWeightsError` on every rank for a model it cannot update."""
    return RankWeights(engine)


def follow(engine: LLMEngine, layout: ServeLayout, updates: RankWeights | None = None) -> None:
    """A rank other than 0 of ``layout``: `glm5.engine.lockstep.follow` until rank 0 stops
    (``updates``: this rank's side of weight updates; None: rank 0 takes none)."""
    lockstep.follow(engine, layout.dp_attention, moe_layers(engine.model),
                    None if updates is None else updates.handle)


def front(engine: LLMEngine, layout: ServeLayout,
          updates: RankWeights | None = None) -> lockstep.RankFront:
    """Rank 0's engine as the `AsyncEngine` steps it under ``layout`` (``updates``: rank 0's
    side of weight updates, run in `RankFront.weights_round`)."""
    return lockstep.RankFront(engine, layout.dp_attention, moe_layers(engine.model),
                              None if updates is None else updates.handle)
