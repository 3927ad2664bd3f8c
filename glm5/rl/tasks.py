"""Verifiable tasks over token ids: a prompt generator and an exact checker per task type.

The digit tasks (copy, reverse, sort, add1, min) are small enough that a `tiny` model learns
them from scratch on a CPU; together they are the five task types a batch mixes. They speak a
fixed token layout (`DigitVocab`), not text: the RL loop is token in, token out.

A task's `score` returns components in [0, 1]: "correctness" (the position-wise match with the
answer, over the longer of answer and output, so a missing or extra token costs its share),
"exact" (1 only for the exact answer followed by EOS) and "format" (digits only, then EOS).
Environments with tools (glm5/rl/envs) register here too.

Text. A task type is registered with ``has_text`` (default False): whether its completions are
text the task can decode, which the text reward components (`glm5.rl.reward`: reasoning_steps,
clarity) need. A task with text implements ``transcript``; the digit tasks have no text, every
environment task (`glm5.rl.episodes.EnvTask`) has (`task_has_text`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

from glm5.rl.envs.base import env_known


@dataclass(frozen=True)
class DigitVocab:
    """Token ids of the digit tasks: PAD, BOS, EOS, SEP, the digits, one marker per task."""

    pad: int = 0
    bos: int = 1
    eos: int = 2
    sep: int = 3
    digit0: int = 4  # digit d is digit0 + d

    def digit(self, d: int) -> int:
        return self.digit0 + d

    def marker(self, index: int) -> int:
        return self.digit0 + 10 + index

    @property
    def size(self) -> int:
        """The vocabulary the digit tasks need (every registered marker included)."""
        return self.digit0 + 10 + len(DIGIT_TASKS)


VOCAB = DigitVocab()


@dataclass
class TaskInstance:
    """One prompt: its token ids and what the checker needs (JSON values only)."""

    task_type: str
    prompt_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    """A task type. One registered with ``has_text=True`` also has ``transcript(inst_meta,
    completion_ids, mask) -> list[dict]`` (and no other has one): the conversation after the
    prompt, ``[{"role": "assistant" | "tool" | "user", "text": str}, ...]``
    (`glm5.rl.reward.RewardContext.turns`); a single-turn task returns one assistant turn, its
    completion decoded (stop token dropped). ``mask``: the trajectory's (empty: all sampled).

    Optional: ``max_answer_tokens`` (int), the longest answer in tokens with its stop token;
    when every task of a run has it, it is the run's default `rollout.max_tokens`."""

    name: str
    stop_token_ids: list[int]  # the engine ends a completion on any of them

    def sample(self, rng: random.Random) -> TaskInstance: ...

    def score(self, inst_meta: dict[str, Any], completion_ids: Sequence[int]
              ) -> dict[str, float]: ...


def _digit_answer(name: str) -> Callable[[list[int]], list[int]]:
    return {
        "copy": lambda x: list(x),
        "reverse": lambda x: x[::-1],
        "sort": sorted,
        "add1": lambda x: [(d + 1) % 10 for d in x],
        "min": lambda x: [min(x)],
    }[name]


DIGIT_TASKS = ("copy", "reverse", "sort", "add1", "min")


