"""Process groups from the environment: `init_distributed` -> `DistContext`, and the TP / EP / DP
groups of a layout (`DistContext.new_groups`).

Where the world comes from (first match):

1. explicit ``rank`` and ``world_size`` (and ``init_method``, default ``env://``);
2. torchrun's variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
   ``MASTER_PORT`` (``glm5 launch`` and ``torchrun`` set them);
3. nothing set: a world of 1 with no process group at all. Every collective of `glm5.parallel.comm`
   is then the identity and torch.distributed is never called, so one device runs exactly as
   before.

The collective backend (gloo, nccl, hccl, cncl, mccl) is the ``collective`` setting of the device
backend that serves the process's device (``[backends.<name>] collective`` in plugins.toml, or
the backend's own default), unless ``backend=`` names one.

Rank layout of `DistContext.new_groups(tp, ep, dp)` (``tp * dp == world_size``, ``ep`` divides
``world_size``), for global rank ``r``:

- TP group: consecutive ranks, ``[(r // tp) * tp, ..., (r // tp) * tp + tp - 1]``; index
  ``r % tp``. Consecutive so that a TP group sits on one node's fast links.
- DP group: the ranks with the same TP index, ``[r % tp, r % tp + tp, ..., r % tp + (dp - 1) * tp]``;
  index ``r // tp``.
- EP group: consecutive blocks of ``ep`` ranks, ``[(r // ep) * ep, ..., (r // ep) * ep + ep - 1]``;
  index ``r % ep``. With ``ep == world_size`` (the EP + DP hybrid) every rank holds
  ``1 / world_size`` of the experts; with ``ep < world_size`` the ``world_size / ep`` blocks
  each hold all experts.

Example, world 4, tp=2, ep=4, dp=2: TP groups [0, 1], [2, 3]; DP groups [0, 2], [1, 3]; EP
group [0, 1, 2, 3].

Layering: glm5.parallel reads the device backends' *settings* through glm5.backends' public API
(registry, selection rule); glm5.core imports only glm5.parallel.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from glm5.backends.api import REFERENCE
from glm5.backends.registry import get_registry
from glm5.backends.selection import ranked

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
COLLECTIVES = ("gloo", "nccl", "hccl", "cncl", "mccl")
TIMEOUT_ENV = "GLM5_DIST_TIMEOUT"  # the default collective timeout (glm5 launch --timeout)
DEFAULT_TIMEOUT_S = 60.0
STORE_PREFIX = "glm5/"  # keys glm5.parallel writes in the rendezvous store (pids, fault reports)

_current: "DistContext | None" = None


class DistConfigError(ValueError):
    """A process-group configuration that cannot work (sizes, ranks, variables, backend)."""


# --------------------------------------------------------------------------- the collective backend
def collective_backend(device: str | torch.device) -> str:
    """The torch.distributed backend name for tensors on ``device``: the ``collective`` setting
    of the device backend the selection rule offers calls on that device type first (available
    backends first, then any registered one for that type, e.g. ``hccl`` for ``npu`` even where
    torch_npu is absent); the reference backend's (``gloo``) for ``cpu``.

    Settings come from plugins.toml ``[backends.<name>] collective`` over the backend's own
    default (a user's ``GLM5_PLUGINS`` file overrides them)."""

    # A string is taken as written: torch.device("npu") fails where torch_npu is absent.
    dtype = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    ordered, _ = ranked()
    serving = [b for b in ordered if b.name != REFERENCE and b.device_type == dtype]
    serving.sort(key=lambda b: not b.is_available()[0])  # stable: rule order among equals
    for b in serving:
        name = b.settings.get("collective")
        if name:
            return _check_collective(str(name), f"plugins.toml [backends.{b.name}] collective")
    if dtype == "cpu":
        ref = get_registry().backends.get(REFERENCE)
        name = ref.settings.get("collective", "gloo") if ref is not None else "gloo"
        return _check_collective(str(name), f"plugins.toml [backends.{REFERENCE}] collective")
    raise DistConfigError(
        f"glm5.parallel.collective_backend: no backend for device type {dtype!r} records a "
        f"collective setting; pass backend= (one of {', '.join(COLLECTIVES)}) to "
        f"init_distributed")


def _check_collective(name: str, where: str) -> str:
    if not name or not name.replace("_", "").isalnum():
        raise DistConfigError(f"glm5.parallel: {where} expected a torch.distributed backend name "
                              f"such as {', '.join(COLLECTIVES)}, got {name!r}")
    return name


# --------------------------------------------------------------------------- groups
@dataclass(eq=False)
class Group:
    """A process group as glm5.parallel uses it: ``ranks`` (global ranks, in group order), this
    process's index ``rank`` in them, and ``pg`` (the torch.distributed group; None for a group
    of 1, whose collectives are the identity). ``name`` is the role ("world", "tp", "ep",
    "dp") shown in errors."""

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: Any = None
    ctx: "DistContext | None" = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    @property
    def timeout_s(self) -> float | None:
        return self.ctx.timeout_s if self.ctx is not None else None

    def next_seq(self) -> int:
        """The number of this group's next collective (1, 2, ...): every rank of the group
        issues the group's collectives in the same order, so the numbers agree across ranks
        (fault reports use them). Shared by every Group object over the same ranks."""
        if self.ctx is None:
            return 0
        s = self.ctx._seqs.get(self.ranks, 0) + 1
        self.ctx._seqs[self.ranks] = s
        return s


def as_group(group: Any, where: str) -> Group | None:
    """``group`` as a `Group`: None stays None (the identity); a `Group` as is; a
    torch.distributed ProcessGroup is wrapped (with the current context's timeout)."""
    if group is None or isinstance(group, Group):
        return group
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        ranks = tuple(dist.get_process_group_ranks(group))
        me = dist.get_rank()
        if me not in ranks:
            raise DistConfigError(f"{where}: argument 'group' is a process group of ranks "
                                  f"{list(ranks)} that does not contain this rank {me}")
        return Group("group", ranks, ranks.index(me), group, _current)
    raise TypeError(f"{where}: argument 'group' expected a glm5.parallel Group, a "
                    f"torch.distributed ProcessGroup or None, got {type(group).__name__}")


@dataclass(eq=False)
class Layout:
    """The groups of one parallel layout (see the module docstring for the rank layout)."""

    tp: Group
    ep: Group
    dp: Group
    world: Group

    def describe(self) -> str:
        return (f"rank {self.world.global_rank}/{self.world.size}: tp {list(self.tp.ranks)} "
                f"(index {self.tp.rank}), ep {list(self.ep.ranks)} (index {self.ep.rank}), "
                f"dp {list(self.dp.ranks)} (index {self.dp.rank})")


def layout_ranks(world_size: int, tp: int, ep: int, dp: int | None = None
                 ) -> dict[str, list[tuple[int, ...]]]:
    """Every group of the layout, by kind ("tp", "ep", "dp"): lists of rank tuples in creation
    order. Checks the sizes; errors name the argument."""
    where = "glm5.parallel.new_groups"
    for name, v in (("tp", tp), ("ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise DistConfigError(f"{where}: argument {name!r} expected a positive int, "
                                  f"got {v!r}")
        if world_size % v:
            raise DistConfigError(f"{where}: argument {name!r} expected a divisor of the world "
                                  f"size {world_size}, got {v}")
    if dp is None:
        dp = world_size // tp
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise DistConfigError(f"{where}: argument 'dp' expected a positive int, got {dp!r}")
    if tp * dp != world_size:
        raise DistConfigError(f"{where}: arguments 'tp' * 'dp' expected to equal the world size "
                              f"{world_size}, got {tp} * {dp} = {tp * dp}")
    return {
        "tp": [tuple(range(i * tp, (i + 1) * tp)) for i in range(dp)],
        "dp": [tuple(range(t, world_size, tp)) for t in range(tp)],
        "ep": [tuple(range(i * ep, (i + 1) * ep)) for i in range(world_size // ep)],
    }


# --------------------------------------------------------------------------- the context
@dataclass(eq=False)
class DistContext:
    """This process's place in the world. ``backend`` is the torch.distributed backend name
    (None for a world of 1 without a process group); ``timeout_s`` bounds every collective (a
    rank that dies or hangs makes the others raise `glm5.parallel.CollectiveError` instead of
    hanging); ``device`` is the device this rank's tensors live on."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    timeout_s: float
    device: torch.device
    store: Any = field(default=None, repr=False)
    owns_pg: bool = field(default=False, repr=False)
    world: Group = field(init=False, repr=False)
    _groups: dict[tuple[int, ...], Any] = field(default_factory=dict, init=False, repr=False)
    _layouts: dict[tuple[int, int, int], Layout] = field(default_factory=dict, init=False,
                                                        repr=False)
    _seqs: dict[tuple[int, ...], int] = field(default_factory=dict, init=False, repr=False)
    _destroyed: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        pg = None
        if self.world_size > 1:
            import torch.distributed as dist

            pg = dist.group.WORLD
        self.world = Group("world", tuple(range(self.world_size)), self.rank, pg, self)

    @property
    def distributed(self) -> bool:
        """True when a process group exists (world size > 1)."""
        return self.world.pg is not None

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def _pg_for(self, ranks: tuple[int, ...]) -> Any:
        """The process group over ``ranks``: None for one rank, WORLD for all, else one
        created once (every rank must call this for every group, in the same order)."""
        if len(ranks) == 1:
            return None
        if len(ranks) == self.world_size:
            return self.world.pg
        if ranks not in self._groups:
            import torch.distributed as dist

            self._groups[ranks] = dist.new_group(list(ranks), timeout=self._timeout(),
                                                 backend=self.backend)
        return self._groups[ranks]

    def new_groups(self, tp: int = 1, ep: int = 1, dp: int | None = None) -> Layout:
        """The TP, EP and DP groups of this rank (``dp`` defaults to ``world_size // tp``).
        Collective: every rank calls it with the same sizes. Cached per sizes. In a world of 1
        every group is the identity group of one rank."""
        self._check_alive("new_groups")
        all_groups = layout_ranks(self.world_size, tp, ep, dp)
        key = (tp, ep, len(all_groups["dp"][0]))
        if key in self._layouts:
            return self._layouts[key]
        mine: dict[str, Group] = {}
        for kind in ("tp", "dp", "ep"):  # creation order is part of the collective contract
            for ranks in all_groups[kind]:
                pg = self._pg_for(ranks)
                if self.rank in ranks:
                    mine[kind] = Group(kind, ranks, ranks.index(self.rank), pg, self)
        lay = Layout(mine["tp"], mine["ep"], mine["dp"], self.world)
        self._layouts[key] = lay
        return lay

    def _check_alive(self, where: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"glm5.parallel.DistContext.{where}: the context was destroyed")

    def destroy(self) -> None:
        """Tear down the process groups this context created (idempotent)."""
        global _current
        if self._destroyed:
            return
        self._destroyed = True
        if self.owns_pg:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        # Drop every reference to the process groups now: a gloo group that outlives this call
        # is freed at interpreter exit, where its worker threads can abort the process
        # ("terminate called without an active exception") after a clean run.
        for lay in self._layouts.values():
            for g in (lay.tp, lay.ep, lay.dp):
                g.pg = None
        self.world.pg = None
        self._groups.clear()
        self._layouts.clear()
        if _current is self:
            _current = None


def get_context() -> DistContext | None:
    """The context `init_distributed` made last in this process (None before, or after
    `destroy`)."""
    return _current


def destroy() -> None:
    """Destroy the current context (no-op without one)."""
    if _current is not None:
        _current.destroy()


# --------------------------------------------------------------------------- init
def _env_int(name: str, where: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise DistConfigError(f"{where}: environment variable {name} expected an integer, "
                              f"got {v!r}") from None


def _default_device(local_rank: int) -> torch.device:
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is None:
        return torch.device("cpu")
    n = torch.accelerator.device_count()
    return torch.device(acc.type, local_rank % n if n else 0)


def init_distributed(
    backend: str | None = None,
    timeout_s: float | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    local_rank: int | None = None,
    device: str | torch.device | None = None,
) -> DistContext:
    """Join the world and return this process's `DistContext` (also `get_context()`).

    ``rank``/``world_size``/``init_method`` given: those (``init_method`` defaults to
    ``env://``, which reads ``MASTER_ADDR``/``MASTER_PORT``; ``tcp://host:port`` works too).
    Otherwise torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``. Neither: a world of 1 with no
    process group (collectives are the identity).

    ``backend``: the torch.distributed backend; None takes the ``collective`` setting of the
    device backend for ``device`` (`collective_backend`). ``device``: this rank's device; None
    is the current accelerator (index ``LOCAL_RANK``, made current) or the CPU. ``timeout_s``
    bounds the rendezvous and every collective; None takes ``GLM5_DIST_TIMEOUT`` (set by
    ``glm5 launch --timeout``), else `DEFAULT_TIMEOUT_S`. A process group that already exists
    (made by the caller) is adopted as is."""
    global _current
    where = "glm5.parallel.init_distributed"
    if timeout_s is None:
        env = os.environ.get(TIMEOUT_ENV)
        try:
            timeout_s = float(env) if env else DEFAULT_TIMEOUT_S
        except ValueError:
            raise DistConfigError(f"{where}: environment variable {TIMEOUT_ENV} expected a "
                                  f"number of seconds, got {env!r}") from None
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not (
            timeout_s > 0):
        raise DistConfigError(f"{where}: argument 'timeout_s' expected a positive number of "
                              f"seconds, got {timeout_s!r}")
    if _current is not None and not _current._destroyed:
        raise RuntimeError(f"{where}: already initialized (rank {_current.rank} of "
                           f"{_current.world_size}); call glm5.parallel.destroy() first")
    explicit = rank is not None or world_size is not None
    if explicit:
        if rank is None or world_size is None:
            missing = "rank" if rank is None else "world_size"
            raise DistConfigError(f"{where}: argument {missing!r} expected with "
                                  f"{'world_size' if missing == 'rank' else 'rank'} (give both "
                                  f"or neither)")
        src = "argument"
    else:
        world_size = _env_int("WORLD_SIZE", where)
        rank = _env_int("RANK", where)
        src = "environment variable"
        if world_size is None and rank is not None:
            raise DistConfigError(f"{where}: environment variable WORLD_SIZE expected with RANK "
                                  f"(set both, or launch with `glm5 launch` / torchrun)")
        if world_size is None:
            world_size = 1
        if rank is None:
            if world_size > 1:
                raise DistConfigError(f"{where}: environment variable RANK expected with "
                                      f"WORLD_SIZE={world_size}")
            rank = 0
    for name, v, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            shown = name.upper() if src.startswith("env") else name
            raise DistConfigError(f"{where}: {src} {shown!r} expected an int >= {low}, got "
                                  f"{v!r}")
    if rank >= world_size:
        raise DistConfigError(f"{where}: rank expected in [0, {world_size}), got {rank} "
                              f"(from the {src}s)")
    if local_rank is None:
        local_rank = _env_int("LOCAL_RANK", where)
        if local_rank is None:
            local_rank = rank
    dev = torch.device(device) if device is not None else _default_device(local_rank)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, local_rank)
    if dev.type != "cpu":
        torch.accelerator.set_device_index(dev.index)
    if backend is not None:
        _check_collective(backend, f"{where}: argument 'backend'")

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        ctx = DistContext(dist.get_rank(), dist.get_world_size(), local_rank,
                          dist.get_backend(), float(timeout_s), dev, None, False)
        _current = ctx
        return ctx
    if world_size == 1:
        ctx = DistContext(0, 1, local_rank, None, float(timeout_s), dev)
        _current = ctx
        return ctx
    if not dist.is_available():
        raise DistConfigError(f"{where}: this torch build has no torch.distributed; a world of "
                              f"{world_size} needs it")
    name = backend or collective_backend(dev)
    url = init_method or "env://"
    if url.startswith("env://"):
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(var):
                raise DistConfigError(
                    f"{where}: environment variable {var} expected for a world of "
                    f"{world_size} (launch with `glm5 launch` / torchrun, or pass "
                    f"init_method='tcp://host:port')")
    from torch.distributed.rendezvous import rendezvous

    timeout = datetime.timedelta(seconds=float(timeout_s))
    store, _, _ = next(rendezvous(url, rank, world_size, timeout=timeout))
    dist.init_process_group(name, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    try:
        # Who is who, for fault reports: a rank that died on this host is told from one that
        # hangs by its pid (see glm5.parallel.faults).
        store.set(f"{STORE_PREFIX}proc/{rank}", f"{socket.gethostname()}:{os.getpid()}")
    except Exception:  # the store is an aid to diagnosis, never a reason to fail
        pass
    ctx = DistContext(rank, world_size, local_rank, name, float(timeout_s), dev, store, True)
    _current = ctx
    return ctx
