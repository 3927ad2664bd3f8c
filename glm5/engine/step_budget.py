"""The prefill token budget of a step: how many prompt tokens may share a step with running
decodes so that the decodes' latency stays within a bound measured from the decodes themselves.

A fixed chunk size cannot do this: the cost of a prefill token grows with the context it
attends to (the indexer scores every earlier key), differs by machine, batch and model, and a
decode step's own time changes with the batch. So the budget is a feedback loop, like the
token budgets of vLLM's and SGLang's chunked prefill but in seconds rather than tokens:

- ``d`` = the median time of the last ``window`` decode-only steps (steps without prefill
  tokens) — the latency the decodes have without a prompt beside them;
- a step that carries prefill may take ``max_slowdown * d``; after it ran with ``n`` prefill
  tokens in ``t`` seconds, the next step's allowance is ``n * (max_slowdown - 1) * d /
  (t - d)`` (the prefill share of the step scaled to the share allowed), clamped to at most
  twice / at least half the previous allowance (one noisy step moves it by 2x at most) and to
  [``min_tokens``, ``max_tokens``];
- a floor keeps the prompt's own progress efficient: the prefill share of the last ``window``
  mixed steps is fitted as ``extra = F + c * n`` (least squares: ``F`` the fixed cost a step
  pays for carrying any prefill at this context — the indexer and the MoE over more rows — and
  ``c`` the cost of a token); the allowance is never below ``F / c``, where the tokens' own
  time equals the fixed part. Without the floor, a context whose fixed cost alone exceeds the
  bound drives the allowance to ``min_tokens`` and the prompt's time to first token to many
  times its unchunked value; with it, the decodes' bound yields there (the trade is the
  engine's ``max_decode_slowdown``). The allowance is dithered 10% down and up on alternate
  steps so that the recent steps always differ in size and the fit follows F and c as the
  context grows (fits are smoothed; the floor raises the allowance by at most 25% a step);
  stuck at ``min_tokens`` over the bound, one step of twice the tokens gives the fit a point;
- without running decodes (or before a decode-only step was seen) there is no allowance: the
  scheduler's fixed chunk size applies, so a lone prompt prefills at full speed.

The loop follows the cost as the context grows (each chunk is priced by the one before it,
one chunk shorter) and as decodes join or leave (``d`` follows the recent decode steps).
"""

from __future__ import annotations

import statistics
from collections import deque


DITHER_DOWN, DITHER_UP = 0.9, 1.1  # the allowance on alternate steps
SPREAD = 1.2  # token counts of the recent steps must span this factor for a new fit


