"""Run an episode's commands isolated: bubblewrap namespaces, rlimits, a pids cgroup and a
seccomp filter.

`Sandbox(config)` is one session: a private writable work directory (created under a temp
root, removed by `close()`), in which `run(cmd)` executes commands one at a time and returns a
`SandboxResult` with the exit status, the captured output (capped; truncation is stated in the
result), the wall time and a `reason`:

    "ok"                 exit status 0
    "timeout"            the wall-clock limit was reached; every process of the command killed
    "cpu_limit"          RLIMIT_CPU (SIGXCPU, or the hard limit's SIGKILL)
    "memory_limit"       RLIMIT_AS: an allocation failed (MemoryError, ENOMEM, bad_alloc)
    "file_size_limit"    RLIMIT_FSIZE (SIGXFSZ, or EFBIG for a program that ignores it)
    "seccomp"            a denied system call ended the command (seccomp_action="kill")
    "killed_signal:<n>"  another signal ended the command
    "error"              any other non-zero exit, or the command could not start

Two modes (`Sandbox.mode`; `Sandbox.capabilities()` and `sandbox_report()` say exactly what is
enforced, and docs/rl_envs.md has the table):

- "bwrap" where `bwrap` is on PATH and works (probed once per process): new user (uid 65534
  inside), PID, network, IPC, UTS and cgroup namespaces; a read-only system (/usr, /bin, /lib*,
  the parts of /etc programs need); a private /tmp; the work directory read-write at /work (the
  working directory); nothing else of the host. rlimits are set before bwrap is exec'd and are
  inherited; the seccomp filter is handed to bwrap as `--seccomp FD`.
- "rlimits" without bwrap: rlimits, a new session, the seccomp filter, and a network namespace
  only when running as root. The host's filesystem stays visible and writable to the command
  (as the calling user): a weaker mode for development machines, never for untrusted code.

In both modes the number of processes is bounded by a pids cgroup where one is writable (v1 or
v2), else by RLIMIT_NPROC, which the kernel does not apply to root: as root without a writable
pids cgroup, `max_processes` is not enforced (reported, and warned about). When a command ends,
every process it started is killed (bwrap: the PID namespace dies with its init; rlimits: the
process group and the cgroup).

Only the standard library is used: libseccomp through ctypes, bwrap as a program. Nothing is
probed at import time.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import functools
import glob
import logging
import os
import platform
import re
import resource
import secrets
import selectors
import shutil
import signal
import socket
import stat
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Literal, Mapping, Sequence

log = logging.getLogger("glm5.rl.envs")

MODES = ("auto", "bwrap", "rlimits")
SECCOMP_ACTIONS = ("errno", "kill")

#: Where the work directory appears inside the bwrap sandbox (also the working directory).
SANDBOX_WORKDIR = "/work"
#: Where the running interpreter's virtual environment appears inside the bwrap sandbox.
SANDBOX_VENV = "/opt/venv"
#: The uid/gid the command runs as inside bwrap's user namespace ("nobody").
SANDBOX_UID = 65534

#: System calls the seccomp filter denies. Names the running libseccomp does not know, and
#: calls this architecture does not have, are skipped (`capabilities()["seccomp_denied"]` lists
#: what is in force). clone() with a namespace flag is denied too, and clone3() (whose flags a
#: filter cannot read) answers ENOSYS so that the C library falls back to clone().
DENIED_SYSCALLS: tuple[str, ...] = (
    # debugging other processes, reading or writing their memory
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    # mounts, namespaces, root changes
    "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen",
    "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    # the kernel itself: modules, kexec, reboot, swap, BPF, perf, keyrings, sysctl, I/O ports
    "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "create_module", "get_kernel_syms", "query_module", "swapon", "swapoff", "bpf",
    "perf_event_open", "keyctl", "add_key", "request_key", "syslog", "_sysctl", "iopl",
    "ioperm", "uselib", "nfsservctl", "lookup_dcookie", "vhangup", "vm86", "vm86old",
    # file handles bypass path permissions; userfaultfd eases kernel exploits
    "open_by_handle_at", "name_to_handle_at", "userfaultfd", "fanotify_init",
    # host-wide state: clock, accounting, quotas, names, execution domain
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "stime", "acct", "quotactl",
    "quotactl_fd", "sethostname", "setdomainname", "personality",
    # io_uring runs operations the filter never sees
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)

# /etc entries programs need (name service, dynamic linker, time zone, TLS roots, Debian's
# alternatives and Python's config); shadow files, keys and the host's own config stay out.
_ETC_ENTRIES = (
    "passwd", "group", "nsswitch.conf", "host.conf", "hosts", "gai.conf", "ld.so.cache",
    "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "ssl", "ca-certificates",
    "ca-certificates.conf", "pki", "alternatives", "mime.types", "os-release",
    "debian_version", "protocols", "services", "locale.alias", "bash.bashrc", "profile",
    "inputrc", "magic", "magic.mime", "python3*")
_ETC_WITH_NETWORK = ("resolv.conf",)

_CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000, 0x00000080)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID,
#                                              NEWNET, NEWTIME
_CLONE_NEWNET = 0x40000000

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_KILL_PROCESS = 0x80000000
_SCMP_CMP_MASKED_EQ = 7
_NR_SCMP_ERROR = -1


def _scmp_act_errno(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)


_LIBSECCOMP = "libseccomp.so.2"

_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory",
                   "Out of memory")
_FILE_SIZE_MARKERS = ("File too large", "[Errno 27]")


class SandboxError(RuntimeError):
    """The sandbox cannot be set up as configured (a mode or interpreter that is unavailable)."""


def _bad(arg: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"{arg}: expected {expected}, got {got!r}")


# --------------------------------------------------------------------------------------- config
@dataclasses.dataclass
class SandboxConfig:
    """Limits and isolation of a sandbox session; `None` turns a limit off.

    cpu_seconds: CPU time per process (RLIMIT_CPU; SIGXCPU, then SIGKILL one second later).
    wall_seconds: default wall-clock limit of a command (`Sandbox.run(timeout=)` overrides it).
    memory_bytes: address space per process (RLIMIT_AS).
    max_processes: processes and threads the command may have at once (a pids cgroup, else
        RLIMIT_NPROC; see the module docstring for root).
    file_size_bytes: largest file a process may write (RLIMIT_FSIZE).
    open_files: file descriptors per process (RLIMIT_NOFILE).
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
    """

    cpu_seconds: int | None = 10
    wall_seconds: float = 30.0
    memory_bytes: int | None = 1 << 30
    max_processes: int | None = 64
    file_size_bytes: int | None = 64 << 20
    open_files: int | None = 256
    network: bool = False
    ro_binds: tuple[str | tuple[str, str], ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    output_bytes: int = 1 << 20
    mode: Literal["auto", "bwrap", "rlimits"] = "auto"
    seccomp: bool = True
    seccomp_action: Literal["errno", "kill"] = "errno"
    python: bool = True

    def __post_init__(self) -> None:
        name = "SandboxConfig"
        for field, minimum in (("cpu_seconds", 1), ("memory_bytes", 16 << 20),
                               ("max_processes", 1), ("file_size_bytes", 1),
                               ("open_files", 16)):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < minimum):
                raise _bad(f"{name}.{field}", f"an int >= {minimum} or None", v)
        if (isinstance(self.wall_seconds, bool) or not isinstance(self.wall_seconds, (int, float))
                or not self.wall_seconds > 0):
            raise _bad(f"{name}.wall_seconds", "a number of seconds > 0", self.wall_seconds)
        if (isinstance(self.output_bytes, bool) or not isinstance(self.output_bytes, int)
                or self.output_bytes < 2):
            raise _bad(f"{name}.output_bytes", "an int >= 2", self.output_bytes)
        for field in ("network", "seccomp", "python"):
            if not isinstance(getattr(self, field), bool):
                raise _bad(f"{name}.{field}", "a bool", getattr(self, field))
        if self.mode not in MODES:
            raise _bad(f"{name}.mode", f"one of {MODES}", self.mode)
        if self.seccomp_action not in SECCOMP_ACTIONS:
            raise _bad(f"{name}.seccomp_action", f"one of {SECCOMP_ACTIONS}",
                       self.seccomp_action)
        if not isinstance(self.env, Mapping) or not all(
                isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                for k, v in self.env.items()):
            raise _bad(f"{name}.env", "a mapping of variable names (no '=') to str values",
                       self.env)
        self.env = dict(self.env)
        if isinstance(self.ro_binds, (str, bytes)) or not isinstance(self.ro_binds, Sequence):
            raise _bad(f"{name}.ro_binds", "a sequence of paths or (host, inside) pairs",
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
        raise _bad(arg, "a path or a (host path, path inside) pair", b)
    if not os.path.isabs(src) or not os.path.exists(src):
        raise _bad(arg, "an existing absolute host path", src)
    dst = os.path.normpath(dst)
    if not os.path.isabs(dst) or dst == "/":
        raise _bad(arg, "an absolute path inside the sandbox other than /", dst)
    for reserved in (SANDBOX_WORKDIR, "/proc", "/dev"):
        if dst == reserved or dst.startswith(reserved + "/"):
            raise _bad(arg, f"a path inside the sandbox outside {reserved} (it is the "
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


class _Capture:
    """One output stream, capped: the first half of the cap and the last half are kept."""

    def __init__(self, name: str, cap: int) -> None:
        self.name = name
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > self.tail_cap:
                del self.tail[:len(self.tail) - self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_cap + self.tail_cap

    def text(self) -> str:
        head = self.head.decode("utf-8", "replace")
        tail = self.tail.decode("utf-8", "replace")
        if not self.truncated:
            return head + tail
        omitted = self.total - len(self.head) - len(self.tail)
        return (f"{head}\n[... glm5 sandbox: {omitted} bytes of {self.name} omitted "
                f"(output_bytes cap) ...]\n{tail}")


# ---------------------------------------------------------------------------------------- probes
@dataclasses.dataclass(frozen=True)
class _BwrapInfo:
    path: str | None
    works: bool
    userns: bool
    version: str
    reason: str


@dataclasses.dataclass(frozen=True)
class _SeccompFilter:
    bpf: bytes
    denied: tuple[str, ...]
    skipped: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _CgroupParent:
    path: Path | None
    version: int
    reason: str


# A child for probes that needs nothing from PATH.
_PROBE_CMD = [sys.executable, "-c", ""]


def _is_root() -> bool:
    return os.geteuid() == 0


def _system_binds(network: bool) -> list[str]:
    """bwrap arguments that show the host's system read-only: /usr, the /bin and /lib* links
    or directories, and the parts of /etc programs need."""
    args = ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    names = _ETC_ENTRIES + (_ETC_WITH_NETWORK if network else ())
    for name in names:
        for p in sorted(glob.glob(os.path.join("/etc", name))):
            if os.path.exists(p):
                args += ["--ro-bind", p, p]
    return args


@functools.lru_cache(maxsize=None)
def _bwrap_probe() -> _BwrapInfo:
    """Find bwrap and check that it can build a sandbox here (a container may forbid
    namespaces): first with a user namespace, then (root only) without one, capabilities
    dropped."""
    path = shutil.which("bwrap")
    if path is None:
        return _BwrapInfo(None, False, False, "", "bwrap not found on PATH")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return _BwrapInfo(path, False, False, "", f"{path} --version failed: {e}")
    base = [path, *_system_binds(False), "--proc", "/proc", "--dev", "/dev", "--unshare-pid",
            "--unshare-net", "--unshare-ipc", "--die-with-parent", "--new-session"]
    attempts = [("userns", ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid",
                            str(SANDBOX_UID)])]
    if _is_root():
        attempts.append(("no userns", ["--cap-drop", "ALL"]))
    errors = []
    for label, extra in attempts:
        try:
            r = subprocess.run([*base, *extra, "--", "true"], capture_output=True, text=True,
                               timeout=20, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{label}: {e}")
            continue
        if r.returncode == 0:
            return _BwrapInfo(path, True, label == "userns", version, "")
        errors.append(f"{label}: exit {r.returncode}: {r.stderr.strip()[:200]}")
    return _BwrapInfo(path, False, False, version,
                      "bwrap cannot create a sandbox here (" + "; ".join(errors) + ")")


class _ScmpArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class _ScmpVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


@functools.lru_cache(maxsize=None)
def _libseccomp() -> tuple[ctypes.CDLL | None, str]:
    """(libseccomp, "") or (None, why it could not be loaded)."""
    try:
        lib = ctypes.CDLL(_LIBSECCOMP, use_errno=True)
    except OSError as e:
        return None, f"libseccomp could not be loaded ({_LIBSECCOMP}): {e}"
    try:
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_release.restype = None
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add_array.restype = ctypes.c_int
        lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                               ctypes.c_uint, ctypes.POINTER(_ScmpArgCmp)]
        lib.seccomp_export_bpf.restype = ctypes.c_int
        lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.seccomp_version.restype = ctypes.POINTER(_ScmpVersion)
        lib.seccomp_version.argtypes = []
    except AttributeError as e:
        return None, f"{_LIBSECCOMP} lacks a function glm5 needs: {e}"
    return lib, ""


def _libseccomp_version() -> str | None:
    lib, _ = _libseccomp()
    if lib is None:
        return None
    v = lib.seccomp_version().contents
    return f"{v.major}.{v.minor}.{v.micro}"


@functools.lru_cache(maxsize=None)
def _seccomp_filter(action: str) -> _SeccompFilter | str:
    """The deny-list filter as classic BPF (what `bwrap --seccomp` and PR_SET_SECCOMP take),
    or why it cannot be built."""
    lib, why = _libseccomp()
    if lib is None:
        return why
    deny = _scmp_act_errno(errno.EPERM) if action == "errno" else _SCMP_ACT_KILL_PROCESS
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        return "seccomp_init failed"
    try:
        denied, skipped = [], []

        def add(act: int, name: str, cmps: Sequence[_ScmpArgCmp] = ()) -> bool:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr == _NR_SCMP_ERROR:
                return False
            arr = (_ScmpArgCmp * max(len(cmps), 1))(*cmps)
            rc = lib.seccomp_rule_add_array(ctx, act, nr, len(cmps), arr)
            if rc < 0:
                raise OSError(-rc, f"seccomp_rule_add({name}): {os.strerror(-rc)}")
            return nr >= 0  # a negative pseudo-number: the call does not exist on this arch

        for name in DENIED_SYSCALLS:
            (denied if add(deny, name) else skipped).append(name)
        # clone()'s flags are its first argument (the second on s390).
        flags_arg = 1 if platform.machine().startswith("s390") else 0
        for flag in _CLONE_NS_FLAGS:
            add(deny, "clone", [_ScmpArgCmp(flags_arg, _SCMP_CMP_MASKED_EQ, flag, flag)])
        denied.append("clone(namespace flags)")
        if add(_scmp_act_errno(errno.ENOSYS), "clone3"):
            denied.append("clone3 (ENOSYS)")
        with tempfile.TemporaryFile() as f:
            rc = lib.seccomp_export_bpf(ctx, f.fileno())
            if rc < 0:
                return f"seccomp_export_bpf failed: {os.strerror(-rc)}"
            f.seek(0)
            bpf = f.read()
    except OSError as e:
        return str(e)
    finally:
        lib.seccomp_release(ctx)
    if not bpf or len(bpf) % 8:
        return f"seccomp_export_bpf wrote {len(bpf)} bytes, not a BPF program"
    return _SeccompFilter(bpf, tuple(denied), tuple(skipped))


def _unescape_mount(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _find_pids_hierarchy() -> tuple[Path | None, int, str]:
    """The directory of this process's cgroup in a hierarchy with the pids controller."""
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError as e:
        return None, 0, f"cannot read /proc/self/cgroup or mountinfo: {e}"
    v1 = v2 = None
    for line in own:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            v2 = path
        elif "pids" in controllers.split(","):
            v1 = path
    for line in mounts:
        left, _, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        root, mnt, fstype, opts = _unescape_mount(lf[3]), _unescape_mount(lf[4]), rf[0], rf[2]
        for version, own_path, ok in ((1, v1, fstype == "cgroup" and "pids" in opts.split(",")),
                                      (2, v2, fstype == "cgroup2")):
            if not ok or own_path is None:
                continue
            rel = own_path[len(root):] if own_path.startswith(root) else own_path
            d = Path(mnt) / rel.lstrip("/")
            if version == 2:
                try:
                    if "pids" not in (d / "cgroup.subtree_control").read_text().split():
                        continue
                except OSError:
                    continue
            return d, version, ""
    return None, 0, "no cgroup hierarchy with the pids controller delegated to this process"


