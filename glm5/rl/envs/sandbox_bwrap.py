"""How a sandboxed command is laid out under bubblewrap: bwrap's options (the read-only system,
the session's tmpfs mounts, the binds), setpriv's drop inside where bwrap runs as root, the
running interpreter's binds, and the start of the command through the launcher programs."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from glm5.rl.envs import sandbox_launch as launch
from glm5.rl.envs import sandbox_stage as stage
from glm5.rl.envs.sandbox_cgroup import PidsCgroup
from glm5.rl.envs.sandbox_config import SANDBOX_UID, SANDBOX_VENV, SANDBOX_WORKDIR, SandboxError

# /etc entries programs need (name service, dynamic linker, time zone, TLS roots, Debian's
# alternatives and Python's config); shadow files, keys and the host's own config stay out.
_ETC_ENTRIES = (
    "passwd", "group", "nsswitch.conf", "host.conf", "hosts", "gai.conf", "ld.so.cache",
    "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "ssl", "ca-certificates",
    "ca-certificates.conf", "pki", "alternatives", "mime.types", "os-release",
    "debian_version", "protocols", "services", "locale.alias", "bash.bashrc", "profile",
    "inputrc", "magic", "magic.mime", "python3*")
_ETC_WITH_NETWORK = ("resolv.conf",)

#: The capabilities bwrap keeps (as root, without a user namespace) for setpriv to drop to
#: the session's uid inside; setpriv then empties every set.
_SETPRIV_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")


def system_binds(network: bool) -> list[str]:
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


def bwrap_argv(bwrap: str, privilege: str, mounts: stage.SessionMounts, network: bool,
               binds: Sequence[tuple[str, str]]) -> list[str]:
    """bwrap's options for a session (the command and `--seccomp` follow). `binds`: (path in
    the stage, path inside) read-only binds."""
    # bwrap's own init stays PID 1 (it reaps orphans, and the command keeps ordinary
    # signal semantics: the kernel spares a namespace's init SIGXCPU, SIGXFSZ, SIGPIPE).
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--hostname", "glm5-sandbox"]
    if privilege == "userns":
        args += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    else:
        args += ["--cap-drop", "ALL"]
        for cap in _SETPRIV_CAPS:
            args += ["--cap-add", cap]
    if not network:
        args.append("--unshare-net")
    # /etc holds the system binds' files: world-traversable (bwrap as root makes the
    # directories it needs 0700, closed to the uid setpriv drops to)
    args += ["--perms", "0755", "--dir", "/etc", *system_binds(network)]
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", mounts.work, SANDBOX_WORKDIR,
             "--bind", mounts.tmp, "/tmp"]
    # the binds' parent directories, made world-traversable (a bwrap running as root would
    # make them 0700: the dropped uid could not reach the interpreter)
    parents: list[str] = []
    for _, dst in binds:
        for p in reversed(Path(dst).parents[:-1]):
            if str(p) not in parents:
                parents.append(str(p))
    for p in parents:
        args += ["--perms", "0755", "--dir", p]
    for src, dst in binds:
        args += ["--ro-bind", src, dst]
    return args + ["--chdir", SANDBOX_WORKDIR, "--remount-ro", "/"]


def inner_prefix(privilege: str, uid: int, gid: int) -> list[str]:
    """What runs inside bwrap before the command: setpriv's drop, where bwrap ran as root."""
    if privilege != "setpriv":
        return []
    setpriv = launch.programs()["setpriv"]
    if setpriv is None:
        raise SandboxError("bwrap as root without a user namespace needs setpriv "
                           "(util-linux) to drop to an unprivileged uid")
    return launch.setpriv_argv(setpriv, uid, gid)


def spawn(argv: list[str], mounts: stage.SessionMounts | None, drop: tuple[int, int] | None,
          limits: Sequence[launch.Rlimit], cgroup: PidsCgroup | None,
          **popen: Any) -> subprocess.Popen[bytes]:
    """Start a bwrap command through the launcher programs, else through preexec_fn."""
    prefix = launcher = launch.launcher(mounts, drop, limits, cgroup)
    pre = None
    if launcher is None:
        prefix = []
        pre = launch.preexec(cgroup=cgroup, mounts=mounts, drop=drop, limits=limits)
    fds = tuple(popen.pop("pass_fds", ())) + (mounts.fds() if mounts is not None else ())
    return subprocess.Popen([*prefix, *argv], preexec_fn=pre, pass_fds=fds, **popen)


# ----------------------------------------------------------------------------------- the sandbox
def python_binds() -> tuple[list[tuple[str, str]], str, str]:
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


BASE_PATH = "/usr/local/bin:/usr/bin:/bin"


def reachable_by_all(executable: str) -> bool:
    """Whether any user may run `executable`: every directory on its real path (and on the
    path of the installation it belongs to) lets others through, and the file lets them
    read and execute it."""
    real = os.path.realpath(executable)
    try:
        mode = os.stat(real).st_mode
    except OSError:
        return False
    return (mode & 0o005 == 0o005 and stage.traversable_by_all(os.path.dirname(real))
            and stage.traversable_by_all(os.path.realpath(sys.prefix)))