class PrefillBudget:
    """Prefill tokens per step while decodes run (see the module docstring).

    ``max_slowdown`` > 1: a step with prefill takes at most this multiple of a decode-only step;
    ``min_tokens`` the smallest allowance (a prompt always progresses); ``max_tokens`` the
    largest; ``window`` the decode-only steps whose median is ``d``."""

    def __init__(self, max_slowdown: float, min_tokens: int, max_tokens: int,
                 window: int = 8) -> None:
        if not (isinstance(max_slowdown, (int, float)) and not isinstance(max_slowdown, bool)
                and 1 < max_slowdown < float("inf")):
            raise ValueError(f"glm5 PrefillBudget: argument 'max_slowdown' expected a finite "
                             f"number > 1, got {max_slowdown!r}")
        for name, v in (("min_tokens", min_tokens), ("max_tokens", max_tokens),
                        ("window", window)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"glm5 PrefillBudget: argument {name!r} expected an int >= 1, "
                                 f"got {v!r}")
        if min_tokens > max_tokens:
            raise ValueError(f"glm5 PrefillBudget: argument 'min_tokens' expected <= "
                             f"max_tokens={max_tokens}, got {min_tokens}")
        self.max_slowdown, self.min_tokens, self.max_tokens = (float(max_slowdown), min_tokens,
                                                               max_tokens)
        self._decode_s: deque[float] = deque(maxlen=window)
        self._mixed: deque[tuple[int, float]] = deque(maxlen=window)  # (n_prefill, extra s)
        self._allow = min_tokens  # the allowance after the last mixed step
        self._fit: tuple[float, float] | None = None  # the last valid fit (see `fit`)
        self._odd = False  # the dither's phase (see `allowance`)

    def decode_seconds(self) -> float | None:
        """``d``: the median of the recent decode-only steps (None before the first)."""
        return statistics.median(self._decode_s) if self._decode_s else None

    @property
    def target(self) -> int:
        """The allowance before its dither (what the feedback and the floor set)."""
        return self._allow

    def allowance(self, decoding: bool) -> int | None:
        """Prefill tokens the next step may carry: None (no bound: the fixed chunk size
        applies) when no decode runs or no decode-only step was measured yet."""
        if not decoding or not self._decode_s:
            return None
        # Dithered 10% down and up on alternate steps: the recent steps then always differ in
        # size, which `fit` needs to tell the fixed cost from the tokens' as the context grows.
        n = round(self._allow * (DITHER_UP if self._odd else DITHER_DOWN))
        return min(self.max_tokens, max(self.min_tokens, n))

    def observe(self, n_decode: int, n_prefill: int, seconds: float) -> None:
        """A step ran ``n_decode`` decoding sequences and ``n_prefill`` prefill tokens in
        ``seconds``."""
        if not seconds > 0:
            raise ValueError(f"glm5 PrefillBudget.observe: argument 'seconds' expected > 0, "
                             f"got {seconds!r}")
        if n_prefill == 0:
            if n_decode > 0:
                self._decode_s.append(seconds)
            return
        d = self.decode_seconds()
        if d is None or n_decode == 0:
            return  # nothing to compare against: the allowance stays
        self._odd = not self._odd
        extra = max(seconds - d, 1e-3 * d)  # the prefill's share (noise can make it < 0)
        want = n_prefill * (self.max_slowdown - 1.0) * d / extra
        lo, hi = max(self.min_tokens, n_prefill // 2), max(self.min_tokens, 2 * n_prefill)
        if n_prefill < self._allow:  # the prompt's last chunk: not a measure of the bound
            hi = max(hi, self._allow)
        self._mixed.append((n_prefill, extra))
        floor = self.floor()
        if floor is not None:  # raised toward the floor by at most 25% a step (a fit is noisy)
            want = max(want, min(floor, 1.25 * n_prefill))
        elif want < lo and n_prefill <= self.min_tokens * DITHER_UP and len(self._mixed) >= 2 \
                and max(n for n, _ in self._mixed) < SPREAD * min(n for n, _ in self._mixed):
            # Over the bound at the lower clamp with every recent step the same size: nothing
            # tells the fixed cost from the tokens'. One step of twice the tokens gives the
            # fit its second point.
            want = lo = 2 * n_prefill
        self._allow = int(min(self.max_tokens, max(lo, min(hi, want))))

    def fit(self) -> tuple[float, float] | None:
        """(F, c): the fixed and per-token seconds of the prefill share of the recent mixed
        steps (least squares over ``window`` of them) when their token counts span a factor
        of ``SPREAD`` (the dither gives 1.22) and the fit is physical (c > 0); else the last
        such fit (the context, and with it F and c, drifts slowly); None before the first."""
        if len(self._mixed) < 3:
            return self._fit
        ns = [float(n) for n, _ in self._mixed]
        es = [e for _, e in self._mixed]
        if max(ns) < SPREAD * min(ns):  # too alike to separate F from c in the noise
            return self._fit
        mn, me = sum(ns) / len(ns), sum(es) / len(es)
        var = sum((n - mn) ** 2 for n in ns)
        c = sum((n - mn) * (e - me) for n, e in zip(ns, es)) / var
        if c > 0:
            new = (max(me - c * mn, 0.0), c)
            old = self._fit
            # smoothed over successive fits: each rests on a few noisy steps
            self._fit = new if old is None else tuple(0.7 * o + 0.3 * v for o, v in zip(old, new))
        return self._fit

    def floor(self) -> float | None:
        """The efficiency floor ``F / c`` of the allowance (None without a fit)."""
        f = self.fit()
        return None if f is None else f[0] / f[1]
