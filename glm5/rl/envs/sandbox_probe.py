"""What this machine lets a sandbox do, probed once per process (cached until
`glm5.rl.envs.sandbox.reset_probes`): whether bwrap can build a session here and how a command
gets its unprivileged uid (`bwrap_probe`), whether a rlimits-mode command can have a network
namespace (`netns_probe`), and so which mode a session runs in (`choose_mode`)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import shutil
import subprocess
import sys

from glm5.rl.envs import sandbox_launch as launch
from glm5.rl.envs import sandbox_stage as stage
from glm5.rl.envs.sandbox_bwrap import bwrap_argv, inner_prefix, spawn
from glm5.rl.envs.sandbox_config import SandboxError

_CLONE_NEWNET = 0x40000000


@dataclasses.dataclass(frozen=True)
class BwrapInfo:
    """Whether bwrap works here and how a command gets its unprivileged uid (`privilege`):
    "userns" (bwrap, started as that uid, maps it to 65534 in a user namespace) or "setpriv"
    (root where user namespaces are refused: bwrap as root keeps only the capabilities
    setpriv needs, and setpriv drops to the uid inside)."""
    path: str | None
    works: bool
    userns: bool
    version: str
    reason: str
    privilege: str = ""


@functools.lru_cache(maxsize=None)
def bwrap_probe() -> BwrapInfo:
    """Find bwrap and check that it can build a sandbox here the way sessions do (a container
    may forbid namespaces): the stage, then bwrap started as an unprivileged uid with a user
    namespace, then (root only) bwrap as root with setpriv dropping inside."""
    path = shutil.which("bwrap")
    if path is None:
        return BwrapInfo(None, False, False, "", "bwrap not found on PATH")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return BwrapInfo(path, False, False, "", f"{path} --version failed: {e}")
    root = launch.is_root()
    try:
        st = stage.stage(userns=not root)
    except stage.StageError as e:
        return BwrapInfo(path, False, False, version,
                          f"bwrap cannot create a sandbox here (no private mount namespace "
                          f"for its tmpfs mounts: {e})")
    errors = []
    for privilege in ("userns", "setpriv") if root else ("userns",):
        uid, gid = launch.session_ids(None)
        try:
            mounts = st.add(uid, gid, 1 << 20, 1 << 20, [],
                            "0711" if privilege == "setpriv" else "0700")
        except stage.StageError as e:
            errors.append(f"{privilege}: {e}")
            continue
        try:
            argv = [*bwrap_argv(path, privilege, mounts, False, []), "--",
                    *inner_prefix(privilege, uid, gid), "true"]
            drop = (uid, gid) if root and privilege == "userns" else None
            proc = spawn(argv, mounts, drop, [], None, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            _, err = proc.communicate(timeout=20)
            if proc.returncode == 0:
                return BwrapInfo(path, True, privilege == "userns", version, "", privilege)
            errors.append(f"{privilege}: exit {proc.returncode}: "
                          f"{err.decode(errors='replace').strip()[:200]}")
        except (OSError, subprocess.SubprocessError, SandboxError) as e:
            errors.append(f"{privilege}: {e}")
        finally:
            mounts.release()
    return BwrapInfo(path, False, False, version,
                      "bwrap cannot create a sandbox here (" + "; ".join(errors) + ")")


def unshare_net() -> None:
    """unshare(CLONE_NEWNET) (root) and bring the new namespace's loopback up."""
    if launch.libc().unshare(_CLONE_NEWNET) != 0:  # libc loaded by the parent
        e = ctypes.get_errno()
        raise OSError(e, f"unshare(CLONE_NEWNET): {os.strerror(e)}")
    launch.loopback_up()


@functools.lru_cache(maxsize=None)
def netns_probe() -> str:
    """"" when this process may give a rlimits-mode child a network namespace of its own
    (root: directly; non-root: inside a user namespace of its own), else why not."""
    launch.libc()  # load it in the parent, so that children only call into it
    how = unshare_net if launch.is_root() else launch.unshare_user_net
    try:
        r = subprocess.run([sys.executable, "-c", ""], preexec_fn=how,
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"a network namespace could not be made: {e}"
    return "" if r.returncode == 0 else \
        f"a network namespace could not be made (probe exited {r.returncode})"


def choose_mode(requested: str) -> tuple[str, BwrapInfo | None, str]:
    """(mode, bwrap's probe where the mode is bwrap, a note: why, or bwrap's version) for a
    requested mode; SandboxError where "bwrap" is asked for and does not work."""
    if requested == "rlimits":
        return "rlimits", None, "requested"
    info = bwrap_probe()
    if info.works:
        return "bwrap", info, info.version
    if requested == "bwrap":
        raise SandboxError(f"SandboxConfig.mode='bwrap': {info.reason}")
    return "rlimits", None, info.reason

