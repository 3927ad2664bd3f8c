"""How a sandboxed command starts: which host uid it runs as, and the steps between this
process and the command (join the pids cgroup, enter the stage's namespaces, drop to the
unprivileged uid, set the rlimits, then exec bwrap or the command).

The uid. A command never runs as host root:
- a non-root trainer's commands run as the trainer's own uid (bwrap maps it to 65534 inside);
- a root trainer's commands run as a uid of their own, one per session, drawn from
  `HOST_UID_RANGE` (`SandboxConfig.host_uid` picks a fixed one instead, e.g. 65534): no
  capabilities, an empty bounding set, no supplementary groups, `no_new_privs`. A uid that no
  other process has also makes RLIMIT_NPROC count exactly the session's processes.

The steps run as programs (`sh` for the cgroup, util-linux's `nsenter`, `setpriv`, `prlimit`)
so that this process — a trainer with torch and a model loaded — is never forked: Popen
vfork()s and execs the first. Where one of them is missing, a `preexec_fn` does the same
after a fork (slower, same result).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import grp
import os
import pwd
import resource
import secrets
import shutil
import signal
import socket
import struct
import time
from typing import Callable, Sequence

from glm5.rl.envs.sandbox_cgroup import PidsCgroup
from glm5.rl.envs.sandbox_stage import SessionMounts

#: (first, count) of the host uids a root trainer gives its sessions: above the ranges
#: distributions and container managers hand out (systemd's container ranges end at
#: 1878982655), below 2^31 (signed-uid trouble). Each session draws one at random; a uid that
#: has a passwd or group entry is skipped.
HOST_UID_RANGE = (1_879_048_192, 1 << 24)

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_PR_CAPBSET_DROP = 24
_SECCOMP_MODE_FILTER = 2


def is_root() -> bool:
    return os.geteuid() == 0


def session_ids(host_uid: int | None) -> tuple[int, int]:
    """The (uid, gid) a session's commands run as on the host (see the module docstring);
    `host_uid` is SandboxConfig.host_uid, already validated."""
    if not is_root():
        return os.getuid(), os.getgid()
    if host_uid is not None:
        return host_uid, host_uid
    first, count = HOST_UID_RANGE
    for _ in range(64):
        uid = first + secrets.randbelow(count)
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
            continue
        except KeyError:
            return uid, uid
    raise RuntimeError("no free uid in glm5's sandbox range after 64 draws")


@functools.lru_cache(maxsize=None)
def libc() -> ctypes.CDLL:
    """libc, loaded in the parent: dlopen after fork can deadlock on the loader's lock."""
    lib = ctypes.CDLL(None, use_errno=True)
    return lib


def programs() -> dict[str, str | None]:
    """The helper programs' paths (None: missing)."""
    return {p: shutil.which(p) for p in ("nsenter", "setpriv", "prlimit")}


def tasks_of(uid: int, skip_userns: str | None = None) -> int:
    """Tasks (processes and threads) whose real uid is `uid`, what RLIMIT_NPROC counts; those
    in the user namespace `skip_userns` (a /proc/<pid>/ns/user link) left out."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                real = threads = None
                for line in f:
                    if line.startswith(b"Uid:"):
                        real = int(line.split()[1])
                    elif line.startswith(b"Threads:"):
                        threads = int(line.split()[1])
                        break
            if real != uid or (skip_userns is not None
                               and os.readlink(f"/proc/{pid}/ns/user") == skip_userns):
                continue
        except (OSError, ValueError, IndexError):
            continue
        n += threads or 1
    return n


def kill_userns(ns_link: str, timeout: float = 5.0) -> int:
    """SIGKILL every process in the user namespace `ns_link` (a /proc/<pid>/ns/user link)
    until none is left; how many were found. What a rlimits-mode command left, wherever it
    went (a setsid() daemon included): the namespace is the command's alone."""
    killed = 0
    end = time.monotonic() + timeout
    while True:
        found = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{pid}/ns/user") != ns_link:
                    continue
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                if state in (b"Z", b"X"):  # dead already, waiting for its parent
                    continue
                os.kill(int(pid), signal.SIGKILL)
                found += 1
            except (OSError, ValueError, IndexError):
                continue
        killed += found
        if not found or time.monotonic() > end:
            return killed
        time.sleep(0.001)


def unshare_user_net() -> None:
    """In a child about to exec: a new user namespace mapping only its own uid and gid, and
    a network namespace with loopback up (rlimits mode, non-root: no host network)."""
    uid, gid = os.getuid(), os.getgid()
    if libc().unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare(CLONE_NEWUSER | CLONE_NEWNET): {os.strerror(e)}")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    loopback_up()


