"""Run an episode's commands isolated: bubblewrap namespaces, an unprivileged host uid,
size-capped tmpfs mounts, rlimits, a pids cgroup and a seccomp filter.

`Sandbox(config)` is one session: a private work directory, in which `run(cmd)` executes
commands one at a time and returns a `SandboxResult` with the exit status, the captured output
(capped; truncation is stated in the result), the wall time and a `reason`:

    "ok"                 exit status 0
    "timeout"            the wall-clock limit was reached; every process of the command killed
    "cpu_limit"          RLIMIT_CPU (SIGXCPU, or the hard limit's SIGKILL)
    "memory_limit"       RLIMIT_AS: an allocation failed (MemoryError, ENOMEM, bad_alloc)
    "file_size_limit"    RLIMIT_FSIZE (SIGXFSZ, or EFBIG for a program that ignores it)
    "disk_limit"         the work directory or /tmp is full (their tmpfs caps: disk_bytes,
                         tmp_bytes, in bytes or in files), or ENOSPC / EDQUOT otherwise
    "seccomp"            a denied system call ended the command (seccomp_action="kill")
    "killed_signal:<n>"  another signal ended the command
    "error"              any other non-zero exit, or the command could not start

Two modes (`Sandbox.mode`; `Sandbox.capabilities()` and `sandbox_report()` say exactly what is
guaranteed, and docs/rl_envs.md has the table):

- "bwrap" where `bwrap` is on PATH and works (probed once per process). Commands run as an
  unprivileged host uid (never host root: `sandbox_launch`), uid 65534 inside a user
  namespace (or, as root where user namespaces are refused, the uid itself, dropped inside by
  setpriv), with no capabilities and no_new_privs; in new PID, network, IPC, UTS and cgroup
  namespaces; over a read-only system (/usr, /bin, /lib*, the parts of /etc programs need),
  every mount nosuid; the work directory at /work and /tmp are size-capped tmpfs mounts
  (`sandbox_stage`) that exist only in a mount namespace this process holds — never on the
  host's disk, freed by the kernel when the session closes or this process dies. /proc/sys and
  /proc/sysrq-trigger are host root's: read-only to the command's uid; /sys is absent.
- "rlimits" without bwrap: rlimits, a new session (no controlling terminal), no_new_privs, the
  seccomp filter (System V IPC denied too), a network namespace as root. The host's
  filesystem and processes stay visible to the command: NOT a security boundary. As root it
  refuses to start unless `SandboxConfig(unsafe_rlimits_as_root=True)`, and then drops to an
  unprivileged uid as bwrap mode does.

In both modes the number of processes is bounded by a pids cgroup where one is writable (v1 or
v2), else by RLIMIT_NPROC (per host uid: exact for a root trainer's per-session uid). When a
command ends, every process it started is killed (bwrap: the PID namespace dies with its init;
rlimits: the process group and the cgroup). Host-side file access (`read_file`, `write_file`,
`copy_in`, `list_dir`, `walk_files`) never follows a link, never writes through an existing
inode and refuses files with more than one link (`sandbox_fs`); `close()` never raises for
what a command left, and reports what it could not remove.

Only the standard library is used: libseccomp and openat2 through ctypes, bwrap and
util-linux's nsenter / setpriv / prlimit as programs. Nothing is probed at import time.
The parts: `sandbox_config` (the limits, the result and its reasons), `sandbox_probe` (what
this machine allows, the mode), `sandbox_bwrap` (bwrap's command line), `sandbox_stage` (the
tmpfs mounts), `sandbox_launch` (uids, rlimits, how a command starts), `sandbox_cgroup`,
`sandbox_seccomp`, `sandbox_supervise` (a running command: output, time limit, kill) and
`sandbox_fs` (host-side file access); this module is the session over them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

from glm5.rl.envs import sandbox_fs as fs
from glm5.rl.envs import sandbox_launch as launch
from glm5.rl.envs import sandbox_probe as probe
from glm5.rl.envs import sandbox_seccomp as seccomp
from glm5.rl.envs import sandbox_stage as stage
from glm5.rl.envs.sandbox_bwrap import (BASE_PATH, bwrap_argv, inner_prefix, python_binds,
                                        reachable_by_all, spawn)
from glm5.rl.envs.sandbox_cgroup import PidsCgroup, pids_cgroup_parent
from glm5.rl.envs.sandbox_config import (MODES, SANDBOX_UID, SANDBOX_VENV, SANDBOX_WORKDIR,
                                         SECCOMP_ACTIONS, SESSION_PREFIX, SandboxConfig,
                                         SandboxError, SandboxResult, bad_arg, classify)
from glm5.rl.envs.sandbox_supervise import supervise

__all__ = ["MODES", "SANDBOX_UID", "SANDBOX_VENV", "SANDBOX_WORKDIR", "SECCOMP_ACTIONS",
           "SESSION_PREFIX", "Sandbox", "SandboxConfig", "SandboxError", "SandboxResult",
           "log", "measure_overhead", "reset_probes", "sandbox_report", "sweep_sessions"]

log = logging.getLogger("glm5.rl.envs")


def _is_root() -> bool:
    return launch.is_root()


_WARNED: set[str] = set()
_SWEPT: set[tuple[int, str]] = set()


def reset_probes() -> None:
    """Forget the cached probes (bwrap, libseccomp, the seccomp filters, cgroups, network
    namespaces, openat2), the sweeps done and the warnings already logged, e.g. after
    installing bwrap in a running process."""
    for f in (probe.bwrap_probe, pids_cgroup_parent, probe.netns_probe, fs.openat2_available):
        getattr(f, "cache_clear", lambda: None)()  # (a test may have replaced one)
    seccomp.reset()
    _WARNED.clear()
    _SWEPT.clear()


def sweep_sessions(root_dir: str | os.PathLike[str]) -> list[str]:
    """Remove the session directories in `root_dir` of processes that are gone (a trainer
    killed mid-session), without recursion; returns what it removed and, "name: problem",
    what it could not. Runs once per process and directory on its own (Sandbox), or
    whenever called."""
    out = []
    try:
        dfd = os.open(root_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return out
    try:
        for name in stage.left_by_the_dead(root_dir, SESSION_PREFIX):
            problems = fs.remove_tree(dfd, name)
            out.extend(problems or [name])
    finally:
        os.close(dfd)
    if out:
        log.info("sandbox: swept %d leftovers of crashed sessions in %s", len(out), root_dir)
    return out


class Sandbox:
    """One isolated session: a private work directory and `run()` for its commands (one at a
    time; concurrent calls wait for each other). Use as a context manager or call `close()`,
    which removes the work directory (no process outlives its command: `capabilities()`
    "containment" says how).

    `mode` is "bwrap" or "rlimits"; `python` the running interpreter's path as commands see it
    (in bwrap mode with `python=False`, just "python3": whatever the system has);
    `host_uid` / `host_gid` the host ids commands run as. `workdir` is a host path to the work
    directory, valid while the session is open: in bwrap mode it lives in a tmpfs that only
    this process reaches, and the path goes through one of this process's descriptors
    (/proc/<pid>/fd/<n>). Move files in and out with `write_file`, `copy_in`, `read_file`,
    `list_dir`, `walk_files`: they give new files to the sandbox's uid and never follow what
    a command planted."""

    def __init__(self, config: SandboxConfig | None = None,
                 root_dir: str | os.PathLike[str] | None = None) -> None:
        if config is None:
            config = SandboxConfig()
        if not isinstance(config, SandboxConfig):
            raise bad_arg("Sandbox(config)", "a SandboxConfig", config)
        if root_dir is not None and not os.path.isdir(root_dir):
            raise bad_arg("Sandbox(root_dir)", "an existing directory or None", root_dir)
        self.config = config
        root = _is_root()
        if not root and config.host_uid not in (None, os.getuid()):
            raise bad_arg("SandboxConfig.host_uid", f"None or this process's own uid "
                       f"{os.getuid()} (only root can run commands as another uid)",
                       config.host_uid)
        self.mode, self._bwrap, self._mode_note = probe.choose_mode(config.mode)
        if self.mode == "rlimits" and root and not config.unsafe_rlimits_as_root:
            raise SandboxError(
                f"rlimits mode ({self._mode_note}) is not a security boundary (the host's "
                "files and processes stay visible to commands) and is refused as root: "
                "install bubblewrap (`apt-get install bubblewrap`) so that the bwrap mode "
                "works, or set SandboxConfig(unsafe_rlimits_as_root=True) to run commands "
                "this way anyway, as an unprivileged uid")
        self.host_uid, self.host_gid = launch.session_ids(config.host_uid)
        bw = self.mode == "bwrap"
        self._privilege = self._bwrap.privilege if bw and self._bwrap else ""
        # root drops to the session's uid before bwrap (userns) or before the command
        # (rlimits); with privilege "setpriv", setpriv drops inside bwrap
        self._drop = ((self.host_uid, self.host_gid)
                      if root and (not bw or self._privilege == "userns") else None)
        self._warnings: list[str] = []
        if not bw:
            self._warnings.append(
                f"rlimits mode ({self._mode_note}): no filesystem isolation, the host stays "
                "visible to commands (readable, and writable where the command's uid may "
                "write); no disk or /tmp quota")
            if root:
                self._warnings.append(
                    "rlimits mode as root (unsafe_rlimits_as_root=True): commands run as an "
                    "unprivileged uid of their own without capabilities, and see the whole "
                    "host")
            if config.ro_binds:
                raise bad_arg("SandboxConfig.ro_binds", "no binds in rlimits mode (it shows the "
                           "whole host filesystem)", config.ro_binds)

        # seccomp (System V IPC too where the host's IPC namespace is shared)
        self._seccomp: seccomp.SeccompFilter | None = None
        self._seccomp_error = "turned off (SandboxConfig.seccomp=False)"
        if config.seccomp:
            filt = seccomp.seccomp_filter(config.seccomp_action, not bw)
            if isinstance(filt, str):
                self._seccomp_error = filt
                self._warnings.append(f"no seccomp filter: {filt}")
            else:
                self._seccomp, self._seccomp_error = filt, ""
        self._fprog_buf = self._fprog = None
        if self._seccomp is not None and not bw:
            self._fprog_buf = ctypes.create_string_buffer(self._seccomp.bpf,
                                                          len(self._seccomp.bpf))
            self._fprog = seccomp.SockFprog(len(self._seccomp.bpf) // 8,
                                            ctypes.addressof(self._fprog_buf))

        # network
        self._netns = False
        if not config.network:
            if bw:
                self._netns = True
            else:
                why = probe.netns_probe()
                self._netns = why == ""
                if why:
                    self._warnings.append(f"network not isolated: {why}")

        # interpreter (without python=True, bwrap shows the system's python3 only)
        py_binds: list[tuple[str, str]] = []
        py_bindir = os.path.dirname(sys.executable)
        self.python = sys.executable
        if bw:
            if config.python:
                py_binds, self.python, py_bindir = python_binds()
            else:
                self.python = "python3"
        elif self._drop is not None and config.python and not reachable_by_all(
                sys.executable):
            self._warnings.append(
                f"rlimits mode as root: the interpreter {os.path.realpath(sys.executable)} "
                "is not reachable by other users (a directory on its path is closed to "
                "them), so the commands' uid cannot run it")

        # the process limit: a pids cgroup per command (bwrap's init, once the command is
        # done, lingers as an orphan until the host's init reaps it; in a cgroup shared by
        # the session's commands its charge would pile up), else RLIMIT_NPROC of the host uid
        self._cgroup_parent = None
        self._nproc_rlimit = False
        if config.max_processes is not None:
            parent = pids_cgroup_parent()
            if parent.path is not None:
                self._cgroup_parent = parent
            else:
                self._nproc_rlimit = True
        # Processes of ours that count against the limit: bwrap's monitor and init (as the
        # session's uid only when bwrap is started as it).
        self._helpers = 2 if bw else 0
        self._nproc_helpers = 2 if bw and self._privilege == "userns" else 0

        # leftovers of crashed sessions, once per process and directory
        base = os.path.realpath(root_dir if root_dir is not None else tempfile.gettempdir())
        if (os.getpid(), base) not in _SWEPT:
            _SWEPT.add((os.getpid(), base))
            sweep_sessions(base)

        # the work directory
        self._mounts: stage.SessionMounts | None = None
        if bw:
            binds = [*py_binds, *config.ro_binds]
            try:
                self._mounts = stage.stage(userns=not root).add(
                    self.host_uid, self.host_gid, config.disk_bytes, config.tmp_bytes,
                    [src for src, _ in binds],
                    "0711" if self._privilege == "setpriv" else "0700")
            except stage.StageError as e:
                raise SandboxError(f"Sandbox: {e}") from e
            self._root_fd = self._mounts.work_fd
            self.workdir = Path(f"/proc/{os.getpid()}/fd/{self._root_fd}")
            self._finalizer = weakref.finalize(self, _release_mounts, self._mounts)
            self._bwrap_args = bwrap_argv(
                self._bwrap.path or "bwrap", self._privilege, self._mounts, config.network,
                list(zip(self._mounts.binds, (dst for _, dst in binds))))
            self._inner = inner_prefix(self._privilege, self.host_uid, self.host_gid)
        else:
            if root and not stage.traversable_by_all(base):
                raise bad_arg("Sandbox(root_dir)", f"a directory every user can traverse (the "
                           f"commands' uid {self.host_uid} must reach its work directory)",
                           base)
            session = Path(tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{stage.owner_tag()}-",
                                            dir=base))
            self.workdir = session / "work"
            self.workdir.mkdir(mode=0o700)
            if root:  # the uid may enter, but not rename its work directory
                os.chmod(session, 0o711)
                os.chown(self.workdir, self.host_uid, self.host_gid)
            self._root_fd = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                    | os.O_CLOEXEC)
            self._finalizer = weakref.finalize(self, _remove_session, self._root_fd,
                                               str(session))
            self._bwrap_args, self._inner = [], []

        env = {"PATH": f"{py_bindir}:{BASE_PATH}" if config.python else BASE_PATH,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        if bw:
            env.update(HOME=SANDBOX_WORKDIR, TMPDIR="/tmp", USER="nobody")
        else:
            env.update(HOME=str(self.workdir), TMPDIR=str(self.workdir))
        env.update(config.env)
        self._env = env
        self._lock = threading.Lock()
        self._fd_lock = threading.RLock()
        self._closed = False
        self.cleanup_problems: list[str] = []
        for w in self._warnings:
            if w not in _WARNED:  # once per process: an RL run opens thousands of sessions
                _WARNED.add(w)
                log.warning("sandbox: %s", w)

    # ------------------------------------------------------------------------------- set-up
    def _rlimits(self) -> list[launch.Rlimit]:
        """(prlimit option, resource, soft, hard) of every limit a command starts under."""
        c = self.config
        nproc = None
        if self._nproc_rlimit and c.max_processes is not None:
            # RLIMIT_NPROC counts the uid's tasks where the command's user namespaces meet
            # the others: on the host (root; rlimits mode), or in the stage's user namespace
            # (a non-root bwrap: the other sessions' commands). What runs there already is
            # added to the command's allowance (nothing, for a root trainer's own uid).
            skip = None
            if self.mode == "bwrap" and not _is_root():
                skip = os.readlink("/proc/self/ns/user")
            nproc = (c.max_processes + self._nproc_helpers
                     + launch.tasks_of(self.host_uid, skip))
        return launch.rlimits(c.cpu_seconds, c.memory_bytes, c.file_size_bytes, c.open_files,
                              nproc)

    def _launcher(self, cgroup: PidsCgroup | None) -> list[str] | None:
        """The argv prefix that starts a bwrap command without forking this process
        (`sandbox_launch.launcher`); None in rlimits mode, or where a program it needs is
        missing: then a preexec_fn does the same."""
        if self.mode != "bwrap":
            return None
        return launch.launcher(self._mounts, self._drop, self._rlimits(), cgroup)

    # -------------------------------------------------------------------------------- report
    def capabilities(self) -> dict[str, Any]:
        """What this session guarantees: the mode, the uids, each isolation (True/False), each
        limit's mechanism (None: not enforced or turned off), the seccomp filter, what this
        mode does not guarantee ("gaps") and warnings."""
        c = self.config
        bw = self.mode == "bwrap"
        procs = None
        if c.max_processes is not None:
            if self._cgroup_parent is not None:
                procs = f"cgroup v{self._cgroup_parent.version} pids.max"
            elif self._nproc_rlimit:
                procs = ("RLIMIT_NPROC of the session's own uid" if _is_root() else
                         "RLIMIT_NPROC (counts all of the user's processes)")

        def tmpfs(size: int | None) -> str | None:
            if not bw:
                return None
            if size is None:
                return "tmpfs, the kernel's default size (half of RAM)"
            return f"tmpfs size={size} nr_inodes={size // stage.BYTES_PER_INODE} (kernel)"

        userns = bool(bw and self._bwrap and self._bwrap.userns)
        gaps = []
        if bw:
            gaps.append("the interpreter and ro_binds are shown whatever their host "
                        "directories' permissions (their own files' permissions hold)")
            if not _is_root():
                gaps.append("commands run as this process's own uid (mapped to 65534): "
                            "whatever is bound is theirs to read")
        else:
            gaps += ["the host's files are readable by the command's uid, and writable where "
                     "it may write" + ("" if _is_root() else " (all of this user's files)"),
                     "host processes are listed, with their command lines"]
            if _is_root():
                pass  # a uid of its own: no host process shares it
            elif self._netns:  # in a user namespace of its own: no ptrace-class access
                gaps.append("host processes of this user can be signalled")
            else:
                gaps.append("host processes of this user are reachable (/proc/<pid>/environ, "
                            "fd, mem; signals)")
            gaps += ["path unix sockets on the host are reachable where their permissions "
                     "allow",
                     "no disk or /tmp quota (RLIMIT_FSIZE per file only)"]
            if not self._netns:
                gaps.append("the host's network")
        return {
            "mode": self.mode,
            "mode_note": self._mode_note,
            "root": _is_root(),
            "bwrap": self._bwrap.path if bw and self._bwrap else None,
            "user_namespace": userns,
            "privilege": self._privilege or ("setpriv (preexec)" if self._drop else None),
            "host_uid": self.host_uid,
            "host_gid": self.host_gid,
            "runs_as_host_root": self.host_uid == 0,
            "uid_inside": SANDBOX_UID if userns else self.host_uid,
            "capabilities": "none (effective, permitted, inheritable, ambient and bounding "
                            "sets empty)" if (bw or self._drop) else "none (a non-root uid)",
            "no_new_privs": True,
            "network_isolated": self._netns,
            "filesystem_isolated": bw,
            "sessions_isolated": bw,
            "pid_namespace": bw,
            "ipc": ("own IPC namespace" if bw else "System V IPC denied by seccomp"
                    if self._seccomp is not None else "the host's (no seccomp filter)"),
            "mounts": ("system read-only; every mount nosuid, nodev but /dev's device nodes"
                       if bw else "the host's, as they are"),
            "proc_sys": ("read-only: host root's, and the command's uid is not root" if bw
                         else "the host's; not writable by the command's non-root uid"),
            "sys": "absent" if bw else "the host's",
            "controlling_terminal": "none (new session); ioctl TIOCSTI / TIOCLINUX denied"
                                    if self._seccomp is not None else "none (new session)",
            "work_dir": ("a tmpfs in a mount namespace only this process holds (never on the "
                         "host's disk; freed with the session or this process)" if bw else
                         f"a host directory ({self.workdir})"),
            "file_io": ("openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS "
                        "| RESOLVE_NO_XDEV)" if fs.openat2_available() else
                        "a walk with O_NOFOLLOW and a device check per component")
            + "; one-link regular files only; writes replace, never write through",
            "cleanup": ("the session's mounts are detached whole" if bw else
                        "an iterative removal; crashed sessions' directories are swept by "
                        "the next Sandbox in the same directory"),
            "containment": ("pid namespace" if bw else "cgroup" if self._cgroup_parent
                            else "the command's own user namespace" if self._own_userns()
                            else "process group (a process that calls setsid() escapes)"),
            "limits": {
                "cpu_seconds": "RLIMIT_CPU" if c.cpu_seconds is not None else None,
                "memory_bytes": "RLIMIT_AS" if c.memory_bytes is not None else None,
                "file_size_bytes": "RLIMIT_FSIZE" if c.file_size_bytes is not None else None,
                "open_files": "RLIMIT_NOFILE" if c.open_files is not None else None,
                "max_processes": procs,
                "disk_bytes": tmpfs(c.disk_bytes),
                "tmp_bytes": tmpfs(c.tmp_bytes),
                "wall_seconds": ("SIGKILL to bwrap (the PID namespace dies)" if bw else
                                 "SIGKILL to the process group")
                + (" and the cgroup" if self._cgroup_parent is not None else ""),
            },
            # RAM the session's tmpfs mounts may hold, beyond its processes' memory
            "tmpfs_ram_bytes": ((c.disk_bytes or 0) + (c.tmp_bytes or 0)
                                if bw and c.disk_bytes and c.tmp_bytes else None),
            "seccomp": self._seccomp is not None,
            "seccomp_action": c.seccomp_action if self._seccomp is not None else None,
            "seccomp_denied": list(self._seccomp.denied) if self._seccomp else [],
            "seccomp_error": self._seccomp_error or None,
            "gaps": gaps,
            "warnings": list(self._warnings),
        }

    # ----------------------------------------------------------------------------------- run
    def _argv(self, cmd: Sequence[str] | str) -> tuple[list[str], bool]:
        if isinstance(cmd, str):
            if not cmd.strip():
                raise bad_arg("Sandbox.run(cmd)", "a non-empty command", cmd)
            return ["/bin/sh", "-c", cmd], True
        if (isinstance(cmd, (bytes, bytearray)) or not isinstance(cmd, Sequence) or not cmd
                or not all(isinstance(a, str) for a in cmd)):
            raise bad_arg("Sandbox.run(cmd)", "a shell string or a non-empty list of str", cmd)
        return list(cmd), False

    def run(self, cmd: Sequence[str] | str, stdin: str | bytes | None = None,
            timeout: float | None = None) -> SandboxResult:
        """Run `cmd` (an argv list, or a string for /bin/sh -c) in the session's work
        directory and return its `SandboxResult`; `stdin` is fed to it (else /dev/null);
        `timeout` overrides `config.wall_seconds`."""
        argv, shell = self._argv(cmd)
        if stdin is not None and not isinstance(stdin, (str, bytes)):
            raise bad_arg("Sandbox.run(stdin)", "str, bytes or None", stdin)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        if timeout is None:
            timeout = self.config.wall_seconds
        elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise bad_arg("Sandbox.run(timeout)", "a number of seconds > 0 or None", timeout)
        with self._lock:
            if self._closed:
                raise RuntimeError("Sandbox.run: the sandbox is closed")
            return self._run_locked(argv, shell, data, float(timeout))

    def _own_userns(self) -> bool:
        """Whether each rlimits-mode command gets a user namespace of its own (non-root,
        where user namespaces work): then its processes are found by it at its end."""
        return self.mode == "rlimits" and self._netns and not _is_root()

    def _start(self, argv: list[str], cgroup: PidsCgroup | None, stdin: bool,
               pass_fds: tuple[int, ...]) -> tuple[subprocess.Popen[bytes], str | None]:
        """The started command and, where it has a user namespace of its own, its link."""
        popen: dict[str, Any] = dict(
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=self._env, start_new_session=True, pass_fds=pass_fds)
        if self.mode == "bwrap":
            return spawn(argv, self._mounts, self._drop, self._rlimits(), cgroup,
                          **popen), None
        rd = wr = None
        if self._own_userns():
            rd, wr = os.pipe()
        try:
            proc = subprocess.Popen(argv, preexec_fn=launch.preexec(
                cgroup=cgroup, mounts=None, drop=self._drop, limits=self._rlimits(),
                before_drop=(None if not self._netns else probe.unshare_net if _is_root()
                             else launch.unshare_user_net),
                chdir_fd=self._root_fd, seccomp_prog=self._fprog, report_userns_fd=wr),
                **popen)
        finally:
            if wr is not None:
                os.close(wr)
        ns = None
        if rd is not None:
            try:
                ns = os.read(rd, 256).decode() or None
            finally:
                os.close(rd)
        return proc, ns

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
            full += ["--", *self._inner, *argv]
        full_before = self._disk_full()
        t0 = time.perf_counter()
        cgroup = None
        try:
            if self._cgroup_parent is not None:
                assert self._cgroup_parent.path is not None and c.max_processes is not None
                cgroup = PidsCgroup(self._cgroup_parent.path, c.max_processes + self._helpers)
            try:
                proc, userns = self._start(full, cgroup, data is not None, pass_fds)
            except (OSError, subprocess.SubprocessError) as e:
                code = 127 if isinstance(e, FileNotFoundError) else 126
                return SandboxResult(code, "", str(e), time.perf_counter() - t0, "error",
                                     detail=f"could not start the command: {e}")
            finally:
                if seccomp_fd is not None:
                    os.close(seccomp_fd)
            reap = (lambda: launch.kill_userns(userns)) if userns else None
            out, err, timed_out, status, rusage = supervise(proc, data, timeout,
                                                            c.output_bytes, cgroup, reap)
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
        # a cap reached by this command (one full before it started is no news)
        full_now = self._disk_full()
        reason, detail = classify(timed_out=timed_out, rc=rc, sig=sig, cpu_s=cpu_s,
                                   stderr=stderr, config=c, timeout=timeout,
                                   bwrap=self.mode == "bwrap",
                                   disk_full=full_now if full_now != full_before else None)
        if forks_refused:
            detail += f"; the process limit ({c.max_processes}) refused {forks_refused} forks"
        return SandboxResult(
            returncode=-sig if sig is not None else rc, stdout=out.text(), stderr=stderr,
            wall_s=wall, reason=reason, detail=detail, signal=sig, cpu_s=cpu_s,
            stdout_bytes=out.total, stderr_bytes=err.total, stdout_truncated=out.truncated,
            stderr_truncated=err.truncated, forks_refused=forks_refused)

    def _disk_full(self) -> str | None:
        """Which capped tmpfs is full (no block or no inode left), if any."""
        if self._mounts is None:
            return None
        for what, fd, cap in (("the work directory", self._mounts.work_fd,
                               self.config.disk_bytes),
                              ("/tmp", self._mounts.tmp_fd, self.config.tmp_bytes)):
            v = os.fstatvfs(fd)
            if v.f_bavail == 0 or (v.f_files and v.f_favail == 0):
                return f"{what} is full ({'the kernel default' if cap is None else cap} " \
                       "bytes" + (", every inode used" if v.f_favail == 0 else "") + ")"
        return None

    # ---------------------------------------------------------------------------- files
    def _fd(self, what: str) -> int:
        if self._closed:
            raise RuntimeError(f"Sandbox.{what}: the sandbox is closed")
        return self._root_fd

    def write_file(self, relpath: str | os.PathLike[str], data: str | bytes) -> None:
        """Write a file into the work directory (parents created), e.g. a task's sources. The
        file is created anew and renamed into place (an existing link is replaced, never
        written through) and belongs to the commands' uid; an existing file's mode is kept."""
        if not isinstance(data, (str, bytes)):
            raise bad_arg("Sandbox.write_file(data)", "str or bytes", type(data).__name__)
        with self._fd_lock:
            fs.write_file(self._fd("write_file"), relpath,
                          data.encode() if isinstance(data, str) else data,
                          (self.host_uid, self.host_gid))

    def read_file(self, relpath: str | os.PathLike[str], limit: int = 16 << 20) -> bytes:
        """Read a regular file a command left in the work directory (no links followed, one
        link only, at most `limit` bytes: a ValueError beyond)."""
        with self._fd_lock:
            return fs.read_file(self._fd("read_file"), relpath, limit)

    def list_dir(self, relpath: str | os.PathLike[str] = "") -> list[str]:
        """The sorted names in a directory of the work directory ("" for its top); no link is
        followed."""
        with self._fd_lock:
            return fs.list_dir(self._fd("list_dir"), relpath)

    def walk_files(self, skip_dirs: Sequence[str] = (), max_entries: int = 100_000
                   ) -> list[str]:
        """Relative paths of the work directory's regular files (links and special files
        are not followed nor listed; directories named in `skip_dirs` are not entered; at
        most `max_entries` entries are looked at)."""
        with self._fd_lock:
            return list(fs.walk_files(self._fd("walk_files"), frozenset(skip_dirs),
                                      max_entries))

    def copy_in(self, src: str | os.PathLike[str], dest: str | os.PathLike[str],
                ignore: Sequence[str] = ()) -> int:
        """Copy a host file or directory tree into the work directory at `dest` (names in
        `ignore` skipped; symbolic links copied as links); returns the bytes copied. Over
        `disk_bytes` it raises OSError (ENOSPC)."""
        if not os.path.exists(src):
            raise bad_arg("Sandbox.copy_in(src)", "an existing host path", os.fspath(src))
        with self._fd_lock:
            return fs.copy_in(self._fd("copy_in"), src, dest, (self.host_uid, self.host_gid),
                              frozenset(ignore))

    # --------------------------------------------------------------------------- lifetime
    def close(self) -> list[str]:
        """Remove the work directory (waits for a running command; a command's processes
        never outlive it: see `capabilities()["containment"]`). Never raises for what a
        command left: returns (and keeps in `cleanup_problems`, and logs) what could not be
        removed, [] when everything went."""
        with self._lock, self._fd_lock:
            self._closed = True
            problems = self._finalizer() or []
        if problems:
            self.cleanup_problems = problems
            log.warning("sandbox: close() could not remove %d entries: %s", len(problems),
                        "; ".join(problems[:5]))
        return problems

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sandbox(mode={self.mode!r}, workdir={str(self.workdir)!r})"


def _release_mounts(mounts: stage.SessionMounts) -> list[str]:
    mounts.release()
    return []


def _remove_session(root_fd: int, session_dir: str) -> list[str]:
    """Close the work directory's descriptor and remove the session directory."""
    os.close(root_fd)
    parent, name = os.path.split(session_dir)
    try:
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return [f"{parent}: {e.strerror}"]
    try:
        return fs.remove_tree(dfd, name, label=session_dir)
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------------- reporting
def sandbox_report() -> dict[str, Any]:
    """What a default sandbox would guarantee on this machine, and why anything is missing
    (for `glm5 doctor`): bwrap, libseccomp, the pids cgroup, network namespaces, and whether
    rlimits mode would be refused (root without the opt-in)."""
    bw = probe.bwrap_probe()
    cg = pids_cgroup_parent()
    lib, lib_error = seccomp.libseccomp()
    # the report describes the mode even where a default config would refuse to run it
    with Sandbox(SandboxConfig(unsafe_rlimits_as_root=True)) as sb:
        caps = sb.capabilities()
    refused = caps["mode"] == "rlimits" and _is_root()
    warnings = [w for w in caps["warnings"] if not w.startswith("rlimits mode as root")]
    if refused:
        warnings.append("rlimits mode as root is refused: commands will not run unless "
                        "SandboxConfig(unsafe_rlimits_as_root=True)")
    return {
        "mode": caps["mode"],
        "refused_as_root": refused,
        "bwrap": {"path": bw.path, "works": bw.works, "user_namespace": bw.userns,
                  "privilege": bw.privilege or None, "version": bw.version or None,
                  "problem": bw.reason or None},
        "libseccomp": {"loaded": lib is not None, "version": seccomp.libseccomp_version(),
                       "problem": lib_error or None},
        "pids_cgroup": {"path": str(cg.path) if cg.path else None,
                        "version": cg.version or None, "problem": cg.reason or None},
        "openat2": fs.openat2_available(),
        "root": _is_root(),
        "enforced": caps,
        "warnings": warnings,
    }


