"""The multi-component reward: a weighted mean of pluggable components, each in [0, 1].

GLM-5's staged RL scores a completion as ``0.6·correctness + 0.3·reasoning_steps + 0.1·clarity``
(`DEFAULT_WEIGHTS`). A component is a function ``fn(ctx: RewardContext) -> float`` in [0, 1],
registered by name with `register_component`; `CompositeReward` combines the named ones as
``Σ w_i c_i / Σ w_i`` so the total stays in [0, 1] whatever the weights' scale.

Built-in components (``ctx.meta`` keys they read, all optional):

- ``correctness``: ``task_score["correctness"]``, the task checker's score (required).
- ``reasoning_steps``: step markers in the text — lines starting with a number and "." or ")"
  ("1." / "2)"), with "Step k:" or with "- " — scored ``min(1, steps / target_steps)``;
  ``target_steps`` (default 3). 0 without text.
- ``clarity``: 1 minus penalties, floored at 0. 0 without text. Penalties:
  0.5 when ``answer_marker`` (a string, default none) is set and absent from the text;
  0.3 when the fraction of repeated word ``ngram``-grams (default 4) exceeds ``max_repeat``
  (default 0.25) — repeated = occurrences beyond the first of each n-gram over all n-grams;
  0.2 when the text is longer than ``max_chars`` characters (default none).
- ``format``: ``task_score["format"]`` for tasks whose checker grades format (required then).
"""

from __future__ import annotations

import math
import numbers
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

DEFAULT_WEIGHTS: dict[str, float] = {"correctness": 0.6, "reasoning_steps": 0.3, "clarity": 0.1}

# the clarity penalties (documented in the module docstring)
MISSING_MARKER_PENALTY = 0.5
REPETITION_PENALTY = 0.3
LENGTH_PENALTY = 0.2


@dataclass
class RewardContext:
    """What a reward component sees of one completion.

    prompt_ids / completion_ids: the token ids as sampled (never re-tokenized). text: the
    decoded completion, None when the task works on token ids only. task_score: the task
    checker's scores, each in [0, 1] (at least "correctness"). meta: the task instance's
    parameters (e.g. answer_marker, target_steps, max_chars).
    """

    task_type: str
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str | None = None
    task_score: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_trajectory(cls, traj: Any, task_score: dict[str, float],
                        text: str | None = None) -> "RewardContext":
        """The context of a `glm5.rl.trajectory.Trajectory` (its task type, ids and meta)."""
        return cls(task_type=traj.task_type, prompt_ids=list(traj.prompt_ids),
                   completion_ids=list(traj.completion_ids), text=text,
                   task_score=dict(task_score), meta=dict(traj.meta))


Component = Callable[[RewardContext], float]
COMPONENTS: dict[str, Component] = {}


def register_component(name: str, *, replace: bool = False) -> Callable[[Component], Component]:
    """Decorator: register ``fn(ctx) -> float in [0, 1]`` as reward component ``name``.

    A name already registered is an error unless ``replace`` is True."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"glm5 rl register_component: name expected a non-empty string, got "
                         f"{name!r}")

    def deco(fn: Component) -> Component:
        if not callable(fn):
            raise TypeError(f"glm5 rl register_component({name!r}): expected a callable, got "
                            f"{type(fn).__name__}")
        if name in COMPONENTS and not replace and COMPONENTS[name] is not fn:
            raise ValueError(f"glm5 rl register_component: component {name!r} is already "
                             f"registered (pass replace=True to override it)")
        COMPONENTS[name] = fn
        return fn

    return deco


def _task_score(ctx: RewardContext, key: str) -> float:
    if key not in ctx.task_score:
        raise KeyError(f"glm5 rl reward component {key!r}: task {ctx.task_type!r} gave no "
                       f"{key!r} score (task_score has {sorted(ctx.task_score)})")
    return ctx.task_score[key]


def _meta_positive_int(ctx: RewardContext, key: str, default: int | None) -> int | None:
    v = ctx.meta.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"glm5 rl reward: meta[{key!r}] of task {ctx.task_type!r} expected an "
                         f"integer >= 1, got {v!r}")
    return v


@register_component("correctness")
def correctness(ctx: RewardContext) -> float:
    """The task checker's correctness score."""
    return _task_score(ctx, "correctness")


@register_component("format")
def format_score(ctx: RewardContext) -> float:
    """The task checker's format score."""
    return _task_score(ctx, "format")


