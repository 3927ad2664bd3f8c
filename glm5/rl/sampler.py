"""The dynamic task-ratio sampler: which task type each next prompt group comes from.

GLM-5's RL mixes task types and shifts the mix toward the types the policy can still learn
from: a type the policy always solves (success rate p ≈ 1) or never solves (p ≈ 0) gives GRPO
groups with zero advantage, so it wastes rollouts. The sampler keeps the last `window` success
values of each type and weights each type by

    weight_i = initial_share_i × learnability(p_i),  learnability(p) = (4 p (1 - p)) ** temperature

(1 at p = 0.5, 0 at p = 0 or 1), then floors the normalised weights at `floor` so no type
starves. Types with no results yet keep their initial share. `choose(n)` turns the ratios
into a sequence of task types whose running counts track the ratios (a deficit scheduler,
below) and that never lets a type fall under `floor · N − 1` picks after N picks in total.
"""

from __future__ import annotations

import math
import numbers
import random
import threading
from collections import deque
from fractions import Fraction
from typing import Any

from glm5.rl.config import SamplerConfig

_STATE_VERSION = 1


def learnability(p: float, temperature: float = 1.0) -> float:
    """How much a task type at success rate ``p`` in [0, 1] teaches: ``(4 p (1-p)) ** temperature``.

    1 at p = 0.5, 0 at p = 0 and p = 1; a higher temperature sharpens the preference for p near
    0.5 (temperature -> 0 flattens it toward uniform)."""
    return (4.0 * p * (1.0 - p)) ** temperature


def water_fill(shares: list[float], floor: float) -> list[float]:
    """Shares (non-negative, sum > 0) normalised to sum 1 with every entry >= ``floor``.

    Entries that would fall under the floor are set to it and the rest of the mass is split over
    the others in proportion to their shares; repeated until none is pushed under (raising the
    floored set only shrinks the others' scale, so at most len(shares) rounds). The largest entry
    absorbs the float rounding: ``math.fsum`` of the result is exactly 1."""
    n = len(shares)
    total = math.fsum(shares)
    if n == 0 or not total > 0 or not math.isfinite(total) or min(shares) < 0:
        raise ValueError(f"glm5 rl water_fill: shares expected non-negative values with a "
                         f"positive sum, got {shares}")
    floored: set[int] = set()
    while floor * n < 1.0:
        free = [i for i in range(n) if i not in floored]
        mass = 1.0 - floor * len(floored)
        s = math.fsum(shares[i] for i in free)
        out = [floor] * n
        if s > 0:
            for i in free:
                out[i] = shares[i] / s * mass
        else:  # every free share is 0: split the mass evenly
            for i in free:
                out[i] = mass / len(free)
        under = [i for i in free if out[i] < floor]
        if not under:
            break
        floored.update(under)
    else:  # the floors take all the mass
        out = [1.0 / n] * n
    # the largest entry (>= 1/n >= floor, so a few ulps keep it at the floor or above, but for
    # an ulp when the floors take all the mass) absorbs the rounding: nudged by ulps until the
    # correctly rounded sum is exactly 1 (one ulp of an entry >= 1/n is below the gap between
    # the doubles around 1, so this ends in a few steps)
    top = max(range(n), key=lambda i: out[i])
    out[top] = 1.0 - math.fsum(out[i] for i in range(n) if i != top)
    for _ in range(64):
        total = math.fsum(out)
        if total == 1.0:
            break
        out[top] = math.nextafter(out[top], -math.inf if total > 1.0 else math.inf)
    return out


