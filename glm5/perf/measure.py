"""Measurement helpers shared by `glm5 bench` and bench/ scripts: peak RSS while a block runs,
peak bytes torch allocates during a call, the machine's matmul rate and memory bandwidth (the
roofline ceilings: best of several runs of torch's fastest path, CPU features read at run time),
robust timing."""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from typing import Any, Callable, Sequence

import torch

from glm5 import host_cpu
from glm5.host_cpu import cpu_model  # noqa: F401  (re-exported: reports name the CPU)


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


def best_time(fn: Callable[[], Any], repeat: int = 5, min_time: float = 0.05) -> float:
    """The least seconds of one call over at least ``repeat`` calls and ``repeat * min_time``
    seconds: the best the machine did, what a ceiling needs. Each call is timed on its own,
    so a moment when a busy machine deschedules one of torch's threads (a parallel region then
    waits a whole time slice) spoils that call only, not a round's average."""
    fn()  # warm-up (builds, caches)
    best = float("inf")
    calls, spent = 0, 0.0
    while calls < repeat or spent < repeat * min_time:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        calls += 1
        spent += dt
    return best


# CPU features that decide torch's fastest matmul path: AMX tiles (oneDNN bf16/int8), AVX-512
# BF16 and VNNI instructions, plain AVX-512 / AVX2 FMA.
_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx_vnni",
          "avx512f", "avx2", "fma")


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (Linux /proc/cpuinfo), read at run time."""
    return set(host_cpu.cpu_flags() or ())


def cpu_features() -> dict[str, Any]:
    """What torch can use on this CPU: the relevant /proc/cpuinfo flags, torch's own runtime
    checks (oneDNN bf16, AMX, AVX-512 BF16, VNNI), its vector ISA and thread count."""
    flags = cpu_flags()
    out: dict[str, Any] = {"flags": [f for f in _FLAGS if f in flags],
                           "torch_isa": torch.backends.cpu.get_cpu_capability(),
                           "threads": torch.get_num_threads(),
                           "mkl": torch.backends.mkl.is_available(),
                           "onednn": torch.backends.mkldnn.is_available()}
    checks = {"onednn_bf16": lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
              "amx": lambda: torch.cpu._is_amx_tile_supported(),
              "avx512_bf16": lambda: torch.cpu._is_avx512_bf16_supported(),
              "vnni": lambda: torch.cpu._is_vnni_supported()}
    for k, f in checks.items():
        try:
            out[k] = bool(f())
        except (AttributeError, RuntimeError):  # an older torch without the check
            out[k] = None
    return out


def matmul_path(dtype: torch.dtype, features: dict[str, Any] | None = None) -> str:
    """The library torch's CPU matmul takes for ``dtype`` here, in words."""
    f = features if features is not None else cpu_features()
    if dtype == torch.bfloat16 and f.get("onednn") and f.get("onednn_bf16"):
        isa = ("AMX" if f.get("amx") else "AVX-512 BF16" if f.get("avx512_bf16")
               else f["torch_isa"])
        return f"oneDNN ({isa})"
    if dtype == torch.float32 and f.get("mkl"):
        return f"MKL sgemm ({f['torch_isa']})"
    return f"ATen ({f['torch_isa']})"


