"""The multi-component reward: a weighted mean of pluggable components, each in [0, 1].

GLM-5's staged RL scores a completion as ``0.6·correctness + 0.3·reasoning_steps + 0.1·clarity``
(`DEFAULT_WEIGHTS`). A component is a function ``fn(ctx: RewardContext) -> float`` in [0, 1],
registered by name with `register_component`; `CompositeReward` combines the named ones as
``Σ w_i c_i / Σ w_i`` so the total stays in [0, 1] whatever the weights' scale.

Text. ``ctx.text`` is what the policy wrote, decoded: a single-turn completion, or an episode's
assistant turns joined by newlines (never the environment's answers, which are in
``ctx.turns``). Only tasks with text provide it: a task registered with ``has_text=True``
(`glm5.rl.tasks.register_task`) and every environment task; the digit tasks are token ids only
(``text`` None). A component that reads the text is registered with ``needs_text=True`` (the
built-in ``reasoning_steps`` and ``clarity`` are); a run config giving such a component a
non-zero weight while one of its tasks has no text is a config error (`text_component_error`),
since the component would score 0 there and silently cap the reward.

Built-in components (``ctx.meta`` keys they read, all optional):

- ``correctness``: ``task_score["correctness"]``, the task checker's score (required).
- ``reasoning_steps``: ``min(1, steps / target_steps)``, ``target_steps`` (default 3); 0
  without text. A step is a line that starts with a step marker — a number and "." or ")"
  then a space ("1. " / "2) "), "Step k:" (any case), or a bullet "- " / "* " — whose content
  (the rest of the line) carries something: at least `MIN_STEP_WORDS` (2) words (runs of
  letters or digits), at least `MIN_STEP_CHARS` (5) non-space characters, and nothing
  illegible (U+FFFD — bytes that decoded to no character — or a control character other than
  tab, newline, CR). A step whose
  normalised content (case-folded, inner whitespace collapsed, punctuation at either end
  stripped) equals an earlier step's is not counted again. So "- \n- \n- ", "- a\n- a\n- a"
  and "1. ok" count 0; "1. add the units\n2. carry the one" counts 2; "1. 3+4=7" counts 1.
- ``clarity``: 0 without text, and 0 for a text without content: fewer than `MIN_CLEAR_WORDS`
  (4) distinct words (case-folded), fewer than `MIN_CLEAR_CHARS` (12) non-space characters,
  or anything illegible (as for steps) — so "", "ok", "!!!", "- \n- ", "a b c d" and the byte
  soup of an untrained byte-level policy score 0; "The answer is 7." scores 1. Otherwise 1
  minus penalties, floored at 0:
  0.5 when ``answer_marker`` (a string, default none) is set and absent from the text;
  0.3 when the fraction of repeated word ``ngram``-grams (default 4) exceeds ``max_repeat``
  (default 0.25) — repeated = occurrences beyond the first of each n-gram over all n-grams;
  0.2 when the text is longer than ``max_chars`` characters (default none).
- ``format``: ``task_score["format"]`` for tasks whose checker grades format (required then).

All are deterministic functions of the context. The rules are heuristics: they stop the cheap
games above (empty or repeated bullets, a word or two of junk, undecodable bytes), not a
policy that writes distinct legible filler; a step is not compared with the prompt.
"""

from __future__ import annotations

import math
import numbers
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from glm5.rl.tasks import task_has_text

DEFAULT_WEIGHTS: dict[str, float] = {"correctness": 0.6, "reasoning_steps": 0.3, "clarity": 0.1}

# the clarity penalties (documented in the module docstring)
MISSING_MARKER_PENALTY = 0.5
REPETITION_PENALTY = 0.3
LENGTH_PENALTY = 0.2
# what a step's content and a clear text need (the module docstring)
MIN_STEP_WORDS = 2
MIN_STEP_CHARS = 5
MIN_CLEAR_WORDS = 4
MIN_CLEAR_CHARS = 12

TURN_ROLES = ("assistant", "tool", "user")


@dataclass
class RewardContext:
    """What a reward component sees of one completion.

    prompt_ids / completion_ids: the token ids as sampled (never re-tokenized). text: what the
    policy wrote, decoded — a single-turn completion, or an episode's assistant turns joined by
    "\\n" (the environment's answers excluded); None when the task works on token ids only.
    turns: the conversation after the prompt, in order, each ``{"role": r, "text": s}`` with
    r one of "assistant" (a policy turn as decoded: stop token dropped, reasoning and tool-call
    markup kept), "tool" (a tool result) or "user" (the environment's feedback), the
    environment's text as the policy was shown it (cut to rollout.max_observation_tokens; the
    answer to an episode's last turn, which the policy never sees, included). A single-turn
    completion is one assistant turn; [] without text. task_score: the task checker's
    scores, each in [0, 1] (at least "correctness"). meta: the task instance's parameters
    (e.g. answer_marker, target_steps, max_chars).
    """

    task_type: str
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str | None = None
    task_score: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    turns: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_trajectory(cls, traj: Any, task_score: dict[str, float],
                        text: str | None = None, task: Any = None) -> "RewardContext":
        """The context of a `glm5.rl.trajectory.Trajectory` (its task type, ids and meta).

        ``task``: the trajectory's task object; when it has text (a ``transcript(meta,
        completion_ids, mask)`` method, see `glm5.rl.tasks.Task`) the turns come from it and
        ``text`` is their assistant turns joined. ``text`` alone: a single assistant turn."""
        transcript = getattr(task, "transcript", None)
        if callable(transcript):
            if text is not None:
                raise ValueError(f"glm5 rl RewardContext.from_trajectory: text expected None "
                                 f"when task {traj.task_type!r} has a transcript, got a string")
            turns = _checked_turns(transcript(traj.meta, traj.completion_ids, traj.mask),
                                   traj.task_type)
            text = "\n".join(t["text"] for t in turns if t["role"] == "assistant")
        else:
            turns = [] if text is None else [{"role": "assistant", "text": text}]
        return cls(task_type=traj.task_type, prompt_ids=list(traj.prompt_ids),
                   completion_ids=list(traj.completion_ids), text=text,
                   task_score=dict(task_score), meta=dict(traj.meta), turns=turns)


