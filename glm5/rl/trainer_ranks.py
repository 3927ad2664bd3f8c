"""The RL trainer on N data-parallel ranks (`trainer.nproc`): how the orchestrator, which calls
one `TrainerService` through a handle, drives N of them in lockstep.

- Under torchrun (`glm5 rl train --nproc N`): rank 0 runs the whole RL loop; its trainer handle
  is a `TrainerFront`, which broadcasts each call (method and arguments) to ranks 1..N-1 —
  they sit in `follow` — runs it on rank 0 too, then gathers every rank's status (a rank's
  error is raised on rank 0, naming the rank).
- Under Ray (`run.ray`): `RayTrainerGroup` places N trainer actors in a placement group (one
  bundle each), has them join a tcp:// world at rank 0's address and calls each method on all
  of them at once.

Every rank's `TrainerService` holds an FSDP2 shard of the policy (`glm5.rl.fsdp`), receives the
whole batch and trains its `dp_slice` of it; the update is the whole batch's (`GRPOTrainer`
with a mesh). Results are rank 0's.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import torch.distributed as dist

from glm5.rl.config import RLConfig
from glm5.rl.services import ServiceActor, ServiceDied, TrainerService
from glm5.rl.trainer import dp_slice

__all__ = ["TrainerFront", "follow", "start_front", "run_follower", "RayTrainerGroup",
           "TrainerRank", "TrainerRankError", "trainer_mesh", "dp_slice", "CALLS"]

# the calls the orchestrator makes of its trainer (each one collective across the ranks)
CALLS = ("warm_start_report", "train_step", "publish", "full_update", "version", "checksums",
         "checkpoint", "restore")


HEARTBEAT_S = 2.0  # an idle front's round period (well under any collective timeout)


class TrainerRankError(RuntimeError):
    """A trainer rank failed a call (or the ranks lost each other)."""


def trainer_mesh(world: int) -> Any:
    """The 1-D device mesh of the trainer's ranks: the whole world, which must have ``world``
    ranks (joined by `glm5.parallel.init_distributed`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from glm5.parallel import get_context  # lazy: torch.distributed's groups

    ctx = get_context()
    if ctx.world_size != world:
        raise ValueError(f"glm5 rl: trainer.nproc is {world}, the world has {ctx.world_size} "
                         f"ranks (run `glm5 rl train --nproc {world}`)")
    return init_device_mesh(ctx.device.type, (world,))


def _say(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"


class TrainerFront:
    """Rank 0's trainer: each call of ``CALLS`` runs on every rank (torchrun mode). While no
    call runs (rank 0 is rolling out), a heartbeat round every `HEARTBEAT_S` keeps the waiting
    ranks' collectives within their timeout and notices a lost rank."""

    def __init__(self, service: TrainerService) -> None:
        self.service = service
        self.world = dist.get_world_size()
        self._stopped = False
        self._lock = threading.Lock()  # one round at a time (calls and heartbeats)
        self._last = time.monotonic()
        self._lost: BaseException | None = None
        self._beat = threading.Thread(target=self._heartbeat, name="glm5-trainer-heartbeat",
                                      daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S / 4)
            with self._lock:
                if self._stopped or self._lost is not None:
                    return
                if time.monotonic() - self._last < HEARTBEAT_S:
                    continue
                try:
                    dist.broadcast_object_list([("heartbeat", ())], src=0)
                except Exception as e:  # noqa: BLE001 - raised by the next call
                    self._lost = e
                    return
                self._last = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        if name not in CALLS:
            raise AttributeError(name)
        return lambda *args: self._round(name, args)

    def _round(self, method: str, args: tuple) -> Any:
        with self._lock:
            try:
                return self._round_locked(method, args)
            finally:
                self._last = time.monotonic()

    def _round_locked(self, method: str, args: tuple) -> Any:
        if self._stopped:
            raise ServiceDied(f"glm5 rl: the trainer ranks were stopped (called {method})")
        if self._lost is not None:
            raise TrainerRankError(f"glm5 rl: the trainer ranks are lost (heartbeat: "
                                   f"{_say(self._lost)})") from self._lost
        sent = args
        if method == "restore":  # the publisher's snapshot stays on rank 0 (it scatters rows)
            sent = ({**args[0], "publisher": None},)
        try:
            dist.broadcast_object_list([(method, sent)], src=0)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistError kinds
            self._lost = e
            raise TrainerRankError(f"glm5 rl: the trainer ranks are lost (sending {method}: "
                                   f"{_say(e)})") from e
        err: BaseException | None = None
        out = None
        try:
            out = getattr(self.service, method)(*args)
        except Exception as e:  # noqa: BLE001 - raised below, after every rank's status
            err = e
        statuses: list[Any] = [None] * self.world
        try:
            dist.gather_object(None if err is None else _say(err), statuses, dst=0)
        except Exception as e:  # noqa: BLE001
            self._lost = e
            raise TrainerRankError(f"glm5 rl: the trainer ranks are lost ({method}: "
                                   f"{_say(e)})") from (err or e)
        if err is not None:
            raise err
        for r, s in enumerate(statuses):
            if s is not None:
                raise TrainerRankError(f"glm5 rl: trainer rank {r} of {self.world} failed "
                                       f"{method}: {s}")
        return out

    def stop(self) -> None:
        """Release ranks 1..N-1 from `follow` (they return)."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                if self._lost is None:
                    try:
                        dist.broadcast_object_list([("stop", ())], src=0)
                    except Exception:  # noqa: BLE001 - a lost rank: torchrun stops the rest
                        pass


def follow(service: TrainerService) -> None:
    """Ranks 1..N-1 (torchrun mode): run each call rank 0's `TrainerFront` broadcasts, until it
    stops. A failed call is reported to rank 0 (which raises it); a lost rank 0 raises here."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        method, args = box[0]
        if method == "stop":
            return
        if method == "heartbeat":
            continue
        status = None
        try:
            getattr(service, method)(*args)
        except Exception as e:  # noqa: BLE001 - reported to rank 0
            status = _say(e)
        dist.gather_object(status, None, dst=0)


def start_front(cfg_dict: dict[str, Any], warm_start: bool) -> TrainerFront:
    """Rank 0 of a torchrun world: builds its service (the other ranks get the resolved config
    from it: `run_follower`) and returns the front that drives them."""
    dist.broadcast_object_list([(cfg_dict, warm_start)], src=0)
    n = RLConfig.from_dict(cfg_dict).trainer.nproc
    return TrainerFront(TrainerService(cfg_dict, warm_start=warm_start, mesh=trainer_mesh(n)))


def run_follower() -> None:
    """Ranks 1..N-1 of a torchrun world: build the service from rank 0's config, follow it."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    cfg_dict, warm_start = box[0]
    n = RLConfig.from_dict(cfg_dict).trainer.nproc
    follow(TrainerService(cfg_dict, warm_start=warm_start, mesh=trainer_mesh(n)))


class TrainerRank:
    """One trainer rank inside a Ray actor: joins the world, then builds its service."""

    def __init__(self, threads: int | None = None) -> None:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        self.service: TrainerService | None = None

    @staticmethod
    def address() -> str:
        """tcp://host:port for the world's rendezvous (called on rank 0's actor)."""
        host = socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join(self, init_method: str, rank: int, world: int) -> int:
        from glm5.parallel import init_distributed  # lazy: torch.distributed's groups

        return init_distributed(rank=rank, world_size=world, init_method=init_method).rank

    def build(self, cfg_dict: dict[str, Any], warm_start: bool) -> None:
        world = dist.get_world_size()
        self.service = TrainerService(cfg_dict, warm_start=warm_start, mesh=trainer_mesh(world))

    def __getattr__(self, name: str) -> Any:
        if name not in CALLS or self.__dict__.get("service") is None:
            raise AttributeError(name)
        return getattr(self.service, name)


class RayTrainerGroup:
    """A handle (``call(method, *args)``) on N trainer ranks as Ray actors in a placement group
    (one CPU bundle each, packed)."""

    def __init__(self, cfg_dict: dict[str, Any], world: int, warm_start: bool,
                 threads: int | None = 1) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self.pg = placement_group([{"CPU": 1}] * world, strategy="PACK")
        ray.get(self.pg.ready())
        cls = ray.remote(num_cpus=1)(ServiceActor)
        self.actors = [cls.options(name=f"trainer-{r}", scheduling_strategy=(
            PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                             placement_group_bundle_index=r))
        ).remote(TrainerRank, threads) for r in range(world)]
        addr = self._get([self.actors[0].call.remote("address")])[0]
        self._get([a.call.remote("join", addr, r, world) for r, a in enumerate(self.actors)])
        self._get([a.call.remote("build", cfg_dict, warm_start) for a in self.actors])

    def _get(self, refs: list) -> list:
        from ray.exceptions import RayActorError

        try:
            return self._ray.get(refs)
        except RayActorError as e:
            raise ServiceDied(f"glm5 rl: a trainer rank's Ray actor died: {e}") from e

    def call(self, method: str, *args: Any) -> Any:
        if method not in CALLS:
            raise AttributeError(f"glm5 rl: the trainer has no call {method!r}")
        return self._get([a.call.remote(method, *args) for a in self.actors])[0]

    def kill(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            self._ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
