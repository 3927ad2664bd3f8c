"""Engines in lockstep over several ranks (a model split by `glm5.parallel`): rank 0's engine
behind a `RankFront`, which an `AsyncEngine` steps as it steps one engine; every other rank in
`follow`. `glm5 serve --tp / --ep` (glm5.serve.ranks) starts the ranks and loads each one's
part of the model; this module only needs torch.distributed's default group (objects over it)
and, with data-parallel attention, the model's communicating MoE modules (handed in: the
engine never imports glm5.parallel).

Each step of the front is one round over the world:

1. rank 0 broadcasts a message: the requests added and aborted since the last step (in the
   order they happened), and — with replicated tokens — the step times its prefill budget
   observed (`glm5.engine.step_budget`: the budget follows measured times, which differ per
   rank; every rank follows rank 0's, so every rank schedules the same);
2. every rank applies it to its engine and steps it;
3. every rank sends rank 0 what came out: with replicated tokens (TP, EP without DP attention)
   a digest of its sampled tokens — rank 0 checks that every rank sampled what it did (a rank
   that diverges is an error, never a silent wrong answer) — and with DP attention its
   requests' outputs, which rank 0 hands to its callers. With them, each rank's gauges
   (`RankFront.snapshot`: ``per_rank``).

**Replicated tokens**: every rank runs every request (the model's collectives split the work);
rank 0 admits and seeds each request (its seed travels with it), so every rank samples the same
tokens.

**DP attention** (``dp``): each rank owns its requests and its pages; rank 0 routes each new
request to a rank by load (requests it holds), preferring the rank whose prefix cache holds the
longest page-aligned prefix of the prompt unless that rank holds ``BALANCE_SLACK`` more
requests than the least loaded one. The MoE layers' all-to-alls need every rank in every
forward: a rank whose step ran no forward (no requests, or none schedulable) runs an empty MoE
pass (each MoE layer over 0 tokens) so the others' all-to-alls complete. Each rank's prefill
budget follows its own step times.

**Other rounds**: a front built with a ``weights`` handler (``glm5 serve
--allow-weight-updates``: `glm5.serve.rank_weights`) runs `RankFront.weights_round`: rank 0
broadcasts ``{"kind": "weights", "op", "data"}`` (e.g. a weight update's bytes) between two
steps, and every rank calls ``weights(op, data)``, which does its own collectives (the handler
owns the whole exchange). A refusal the handler raises alike on every rank after they agreed
on it (an exception with ``every_rank`` set) leaves the world in step: followers go on, rank 0
raises it to its caller. Anything else is a broken round (`RankLost`).

**Faults**: a rank that dies breaks the next round (or the model's next collective) within the
collective timeout; any failure mid-round is `RankLost` (``fatal_to_step``: the `AsyncEngine`
fails every open request with ``http_status`` 503 and stops). While idle, rank 0 runs a round
every ``HEARTBEAT_S`` so that a rank lost between requests is seen, and so that ranks waiting
for the next message never reach their timeout. Lockstep engines do not retry a failed forward
request by request (``isolate_failures`` False): a rank that retried alone would issue
collectives the others never match.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from glm5.engine.engine import LLMEngine
from glm5.engine.outputs import RequestOutput
from glm5.engine.sampling import SamplingParams

HEARTBEAT_S = 1.0  # an idle front's round period (well under any collective timeout)
BALANCE_SLACK = 2  # DP attention: a prefix hit wins unless its rank holds this many more
PREFIX_MEMORY = 4096  # page-aligned prompt prefixes remembered per rank (LRU)


class RankLost(RuntimeError):
    """A rank of a multi-rank server stopped answering: the server cannot step again."""

    fatal_to_step = True  # glm5.engine: not a request's fault; the AsyncEngine stops
    http_status = 503


class RankDiverged(RankLost):
    """A rank sampled other tokens than rank 0 (replicated tokens must agree)."""


# --------------------------------------------------------------------------- the round
class _Channel:
    """Rank 0's messages to every rank and their answers (objects over the world group)."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _fail(self, what: str, e: BaseException) -> RankLost:
        return RankLost(f"glm5 serve: rank {self.rank} of {self.world} lost the other ranks "
                        f"({what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        f")")

    def send(self, msg: dict | None = None) -> dict:
        box = [msg]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistError kinds
            raise self._fail("broadcast of the step", e) from e
        return box[0]

    def gather(self, answer: Any) -> list[Any] | None:
        out = [None] * self.world if self.rank == 0 else None
        try:
            dist.gather_object(answer, out, dst=0)
        except Exception as e:  # noqa: BLE001
            raise self._fail("gather of the step's results", e) from e
        return out