def _checked_turns(turns: Any, task_type: str) -> list[dict[str, Any]]:
    where = f"glm5 rl RewardContext.from_trajectory: task {task_type!r}'s transcript"
    if not isinstance(turns, list):
        raise TypeError(f"{where} expected a list of turns, got {type(turns).__name__}")
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("role") not in TURN_ROLES \
                or not isinstance(t.get("text"), str):
            raise ValueError(f"{where}: turn {i} expected a dict with role in "
                             f"{list(TURN_ROLES)} and a string text, got {t!r}")
    return turns


Component = Callable[[RewardContext], float]
COMPONENTS: dict[str, Component] = {}
TEXT_COMPONENTS: set[str] = set()  # registered with needs_text=True


def register_component(name: str, *, replace: bool = False, needs_text: bool = False
                       ) -> Callable[[Component], Component]:
    """Decorator: register ``fn(ctx) -> float in [0, 1]`` as reward component ``name``.

    ``needs_text``: the component reads ``ctx.text`` / ``ctx.turns`` (scores nothing on a task
    without text), so a config weighting it on such a task is an error. A name already
    registered is an error unless ``replace`` is True."""
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
        if needs_text:
            TEXT_COMPONENTS.add(name)
        else:
            TEXT_COMPONENTS.discard(name)
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


# "1." / "12)" followed by a space or the end, "Step 3:" / "step 3 :", "- " or "* "
_STEP = re.compile(r"^\s*(?:\d+[.)](?:\s|$)|step\s*\d+\s*:|[-*](?:\s|$))", re.IGNORECASE)
_WORD = re.compile(r"[^\W_]+")  # a run of letters or digits
_EDGE_PUNCT = string.punctuation + string.whitespace


# U+FFFD (bytes that decoded to no character) or a control character but tab / newline / CR
_ILLEGIBLE = re.compile(r"[\ufffd\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _has_content(text: str, min_words: int, min_chars: int, distinct: bool = False) -> bool:
    if _ILLEGIBLE.search(text):
        return False
    words = [w.casefold() for w in _WORD.findall(text)]
    n = len(set(words)) if distinct else len(words)
    return n >= min_words and sum(not c.isspace() for c in text) >= min_chars


def step_contents(text: str) -> list[str]:
    """The normalised contents of the steps of ``text`` that count (the rule of the module
    docstring): marked lines with content, each content once, in order."""
    seen: dict[str, None] = {}  # ordered
    for line in text.splitlines():
        m = _STEP.match(line)
        if m is None:
            continue
        content = line[m.end():]
        if not _has_content(content, MIN_STEP_WORDS, MIN_STEP_CHARS):
            continue
        key = " ".join(content.casefold().split()).strip(_EDGE_PUNCT)
        seen.setdefault(key)
    return list(seen)


def count_steps(text: str) -> int:
    """The number of steps of ``text`` that count (see `step_contents`)."""
    return len(step_contents(text))


@register_component("reasoning_steps", needs_text=True)
def reasoning_steps(ctx: RewardContext) -> float:
    """min(1, counted steps / meta target_steps (default 3)); 0 without text."""
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


def has_clear_content(text: str) -> bool:
    """Whether ``text`` has enough content for `clarity` to score it (module docstring)."""
    return _has_content(text, MIN_CLEAR_WORDS, MIN_CLEAR_CHARS, distinct=True)


@register_component("clarity", needs_text=True)
def clarity(ctx: RewardContext) -> float:
    """1 minus the penalties of the module docstring (floored at 0); 0 without text or
    content."""
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
    if ctx.text is None or not has_clear_content(ctx.text):
        return 0.0
    penalty = 0.0
    if marker is not None and marker not in ctx.text:
        penalty += MISSING_MARKER_PENALTY
    if repeated_ngram_fraction(ctx.text, n) > max_repeat:
        penalty += REPETITION_PENALTY
    if max_chars is not None and len(ctx.text) > max_chars:
        penalty += LENGTH_PENALTY
    return max(0.0, 1.0 - penalty)


def text_component_error(weights: dict[str, float], task_names: list[str]) -> str | None:
    """Why ``weights`` (component -> weight) cannot score ``task_names``, or None: a component
    registered with ``needs_text`` has a non-zero weight while a task has no text
    (`glm5.rl.tasks.task_has_text`). Unknown task and component names are left to the code
    that builds them."""
    text_weighted = [c for c, w in weights.items() if c in TEXT_COMPONENTS and w != 0]
    if not text_weighted:
        return None
    for task in task_names:
        if task_has_text(task) is False:
            c = text_weighted[0]
            return (f"reward.components.{c} expected weight 0 with task {task!r}, which has no "
                    f"text (token ids only), got {weights[c]}: the text component {c!r} would "
                    f"score 0 on it and cap the reward; drop {c!r} or use tasks with text "
                    f"(environment tasks, or tasks registered with has_text=True)")
    return None


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