# "1." / "12)" followed by a space or the end, "Step 3:" / "step 3 :", or "- "
_STEP = re.compile(r"^\s*(?:\d+[.)](?:\s|$)|step\s*\d+\s*:|-\s)", re.IGNORECASE)


def count_steps(text: str) -> int:
    """The number of lines of ``text`` that start with a step marker."""
    return sum(1 for line in text.splitlines() if _STEP.match(line))


@register_component("reasoning_steps")
def reasoning_steps(ctx: RewardContext) -> float:
    """min(1, step-marked lines / meta target_steps (default 3)); 0 without text."""
    target = _meta_positive_int(ctx, "target_steps", 3)
    if ctx.text is None:
        return 0.0
    return min(1.0, count_steps(ctx.text) / target)


def repeated_ngram_fraction(text: str, n: int) -> float:
    """The fraction of the word n-grams of ``text`` that repeat an earlier one (0 when the
    text has fewer than n words)."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return (len(grams) - len(Counter(grams))) / len(grams)


@register_component("clarity")
def clarity(ctx: RewardContext) -> float:
    """1 minus the penalties of the module docstring (floored at 0); 0 without text."""
    marker = ctx.meta.get("answer_marker")
    if marker is not None and (not isinstance(marker, str) or not marker):
        raise ValueError(f"glm5 rl reward: meta['answer_marker'] of task {ctx.task_type!r} "
                         f"expected a non-empty string, got {marker!r}")
    n = _meta_positive_int(ctx, "ngram", 4)
    max_chars = _meta_positive_int(ctx, "max_chars", None)
    max_repeat = ctx.meta.get("max_repeat", 0.25)
    if isinstance(max_repeat, bool) or not isinstance(max_repeat, (int, float)) \
            or not 0.0 <= max_repeat <= 1.0:
        raise ValueError(f"glm5 rl reward: meta['max_repeat'] of task {ctx.task_type!r} "
                         f"expected a number in [0, 1], got {max_repeat!r}")
    if ctx.text is None:
        return 0.0
    penalty = 0.0
    if marker is not None and marker not in ctx.text:
        penalty += MISSING_MARKER_PENALTY
    if repeated_ngram_fraction(ctx.text, n) > max_repeat:
        penalty += REPETITION_PENALTY
    if max_chars is not None and len(ctx.text) > max_chars:
        penalty += LENGTH_PENALTY
    return max(0.0, 1.0 - penalty)


class CompositeReward:
    """``Σ w_i c_i / Σ w_i`` over registered components, each checked to lie in [0, 1].

    weights: component name -> weight (>= 0, finite, sum > 0). Calling returns
    ``(total, {name: component value})``; the total is in [0, 1].
    """

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        where = "glm5 rl CompositeReward"
        weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        if not weights:
            raise ValueError(f"{where}: weights expected at least one component, got {{}}")
        unknown = sorted(set(weights) - set(COMPONENTS))
        if unknown:
            raise ValueError(f"{where}: unknown reward component {unknown[0]!r}; registered "
                             f"components are {sorted(COMPONENTS)}")
        for name, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) \
                    or w < 0:
                raise ValueError(f"{where}: weight of {name!r} expected a finite number >= 0, "
                                 f"got {w!r}")
        total = math.fsum(weights.values())
        if not total > 0:
            raise ValueError(f"{where}: weights expected a positive sum, got {weights}")
        self.weights = {k: float(v) for k, v in weights.items()}
        self._components = {k: COMPONENTS[k] for k in weights}
        self._wsum = total

    @classmethod
    def from_config(cls, config: Any) -> "CompositeReward":
        """From a `glm5.rl.config.RewardConfig` (its ``components`` mapping)."""
        return cls(dict(config.components))

    def __call__(self, ctx: RewardContext) -> tuple[float, dict[str, float]]:
        values: dict[str, float] = {}
        for name, fn in self._components.items():
            v = fn(ctx)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
                    or not 0.0 <= v <= 1.0:
                raise ValueError(f"glm5 rl CompositeReward: component {name!r} returned {v!r} "
                                 f"for task {ctx.task_type!r}; expected a finite number in "
                                 f"[0, 1]")
            values[name] = float(v)
        total = math.fsum(self.weights[k] * values[k] for k in values) / self._wsum
        return total, values

    def __repr__(self) -> str:
        return f"CompositeReward({self.weights})"