class _MoECount:
    """Counts the model's forwards through its first routed MoE layer (DP attention: a rank
    whose step ran none runs the empty pass)."""

    def __init__(self, moes: Sequence[torch.nn.Module]) -> None:
        self.moes = list(moes)
        self.n = 0
        if self.moes:
            self.moes[0].register_forward_pre_hook(self._hit)

    def _hit(self, *_: Any) -> None:
        self.n += 1

def empty_moe_pass(moes: Sequence[torch.nn.Module], hidden: int, dtype: torch.dtype,
                   device: torch.device) -> None:
    """Each MoE layer over 0 tokens: this rank's part of every all-to-all of a forward."""
    x = torch.empty(0, hidden, dtype=dtype, device=device)
    with torch.no_grad():
        for m in moes:
            m(x)


class _Rank:
    """What every rank does with a message (rank 0 through `RankFront`, the others in
    `follow`)."""

    def __init__(self, engine: LLMEngine, dp: bool, moes: Sequence[torch.nn.Module],
                 rank: int) -> None:
        self.engine, self.dp, self.rank = engine, dp, rank
        engine.isolate_failures = False
        self.count = _MoECount(moes) if dp else None
        m = engine.model
        self._hidden = m.config.hidden_size
        p = next(iter(m.parameters()))
        self._dtype, self._device = (p.dtype if p.is_floating_point() else torch.float32,
                                     p.device)
        budget = engine.scheduler.budget
        self.observe = None if budget is None else budget.observe

    def apply(self, msg: dict) -> list[RequestOutput]:
        e = self.engine
        for op in msg["ops"]:
            if op[0] == "abort":
                e.abort(op[1])
            elif self.rank != 0 and (not self.dp or op[1] == self.rank):
                _, _, rid, ids, params, kind = op
                e.add_request(rid, ids, params, output_kind=kind, rate_limit=False)
        if self.rank != 0 and self.observe is not None:
            for args in msg["observed"]:
                self.observe(*args)
        if not msg["active"]:
            return []
        if self.count is not None:
            self.count.n = 0
        outs = e.step()
        if self.count is not None and self.count.n == 0 and self.count.moes:
            with e._backend():
                empty_moe_pass(self.count.moes, self._hidden, self._dtype, self._device)
        return outs

    def answer(self, outs: list[RequestOutput]) -> tuple[Any, dict]:
        if self.dp:
            return outs, self.engine.snapshot()
        return digest(outs), self.engine.snapshot()


def digest(outs: Sequence[RequestOutput]) -> list[tuple[str, tuple[int, ...], bool]]:
    """What replicated ranks must agree on after a step: each output's new tokens and end."""
    return [(o.request_id, tuple(o.new_token_ids), o.finished) for o in outs]

WeightsHandler = Callable[[str, Any], Any]  # (op, data) -> result; collective over the world


def agreed(e: BaseException) -> bool:
    """``e`` was raised alike on every rank after they agreed on it (the round completed)."""
    return bool(getattr(e, "every_rank", False))


