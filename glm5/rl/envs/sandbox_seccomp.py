"""The sandbox's seccomp filter: a deny list built with libseccomp (through ctypes) and exported
as classic BPF, which `bwrap --seccomp FD` and `prctl(PR_SET_SECCOMP)` take.

Denied in every mode: debugging other processes, mounts and namespaces, the kernel's own
controls, file handles, io_uring, host-wide clock and names (`DENIED_SYSCALLS`); clone() with a
namespace flag (clone3(), whose flags a filter cannot read, answers ENOSYS so that the C library
falls back to clone()); ioctl TIOCSTI and TIOCLINUX (typing into a terminal). Where the command
shares the host's IPC namespace (rlimits mode), System V IPC too (`SYSV_IPC_SYSCALLS`): the
host's shared memory segments, semaphores and message queues are out of reach.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import os
import platform
import tempfile
from typing import Sequence

#: System calls the filter denies. Names the running libseccomp does not know, and calls this
#: architecture does not have, are skipped (`Sandbox.capabilities()["seccomp_denied"]` lists
#: what is in force).
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

#: System V IPC: denied where the command shares the host's IPC namespace (rlimits mode).
SYSV_IPC_SYSCALLS: tuple[str, ...] = (
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl", "ipc")

#: ioctl requests denied on any descriptor: pushing input into a terminal (TIOCSTI) and the
#: console's selection / paste (TIOCLINUX).
DENIED_IOCTLS: tuple[tuple[str, int], ...] = (("TIOCSTI", 0x5412), ("TIOCLINUX", 0x541C))

_CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000, 0x00000080)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID,
#                                              NEWNET, NEWTIME

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_KILL_PROCESS = 0x80000000
_SCMP_CMP_MASKED_EQ = 7
_NR_SCMP_ERROR = -1

#: The shared object loaded (a test points it at a missing library).
LIBSECCOMP = "libseccomp.so.2"


def _scmp_act_errno(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)


class _ScmpArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class _ScmpVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    """struct sock_fprog, what PR_SET_SECCOMP takes."""
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


@dataclasses.dataclass(frozen=True)
class SeccompFilter:
    """A built filter: its BPF program, what it denies and the names it had to skip."""
    bpf: bytes
    denied: tuple[str, ...]
    skipped: tuple[str, ...]


@functools.lru_cache(maxsize=None)
def libseccomp() -> tuple[ctypes.CDLL | None, str]:
    """(libseccomp, "") or (None, why it could not be loaded)."""
    try:
        lib = ctypes.CDLL(LIBSECCOMP, use_errno=True)
    except OSError as e:
        return None, f"libseccomp could not be loaded ({LIBSECCOMP}): {e}"
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
        return None, f"{LIBSECCOMP} lacks a function glm5 needs: {e}"
    return lib, ""


def libseccomp_version() -> str | None:
    lib, _ = libseccomp()
    if lib is None:
        return None
    v = lib.seccomp_version().contents
    return f"{v.major}.{v.minor}.{v.micro}"


@functools.lru_cache(maxsize=None)
def seccomp_filter(action: str, sysv_ipc: bool = False) -> SeccompFilter | str:
    """The deny-list filter as classic BPF, or why it cannot be built. `action`: "errno" (a
    denied call fails with EPERM) or "kill"; `sysv_ipc`: deny System V IPC too."""
    lib, why = libseccomp()
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

        for name in DENIED_SYSCALLS + (SYSV_IPC_SYSCALLS if sysv_ipc else ()):
            (denied if add(deny, name) else skipped).append(name)
        # clone()'s flags are its first argument (the second on s390).
        flags_arg = 1 if platform.machine().startswith("s390") else 0
        for flag in _CLONE_NS_FLAGS:
            add(deny, "clone", [_ScmpArgCmp(flags_arg, _SCMP_CMP_MASKED_EQ, flag, flag)])
        denied.append("clone(namespace flags)")
        if add(_scmp_act_errno(errno.ENOSYS), "clone3"):
            denied.append("clone3 (ENOSYS)")
        for name, request in DENIED_IOCTLS:
            # the request is an unsigned int: compare its low 32 bits only
            add(deny, "ioctl", [_ScmpArgCmp(1, _SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, request)])
            denied.append(f"ioctl({name})")
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
    return SeccompFilter(bpf, tuple(denied), tuple(skipped))


def reset() -> None:
    """Forget the loaded library and the built filters."""
    libseccomp.cache_clear()
    seccomp_filter.cache_clear()