class _Threads:
    """torch's intra-op thread count set for the block, restored after."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> "_Threads":
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.saved)


def _thread_counts() -> list[int]:
    """torch's own thread count and 1: on a machine busier than its cores a parallel region
    waits for its slowest thread to be scheduled (a small copy can take orders of magnitude
    longer with 2 threads than with 1), so either may be the fastest path at the moment."""
    n = torch.get_num_threads()
    return [n] if n == 1 else [n, 1]


def _threads_text(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


def matmul_rate(dtype: torch.dtype, sizes: Sequence[int] = (256, 512, 1024, 2048),
                repeat: int = 5, min_time: float = 0.05) -> tuple[float, str]:
    """The machine's matmul ceiling in ``dtype``: the best FLOP/s over square sizes, over the
    two entry points that reach different kernels (``torch.mm``, and ``F.linear``, which takes
    the transposed-weight path: oneDNN for bf16 where the CPU has it, MKL for fp32) and over
    torch's thread count and one thread, each the least time of at least ``repeat`` calls.
    Returns (FLOP/s, what reached it)."""
    best, how = 0.0, ""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for threads in _thread_counts():
            with _Threads(threads):
                for n in sizes:
                    a = torch.randn(n, n, generator=g).to(dtype)
                    b = torch.randn(n, n, generator=g).to(dtype)
                    for name, fn in (("torch.mm", lambda: torch.mm(a, b)),
                                     ("F.linear", lambda: torch.nn.functional.linear(a, b))):
                        rate = 2.0 * n**3 / best_time(fn, repeat, min_time)
                        if rate > best:
                            best, how = rate, f"{name} {n}x{n}x{n}, {_threads_text(threads)}"
    return best, how


def memory_bandwidth(sizes: Sequence[int] = tuple(2**k for k in range(18, 29, 2)),
                     repeat: int = 5, min_time: float = 0.05) -> tuple[float, str, dict[int, float]]:
    """Bytes/s: the best over buffer sizes (in cache up to DRAM), over a copy (read + write
    counted) and a sum (read), and over torch's thread count and one thread, each the least
    time of at least ``repeat`` calls. Returns (best bytes/s, what reached it, {size: best
    bytes/s at that size})."""
    best, how, by_size = 0.0, "", {}
    with torch.inference_mode():
        for nbytes in sizes:
            src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
            dst = torch.empty_like(src)
            here = 0.0
            for threads in _thread_counts():
                with _Threads(threads):
                    for name, moved, fn in (("copy", 2 * nbytes, lambda: dst.copy_(src)),
                                            ("sum", nbytes, lambda: src.sum())):
                        rate = moved / best_time(fn, repeat, min_time)
                        here = max(here, rate)
                        if rate > best:
                            best, how = rate, (f"{name} of {fmt_bytes(nbytes)}, "
                                               f"{_threads_text(threads)}")
            by_size[nbytes] = here
            del src, dst
    return best, how, by_size


def _sig3(v: float) -> str:
    """Three significant digits, trailing zeros kept (``2.50``, ``12.3``, ``150``)."""
    return f"{v:.0f}" if v >= 99.95 else f"{v:.1f}" if v >= 9.995 else f"{v:.2f}"


def fmt_bytes(nbytes: float) -> str:
    """``1536`` -> ``1.50 KiB``: bytes in the largest binary unit that keeps the value >= 1."""
    if nbytes < 1023.5:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if nbytes < 1023.5 or unit == "GiB":
            return f"{_sig3(nbytes)} {unit}"
    raise AssertionError("unreachable")


def fmt_time(seconds: float) -> str:
    """Seconds in the unit that reads best: ``4.2e-05`` -> ``42.0 µs``, ``0.0123`` ->
    ``12.3 ms``, ``2.5`` -> ``2.50 s``."""
    if seconds * 1e6 < 999.5:
        return f"{_sig3(seconds * 1e6)} µs"
    if seconds * 1e3 < 999.5:
        return f"{_sig3(seconds * 1e3)} ms"
    return f"{_sig3(seconds)} s"


class _QuietStderr:
    """fd 2 sent to /dev/null for the block: torch's profiler (kineto) writes start/stop lines
    straight to the file descriptor, which would land between a command's output lines."""

    def __enter__(self) -> "_QuietStderr":
        sys.stderr.flush()
        self._saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)


def peak_allocated(fn: Callable[[], Any]) -> int | None:
    """Bytes torch's CPU allocator holds at the highest point of one call of ``fn`` (its
    outputs and temporaries; memory allocated before the call is not counted, nor memory a
    compiled kernel allocates outside torch), from the profiler's allocation events. None
    where torch has no kineto profiler."""
    from torch._C._autograd import DeviceType
    from torch.autograd import kineto_available
    from torch.profiler import ProfilerActivity, profile

    if not kineto_available():
        return None
    with _QuietStderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
        del out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


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
