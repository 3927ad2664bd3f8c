"""Measurement helpers shared by `glm5 bench` and bench/ scripts: peak RSS while a block runs,
the machine's matmul rate and memory bandwidth (the roofline ceilings), robust timing."""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any, Callable

import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Peak resident-set growth over the block: the kernel's own peak mark (VmHWM, reset on
    entry) where Linux allows it, else sampled every `interval` s (a short-lived allocation can
    fall between two samples on a busy machine)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = False

    def __enter__(self) -> "PeakRSS":
        self.base = rss_bytes()
        self._hwm = _reset_hwm()
        self._peak_abs = self.base
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def _watch(self) -> None:
        while not self._stop:
            self._peak_abs = max(self._peak_abs, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc: Any) -> None:
        self._stop = True
        self._t.join()
        self._peak_abs = max(self._peak_abs, rss_bytes())
        if self._hwm:
            self._peak_abs = max(self._peak_abs, _hwm_bytes())
        self.peak = self._peak_abs - self.base


def time_it(fn: Callable[[], Any], repeat: int = 5, min_time: float = 0.05) -> float:
    """Median seconds per call over `repeat` rounds (each round runs >= min_time)."""
    fn()  # warm-up (builds, caches)
    n = 1
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    if one < min_time:
        n = max(1, int(min_time / max(one, 1e-9)))
    rounds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n)
    return statistics.median(rounds)


def matmul_rate(dtype: torch.dtype, n: int = 1024, repeat: int = 3) -> float:
    """FLOP/s of an n x n x n torch.matmul in ``dtype`` on this machine."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    with torch.inference_mode():
        t = time_it(lambda: torch.matmul(a, b), repeat=repeat)
    return 2.0 * n**3 / t


def memory_bandwidth(nbytes: int = 256 * 2**20, repeat: int = 3) -> float:
    """Bytes/s of a large copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = time_it(lambda: dst.copy_(src), repeat=repeat)
    return 2.0 * nbytes / t


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
