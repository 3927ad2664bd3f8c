"""`glm5 serve` run as a user runs it, for tests and benchmarks: the command in a process of its
own (`python -m glm5.cli serve DIR ... --port 0`; torchrun underneath for more than one rank),
its output read as it comes, the URL it prints, and — Linux — the pids of its ranks.

    srv = ServeProcess(["path/to/ckpt", "--tp", "2"])   # returns once it serves
    httpx.post(srv.url + "/v1/completions", ...)
    srv.stop()                                           # SIGTERM: drains; its exit status
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

URL_LINE = re.compile(r" at (http://\S+)/v1 ")  # `glm5 serve`'s "NAME at http://HOST:PORT/v1"
PIDFILE_VAR = b"GLM5_SERVE_PIDFILE="  # glm5.serve.ranks.PIDFILE_ENV: set for its torchrun


class ServeProcess:
    """``glm5 serve *args --port 0`` started now; the constructor returns once the server
    prints its URL (``url``: ``http://host:port``), or raises RuntimeError with what it printed
    when it exits first or takes over ``start_timeout`` s. ``lines``: everything it printed
    (stdout and stderr) so far."""

    def __init__(self, args: list[str], start_timeout: float = 180.0,
                 log_level: str = "warning") -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "glm5.cli", "serve", *args,
                                      "--port", "0", "--log-level", log_level],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env)
        self.lines: list[str] = []
        self.url: str | None = None
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + start_timeout
        while self.url is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("glm5 serve did not start:\n" + self.output)
            time.sleep(0.1)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = URL_LINE.search(line)
            if m:
                self.url = m.group(1)

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of this server's ranks (the processes of its torchrun; {} for a server
        of one process or once they are gone)."""
        try:
            launchers = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") \
                .read_text().split()
        except OSError:
            return {}
        mine = set()
        for t in launchers:  # the command's torchrun, and its pidfile variable
            try:
                env = Path(f"/proc/{t}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            mine |= {e for e in env if e.startswith(PIDFILE_VAR)}
        return rank_pids(mine)

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (the server drains, then stops every rank); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the command and every rank still there."""
        ranks = self.ranks()
        if self.proc.poll() is None:
            self.proc.kill()
        for pid in ranks.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait(30)


def alive(pid: int) -> bool:
    """The process ``pid`` exists and is not a zombie (Linux /proc)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rank_pids(markers: set[bytes]) -> dict[int, int]:
    """{RANK: pid} of the `glm5` commands torchrun runs (not torchrun itself) whose environment
    holds one of ``markers`` (``b"NAME=value"`` entries)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"glm5.cli" not in cmd or b"torch.distributed.run" in cmd or \
                not markers.intersection(env):
            continue
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank:
            out[int(rank[0][5:])] = int(d.name)
    return out
