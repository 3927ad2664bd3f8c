"""A sandbox session's policy: its limits and isolation (`SandboxConfig`, validated when made),
what a command did (`SandboxResult`) and why it ended (`classify`: the reasons listed in
`glm5.rl.envs.sandbox`)."""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any, Literal, Mapping, Sequence

MODES = ("auto", "bwrap", "rlimits")
SECCOMP_ACTIONS = ("errno", "kill")

#: Where the work directory appears inside the bwrap sandbox (also the working directory).
SANDBOX_WORKDIR = "/work"
#: Where the running interpreter's virtual environment appears inside the bwrap sandbox.
SANDBOX_VENV = "/opt/venv"
#: The uid/gid a command has inside bwrap's user namespace ("nobody").
SANDBOX_UID = 65534
#: The rlimits-mode session directories' name prefix (a sweep finds crashed sessions' by it).
SESSION_PREFIX = "glm5-sandbox-"

_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory",
                   "Out of memory")
_FILE_SIZE_MARKERS = ("File too large", "[Errno 27]")
_DISK_MARKERS = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")


class SandboxError(RuntimeError):
    """The sandbox cannot be set up as configured (a mode or interpreter that is unavailable,
    rlimits mode as root without the explicit opt-in)."""


def bad_arg(arg: str, expected: str, got: Any) -> ValueError:
    """The error for a bad argument, naming it, what it expected and what it got."""
    return ValueError(f"{arg}: expected {expected}, got {got!r}")


# --------------------------------------------------------------------------------------- config
@dataclasses.dataclass
class SandboxConfig:
    """Limits and isolation of a sandbox session; `None` turns a limit off.

    cpu_seconds: CPU time per process (RLIMIT_CPU; SIGXCPU, then SIGKILL one second later).
    wall_seconds: default wall-clock limit of a command (`Sandbox.run(timeout=)` overrides it).
    memory_bytes: address space per process (RLIMIT_AS).
    max_processes: processes and threads the command may have at once (a pids cgroup, else
        RLIMIT_NPROC).
    file_size_bytes: largest file a process may write (RLIMIT_FSIZE).
    open_files: file descriptors per process (RLIMIT_NOFILE).
    disk_bytes: the work directory's size (bwrap mode: a tmpfs of this size, with one inode
        per KiB of it; None: the kernel's default, half of RAM). Held in RAM: see tmp_bytes.
    tmp_bytes: /tmp's size, the same way (bwrap mode; rlimits mode has no private /tmp).
        A session can hold up to disk_bytes + tmp_bytes of RAM in these, beyond its
        processes' memory_bytes each; it is freed when the session closes.
    network: keep the host's network (default False: a private network namespace).
    ro_binds: extra read-only paths, each a host path (visible at the same path) or a
        (host path, path inside) pair; bwrap mode only.
    env: variables added to (or replacing) the sandbox's minimal environment.
    output_bytes: captured bytes per stream; beyond it the head and the tail are kept and the
        result says how much was left out.
    mode: "auto" (bwrap where it works, else rlimits), "bwrap" (an error where it does not
        work) or "rlimits".
    seccomp: install the seccomp filter (where libseccomp loads; reported when it does not).
    seccomp_action: "errno" (a denied call fails with EPERM and the program carries on) or
        "kill" (it ends the command: reason "seccomp").
    python: expose the running interpreter and its virtual environment read-only inside the
        sandbox (`Sandbox.python` is its path there; `python` on PATH is it).
    host_uid: the host uid (and gid) a root trainer's commands run as (None: one of their own
        per session, see `sandbox_launch.HOST_UID_RANGE`; 0 is refused). A non-root trainer's
        commands always run as its own uid: only None or that uid is accepted.
    unsafe_rlimits_as_root: let rlimits mode run commands when this process is root. rlimits
        mode is no security boundary (the host's files and processes stay visible); even so
        the commands drop to an unprivileged uid.
    """

    cpu_seconds: int | None = 10
    wall_seconds: float = 30.0
    memory_bytes: int | None = 1 << 30
    max_processes: int | None = 64
    file_size_bytes: int | None = 64 << 20
    open_files: int | None = 256
    disk_bytes: int | None = 256 << 20
    tmp_bytes: int | None = 64 << 20
    network: bool = False
    ro_binds: tuple[str | tuple[str, str], ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    output_bytes: int = 1 << 20
    mode: Literal["auto", "bwrap", "rlimits"] = "auto"
    seccomp: bool = True
    seccomp_action: Literal["errno", "kill"] = "errno"
    python: bool = True
    host_uid: int | None = None
    unsafe_rlimits_as_root: bool = False

    def __post_init__(self) -> None:
        name = "SandboxConfig"
        for field, minimum in (("cpu_seconds", 1), ("memory_bytes", 16 << 20),
                               ("max_processes", 1), ("file_size_bytes", 1),
                               ("open_files", 16), ("disk_bytes", 1 << 20),
                               ("tmp_bytes", 1 << 20), ("host_uid", 1)):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < minimum):
                raise bad_arg(f"{name}.{field}", f"an int >= {minimum} or None", v)
        if self.host_uid is not None and self.host_uid >= (1 << 32) - 1:
            raise bad_arg(f"{name}.host_uid", "a uid below 2**32 - 1", self.host_uid)
        if (isinstance(self.wall_seconds, bool) or not isinstance(self.wall_seconds, (int, float))
                or not self.wall_seconds > 0):
            raise bad_arg(f"{name}.wall_seconds", "a number of seconds > 0", self.wall_seconds)
        if (isinstance(self.output_bytes, bool) or not isinstance(self.output_bytes, int)
                or self.output_bytes < 2):
            raise bad_arg(f"{name}.output_bytes", "an int >= 2", self.output_bytes)
        for field in ("network", "seccomp", "python", "unsafe_rlimits_as_root"):
            if not isinstance(getattr(self, field), bool):
                raise bad_arg(f"{name}.{field}", "a bool", getattr(self, field))
        if self.mode not in MODES:
            raise bad_arg(f"{name}.mode", f"one of {MODES}", self.mode)
        if self.seccomp_action not in SECCOMP_ACTIONS:
            raise bad_arg(f"{name}.seccomp_action", f"one of {SECCOMP_ACTIONS}",
                       self.seccomp_action)
        if not isinstance(self.env, Mapping) or not all(
                isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                for k, v in self.env.items()):
            raise bad_arg(f"{name}.env", "a mapping of variable names (no '=') to str values",
                       self.env)
        self.env = dict(self.env)
        if isinstance(self.ro_binds, (str, bytes)) or not isinstance(self.ro_binds, Sequence):
            raise bad_arg(f"{name}.ro_binds", "a sequence of paths or (host, inside) pairs",
                       self.ro_binds)
        self.ro_binds = tuple(_normalize_bind(b) for b in self.ro_binds)


