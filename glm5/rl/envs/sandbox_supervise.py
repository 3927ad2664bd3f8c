"""Supervising one sandboxed command: feeding its stdin, capturing its output within a cap
(head and tail kept, the omission stated), the wall-clock limit, and killing everything it
left when it ends."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from typing import Any, Callable

from glm5.rl.envs.sandbox_cgroup import PidsCgroup


class Capture:
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


def supervise(proc: subprocess.Popen[bytes], data: bytes | None, timeout: float, cap: int,
              cgroup: PidsCgroup | None, reap: Callable[[], Any] | None = None
              ) -> tuple[Capture, Capture, bool, int, Any]:
    """Feed stdin, capture both streams (capped), enforce the wall-clock limit, and when the
    command ends kill everything it left (its process group, its `cgroup`, and whatever
    `reap` finds); returns (stdout, stderr, timed_out, wait status, rusage of the whole
    tree)."""
    out, err = Capture("stdout", cap), Capture("stderr", cap)
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
                    if reap is not None:
                        reap()
                if exited():
                    kill_tree()  # what the command left in its process group
                    _, status, rusage = os.wait4(proc.pid, 0)
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    if cgroup is not None:
                        cgroup.kill_all()
                    if reap is not None:
                        reap()
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