def loopback_up() -> None:
    """Bring `lo` up in this (new) network namespace, so that a command can still talk to
    itself on 127.0.0.1 (bwrap does the same)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
        req = fcntl.ioctl(s, siocgifflags, struct.pack("16sh14x", b"lo", 0))
        flags = struct.unpack("16sh14x", req)[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh14x", b"lo", flags | iff_up))


def setpriv_argv(setpriv: str, uid: int, gid: int) -> list[str]:
    """setpriv's argv prefix that becomes uid:gid with nothing left: no groups, no inheritable
    or bounding capabilities (the permitted ones go with the uid), no_new_privs."""
    return [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--"]


Rlimit = tuple[str, int, int, int]  # (prlimit option, resource, soft, hard)


def rlimits(cpu_seconds: int | None, memory_bytes: int | None, file_size_bytes: int | None,
            open_files: int | None, nproc: int | None) -> list[Rlimit]:
    """Every limit a command starts under; no core dumps ever (a dump of a crashed command
    lands in its work directory or in the host's crash handler)."""
    out: list[Rlimit] = [("core", resource.RLIMIT_CORE, 0, 0)]
    if cpu_seconds is not None:
        out.append(("cpu", resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1))
    for opt, rlim, value in (("as", resource.RLIMIT_AS, memory_bytes),
                             ("fsize", resource.RLIMIT_FSIZE, file_size_bytes),
                             ("nofile", resource.RLIMIT_NOFILE, open_files),
                             ("nproc", resource.RLIMIT_NPROC, nproc)):
        if value is not None:
            out.append((opt, rlim, value, value))
    return out


def launcher(mounts: SessionMounts | None, drop: tuple[int, int] | None,
             limits: Sequence[Rlimit], cgroup: PidsCgroup | None) -> list[str] | None:
    """The argv prefix that starts a bwrap command without forking this process: /bin/sh
    writes its own pid into the cgroup, nsenter enters the stage's namespaces, setpriv drops
    to `drop` (uid, gid), prlimit sets the limits, and each execs the next. None where a
    program it needs is missing (then `preexec` does the same)."""
    progs = programs()
    if progs["prlimit"] is None or (mounts is not None and progs["nsenter"] is None) or (
            drop is not None and progs["setpriv"] is None):
        return None
    prefix: list[str] = []
    if cgroup is not None:
        prefix = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup.procs_file]
    if mounts is not None:
        prefix += [progs["nsenter"], f"--mount=/proc/self/fd/{mounts.mnt_fd}"]  # type: ignore
        if mounts.user_fd is not None:
            prefix += [f"--user=/proc/self/fd/{mounts.user_fd}", "--preserve-credentials"]
        prefix.append("--")
    if drop is not None:
        prefix += setpriv_argv(progs["setpriv"], *drop)  # type: ignore[arg-type]
    return prefix + [progs["prlimit"],  # type: ignore[list-item]
                     *(f"--{opt}={soft}:{hard}" for opt, _, soft, hard in limits), "--"]


def preexec(*, cgroup: PidsCgroup | None, mounts: SessionMounts | None,
            drop: tuple[int, int] | None, limits: Sequence[Rlimit],
            before_drop: Callable[[], None] | None = None, chdir_fd: int | None = None,
            seccomp_prog: ctypes.Structure | None = None,
            report_userns_fd: int | None = None) -> Callable[[], None]:
    """What the child does between fork and exec, in this order: join the cgroup, enter the
    stage's namespaces, the rlimits, `before_drop` (e.g. leave the network; then the user
    namespace's link is written to `report_userns_fd`), drop to `drop`
    (bounding set emptied, groups cleared, gid and uid set: the permitted capabilities go
    with uid 0), fchdir to `chdir_fd`, no_new_privs, and the seccomp filter (`seccomp_prog`,
    a struct sock_fprog)."""
    lib = libc()
    setns, prctl = lib.setns, lib.prctl
    ns = []
    if mounts is not None:
        if mounts.user_fd is not None:
            ns.append((mounts.user_fd, _CLONE_NEWUSER))
        ns.append((mounts.mnt_fd, _CLONE_NEWNS))
    limit_values = [(rlim, (soft, hard)) for _, rlim, soft, hard in limits]
    prog_addr = ctypes.c_void_p(ctypes.addressof(seccomp_prog)) if seccomp_prog else None

    def fail(what: str) -> None:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")

    def child() -> None:
        if cgroup is not None:
            cgroup.join()
        for fd, nstype in ns:
            if setns(fd, nstype) != 0:
                fail("setns")
        # the limits before any new user namespace: it takes RLIMIT_NPROC as its own cap
        for rlim, value in limit_values:
            resource.setrlimit(rlim, value)
        if before_drop is not None:
            before_drop()
        if report_userns_fd is not None:  # which user namespace the command lives in
            os.write(report_userns_fd, os.readlink("/proc/self/ns/user").encode())
            os.close(report_userns_fd)
        if drop is not None:
            for cap in range(64):
                if prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:
                    fail("prctl(PR_CAPBSET_DROP)")  # EINVAL: past the kernel's last cap
            os.setgroups([])
            os.setresgid(drop[1], drop[1], drop[1])
            os.setresuid(drop[0], drop[0], drop[0])
        if chdir_fd is not None:
            os.fchdir(chdir_fd)
        if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            fail("prctl(PR_SET_NO_NEW_PRIVS)")
        if prog_addr is not None and prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, prog_addr,
                                           0, 0) != 0:
            fail("prctl(PR_SET_SECCOMP)")

    return child