def _normalize_bind(b: Any) -> tuple[str, str]:
    arg = "SandboxConfig.ro_binds"
    if isinstance(b, (str, os.PathLike)):
        src = dst = os.fspath(b)
    elif isinstance(b, (tuple, list)) and len(b) == 2 and all(
            isinstance(x, (str, os.PathLike)) for x in b):
        src, dst = os.fspath(b[0]), os.fspath(b[1])
    else:
        raise bad_arg(arg, "a path or a (host path, path inside) pair", b)
    if not os.path.isabs(src) or not os.path.exists(src):
        raise bad_arg(arg, "an existing absolute host path", src)
    dst = os.path.normpath(dst)
    if not os.path.isabs(dst) or dst == "/":
        raise bad_arg(arg, "an absolute path inside the sandbox other than /", dst)
    for reserved in (SANDBOX_WORKDIR, "/proc", "/dev", "/tmp"):
        if dst == reserved or dst.startswith(reserved + "/"):
            raise bad_arg(arg, f"a path inside the sandbox outside {reserved} (it is the "
                       "sandbox's own)", dst)
    return src, dst


# --------------------------------------------------------------------------------------- result
@dataclasses.dataclass
class SandboxResult:
    """What a command did. `returncode` is the exit status, or -N when signal N ended it
    (bwrap's and the shell's 128+N are translated); `reason` is one of the module docstring's
    reasons; `detail` says it in words. `stdout_bytes` / `stderr_bytes` count everything the
    command wrote; where that exceeded the cap, `*_truncated` is set and the text keeps the head
    and the tail around a line saying how many bytes were left out. `forks_refused` counts forks
    the process limit refused (None where it cannot be measured: no pids cgroup). `cpu_s` is
    the CPU time of the command and of the descendants it waited for, in rlimits mode (None
    in bwrap mode: bwrap's monitor leaves its init unreaped, and the kernel's count with
    it)."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    reason: str
    detail: str = ""
    signal: int | None = None
    cpu_s: float | None = None
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    forks_refused: int | None = None

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def classify(*, timed_out: bool, rc: int, sig: int | None, cpu_s: float | None, stderr: str,
             config: SandboxConfig, timeout: float, bwrap: bool,
             disk_full: str | None = None) -> tuple[str, str]:
    """(reason, detail) of a finished command."""
    if timed_out:
        return "timeout", (f"the wall-clock limit of {timeout:g} s was reached; every process "
                           "of the command was killed")
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
        # SIGKILL past the CPU limit: the hard limit, for a program that survives SIGXCPU
        # (recognised where the CPU time is known).
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and config.cpu_seconds is not None
                                     and cpu_s is not None and cpu_s >= config.cpu_seconds):
            return "cpu_limit", f"the CPU limit of {config.cpu_seconds} s was reached ({name})"
        if sig == signal.SIGXFSZ:
            return "file_size_limit", (f"a file reached the size limit of "
                                       f"{config.file_size_bytes} bytes ({name})")
        if sig == signal.SIGSYS:
            return "seccomp", f"a system call the seccomp filter denies was made ({name})"
        return f"killed_signal:{sig}", f"ended by {name}"
    if rc == 0:
        return "ok", "exit status 0"
    tail = stderr[-8192:]
    if config.memory_bytes is not None and any(m in tail for m in _MEMORY_MARKERS):
        return "memory_limit", (f"an allocation failed under the memory limit of "
                                f"{config.memory_bytes} bytes (exit status {rc})")
    if config.file_size_bytes is not None and any(m in tail for m in _FILE_SIZE_MARKERS):
        return "file_size_limit", (f"a write failed at the file size limit of "
                                   f"{config.file_size_bytes} bytes (exit status {rc})")
    if disk_full is not None or any(m in tail for m in _DISK_MARKERS):
        return "disk_limit", (f"no space left: {disk_full or 'a write failed with ENOSPC'} "
                              f"(exit status {rc})")
    if bwrap and rc == 1 and stderr.startswith("bwrap: "):
        return "error", f"bwrap could not start the command: {stderr.splitlines()[0]}"
    return "error", f"exit status {rc}"