def follow(engine: LLMEngine, dp: bool = False, moes: Sequence[torch.nn.Module] = (),
           weights: WeightsHandler | None = None) -> None:
    """A rank other than 0: apply rank 0's messages until it says stop. ``dp``: data-parallel
    attention (this rank's own requests), ``moes``: the model's communicating MoE modules in
    forward order (for the empty pass), ``weights``: this rank's handler of weights rounds
    (see the module docstring; None: rank 0 sends none). Raises `RankLost` when rank 0 (or
    another rank) is gone. A terminal's Ctrl-C is rank 0's to act on (it drains, then says
    stop): ignored here."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    me = _Rank(engine, dp, moes, dist.get_rank())
    if me.observe is not None and not dp:
        # replicated tokens: rank 0's step times move this rank's budget, never its own (a DP
        # rank schedules its own requests by its own times)
        engine.scheduler.budget.observe = lambda *a: None
    ch = _Channel()
    while True:
        msg = ch.send()
        if msg["kind"] == "stop":
            return
        if msg["kind"] == "weights":
            _follow_weights(weights, msg, ch)
            continue
        outs = me.apply(msg) if msg["kind"] == "step" else []
        ch.gather(me.answer(outs))


def _follow_weights(weights: WeightsHandler | None, msg: dict, ch: "_Channel") -> None:
    """A follower's part of a weights round; an agreed refusal is rank 0's to report."""
    if weights is None:
        raise RankLost(f"glm5 serve: rank {ch.rank} got a weights round ({msg['op']!r}) but "
                       f"was started without a weights handler (rank 0 and this rank disagree "
                       f"on --allow-weight-updates)")
    try:
        weights(msg["op"], msg["data"])
    except Exception as e:  # noqa: BLE001 - sorted: agreed refusals only are survivable
        if not agreed(e):
            raise


class RankFront:
    """Rank 0's engine as the `AsyncEngine` (and the app) see it: requests go to the ranks
    (see the module docstring), each `step` is one round over the world. Attributes it does
    not define (config, max_model_len, allocator, tokenizer, ...) are rank 0's engine's."""

    def __init__(self, engine: LLMEngine, dp: bool = False,
                 moes: Sequence[torch.nn.Module] = (),
                 weights: WeightsHandler | None = None) -> None:
        self.local, self.dp = engine, dp
        self.weights = weights  # rank 0's handler of weights rounds (None: no such rounds)
        self._me = _Rank(engine, dp, moes, 0)
        self._ch = _Channel()
        self.world = self._ch.world
        self._ops: list[tuple] = []
        self._ops_lock = threading.Lock()  # aborts come from any thread
        self.owner: dict[str, int] = {}  # open request id -> its rank (DP attention)
        self.held = [0] * self.world  # open requests per rank
        self.routed = [0] * self.world  # requests ever routed per rank
        self._prefixes: list[OrderedDict[int, None]] = [OrderedDict() for _ in
                                                         range(self.world)]
        self.rank_snapshots: list[dict] = [engine.snapshot() for _ in range(self.world)]
        self._observed: list[tuple] = []
        if self._me.observe is not None and not dp:
            real = self._me.observe

            def observe(*args: Any) -> None:  # rank 0's step times, sent to every rank
                real(*args)
                self._observed.append(args)

            engine.scheduler.budget.observe = observe
        self._last_round = time.monotonic()
        self._closed = False
        self.lost = False  # a round failed: the world is broken

    def __getattr__(self, name: str) -> Any:
        if name == "local":  # not set yet (during unpickling, copy): no recursion
            raise AttributeError(name)
        return getattr(self.local, name)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *,
                    output_kind: str = "cumulative") -> None:
        params = params or SamplingParams()
        if request_id in self.owner:
            raise self.local._reject(400, f"glm5 engine: request id {request_id!r} is already "
                                     f"in use", "request_id")
        if not self.dp:
            self.local.add_request(request_id, prompt, params, output_kind=output_kind)
            req = self.local.requests[request_id]
            # every rank samples with the generator rank 0 drew
            seeded = dataclasses.replace(params, seed=req.generator.initial_seed())
            op = ("add", -1, request_id, req.prompt_ids, seeded, output_kind)
            r = 0
        else:
            ids = self.local.check_request(request_id, prompt, params, output_kind=output_kind)
            r = self.route(ids)
            if r == 0:
                self.local.add_request(request_id, ids, params, output_kind=output_kind,
                                       rate_limit=False)
            op = ("add", r, request_id, ids, params, output_kind)
        with self._ops_lock:
            self._ops.append(op)
        self.owner[request_id] = r
        self.held[r] += 1
        self.routed[r] += 1

    def abort(self, request_id: str) -> None:
        with self._ops_lock:
            self._ops.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self.owner) or bool(self._ops)

    # ------------------------------------------------------------------ routing (DP)
    def _prefix_keys(self, ids: Sequence[int]) -> list[int]:
        """A key per page-aligned prefix of ``ids`` (a chain: key k covers pages 0..k)."""
        page = self.local.page_size
        keys, h = [], 0
        for a in range(0, len(ids) - page + 1, page):
            h = hash((h, tuple(ids[a:a + page])))
            keys.append(h)
        return keys

    def route(self, ids: Sequence[int]) -> int:
        """The DP rank for a prompt: the one whose prefix cache likely holds most of it, unless
        it holds `BALANCE_SLACK` more requests than the least loaded; else the least loaded
        (ties: the one routed fewest requests so far)."""
        keys = self._prefix_keys(ids)
        hits = []
        for r in range(self.world):
            have = self._prefixes[r]
            n = 0
            while n < len(keys) and keys[n] in have:
                n += 1
            hits.append(n)
        low = min(range(self.world), key=lambda r: (self.held[r], self.routed[r], r))
        best = max(range(self.world), key=lambda r: (hits[r], -self.held[r], -r))
        r = best if hits[best] and self.held[best] <= self.held[low] + BALANCE_SLACK else low
        have = self._prefixes[r]
        for k in keys:
            have[k] = None
            have.move_to_end(k)
        while len(have) > PREFIX_MEMORY:
            have.popitem(last=False)
        return r

    # ------------------------------------------------------------------ rounds
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        except RankLost:
            self.lost = True  # no goodbye to a broken world (it would wait its timeout)
            raise
        except Exception as e:
            # Whatever failed mid-round (a forward, a collective, this code), the ranks are no
            # longer at the same point of the round: another round would pair the wrong
            # collectives. The server stops (503), it never serves from an unknown state.
            self.lost = True
            raise RankLost(f"glm5 serve: rank 0's step failed mid-round ({type(e).__name__}: "
                           f"{e}); the ranks are out of step") from e

    def _step(self) -> list[RequestOutput]:
        with self._ops_lock:
            ops, self._ops = self._ops, []
        observed, self._observed = self._observed, []
        msg = {"kind": "step", "ops": ops, "observed": observed, "active": bool(self.owner)}
        self._ch.send(msg)
        outs = self._me.apply(msg)
        answers = self._ch.gather(self._me.answer(outs))
        self._last_round = time.monotonic()
        self.rank_snapshots = [a[1] for a in answers]
        if self.dp:
            outs = [o for a in answers[1:] for o in a[0]] + outs
        else:
            mine = digest(outs)
            for r, a in enumerate(answers[1:], 1):
                if a[0] != mine:
                    raise RankDiverged(f"glm5 serve: rank {r} sampled other tokens than rank 0 "
                                       f"in the same step ({_first_difference(mine, a[0])}); "
                                       f"replicated ranks must agree")
        for o in outs:
            if o.finished and self.owner.get(o.request_id) is not None:
                self.held[self.owner.pop(o.request_id)] -= 1
        return outs

    def idle(self) -> None:
        """A round without a step every `HEARTBEAT_S` while nothing runs."""
        if time.monotonic() - self._last_round >= HEARTBEAT_S:
            try:
                self._ch.send({"kind": "heartbeat"})
                answers = self._ch.gather(self._me.answer([]))
            except RankLost:
                self.lost = True
                raise
            self.rank_snapshots = [a[1] for a in answers]
            self._last_round = time.monotonic()

    def weights_round(self, op: str, data: Any = None) -> Any:
        """One round between steps in which every rank runs its weights handler on ``(op,
        data)`` (rank 0 broadcasts them); returns rank 0's result. An agreed refusal (see
        `agreed`) is raised as it is, the world in step; any other failure is `RankLost` (the
        front is lost). Call it while no step runs (`AsyncEngine.between_steps`)."""
        if self.weights is None:
            raise RuntimeError("glm5 RankFront.weights_round: this front has no weights handler "
                               "(build it with weights=...; glm5 serve does with "
                               "--allow-weight-updates)")
        if self.lost:
            raise RankLost("glm5 serve: the ranks were lost; no weights round can run")
        try:
            self._ch.send({"kind": "weights", "op": op, "data": data})
            out = self.weights(op, data)
        except Exception as e:
            if agreed(e):
                self._last_round = time.monotonic()
                raise
            self.lost = True
            if isinstance(e, RankLost):
                raise
            raise RankLost(f"glm5 serve: a weights round ({op!r}) failed on rank 0 "
                           f"({type(e).__name__}: {e}); the ranks are out of step") from e
        self._last_round = time.monotonic()
        return out

    def fail_all(self, message: str) -> list[RequestOutput]:
        outs = self.local.fail_all(message)
        seen = {o.request_id for o in outs}
        for rid in list(self.owner):
            if rid not in seen:
                outs.append(RequestOutput(rid, [], [], [], finished=True, finish_reason="error",
                                          error=message))
        self.owner.clear()
        self.held = [0] * self.world
        with self._ops_lock:
            self._ops = []
        return outs

    def snapshot(self) -> dict:
        """Rank 0's gauges (replicated tokens: every rank runs the same requests) or their sum
        over the ranks (DP attention), with ``per_rank``: each rank's, as of the last round."""
        per = [dict(s) for s in self.rank_snapshots]
        per[0] = self.local.snapshot()
        if self.dp:
            total = {k: sum(s.get(k, 0) for s in per) for k in per[0]}
        else:
            total = dict(per[0])
        total["per_rank"] = per
        return total

    def close(self) -> None:
        """Tell the other ranks to exit (once; a lost world is left as it is)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ch.send({"kind": "stop"})
        except RankLost:
            pass


def _first_difference(a: list, b: list) -> str:
    ra, rb = dict((x[0], x[1:]) for x in a), dict((x[0], x[1:]) for x in b)
    for rid in sorted(set(ra) | set(rb)):
        if ra.get(rid) != rb.get(rid):
            return f"request {rid!r}: rank 0 {ra.get(rid)}, that rank {rb.get(rid)}"
    return "the outputs' order differs"