def measure_overhead(runs: int = 20, config: SandboxConfig | None = None) -> dict[str, float]:
    """Median wall time (ms) of `true` run directly by subprocess and through a sandbox in
    each mode that works here, and each mode's overhead over the direct run; `session_*`:
    the median time to open and close a session."""
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise bad_arg("measure_overhead(runs)", "an int >= 1", runs)
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
    modes = ["rlimits"] + (["bwrap"] if probe.bwrap_probe().works else [])
    for mode in modes:
        # `true` harms nothing: rlimits mode's root opt-in is given for the measurement
        cfg = dataclasses.replace(config, mode=mode, unsafe_rlimits_as_root=True)
        with Sandbox(cfg) as sb:
            def one() -> None:
                r = sb.run([true])
                if not r.ok:
                    raise SandboxError(f"measure_overhead: `true` failed in {mode} mode: "
                                       f"{r.detail}: {r.stderr[:200]}")
            out[f"{mode}_ms"] = median_ms(one)
        out[f"{mode}_overhead_ms"] = out[f"{mode}_ms"] - out["direct_ms"]
        out[f"{mode}_session_ms"] = median_ms(lambda: Sandbox(cfg).close())
    return out


if __name__ == "__main__":  # python -m glm5.rl.envs.sandbox: the report and the overhead
    import json

    print(json.dumps(sandbox_report(), indent=2))
    print(json.dumps({k: round(v, 2) for k, v in measure_overhead().items()}, indent=2))
