"""Progress bars for long-running work (quantize, export, loading and saving checkpoints, bench).

A bar is drawn with tqdm on stderr, and only when stderr is a terminal: piped or captured output
(CI logs, `2> file`, pytest) gets no control characters and no extra lines. tqdm is imported
lazily, so `import glm5` does not pull it in, and without it the bars are simply not drawn.

This module imports no other glm5 module, so every layer may use it.
"""

from __future__ import annotations

import sys
from typing import Any


class _NoBar:
    """The interface of the tqdm methods glm5 uses, doing nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def set_description_str(self, desc: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def enabled() -> bool:
    """Whether bars are drawn: stderr is a terminal and tqdm is importable."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
    if not tty:
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def progress_bar(total: float | None, desc: str, unit: str = "it", delay: float = 0.5) -> Any:
    """A tqdm bar on stderr (a no-op object when `enabled()` is false).

    ``total``: the amount of work (None: unknown); ``unit="B"`` shows bytes scaled to KiB/MiB/GiB.
    The bar appears only once the work has taken ``delay`` seconds, so quick work (a tiny
    checkpoint) draws nothing. Use it as a context manager and call ``update(n)`` as work is
    done; the bar is removed when closed (``leave=False``) so the command's output follows.
    """
    if not enabled():
        return _NoBar()
    from tqdm import tqdm

    scaled = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scaled,
                unit_divisor=1024 if scaled else 1000, file=sys.stderr, leave=False,
                dynamic_ncols=True, delay=delay)
