"""The sandbox's per-command pids cgroup: bounds processes + threads, counts refused forks, and
lets every process of a command be killed even after it left its process group.

Created under this process's own cgroup where the pids controller is there and writable (v1,
or v2 with `pids` delegated); probed once by moving a real process in (containers often mount
cgroups read-only). Cgroups are named `glm5-sandbox-<pid>-<start time>-<hex>`: the first
sandbox of a process removes those of processes that are gone (`sweep`), so a trainer killed
with SIGKILL leaves none behind for long.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from glm5.rl.envs.sandbox_stage import left_by_the_dead, owner_tag

log = logging.getLogger("glm5.rl.envs")

PREFIX = "glm5-sandbox-"
# A child for probes that needs nothing from PATH.
_PROBE_CMD = [sys.executable, "-c", ""]


@dataclasses.dataclass(frozen=True)
class CgroupParent:
    """Where sessions' cgroups go (None: nowhere, `reason` says why), and the version."""
    path: Path | None
    version: int
    reason: str


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
def pids_cgroup_parent() -> CgroupParent:
    """A pids cgroup directory this process may create children in (checked by moving a real
    process into a child); leftovers of dead processes there are swept first."""
    d, version, why = _find_pids_hierarchy()
    if d is None:
        return CgroupParent(None, 0, why)
    sweep(d)
    try:
        cg = PidsCgroup(d, 8)
    except OSError as e:
        return CgroupParent(None, 0, f"cannot create a cgroup in {d}: {e}")
    try:
        r = subprocess.run(_PROBE_CMD, preexec_fn=cg.join, stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=10)
        if r.returncode != 0:
            return CgroupParent(None, 0, f"a process moved into {cg.path} failed")
    except (OSError, subprocess.SubprocessError) as e:
        return CgroupParent(None, 0, f"cannot move a process into a cgroup under {d}: {e}")
    finally:
        cg.remove()
    return CgroupParent(d, version, "")


def sweep(parent: Path) -> list[str]:
    """Kill what is left in, and remove, the cgroups of processes that are gone."""
    removed = []
    for name in left_by_the_dead(parent, PREFIX):
        cg = PidsCgroup.__new__(PidsCgroup)
        cg.path = parent / name
        cg.procs_file = str(cg.path / "cgroup.procs")
        cg.remove()
        if not cg.path.exists():
            removed.append(name)
    return removed


class PidsCgroup:
    """One command's pids cgroup (see the module docstring)."""

    def __init__(self, parent: Path, limit: int) -> None:
        self.path = parent / f"{PREFIX}{owner_tag()}-{secrets.token_hex(4)}"
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
