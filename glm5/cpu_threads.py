"""How many threads glm5's CPU work runs on, and how idle pool threads wait: the one place that
decides it for torch's intra-op (OpenMP) pool and TVM's thread pool.

A cpu-backend forward alternates torch ops (GEMMs, in torch's OpenMP pool) with TVM kernels (in
TVM's own pool), hundreds of times a pass. Measured on a 2-CPU VM with two busy background
processes (docs/performance.md, "CPU under load"), what made glm5 slow down far more than
transformers there was how the two pools wait, not their size:

* torch's libgomp workers spin ~300 000 iterations after every parallel region (its default
  when ``OMP_WAIT_POLICY`` is unset), taking a core from TVM's workers and from the other
  processes at every hand-over. ``OMP_WAIT_POLICY=PASSIVE`` (spin count 0) made the loaded
  forward several times faster and the idle one no slower (docs/performance.md, "CPU under
  load"). libgomp reads it once, when torch loads it, so
  ``import glm5`` sets it (`quiet_openmp`) if no OpenMP runtime is loaded yet and the user did
  not choose a policy.
* TVM pins each worker thread to one core (and the calling thread too, even to a core outside
  the process's affinity): a pinned worker waits for its busy core while another is free.
  ``TVM_BIND_THREADS=0`` leaves placement to the kernel's scheduler; ``TVM_THREAD_POOL_SPIN_COUNT
  =0`` makes TVM's idle workers sleep.
* Pool size: the CPUs this process may run on (affinity) capped by its cgroup's CPU quota
  (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``; a pool larger than the quota is throttled
  every period), or ``GLM5_CPU_THREADS``. Smaller pools while the machine is loaded were not
  consistently faster once the pools sleep instead of spinning, so the load average is not
  used.

This module imports only the standard library: `glm5/__init__` calls `quiet_openmp` before
anything imports torch.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, MutableMapping, NamedTuple

#: Environment variable that fixes the thread count of both pools.
OVERRIDE = "GLM5_CPU_THREADS"
#: Where cgroup file systems are mounted.
CGROUP_ROOT = "/sys/fs/cgroup"
#: This process's cgroup membership (one line per hierarchy).
SELF_CGROUP = "/proc/self/cgroup"
#: OpenMP runtimes whose presence in the process means torch's pool already read its settings.
_OPENMP_LIBS = ("libgomp", "libiomp", "libomp")


class CPUThreadsError(ValueError):
    """A bad thread setting (GLM5_CPU_THREADS)."""


class ThreadDecision(NamedTuple):
    """The pool size glm5 uses for torch's intra-op threads and TVM's workers.

    threads: the size; source: "GLM5_CPU_THREADS", "affinity" or "cgroup cpu quota";
    affinity: CPUs this process may run on; quota: CPUs its cgroup grants (None: no quota);
    quota_file: the file that set the quota."""

    threads: int
    source: str
    affinity: int
    quota: float | None
    quota_file: str | None

    def describe(self) -> str:
        quota = (f"cgroup quota {self.quota:g} CPUs ({self.quota_file})" if self.quota is not None
                 else "no cgroup CPU quota")
        return (f"{self.threads} (from {self.source}; {self.affinity} CPUs in the affinity mask, "
                f"{quota})")


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _quota_in(directory: str, v2: bool) -> tuple[float, str] | None:
    """The CPU quota set in one cgroup directory (None: none set there, or unreadable)."""
    try:
        return _quota_in_unchecked(directory, v2)
    except (ValueError, IndexError):  # a file we cannot parse sets no quota we can honour
        return None


def _quota_in_unchecked(directory: str, v2: bool) -> tuple[float, str] | None:
    if v2:
        path = os.path.join(directory, "cpu.max")
        text = _read(path)
        if not text:
            return None
        fields = text.split()
        if fields[0] == "max":
            return None
        quota, period = float(fields[0]), float(fields[1]) if len(fields) > 1 else 100000.0
    else:
        path = os.path.join(directory, "cpu.cfs_quota_us")
        q, p = _read(path), _read(os.path.join(directory, "cpu.cfs_period_us"))
        if q is None or p is None:
            return None
        quota, period = float(q), float(p)
    if quota <= 0 or period <= 0:  # v1's -1: no quota
        return None
    return quota / period, path


def _ancestors(path: str) -> list[str]:
    """``/a/b`` -> ["/a/b", "/a", "/"]: a cgroup and every cgroup above it."""
    out, p = [], "/" + path.strip("/")
    while True:
        out.append(p)
        if p == "/":
            return out
        p = os.path.dirname(p)


def cgroup_cpu_quota(root: str | None = None,
                     self_cgroup: str | None = None) -> tuple[float, str] | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, in CPUs, and the
    file that sets it; None where no quota applies (or cgroups cannot be read).

    cgroup v2 (a ``0::<path>`` line): ``<root>/<path>/cpu.max`` ("max" or "<quota> <period>");
    v1 (a line whose controllers include ``cpu``): ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    under the ``cpu`` hierarchy's mount (-1: none). Inside a container the mount often is the
    container's own cgroup while the listed path is the host's: the mount's top directory is
    checked too. ``root`` / ``self_cgroup`` default to `CGROUP_ROOT` / `SELF_CGROUP`."""
    root = CGROUP_ROOT if root is None else root
    text = _read(SELF_CGROUP if self_cgroup is None else self_cgroup)
    if not text:
        return None
    found: list[tuple[float, str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            mounts, v2 = [root, os.path.join(root, "unified")], True
        elif "cpu" in controllers.split(","):
            mounts = [os.path.join(root, name) for name in (controllers, "cpu", "cpu,cpuacct")]
            v2 = False
        else:
            continue
        for mount in dict.fromkeys(mounts):
            if not os.path.isdir(mount):
                continue
            for cg in _ancestors(path):
                q = _quota_in(os.path.join(mount, cg.lstrip("/")), v2)
                if q is not None:
                    found.append(q)
    return min(found) if found else None


def parse_override(value: str | None) -> int | None:
    """GLM5_CPU_THREADS's value as a thread count (None: unset or empty); anything but a
    positive integer is a `CPUThreadsError`."""
    if value is None or value.strip() == "":
        return None
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise CPUThreadsError(f"glm5 cpu threads: environment variable {OVERRIDE} expected a "
                              f"positive integer (threads for torch's and TVM's pools), got "
                              f"{value!r}")
    return n


def decide(environ: MutableMapping[str, str] | None = None) -> ThreadDecision:
    """The pool size: GLM5_CPU_THREADS if set, else the affinity mask's CPU count capped by the
    cgroup quota (rounded down, at least 1: a pool wider than the quota is throttled)."""
    env = os.environ if environ is None else environ
    aff = affinity_cpus()
    q = cgroup_cpu_quota()
    quota, quota_file = (q if q is not None else (None, None))
    n = parse_override(env.get(OVERRIDE))
    if n is not None:
        return ThreadDecision(n, OVERRIDE, aff, quota, quota_file)
    if quota is not None and max(1, math.floor(quota + 1e-9)) < aff:
        return ThreadDecision(max(1, math.floor(quota + 1e-9)), "cgroup cpu quota", aff, quota,
                              quota_file)
    return ThreadDecision(aff, "affinity", aff, quota, quota_file)


def tvm_env(decision: ThreadDecision) -> dict[str, str]:
    """The TVM runtime settings glm5 wants, read when TVM's pool starts: its size, no pinning of
    threads to cores, no spinning of idle workers."""
    return {"TVM_NUM_THREADS": str(decision.threads), "TVM_BIND_THREADS": "0",
            "TVM_THREAD_POOL_SPIN_COUNT": "0"}


_applied: dict[str, Any] | None = None


def apply(environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """Apply the decision before the cpu backend starts TVM: TVM's settings (`tvm_env`) where
    the user has not set them, and torch's intra-op threads — set to GLM5_CPU_THREADS when that
    is given, else lowered to the decision if torch uses more (never raised: torch's default is
    the affinity mask, which the decision never exceeds without the override); left alone when
    OMP_NUM_THREADS is set. Returns what was decided and set; raises `CPUThreadsError` on a bad
    GLM5_CPU_THREADS."""
    import torch

    global _applied
    env = os.environ if environ is None else environ
    d = decide(env)
    tvm = {}
    for k, v in tvm_env(d).items():
        tvm[k] = env.setdefault(k, v)
    before = torch.get_num_threads()
    if env.get("OMP_NUM_THREADS"):
        how = "left as set by OMP_NUM_THREADS"
    elif d.source == OVERRIDE and before != d.threads:
        torch.set_num_threads(d.threads)
        how = f"set to {d.threads} ({OVERRIDE})"
    elif before > d.threads:
        torch.set_num_threads(d.threads)
        how = f"lowered from {before} to the decision"
    else:
        how = "unchanged"
    _applied = {"decision": d, "tvm_env": tvm, "torch_threads": torch.get_num_threads(),
                "torch_threads_how": how}
    return _applied


def applied() -> dict[str, Any] | None:
    """What `apply` last did in this process (None: the cpu backend has not started)."""
    return _applied


def _openmp_loaded() -> bool | None:
    """Whether an OpenMP runtime is mapped into this process (None: cannot tell)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return any(lib in maps for lib in _OPENMP_LIBS)


_openmp_state: dict[str, Any] | None = None


def quiet_openmp(environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """Ask torch's OpenMP workers to sleep rather than spin when idle: set
    ``OMP_WAIT_POLICY=PASSIVE`` unless the user set a policy or an OpenMP runtime has already
    read its environment (torch imported before glm5: then the setting could not take effect
    here and would only reach child processes). Called by ``import glm5``. Returns, and
    records for `openmp_state`, what the pool's policy is."""
    global _openmp_state
    env = os.environ if environ is None else environ
    loaded = _openmp_loaded()
    if loaded is None:
        loaded = "torch" in sys.modules
    user = env.get("OMP_WAIT_POLICY")
    if user:
        state = {"policy": user.upper(), "by": "the environment", "spinning": False}
        if user.strip().upper() == "ACTIVE":
            state["spinning"] = True
    elif loaded:
        state = {"policy": None, "by": "OpenMP started before glm5 was imported",
                 "spinning": True}
    else:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        state = {"policy": "PASSIVE", "by": "glm5", "spinning": False}
    _openmp_state = state
    return state


def openmp_state() -> dict[str, Any]:
    """torch's OpenMP wait policy as `quiet_openmp` found or set it: policy (None: OpenMP's
    default, which spins), by (who chose it), spinning (whether idle workers spin)."""
    return _openmp_state if _openmp_state is not None else quiet_openmp()


def spinning_warning() -> str | None:
    """A warning with the fix where torch's OpenMP workers spin because they started before
    glm5 set the policy (None otherwise)."""
    s = openmp_state()
    if not s["spinning"] or s["policy"] == "ACTIVE":
        return None
    return ("torch's OpenMP threads spin after every parallel region (torch was imported before "
            "glm5, without OMP_WAIT_POLICY): on a busy machine the cpu backend's forward is then "
            "several times slower. Import glm5 before torch, or set OMP_WAIT_POLICY=PASSIVE "
            "before starting Python")
