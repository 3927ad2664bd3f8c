"""The bwrap sandbox's mounts: each session's work directory and /tmp as size-capped tmpfs
mounts in a private mount namespace that only this process can enter.

One helper process per trainer process (the *stage*) holds a mount namespace of its own: a
copy of the host's, as a slave (host mounts made later still show up in it, nothing goes
back), with a small tmpfs mounted over an empty directory (`<tmp>/.glm5-stage-...`). For each
session it mounts there:

    <stage>/<sid>/work   tmpfs size=disk_bytes, nr_inodes=disk_bytes/1 KiB, mode 0700,
                         owned by the session's host uid, nosuid, nodev
    <stage>/<sid>/tmp    tmpfs size=tmp_bytes, the same for /tmp
    <stage>/<sid>/b<i>   a read-only, nosuid, nodev bind of each host path the session shows
                         (the interpreter, `ro_binds`): the stage opens it with the trainer's
                         permissions, so the sandbox's unprivileged uid never has to traverse
                         the host path's directories (a venv under /root, 0700)

Commands enter that namespace (`nsenter --mount`, as root; `--user --mount` for a non-root
trainer, whose stage needs a user namespace to mount) and start bwrap there. The host reaches a
session's files through a directory descriptor opened on its work mount.

Nothing of it is on the host's disk or in the host's mount table. The kernel frees it all when
the last reference goes: the stage exits when this process's end of its pipe closes — also when
this process is SIGKILLed — and each session holds descriptors on the namespace, which it
closes in `release()`. So a crash leaves no mounted tmpfs behind, and a deep tree a command
built costs nothing to remove: the mount is detached whole.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import secrets
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

#: Inodes per byte of a tmpfs cap: one inode per KiB, so that a tree of empty files (which
#: takes no data pages) costs the kernel at most about the cap again in inode memory.
BYTES_PER_INODE = 1024
_STAGE_PREFIX = ".glm5-stage-"

# The stage process. Runs as `python -I -S -c SRC SPEC`: only the standard library, no site.
# Replies one JSON line per request on stdout; exits at EOF on stdin.
_STAGE_SRC = r'''
import ctypes, json, os, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWUSER = 0x20000, 0x10000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC = 1, 2, 4, 8, 32, 4096, 16384
PRIVATE, SLAVE, DETACH = 1 << 18, 1 << 19, 2
# statvfs f_flag bits -> mount flags (a bind keeps the flags a user namespace cannot clear)
ST_TO_MS = ((1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (64, 64), (1024, 1024), (2048, 2048),
            (4096, 1 << 21))

def check(r, what):
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, what + ": " + os.strerror(e))

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), "mount " + dst)

def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()

def setup():
    check(libc.unshare(NEWNS | (NEWUSER if spec["userns"] else 0)), "unshare")
    if spec["userns"]:
        u, g = spec["uid"], spec["gid"]
        for f, text in (("setgroups", "deny"), ("uid_map", f"{u} {u} 1"),
                        ("gid_map", f"{g} {g} 1")):
            with open("/proc/self/" + f, "w") as fh:
                fh.write(text)
    mount(None, "/", None, REC | SLAVE)
    mount("glm5-stage", spec["stage"], "tmpfs", NOSUID | NODEV | NOEXEC,
          "size=4m,nr_inodes=65536,mode=0755")
    mount(None, spec["stage"], None, PRIVATE)

def drop(sid):
    d = os.path.join(spec["stage"], sid)
    if not os.path.isdir(d):
        return
    for name in os.listdir(d):
        p = os.path.join(d, name)
        libc.umount2(p.encode(), DETACH)
        (os.rmdir if os.path.isdir(p) and not os.path.islink(p) else os.unlink)(p)
    os.rmdir(d)

def add(req):
    d = os.path.join(spec["stage"], req["sid"])
    os.mkdir(d, 0o755)
    try:
        for name, size, inodes, mode in req["tmpfs"]:
            p = os.path.join(d, name)
            os.mkdir(p, 0o700)
            opts = f"mode={mode},uid={req['uid']},gid={req['gid']}"
            opts += f",size={size}" if size else ""
            opts += f",nr_inodes={inodes}" if inodes else ""
            mount("glm5", p, "tmpfs", NOSUID | NODEV, opts)
        for i, src in enumerate(req["binds"]):
            fd = os.open(src, os.O_PATH | os.O_CLOEXEC)
            try:
                p = os.path.join(d, f"b{i}")
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.mkdir(p, 0o755)
                else:
                    os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
                mount(f"/proc/self/fd/{fd}", p, None, BIND | REC)
                keep = os.statvfs(p).f_flag
                flags = REMOUNT | BIND | RDONLY | NOSUID | NODEV
                for st, ms in ST_TO_MS:
                    flags |= ms if keep & st else 0
                mount(None, p, None, flags)
            finally:
                os.close(fd)
    except BaseException:
        drop(req["sid"])
        raise

try:
    setup()
except BaseException as e:
    say({"error": f"{type(e).__name__}: {e}"})
    sys.exit(1)
say({"ready": os.getpid()})
for line in sys.stdin:
    try:
        req = json.loads(line)
        if req["op"] == "add":
            add(req)
        elif req["op"] == "drop":
            drop(req["sid"])
        else:
            raise ValueError("unknown op " + repr(req["op"]))
        say({"ok": True})
    except BaseException as e:
        say({"error": f"{type(e).__name__}: {e}"})
'''


class StageError(RuntimeError):
    """The stage could not be started, or refused a request (the message says why)."""


def process_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks (None if there is no such process):
    with the pid, a name for a process that a reused pid cannot take."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def owner_tag() -> str:
    """`<pid>-<start time>` of this process, put in the names of what it leaves on the host
    (session directories, cgroups, stage directories) so that a sweep can tell leftovers."""
    pid = os.getpid()
    return f"{pid}-{process_start(pid) or 0}"


_TAG = re.compile(r"(\d+)-(\d+)-")


def owner_alive(name: str, prefix: str) -> bool:
    """Whether the process whose tag follows `prefix` in `name` still runs (unparsable names
    count as alive: they are not ours to remove)."""
    m = _TAG.match(name[len(prefix):]) if name.startswith(prefix) else None
    if m is None:
        return True
    pid, start = int(m.group(1)), int(m.group(2))
    return process_start(pid) == start


def traversable_by_all(path: str) -> bool:
    """Whether every directory from / down to `path` lets any user through (o+x)."""
    p = Path(path).resolve()
    for d in [p, *p.parents]:
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


def stage_parent() -> str:
    """Where the stage's (empty) mount point goes: the first temp directory any user can
    reach (the sandbox's uid walks it to reach its binds)."""
    for d in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d) and traversable_by_all(d):
            return d
    raise StageError("no temp directory that every user can traverse (tried $TMPDIR, /tmp, "
                     "/var/tmp, /dev/shm): the sandbox's unprivileged uid must reach its "
                     "mounts")