@functools.lru_cache(maxsize=None)
def _pids_cgroup_parent() -> _CgroupParent:
    """A pids cgroup directory this process may create children in, checked by moving a real
    process into a child (containers often mount cgroups read-only)."""
    d, version, why = _find_pids_hierarchy()
    if d is None:
        return _CgroupParent(None, 0, why)
    try:
        cg = _PidsCgroup(d, 8)
    except OSError as e:
        return _CgroupParent(None, 0, f"cannot create a cgroup in {d}: {e}")
    try:
        r = subprocess.run(_PROBE_CMD, preexec_fn=cg.join, stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=10)
        if r.returncode != 0:
            return _CgroupParent(None, 0, f"a process moved into {cg.path} failed")
    except (OSError, subprocess.SubprocessError) as e:
        return _CgroupParent(None, 0, f"cannot move a process into a cgroup under {d}: {e}")
    finally:
        cg.remove()
    return _CgroupParent(d, version, "")


def _unshare_net() -> None:
    """unshare(CLONE_NEWNET) and bring the new namespace's loopback up (bwrap does the same),
    so that a command can still talk to itself on 127.0.0.1."""
    if hasattr(os, "unshare"):
        os.unshare(_CLONE_NEWNET)
    else:
        libc = _libc()  # cached: loaded by the parent's probe before any child ran this
        if libc.unshare(_CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"unshare(CLONE_NEWNET): {os.strerror(e)}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
        req = fcntl.ioctl(s, siocgifflags, struct.pack("16sh14x", b"lo", 0))
        flags = struct.unpack("16sh14x", req)[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh14x", b"lo", flags | iff_up))


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@functools.lru_cache(maxsize=None)
def _netns_probe() -> str:
    """"" when this process may give a child its own network namespace (root), else why not."""
    if not _is_root():
        return "a network namespace needs root without bwrap"
    _libc()  # load it in the parent, so that children only call into it
    try:
        r = subprocess.run(_PROBE_CMD, preexec_fn=_unshare_net, stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unshare(CLONE_NEWNET) failed: {e}"
    return "" if r.returncode == 0 else f"unshare(CLONE_NEWNET) probe exited {r.returncode}"


_WARNED: set[str] = set()


def reset_probes() -> None:
    """Forget the cached probes (bwrap, libseccomp, the seccomp filter, cgroups, network
    namespaces) and the warnings already logged, e.g. after installing bwrap in a running
    process."""
    for f in (_bwrap_probe, _libseccomp, _seccomp_filter, _pids_cgroup_parent, _netns_probe):
        f.cache_clear()
    _WARNED.clear()


# ---------------------------------------------------------------------------------------- cgroup
class _PidsCgroup:
    """A session's own pids cgroup: bounds processes + threads, counts refused forks, and lets
    every process of a command be killed even after it left its process group."""

    def __init__(self, parent: Path, limit: int) -> None:
        self.path = parent / f"glm5-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        self.path.mkdir()
        try:
            (self.path / "pids.max").write_text(str(limit))
        except OSError:
            self.path.rmdir()
            raise
        self.procs_file = str(self.path / "cgroup.procs")

    def join(self) -> None:
        """Move the calling process in (used in the child between fork and exec)."""
        fd = os.open(self.procs_file, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def forks_refused(self) -> int:
        """How many forks the limit has refused so far (pids.events "max N")."""
        try:
            for line in (self.path / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in Path(self.procs_file).read_text().split()]
        except (OSError, ValueError):
            return []

    def kill_all(self, timeout: float = 5.0) -> bool:
        """SIGKILL every process in the cgroup until it is empty; False if it did not empty in
        `timeout` seconds."""
        kill_file = self.path / "cgroup.kill"
        end = time.monotonic() + timeout
        pause = 0.0001  # bwrap's init leaves within a millisecond: poll fast, then back off
        while True:
            pids = self.pids()
            if not pids:
                return True
            if kill_file.exists():
                try:
                    kill_file.write_text("1")
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > end:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def remove(self) -> None:
        if not self.path.exists():
            return
        if not self.kill_all():
            log.warning("sandbox: processes left in %s after SIGKILL", self.path)
        for _ in range(200):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)
        log.warning("sandbox: could not remove cgroup %s", self.path)


# ----------------------------------------------------------------------------------- the sandbox
def _python_binds() -> tuple[list[tuple[str, str]], str, str]:
    """Read-only binds that make the running interpreter usable inside bwrap, its path there,
    and the directory to put first on PATH. The base installation keeps its own path (a venv's
    interpreter is an absolute symlink into it); a virtual environment appears at /opt/venv
    (its own path may lie under /work, which the session's work directory hides)."""
    base = os.path.realpath(sys.base_prefix)
    exe_name = os.path.basename(sys.executable) or "python3"
    if base == SANDBOX_WORKDIR or base.startswith(SANDBOX_WORKDIR + "/"):
        raise SandboxError(
            f"SandboxConfig.python: the interpreter's installation {base} lies under "
            f"{SANDBOX_WORKDIR}, which the sandbox's work directory hides; set python=False "
            "and bind an interpreter with ro_binds")
    binds: list[tuple[str, str]] = []
    if not (base == "/usr" or base.startswith("/usr/")):
        binds.append((base, base))
    if os.path.realpath(sys.prefix) != base:
        binds.append((os.path.realpath(sys.prefix), SANDBOX_VENV))
        bindir = f"{SANDBOX_VENV}/bin"
    else:
        bindir = os.path.dirname(os.path.realpath(sys.executable))
    return binds, f"{bindir}/{exe_name}", bindir


_BASE_PATH = "/usr/local/bin:/usr/bin:/bin"


class Sandbox:
    """One isolated session: a private work directory and `run()` for its commands (one at a
    time; concurrent calls wait for each other). Use as a context manager or call `close()`,
    which removes the work directory (no process outlives its command: `capabilities()`
    "containment" says how).

    `workdir` is the work directory's host path (it is /work inside bwrap); `python` the
    running interpreter's path as commands see it (in bwrap mode with `python=False`, just
    "python3": whatever the system has); `mode` "bwrap" or "rlimits"."""

    def __init__(self, config: SandboxConfig | None = None,
                 root_dir: str | os.PathLike[str] | None = None) -> None:
        if config is None:
            config = SandboxConfig()
        if not isinstance(config, SandboxConfig):
            raise _bad("Sandbox(config)", "a SandboxConfig", config)
        if root_dir is not None and not os.path.isdir(root_dir):
            raise _bad("Sandbox(root_dir)", "an existing directory or None", root_dir)
        self.config = config
        self.mode, self._bwrap, self._mode_note = _choose_mode(config.mode)
        # Processes of ours that count against the limit: bwrap's monitor and init.
        self._helpers = 2 if self.mode == "bwrap" else 0
        self._warnings: list[str] = []
        if self.mode == "rlimits":
            self._warnings.append(
                f"rlimits mode ({self._mode_note}): no filesystem isolation, the host stays "
                "visible and writable to commands")
            if config.ro_binds:
                raise _bad("SandboxConfig.ro_binds", "no binds in rlimits mode (it shows the "
                           "whole host filesystem)", config.ro_binds)

        # seccomp
        self._seccomp: _SeccompFilter | None = None
        self._seccomp_error = "turned off (SandboxConfig.seccomp=False)"
        if config.seccomp:
            filt = _seccomp_filter(config.seccomp_action)
            if isinstance(filt, str):
                self._seccomp_error = filt
                self._warnings.append(f"no seccomp filter: {filt}")
            else:
                self._seccomp, self._seccomp_error = filt, ""
        self._fprog_buf = self._fprog = None
        if self._seccomp is not None and self.mode == "rlimits":
            self._fprog_buf = ctypes.create_string_buffer(self._seccomp.bpf,
                                                          len(self._seccomp.bpf))
            self._fprog = _SockFprog(len(self._seccomp.bpf) // 8,
                                     ctypes.addressof(self._fprog_buf))

        # network
        self._netns = False
        if not config.network:
            if self.mode == "bwrap":
                self._netns = True
            else:
                why = _netns_probe()
                self._netns = why == ""
                if why:
                    self._warnings.append(f"network not isolated: {why}")

        # interpreter (without python=True, bwrap shows the system's python3 only)
        py_binds: list[tuple[str, str]] = []
        py_bindir = os.path.dirname(sys.executable)
        self.python = sys.executable
        if self.mode == "bwrap":
            if config.python:
                py_binds, self.python, py_bindir = _python_binds()
            else:
                self.python = "python3"

        # the process limit: a pids cgroup per command (bwrap's init, once the command is
        # done, lingers as an orphan until the host's init reaps it; in a cgroup shared by
        # the session's commands its charge would pile up), else RLIMIT_NPROC
        self._cgroup_parent: _CgroupParent | None = None
        self._nproc_rlimit = False
        if config.max_processes is not None:
            parent = _pids_cgroup_parent()
            if parent.path is not None:
                self._cgroup_parent = parent
            else:
                self._nproc_rlimit = not _is_root()
                if not self._nproc_rlimit:
                    self._warnings.append(
                        "max_processes not enforced: running as root and no writable pids "
                        f"cgroup ({parent.reason}); RLIMIT_NPROC does not apply to root")

        # the session directory
        self._session_dir = Path(tempfile.mkdtemp(prefix="glm5-sandbox-", dir=root_dir))
        self.workdir = self._session_dir / "work"
        self.workdir.mkdir()
        self._finalizer = weakref.finalize(self, _cleanup, self._session_dir)

        env = {"PATH": f"{py_bindir}:{_BASE_PATH}" if config.python else _BASE_PATH,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        if self.mode == "bwrap":
            env.update(HOME=SANDBOX_WORKDIR, TMPDIR="/tmp", USER="nobody")
        else:
            env.update(HOME=str(self.workdir), TMPDIR=str(self.workdir))
        env.update(config.env)
        self._env = env
        self._bwrap_args = self._build_bwrap_args(py_binds) if self.mode == "bwrap" else []
        self._prlimit = shutil.which("prlimit") if self.mode == "bwrap" else None
        self._lock = threading.Lock()
        self._closed = False
        for w in self._warnings:
            if w not in _WARNED:  # once per process: an RL run opens thousands of sessions
                _WARNED.add(w)
                log.warning("sandbox: %s", w)

    # ------------------------------------------------------------------------------- set-up
    def _build_bwrap_args(self, py_binds: list[tuple[str, str]]) -> list[str]:
        c = self.config
        assert self._bwrap is not None
        # bwrap's own init stays PID 1 (it reaps orphans, and the command keeps ordinary
        # signal semantics: the kernel spares a namespace's init SIGXCPU, SIGXFSZ, SIGPIPE).
        args = [self._bwrap.path or "bwrap", "--die-with-parent", "--new-session",
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--hostname", "glm5-sandbox"]
        if self._bwrap.userns:
            args += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        else:
            args += ["--cap-drop", "ALL"]
        if not c.network:
            args.append("--unshare-net")
        args += _system_binds(c.network)
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for src, dst in (*py_binds, *c.ro_binds):
            args += ["--ro-bind", src, dst]
        args += ["--bind", str(self.workdir), SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR,
                 "--remount-ro", "/"]
        return args

    def _rlimits(self) -> list[tuple[str, int, int, int]]:
        """(prlimit option, resource, soft, hard) of every limit a command starts under; no
        core dumps ever (a dump of a crashed command lands in its work directory or in the
        host's crash handler)."""
        c = self.config
        out = [("core", resource.RLIMIT_CORE, 0, 0)]
        if c.cpu_seconds is not None:
            out.append(("cpu", resource.RLIMIT_CPU, c.cpu_seconds, c.cpu_seconds + 1))
        for opt, rlim, value in (("as", resource.RLIMIT_AS, c.memory_bytes),
                                 ("fsize", resource.RLIMIT_FSIZE, c.file_size_bytes),
                                 ("nofile", resource.RLIMIT_NOFILE, c.open_files)):
            if value is not None:
                out.append((opt, rlim, value, value))
        if self._nproc_rlimit and c.max_processes is not None:
            n = c.max_processes + self._helpers  # bwrap's monitor runs as the same user
            out.append(("nproc", resource.RLIMIT_NPROC, n, n))
        return out

    def _launcher(self, cgroup: _PidsCgroup | None) -> list[str] | None:
        """The argv prefix that sets a bwrap command up without forking this process:
        /bin/sh writes its own pid into the cgroup, then execs prlimit, which sets the
        rlimits and execs bwrap. A plain vfork then starts commands (fork + preexec_fn copies
        the page tables of a large process: 20-30 ms with torch loaded). None where prlimit
        is missing: then preexec_fn does the same."""
        if self.mode != "bwrap" or self._prlimit is None:
            return None
        prefix = []
        if cgroup is not None:
            prefix = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup.procs_file]
        return [*prefix, self._prlimit,
                *(f"--{opt}={soft}:{hard}" for opt, _, soft, hard in self._rlimits()), "--"]

    def _preexec(self, cgroup: _PidsCgroup | None) -> Callable[[], None]:
        """What the child does between fork and exec: join the cgroup, set the rlimits, and in
        rlimits mode leave the network and install the seccomp filter (bwrap does both
        itself)."""
        limits = [(rlim, (soft, hard)) for _, rlim, soft, hard in self._rlimits()]
        netns = self._netns and self.mode == "rlimits"
        fprog = self._fprog
        # Loaded here, not in the child: dlopen after fork can deadlock on the loader's lock.
        prctl = _libc().prctl if fprog is not None else None

        def preexec() -> None:
            if cgroup is not None:
                cgroup.join()
            for rlim, value in limits:
                resource.setrlimit(rlim, value)
            if netns:
                _unshare_net()
            if fprog is not None and prctl is not None:
                pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
                if prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
                    raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
                if prctl(pr_set_seccomp, seccomp_mode_filter,
                         ctypes.c_void_p(ctypes.addressof(fprog)), 0, 0) != 0:
                    raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")

        return preexec

    # -------------------------------------------------------------------------------- report
    def capabilities(self) -> dict[str, Any]:
        """What this session enforces: the mode, each isolation (True/False), each limit's
        mechanism (None: not enforced or turned off), the seccomp filter, and warnings."""
        c = self.config
        bw = self.mode == "bwrap"
        procs = None
        if c.max_processes is not None:
            if self._cgroup_parent is not None:
                procs = f"cgroup v{self._cgroup_parent.version} pids.max"
            elif self._nproc_rlimit:
                procs = "RLIMIT_NPROC (counts all of the user's processes)"
        return {
            "mode": self.mode,
            "mode_note": self._mode_note,
            "root": _is_root(),
            "bwrap": self._bwrap.path if bw and self._bwrap else None,
            "user_namespace": bool(bw and self._bwrap and self._bwrap.userns),
            "network_isolated": self._netns,
            "filesystem_isolated": bw,
            "sessions_isolated": bw,
            "pid_namespace": bw,
            # What is killed when a command ends or times out.
            "containment": ("pid namespace" if bw else "cgroup" if self._cgroup_parent
                            else "process group (a process that calls setsid() escapes)"),
            "limits": {
                "cpu_seconds": "RLIMIT_CPU" if c.cpu_seconds is not None else None,
                "memory_bytes": "RLIMIT_AS" if c.memory_bytes is not None else None,
                "file_size_bytes": "RLIMIT_FSIZE" if c.file_size_bytes is not None else None,
                "open_files": "RLIMIT_NOFILE" if c.open_files is not None else None,
                "max_processes": procs,
                "wall_seconds": ("SIGKILL to bwrap (the PID namespace dies)" if bw else
                                 "SIGKILL to the process group")
                + (" and the cgroup" if self._cgroup_parent is not None else ""),
            },
            "seccomp": self._seccomp is not None,
            "seccomp_action": c.seccomp_action if self._seccomp is not None else None,
            "seccomp_denied": list(self._seccomp.denied) if self._seccomp else [],
            "seccomp_error": self._seccomp_error or None,
            "warnings": list(self._warnings),
        }

    # ----------------------------------------------------------------------------------- run
    def _argv(self, cmd: Sequence[str] | str) -> tuple[list[str], bool]:
        if isinstance(cmd, str):
            if not cmd.strip():
                raise _bad("Sandbox.run(cmd)", "a non-empty command", cmd)
            return ["/bin/sh", "-c", cmd], True
        if (isinstance(cmd, (bytes, bytearray)) or not isinstance(cmd, Sequence) or not cmd
                or not all(isinstance(a, str) for a in cmd)):
            raise _bad("Sandbox.run(cmd)", "a shell string or a non-empty list of str", cmd)
        return list(cmd), False

    def run(self, cmd: Sequence[str] | str, stdin: str | bytes | None = None,
            timeout: float | None = None) -> SandboxResult:
        """Run `cmd` (an argv list, or a string for /bin/sh -c) in the session's work
        directory and return its `SandboxResult`; `stdin` is fed to it (else /dev/null);
        `timeout` overrides `config.wall_seconds`."""
        argv, shell = self._argv(cmd)
        if stdin is not None and not isinstance(stdin, (str, bytes)):
            raise _bad("Sandbox.run(stdin)", "str, bytes or None", stdin)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        if timeout is None:
            timeout = self.config.wall_seconds
        elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise _bad("Sandbox.run(timeout)", "a number of seconds > 0 or None", timeout)
        with self._lock:
            if self._closed:
                raise RuntimeError("Sandbox.run: the sandbox is closed")
            return self._run_locked(argv, shell, data, float(timeout))

    def _run_locked(self, argv: list[str], shell: bool, data: bytes | None,
                    timeout: float) -> SandboxResult:
        c = self.config
        pass_fds: tuple[int, ...] = ()
        full = argv
        seccomp_fd = None
        if self.mode == "bwrap":
            full = list(self._bwrap_args)
            if self._seccomp is not None:
                seccomp_fd = os.memfd_create("glm5-seccomp", 0)
                os.write(seccomp_fd, self._seccomp.bpf)
                os.lseek(seccomp_fd, 0, os.SEEK_SET)
                pass_fds = (seccomp_fd,)
                full += ["--seccomp", str(seccomp_fd)]
            full += ["--", *argv]
        t0 = time.perf_counter()
        cgroup = None
        try:
            if self._cgroup_parent is not None:
                assert self._cgroup_parent.path is not None and c.max_processes is not None
                cgroup = _PidsCgroup(self._cgroup_parent.path, c.max_processes + self._helpers)
            launcher = self._launcher(cgroup)
            if launcher is not None:
                full = launcher + full
            try:
                proc = subprocess.Popen(
                    full, stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    cwd=str(self.workdir) if self.mode == "rlimits" else None, env=self._env,
                    preexec_fn=self._preexec(cgroup) if launcher is None else None,
                    start_new_session=True, pass_fds=pass_fds)
            except (OSError, subprocess.SubprocessError) as e:
                code = 127 if isinstance(e, FileNotFoundError) else 126
                return SandboxResult(code, "", str(e), time.perf_counter() - t0, "error",
                                     detail=f"could not start the command: {e}")
            finally:
                if seccomp_fd is not None:
                    os.close(seccomp_fd)
            out, err, timed_out, status, rusage = _supervise(proc, data, timeout,
                                                             c.output_bytes, cgroup)
            wall = time.perf_counter() - t0
            forks_refused = cgroup.forks_refused() if cgroup is not None else None
        finally:
            if cgroup is not None:
                cgroup.remove()
        cpu_s = None if self.mode == "bwrap" else rusage.ru_utime + rusage.ru_stime
        rc = os.waitstatus_to_exitcode(status)
        sig = -rc if rc < 0 else None
        if sig is None and (self.mode == "bwrap" or shell) and 128 < rc <= 128 + 64:
            sig = rc - 128
        stderr = err.text()
        reason, detail = _classify(timed_out=timed_out, rc=rc, sig=sig, cpu_s=cpu_s,
                                   stderr=stderr, config=c, timeout=timeout,
                                   bwrap=self.mode == "bwrap")
        if forks_refused:
            detail += f"; the process limit ({c.max_processes}) refused {forks_refused} forks"
        return SandboxResult(
            returncode=-sig if sig is not None else rc, stdout=out.text(), stderr=stderr,
            wall_s=wall, reason=reason, detail=detail, signal=sig, cpu_s=cpu_s,
            stdout_bytes=out.total, stderr_bytes=err.total, stdout_truncated=out.truncated,
            stderr_truncated=err.truncated, forks_refused=forks_refused)

    # ---------------------------------------------------------------------------- files
    def _open(self, relpath: str | os.PathLike[str], flags: int, create_dirs: bool) -> int:
        """Open a path inside the work directory without following any symbolic link (a
        command may plant links to host files)."""
        parts = PurePosixPath(os.fspath(relpath)).parts
        if not parts or PurePosixPath(os.fspath(relpath)).is_absolute() or any(
                p in ("..", ".") for p in parts):
            raise _bad("Sandbox file path", "a relative path inside the work directory "
                       "without '..'", os.fspath(relpath))
        dfd = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for p in parts[:-1]:
                if create_dirs:
                    try:
                        os.mkdir(p, 0o755, dir_fd=dfd)
                    except FileExistsError:
                        pass
                nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
                os.close(dfd)
                dfd = nfd
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=dfd)
        finally:
            os.close(dfd)

    def write_file(self, relpath: str | os.PathLike[str], data: str | bytes) -> None:
        """Write a file into the work directory (parents created), e.g. a task's sources."""
        if not isinstance(data, (str, bytes)):
            raise _bad("Sandbox.write_file(data)", "str or bytes", type(data).__name__)
        fd = self._open(relpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, create_dirs=True)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)

    def read_file(self, relpath: str | os.PathLike[str], limit: int = 16 << 20) -> bytes:
        """Read a regular file a command left in the work directory (no links followed, at
        most `limit` bytes: a ValueError beyond)."""
        fd = self._open(relpath, os.O_RDONLY, create_dirs=False)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise _bad("Sandbox.read_file(relpath)", "a regular file", os.fspath(relpath))
            data = f.read(limit + 1)
        if len(data) > limit:
            raise _bad("Sandbox.read_file", f"a file of at most {limit} bytes", relpath)
        return data

    # --------------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Remove the work directory (a command's processes never outlive it: see
        `capabilities()["containment"]`); waits for a running command."""
        with self._lock:
            self._closed = True
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sandbox(mode={self.mode!r}, workdir={str(self.workdir)!r})"


def _cleanup(session_dir: Path) -> None:
    def make_writable(func: Callable[..., Any], path: str, exc: Any) -> None:
        # A command may leave directories without write permission (matters when not root).
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
        except OSError:
            pass
        func(path)

    if session_dir.exists():
        shutil.rmtree(session_dir, onerror=make_writable)


def _choose_mode(requested: str) -> tuple[str, _BwrapInfo | None, str]:
    if requested == "rlimits":
        return "rlimits", None, "requested"
    info = _bwrap_probe()
    if info.works:
        return "bwrap", info, info.version
    if requested == "bwrap":
        raise SandboxError(f"SandboxConfig.mode='bwrap': {info.reason}")
    return "rlimits", None, info.reason


def _supervise(proc: subprocess.Popen[bytes], data: bytes | None, timeout: float, cap: int,
               cgroup: _PidsCgroup | None) -> tuple[_Capture, _Capture, bool, int, Any]:
    """Feed stdin, capture both streams (capped), enforce the wall-clock limit, and when the
    command ends kill everything it left; returns (stdout, stderr, timed_out, wait status,
    rusage of the whole tree)."""
    out, err = _Capture("stdout", cap), _Capture("stderr", cap)
    sel = selectors.DefaultSelector()
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}  # type: ignore[union-attr]
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(data) if data else None
    stdin_fd = -1
    if proc.stdin is not None:
        if pending:
            stdin_fd = proc.stdin.fileno()
            os.set_blocking(stdin_fd, False)
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ)
        except OSError:
            pidfd = None
    deadline = time.monotonic() + timeout
    timed_out = False
    status = rusage = None
    drain_until = None

    def kill_tree() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def exited() -> bool:
        res = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return res is not None and res.si_pid == proc.pid

    try:
        while True:
            now = time.monotonic()
            if status is None:
                if not timed_out and now >= deadline:
                    timed_out = True
                    kill_tree()
                    if cgroup is not None:
                        cgroup.kill_all(timeout=0)
                if exited():
                    kill_tree()  # what the command left in its process group
                    _, status, rusage = os.wait4(proc.pid, 0)
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    if cgroup is not None:
                        cgroup.kill_all()
                    # killed processes close their pipes at once; only an escaped one
                    # (rlimits mode without a cgroup) would hold them longer
                    drain_until = time.monotonic() + 0.5
                    if pidfd is not None:
                        sel.unregister(pidfd)
                        os.close(pidfd)
                        pidfd = None
            if status is not None and (not streams or time.monotonic() > drain_until):
                break
            if status is None:
                wait = max(0.0, deadline - now) if not timed_out else 0.05
                if pidfd is None:
                    wait = min(wait, 0.01)
            else:
                wait = max(0.0, drain_until - time.monotonic())
            for key, _ in sel.select(wait):
                fd = key.fd
                if fd == pidfd:
                    continue
                if fd == stdin_fd:
                    try:
                        n = os.write(fd, pending[:65536])
                        pending = pending[n:]
                    except BlockingIOError:
                        continue
                    except (BrokenPipeError, OSError):
                        pending = pending[:0]
                    if not len(pending):
                        sel.unregister(fd)
                        proc.stdin.close()  # type: ignore[union-attr]
                        stdin_fd, pending = -1, None
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if chunk:
                    streams[fd].feed(chunk)
                else:
                    sel.unregister(fd)
                    del streams[fd]
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None and not f.closed:
                f.close()
        if status is None:  # an exception escaped: leave nothing running
            kill_tree()
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
    return out, err, timed_out, status, rusage


def _classify(*, timed_out: bool, rc: int, sig: int | None, cpu_s: float | None, stderr: str,
              config: SandboxConfig, timeout: float, bwrap: bool) -> tuple[str, str]:
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
    if bwrap and rc == 1 and stderr.startswith("bwrap: "):
        return "error", f"bwrap could not start the command: {stderr.splitlines()[0]}"
    return "error", f"exit status {rc}"


# --------------------------------------------------------------------------------- reporting
def sandbox_report() -> dict[str, Any]:
    """What a default sandbox would enforce on this machine, and why anything is missing
    (for `glm5 doctor`): bwrap, libseccomp, the pids cgroup, network namespaces."""
    bw = _bwrap_probe()
    cg = _pids_cgroup_parent()
    lib, lib_error = _libseccomp()
    with Sandbox(SandboxConfig()) as sb:
        caps = sb.capabilities()
    return {
        "mode": caps["mode"],
        "bwrap": {"path": bw.path, "works": bw.works, "user_namespace": bw.userns,
                  "version": bw.version or None, "problem": bw.reason or None},
        "libseccomp": {"loaded": lib is not None, "version": _libseccomp_version(),
                       "problem": lib_error or None},
        "pids_cgroup": {"path": str(cg.path) if cg.path else None,
                        "version": cg.version or None, "problem": cg.reason or None},
        "root": _is_root(),
        "enforced": caps,
        "warnings": caps["warnings"],
    }


def measure_overhead(runs: int = 20, config: SandboxConfig | None = None) -> dict[str, float]:
    """Median wall time (ms) of `true` run directly by subprocess and through a sandbox in
    each mode that works here, and each mode's overhead over the direct run."""
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise _bad("measure_overhead(runs)", "an int >= 1", runs)
    config = config or SandboxConfig()
    true = shutil.which("true") or "/bin/true"

    def median_ms(fn: Callable[[], Any]) -> float:
        fn()  # warm-up
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    out = {"direct_ms": median_ms(lambda: subprocess.run([true], check=True))}
    modes = ["rlimits"] + (["bwrap"] if _bwrap_probe().works else [])
    for mode in modes:
        with Sandbox(dataclasses.replace(config, mode=mode)) as sb:
            def one() -> None:
                r = sb.run([true])
                if not r.ok:
                    raise SandboxError(f"measure_overhead: `true` failed in {mode} mode: "
                                       f"{r.detail}: {r.stderr[:200]}")
            out[f"{mode}_ms"] = median_ms(one)
        out[f"{mode}_overhead_ms"] = out[f"{mode}_ms"] - out["direct_ms"]
    return out


if __name__ == "__main__":  # python -m glm5.rl.envs.sandbox: the report and the overhead
    import json

    print(json.dumps(sandbox_report(), indent=2))
    print(json.dumps({k: round(v, 2) for k, v in measure_overhead().items()}, indent=2))