class DigitTask:
    """A digit-string task: the prompt is BOS, the task marker, ``length`` digits (each in
    [0, ``base``)), SEP; the answer is the task's function of the digits, then EOS.

    params: ``length`` (int, or [lo, hi] for a range), ``base`` (2..10)."""

    def __init__(self, name: str, length: int | Sequence[int] = 3, base: int = 10,
                 vocab: DigitVocab = VOCAB) -> None:
        if name not in DIGIT_TASKS:
            raise ValueError(f"glm5 rl DigitTask: name expected one of {list(DIGIT_TASKS)}, "
                             f"got {name!r}")
        lo, hi = (length, length) if isinstance(length, int) else tuple(length)
        if isinstance(lo, bool) or not (isinstance(lo, int) and isinstance(hi, int)) \
                or not 1 <= lo <= hi:
            raise ValueError(f"glm5 rl DigitTask({name}): length expected an int >= 1 or "
                             f"[lo, hi] with 1 <= lo <= hi, got {length!r}")
        if isinstance(base, bool) or not isinstance(base, int) or not 2 <= base <= 10:
            raise ValueError(f"glm5 rl DigitTask({name}): base expected an int in [2, 10], got "
                             f"{base!r}")
        self.name, self.lo, self.hi, self.base, self.vocab = name, lo, hi, base, vocab
        self.stop_token_ids = [vocab.eos]
        self._answer = _digit_answer(name)
        self._marker = vocab.marker(DIGIT_TASKS.index(name))

    @property
    def max_answer_tokens(self) -> int:
        """The longest answer, EOS included (the default `rollout.max_tokens`)."""
        return len(self._answer([0] * self.hi)) + 1

    def sample(self, rng: random.Random) -> TaskInstance:
        n = rng.randint(self.lo, self.hi)
        digits = [rng.randrange(self.base) for _ in range(n)]
        v = self.vocab
        prompt = [v.bos, self._marker] + [v.digit(d) for d in digits] + [v.sep]
        return TaskInstance(self.name, prompt, {"digits": digits,
                                                "answer": self._answer(digits)})

    def score(self, meta: dict[str, Any], completion_ids: Sequence[int]) -> dict[str, float]:
        v = self.vocab
        ids = list(completion_ids)
        ended = bool(ids) and ids[-1] == v.eos
        body = ids[:-1] if ended else ids
        answer = [v.digit(d) for d in meta["answer"]]
        hits = sum(a == b for a, b in zip(body, answer))
        correctness = hits / max(len(answer), len(body))
        digits_only = all(v.digit0 <= t < v.digit0 + 10 for t in body)
        return {"correctness": correctness,
                "exact": float(ended and body == answer),
                "format": float(ended and digits_only)}


TASKS: dict[str, Callable[..., Task]] = {name: (lambda n=name, **p: DigitTask(n, **p))
                                         for name in DIGIT_TASKS}
TEXT_TASKS: set[str] = set()  # task types registered with has_text=True


def register_task(name: str, factory: Callable[..., Task], *, has_text: bool = False) -> None:
    """Make ``name`` usable in a config's tasks list (``factory(**params)`` builds it).

    ``has_text``: its completions are text, decoded by the task's ``transcript`` (see `Task`);
    False: token ids only, and a config weighting a text reward component on it is an
    error."""
    if name in TASKS:
        raise ValueError(f"glm5 rl register_task: task type {name!r} is already registered")
    if not isinstance(has_text, bool):
        raise TypeError(f"glm5 rl register_task({name!r}): has_text expected True or False, "
                        f"got {has_text!r}")
    TASKS[name] = factory
    if has_text:
        TEXT_TASKS.add(name)


def task_has_text(name: str) -> bool | None:
    """Whether task type ``name`` has text: its registration's ``has_text`` for a registered
    task, True for an environment type (`is_env_task`), None when unknown."""
    if name in TASKS:
        return name in TEXT_TASKS
    return True if env_known(name) else None


def is_env_task(name: str) -> bool:
    """Whether ``name`` is an environment type (`glm5.rl.envs.base.env_known`) rather than a
    token task of `TASKS` (those win a name clash)."""
    return name not in TASKS and env_known(name)


def answer_limit(tasks: Iterable[Any]) -> int | None:
    """The longest answer (tokens, stop token included) over ``tasks``, where every one declares
    ``max_answer_tokens``; None when one does not (its completions' length is not known)."""
    limits = [getattr(t, "max_answer_tokens", None) for t in tasks]
    if not limits or any(n is None for n in limits):
        return None
    return max(limits)


def make_task(name: str, params: dict[str, Any] | None = None) -> Task:
    try:
        factory = TASKS[name]
    except KeyError:
        raise ValueError(f"glm5 rl: unknown task type {name!r}; registered: "
                         f"{sorted(TASKS)}") from None
    try:
        task = factory(**(params or {}))
    except TypeError as e:
        raise ValueError(f"glm5 rl task {name!r}: bad params {params!r}: {e}") from None
    has_text = name in TEXT_TASKS
    if callable(getattr(task, "transcript", None)) != has_text:
        raise ValueError(f"glm5 rl make_task({name!r}): a task registered with has_text="
                         f"{has_text} expected {'a' if has_text else 'no'} transcript(meta, "
                         f"completion_ids, mask) method, got {type(task).__name__} "
                         f"{'without' if has_text else 'with'} one")
    return task