def left_by_the_dead(parent: str | os.PathLike[str], prefix: str) -> list[str]:
    """The names in `parent` that start with `prefix` and carry the tag (`owner_tag`) of a
    process that is gone: what a crashed process left."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(prefix) and not owner_alive(n, prefix))


def sweep_stage_dirs(parent: str) -> list[str]:
    """Remove the (empty) mount points of stages whose process is gone; returns them."""
    removed = []
    for name in left_by_the_dead(parent, _STAGE_PREFIX):
        try:
            os.rmdir(os.path.join(parent, name))
            removed.append(name)
        except OSError:
            pass
    return removed


@dataclasses.dataclass
class SessionMounts:
    """One session's mounts in a stage. `work_fd` / `tmp_fd`: directory descriptors on the
    work and /tmp mounts (host-side file access, usage); `mnt_fd` / `user_fd`: the stage's
    namespaces (user_fd None for a root stage), which commands enter; `work`, `tmp`,
    `binds`: the mounts' paths inside that namespace (what bwrap binds from)."""

    sid: str
    work: str
    tmp: str
    binds: list[str]
    work_fd: int
    tmp_fd: int
    mnt_fd: int
    user_fd: int | None
    stage: "Stage"

    def fds(self) -> tuple[int, ...]:
        """The namespace descriptors a command's launcher needs passed."""
        return (self.mnt_fd,) + ((self.user_fd,) if self.user_fd is not None else ())

    def release(self) -> None:
        """Unmount (when the stage still runs) and close every descriptor: the tmpfs memory
        is freed once no command holds it."""
        try:
            self.stage.drop(self.sid)
        finally:
            for fd in (self.work_fd, self.tmp_fd, self.mnt_fd, self.user_fd):
                if fd is not None and fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self.work_fd = self.tmp_fd = self.mnt_fd = -1
            self.user_fd = None