class DynamicRatioSampler:
    """Task-type ratios that follow recent success rates, with floors.

    task_names: the task types (distinct). initial: their initial weights (a dict keyed by the
    names or a list in the same order; positive; normalised to shares). config: SamplerConfig
    (dynamic, window, floor, temperature, update_every). seed: the tie-break RNG's seed.

    Use: ``choose(n)`` for the task types of the next n prompt groups, ``record(type, success)``
    for each finished trajectory, ``step()`` once per trainer step (runs ``update()`` every
    ``update_every`` steps) or ``update()`` directly. ``state_dict()`` is JSON-serialisable and
    restores the exact future sequence of choices. Methods are thread-safe.

    Scheduling: every pick adds each type's ratio to its deficit (expected minus delivered
    picks) and serves, among the types whose deficit reached 1/(2m-2) (m types), the one that
    would reach a deficit of 1 soonest (Tijdeman's chairman-assignment rule; ties broken by the
    seeded RNG). With fixed ratios this keeps |count_i − N·ratio_i| < 1 after every pick. A
    floor guard overrides that pick when it would make the floor schedule infeasible (earliest
    deadline first on the floors), so count_i ≥ floor·N − 1 holds for every type and every N
    even while the ratios change.
    """

    def __init__(self, task_names: list[str], initial: dict[str, float] | list[float],
                 config: SamplerConfig, seed: int = 0) -> None:
        where = "glm5 rl DynamicRatioSampler"
        if isinstance(task_names, str) or not isinstance(task_names, (list, tuple)):
            raise TypeError(f"{where}: task_names expected a list of task type names, got "
                            f"{type(task_names).__name__}")
        names = list(task_names)
        if not names:
            raise ValueError(f"{where}: task_names expected at least one task type, got []")
        if any(not isinstance(t, str) or not t for t in names):
            raise ValueError(f"{where}: task_names expected non-empty strings, got {names}")
        if len(set(names)) != len(names):
            dup = sorted({t for t in names if names.count(t) > 1})
            raise ValueError(f"{where}: task_names expected distinct names, got {dup} twice")
        if isinstance(initial, dict):
            if set(initial) != set(names):
                raise ValueError(f"{where}: initial expected weights for exactly {names}, got "
                                 f"keys {sorted(initial)}")
            w0 = [initial[t] for t in names]
        elif isinstance(initial, (list, tuple)):
            if len(initial) != len(names):
                raise ValueError(f"{where}: initial expected {len(names)} weights (one per task "
                                 f"type), got {len(initial)}")
            w0 = list(initial)
        else:
            raise TypeError(f"{where}: initial expected a dict or a list of weights, got "
                            f"{type(initial).__name__}")
        for t, w in zip(names, w0):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) \
                    or not w > 0:
                raise ValueError(f"{where}: initial weight of {t!r} expected a finite number "
                                 f"> 0, got {w!r}")
        if not isinstance(config, SamplerConfig):
            raise TypeError(f"{where}: config expected a SamplerConfig, got "
                            f"{type(config).__name__}")
        _check_config(config, len(names))
        self.task_names = names
        self.config = config
        total = math.fsum(w0)
        self._initial = [float(w) / total for w in w0]
        self._index = {t: i for i, t in enumerate(names)}
        self._windows: list[deque[float]] = [deque(maxlen=config.window) for _ in names]
        self._recorded = [0] * len(names)  # lifetime number of record() calls per type
        self._chosen = [0] * len(names)  # lifetime picks per type
        self._deficit = [0.0] * len(names)
        self._steps = 0
        self._rng = random.Random(seed)
        self._ratios = water_fill(self._initial, config.floor)
        self._lock = threading.RLock()

    # ---------------------------------------------------------------------------------- ratios

    def ratios(self) -> dict[str, float]:
        """The current share of each task type (sum 1, each >= floor)."""
        with self._lock:
            return dict(zip(self.task_names, self._ratios))

    def initial_ratios(self) -> dict[str, float]:
        """The initial weights normalised to shares (before flooring)."""
        return dict(zip(self.task_names, self._initial))

    def record(self, task_type: str, success: float) -> None:
        """Add one trajectory's success in [0, 1] (its reward or exact match) to the type's
        window of the last ``config.window`` results."""
        where = "glm5 rl DynamicRatioSampler.record"
        if task_type not in self._index:
            raise KeyError(f"{where}: unknown task type {task_type!r}; the sampler's task types "
                           f"are {self.task_names}")
        if not isinstance(success, numbers.Real) or not math.isfinite(success) \
                or not 0.0 <= success <= 1.0:
            raise ValueError(f"{where}: success of {task_type!r} expected a number in [0, 1], "
                             f"got {success!r}")
        i = self._index[task_type]
        with self._lock:
            self._windows[i].append(float(success))
            self._recorded[i] += 1

    def mean_success(self) -> dict[str, float]:
        """The mean of each type's window (nan where the type has no result yet)."""
        with self._lock:
            return {t: (math.fsum(w) / len(w) if w else math.nan)
                    for t, w in zip(self.task_names, self._windows)}

    def update(self) -> dict[str, float]:
        """Recompute the ratios from the windows (a no-op with ``config.dynamic`` False) and
        return them.

        Types with data share the mass their initial shares hold, in proportion to
        initial_share × learnability(mean success); types without data keep their initial
        share; when every type with data has learnability 0 (all always right or always wrong)
        they split their mass by initial share. Then floored (`water_fill`)."""
        with self._lock:
            if not self.config.dynamic:
                return self.ratios()
            have = [i for i, w in enumerate(self._windows) if w]
            shares = list(self._initial)
            if have:
                mass = math.fsum(self._initial[i] for i in have)
                weights = {i: self._initial[i] * learnability(
                    math.fsum(self._windows[i]) / len(self._windows[i]), self.config.temperature)
                    for i in have}
                wsum = math.fsum(weights.values())
                for i in have:
                    shares[i] = (weights[i] / wsum * mass if wsum > 0
                                 else self._initial[i])
            self._ratios = water_fill(shares, self.config.floor)
            return self.ratios()

    def step(self) -> bool:
        """Count one trainer step; every ``config.update_every``-th runs `update`. Returns
        whether the ratios were recomputed."""
        with self._lock:
            self._steps += 1
            if self.config.dynamic and self._steps % self.config.update_every == 0:
                self.update()
                return True
            return False

    # -------------------------------------------------------------------------------- choosing

    def choose(self, n: int) -> list[str]:
        """The task types of the next ``n`` prompt groups (n >= 0), in the order to run them.

        Deterministic given the seed and the history of calls (see the class docstring for the
        rule and its bounds)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"glm5 rl DynamicRatioSampler.choose: n expected an integer >= 0, "
                             f"got {n!r}")
        with self._lock:
            return [self.task_names[self._pick()] for _ in range(n)]

    def _pick(self) -> int:
        m = len(self.task_names)
        if m == 1:
            self._chosen[0] += 1
            return 0
        r = self._ratios
        for i in range(m):
            self._deficit[i] += r[i]
        delta = 1.0 / (2 * m - 2)
        eligible = [i for i in range(m) if self._deficit[i] >= delta - 1e-12]
        if not eligible:  # cannot happen in exact arithmetic (deficits sum to 0 after a pick)
            eligible = list(range(m))

        def deadline(i: int) -> float:
            return (1.0 - delta - self._deficit[i]) / r[i] if r[i] > 0 else math.inf

        best = min(deadline(i) for i in eligible)
        ties = [i for i in eligible if deadline(i) <= best + 1e-12]
        pick = ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]
        pick = self._floor_guard(pick)
        self._deficit[pick] -= 1.0
        self._chosen[pick] += 1
        return pick

    def _floor_guard(self, pick: int) -> int:
        """``pick``, or the type whose floor deadline is earliest when picking ``pick`` would
        leave some type unable to stay at >= floor·N − 1 picks.

        Exact arithmetic (fractions): with N picks made and c_i of type i, type i can wait k_i =
        floor((1 − (f·(N+1) − c_i)) / f) more picks after this one's slot before falling under
        the floor. The floors are schedulable iff, sorted ascending, the j-th smallest k is >= j
        (unit jobs, earliest deadline first). A served type's next deadline is >= 1/f − 1 >= m − 1
        picks away, so only each type's next deadline matters."""
        f = min(Fraction(self.config.floor), Fraction(1, len(self.task_names)))
        if f == 0:
            return pick
        total = sum(self._chosen)
        m = len(self.task_names)

        def slack_after(choice: int) -> list[Fraction]:
            # picks each other type may still wait after this pick goes to ``choice``
            out = []
            for i in range(m):
                if i == choice:
                    continue
                owed = f * (total + 1) - self._chosen[i]  # floor deficit after this pick
                out.append((1 - owed) / f)
            return sorted(out)

        def feasible(choice: int) -> bool:
            return all(k >= j for j, k in enumerate(slack_after(choice)))

        if feasible(pick):
            return pick
        # earliest floor deadline first (ties: lowest index, deterministic)
        return min(range(m), key=lambda i: (-(f * (total + 1) - self._chosen[i]), i))

    # ------------------------------------------------------------------------------ inspection

    def stats(self) -> dict[str, dict[str, float | int]]:
        """Per task type: ``count`` (results in the window), ``mean_success`` (nan when none),
        ``learnability``, ``ratio``, ``recorded`` and ``chosen`` (lifetime totals)."""
        with self._lock:
            means = self.mean_success()
            return {t: {"count": len(self._windows[i]),
                        "mean_success": means[t],
                        "learnability": (learnability(means[t], self.config.temperature)
                                         if self._windows[i] else math.nan),
                        "ratio": self._ratios[i],
                        "recorded": self._recorded[i],
                        "chosen": self._chosen[i]}
                    for i, t in enumerate(self.task_names)}

    # ----------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Windows, ratios, deficits, counters and the RNG state, as JSON values."""
        with self._lock:
            version, internal, gauss = self._rng.getstate()
            return {"version": _STATE_VERSION,
                    "task_names": list(self.task_names),
                    "windows": [list(w) for w in self._windows],
                    "recorded": list(self._recorded),
                    "chosen": list(self._chosen),
                    "deficit": list(self._deficit),
                    "ratios": list(self._ratios),
                    "steps": self._steps,
                    "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` output. The task types must match; the config is this
        sampler's: a window now shorter keeps the newest results, ratios under a floor now
        higher are re-floored, and with ``dynamic`` False the ratios are the initial ones."""
        where = "glm5 rl DynamicRatioSampler.load_state_dict"
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"{where}: state expected a dict with version {_STATE_VERSION}, got "
                             f"{state.get('version') if isinstance(state, dict) else state!r}")
        if list(state.get("task_names", [])) != self.task_names:
            raise ValueError(f"{where}: state holds task types {state.get('task_names')}, this "
                             f"sampler has {self.task_names}")
        m = len(self.task_names)
        for key in ("windows", "recorded", "chosen", "deficit", "ratios"):
            if len(state.get(key, ())) != m:
                raise ValueError(f"{where}: state[{key!r}] expected {m} entries, got "
                                 f"{len(state.get(key, ()))}")
        version, internal, gauss = state["rng"]
        with self._lock:
            self._windows = [deque((float(x) for x in w), maxlen=self.config.window)
                             for w in state["windows"]]
            self._recorded = [int(x) for x in state["recorded"]]
            self._chosen = [int(x) for x in state["chosen"]]
            self._deficit = [float(x) for x in state["deficit"]]
            ratios = [float(x) for x in state["ratios"]]
            if not self.config.dynamic:
                ratios = water_fill(self._initial, self.config.floor)
            elif any(r < self.config.floor for r in ratios):
                # a floor raised on resume applies at once (the floor guard then serves the
                # types that fell behind it first)
                ratios = water_fill(ratios, self.config.floor)
            self._ratios = ratios
            self._steps = int(state["steps"])
            self._rng.setstate((version, tuple(internal), gauss))


def _check_config(c: SamplerConfig, num_types: int) -> None:
    where = "glm5 rl DynamicRatioSampler"
    if isinstance(c.window, bool) or not isinstance(c.window, int) or c.window < 1:
        raise ValueError(f"{where}: config.window expected an integer >= 1, got {c.window!r}")
    if isinstance(c.update_every, bool) or not isinstance(c.update_every, int) \
            or c.update_every < 1:
        raise ValueError(f"{where}: config.update_every expected an integer >= 1, got "
                         f"{c.update_every!r}")
    if not math.isfinite(c.temperature) or not c.temperature > 0:
        raise ValueError(f"{where}: config.temperature expected a finite number > 0, got "
                         f"{c.temperature!r}")
    if not math.isfinite(c.floor) or c.floor < 0:
        raise ValueError(f"{where}: config.floor expected a number >= 0, got {c.floor!r}")
    if c.floor * num_types > 1.0:
        raise ValueError(f"{where}: config.floor expected at most 1 / {num_types} task types "
                         f"= {1.0 / num_types:.6g} (floor × types <= 1), got {c.floor}")