class Stage:
    """The stage process of this trainer process (see the module docstring). `userns`: it
    makes a user namespace too (a non-root trainer)."""

    def __init__(self, userns: bool) -> None:
        self.userns = userns
        self.owner = os.getpid()
        self.parent = stage_parent()
        sweep_stage_dirs(self.parent)
        self.path = os.path.join(self.parent, f"{_STAGE_PREFIX}{owner_tag()}-"
                                              f"{secrets.token_hex(4)}")
        os.mkdir(self.path, 0o700)
        self._lock = threading.Lock()
        self._alive = False
        spec = {"userns": userns, "uid": os.getuid(), "gid": os.getgid(), "stage": self.path}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _STAGE_SRC, json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env={"PATH": "/usr/bin:/bin"})
        except OSError as e:
            os.rmdir(self.path)
            raise StageError(f"cannot start the sandbox's stage process: {e}") from e
        first = self._reply()
        if "ready" not in first:
            self._stop()
            raise StageError("the sandbox's stage could not make its mount namespace: "
                             f"{first.get('error', first)}")
        pid = self._proc.pid
        try:
            self._mnt = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            self._user = (os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
                          if userns else None)
            self._root = os.open(f"/proc/{pid}/root{self.path}",
                                 os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            self._stop()
            raise StageError(f"cannot open the stage's namespaces: {e}") from e
        self._alive = True

    # ------------------------------------------------------------------------ protocol
    def _reply(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            return {"error": "the stage process ended (exit status "
                             f"{self._proc.poll()})"}
        try:
            return json.loads(line)
        except ValueError:
            rest = line + self._proc.stdout.read(4096)
            return {"error": rest.decode(errors="replace").strip()}

    def _request(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if not self.alive:
                raise StageError("the sandbox's stage process has ended")
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write((json.dumps(req) + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                self._alive = False
                raise StageError(f"the sandbox's stage process has ended: {e}") from e
            rep = self._reply()
            if "error" in rep and self._proc.poll() is not None:
                self._alive = False
            return rep

    @property
    def alive(self) -> bool:
        return self._alive and self._proc.poll() is None

    # ------------------------------------------------------------------------ sessions
    def add(self, uid: int, gid: int, disk_bytes: int | None, tmp_bytes: int | None,
            binds: Sequence[str], work_mode: str = "0700") -> SessionMounts:
        """Mount a new session's work and /tmp tmpfs (capped at disk_bytes / tmp_bytes, None:
        the kernel's default, half of RAM) owned by uid:gid, and its read-only binds.
        `work_mode`: the work directory's permissions ("0711" lets a bwrap running as root
        without capabilities chdir into it)."""
        sid = secrets.token_hex(8)

        def tmpfs(name: str, size: int | None, mode: str) -> list[Any]:
            return [name, size or 0, (size // BYTES_PER_INODE) if size else 0, mode]

        rep = self._request({"op": "add", "sid": sid, "uid": uid, "gid": gid,
                             "tmpfs": [tmpfs("work", disk_bytes, work_mode),
                                       tmpfs("tmp", tmp_bytes, "1777")],
                             "binds": list(binds)})
        if "error" in rep:
            raise StageError(f"the sandbox's mounts could not be made: {rep['error']}")
        d = f"{self.path}/{sid}"
        opened: list[int] = []
        try:
            for name in ("work", "tmp"):
                opened.append(os.open(f"{sid}/{name}", os.O_RDONLY | os.O_DIRECTORY
                                      | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._root))
            opened.append(os.dup(self._mnt))
            if self._user is not None:
                opened.append(os.dup(self._user))
        except OSError as e:
            for fd in opened:
                os.close(fd)
            self.drop(sid)
            raise StageError(f"cannot open the session's mounts: {e}") from e
        return SessionMounts(sid, f"{d}/work", f"{d}/tmp",
                             [f"{d}/b{i}" for i in range(len(binds))], opened[0], opened[1],
                             opened[2], opened[3] if self._user is not None else None, self)

    def drop(self, sid: str) -> None:
        """Detach a session's mounts (nothing to do once the stage has ended: the namespace
        goes with its last descriptor)."""
        if not self.alive:
            return
        try:
            self._request({"op": "drop", "sid": sid})
        except StageError:
            pass

    # ------------------------------------------------------------------------ lifetime
    def _stop(self) -> None:
        self._alive = False
        for f in (self._proc.stdin, self._proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        try:
            os.rmdir(self.path)
        except OSError:
            pass

    def close(self) -> None:
        """End the stage (sessions still open keep their namespace through their own
        descriptors)."""
        with self._lock:
            if self._proc.returncode is None:
                self._stop()
            for fd in (getattr(self, "_mnt", None), getattr(self, "_user", None),
                       getattr(self, "_root", None)):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._mnt = self._user = self._root = None  # type: ignore[assignment]


_STAGES: dict[bool, Stage] = {}
_STAGES_LOCK = threading.Lock()


def stage(userns: bool) -> Stage:
    """This process's stage (started on first use, restarted if it ended)."""
    with _STAGES_LOCK:
        st = _STAGES.get(userns)
        if st is None or not st.alive or st.owner != os.getpid():
            st = Stage(userns)
            _STAGES[userns] = st
        return st


def close_stages() -> None:
    """End this process's stages (sessions still open keep their mounts)."""
    with _STAGES_LOCK:
        for st in _STAGES.values():
            st.close()
        _STAGES.clear()


def _after_fork_in_child() -> None:
    # The parent's stage is the parent's: its pipe must not keep it alive after the parent
    # ends, and two processes must not talk over one pipe. The pipe's descriptors are pointed
    # at /dev/null (not closed: their numbers stay taken until the file objects go).
    global _STAGES_LOCK
    _STAGES_LOCK = threading.Lock()
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for st in _STAGES.values():
        st._alive = False
        st._lock = threading.Lock()
        for f in (st._proc.stdin, st._proc.stdout):
            if f is not None:
                try:
                    os.dup2(null, f.fileno())
                except (OSError, ValueError):
                    pass
    os.close(null)
    _STAGES.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
# at a normal exit the stages' (empty) mount points go too; after a crash, the next stage
# sweeps them
atexit.register(close_stages)
