"""The agentic sandbox (glm5.rl.envs.sandbox) tried as an attacker would, through its API only:
every escape an episode's command may try — the host's network, its kernel settings, root-only
files, setuid files, writing outside its work directory, reading another session's files,
filling the disk or /tmp, a tree close() cannot remove, a fork bomb, a memory bomb, an endless
loop, a denied system call, a huge file, and in rlimits mode host processes, terminals, System
V IPC, hard and symbolic links — is stopped, reported in the result, and leaves the host
untouched; ordinary commands (Python, pytest) work.

Tests run as root (CI) and again as an unprivileged user (.ci/run runs this file under a
non-root uid); a test that only means something as one of them says so and skips as the other.
Modes: "bwrap", "bwrap-setpriv" (root only: bwrap as root, setpriv dropping to the uid inside,
what runs where user namespaces are refused) and "rlimits". bwrap tests skip where bwrap does
not work, except under CI=true, where they fail: CI installs bwrap (.ci/run). Each check that
expects a block also runs an open twin (the network allowed, the filter off, the host's view)
to show the check can see an escape. No test writes a host sysctl or fills the real disk:
writability is probed by opening for write, and fills are capped at a few MiB."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import pty
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from glm5.rl.envs import sandbox as S
from glm5.rl.envs import sandbox_bwrap
from glm5.rl.envs import sandbox_config
from glm5.rl.envs import sandbox_fs
from glm5.rl.envs import sandbox_launch
from glm5.rl.envs import sandbox_probe
from glm5.rl.envs import sandbox_seccomp
from glm5.rl.envs import sandbox_stage
from glm5.rl.envs.sandbox import Sandbox, SandboxConfig, SandboxError

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ROOT = os.geteuid() == 0
# bwrap runs as root (and setpriv drops inside) only where the trainer is root
MODES = ["bwrap", "bwrap-setpriv", "rlimits"] if ROOT else ["bwrap", "rlimits"]


def require_bwrap() -> None:
    info = sandbox_probe.bwrap_probe()
    if not info.works:
        if IN_CI:
            pytest.fail(f"CI must run the bwrap sandbox tests: {info.reason}")
        pytest.skip(info.reason)


def require_root(why: str) -> None:
    if not ROOT:
        pytest.skip(f"as root only: {why}")


@pytest.fixture(autouse=True)
def _fresh_probes():
    S.reset_probes()
    yield
    S.reset_probes()


@pytest.fixture(params=MODES)
def mode(request, monkeypatch) -> str:
    """The mode under test; "bwrap-setpriv" forces bwrap's root fallback for the test."""
    if request.param.startswith("bwrap"):
        require_bwrap()
    if request.param == "bwrap-setpriv":
        require_root("bwrap runs as root only for root")
        info = sandbox_probe.bwrap_probe()
        forced = sandbox_probe.BwrapInfo(info.path, True, False, info.version, "", "setpriv")
        monkeypatch.setattr(sandbox_probe, "bwrap_probe", lambda: forced)
    return request.param


@pytest.fixture
def session_root(tmp_path):
    """Where rlimits-mode sessions go: as root, a directory every user can traverse (the
    commands' uid must reach its work directory; pytest's own tmp_path is root's, 0700)."""
    if not ROOT:
        yield tmp_path
        return
    d = tempfile.mkdtemp(prefix="glm5-test-sessions-")
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make(session_root):
    """make(mode, **config) -> an open Sandbox, closed after the test."""
    opened: list[Sandbox] = []

    def _make(mode: str, **kw) -> Sandbox:
        kw.setdefault("wall_seconds", 20)
        mode = "bwrap" if mode.startswith("bwrap") else mode
        if mode == "rlimits" and ROOT:
            kw.setdefault("unsafe_rlimits_as_root", True)
            if not sandbox_bwrap.reachable_by_all(sys.executable):
                # rlimits mode binds nothing: the commands' uid runs the host's interpreter
                # by its own path (.ci/run opens the path to other users, as it must for
                # its unprivileged run of this file)
                msg = (f"rlimits mode as root: {os.path.realpath(sys.executable)} is not "
                       "reachable by other users")
                if IN_CI:
                    pytest.fail(msg)
                pytest.skip(msg)
        sb = Sandbox(SandboxConfig(mode=mode, **kw), root_dir=session_root)
        opened.append(sb)
        return sb

    yield _make
    for sb in opened:
        assert sb.close() == []


def procs_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (bwrap's own two processes, whose
    command lines hold the whole sandboxed command, left out)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in b"\0".join(argv) and not argv[0].endswith(b"bwrap"):
            out.append(int(p))
    return out


def host_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def shmem_kib() -> int:
    """The host's tmpfs / shared memory in use (kB), from /proc/meminfo."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    raise AssertionError("no Shmem line in /proc/meminfo")


# ------------------------------------------------------------------------- attack: host root
def test_commands_never_run_as_host_root(mode, make):
    """The uid a command has on the host (read from the host's /proc while it runs, and from
    the owner of a file it made) is never 0; no capabilities of any kind, no_new_privs."""
    sb = make(mode)
    assert sb.run("touch made").ok
    marker = f"9{uuid.uuid4().int % 10**6}.5"
    t = threading.Thread(target=lambda: sb.run(["sleep", marker], timeout=20))
    t.start()

    def sleeper() -> list[int]:  # the command itself, not the launcher on its way to bwrap
        return [p for p in procs_with(marker)
                if Path(f"/proc/{p}/exe").resolve().name == "sleep"]

    try:
        deadline = time.monotonic() + 10
        while not sleeper() and time.monotonic() < deadline:
            time.sleep(0.02)
        (pid,) = sleeper()
        st = host_status(pid)
    finally:
        for p in procs_with(marker):
            os.kill(p, signal.SIGKILL)
        t.join()
    uids = {int(x) for x in st["Uid"].split()}
    gids = {int(x) for x in st["Gid"].split()}
    assert uids == {sb.host_uid} and gids == {sb.host_gid} and 0 not in uids | gids, st
    for cap in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(st[cap], 16) == 0, (cap, st[cap])
    assert st["NoNewPrivs"] == "1", st
    if ROOT or mode.startswith("bwrap"):  # (a non-root process cannot empty its own)
        assert int(st["CapBnd"], 16) == 0, st["CapBnd"]
    if ROOT:  # the trainer's groups are not inherited
        assert st["Groups"].split() in ([], [str(sb.host_gid)]), st
    assert os.stat(sb.workdir / "made").st_uid == sb.host_uid
    caps = sb.capabilities()
    assert not caps["runs_as_host_root"] and caps["host_uid"] == sb.host_uid
    if ROOT:  # a uid of the session's own, from glm5's range, never shared by two sessions
        first, count = sandbox_launch.HOST_UID_RANGE
        other = make(mode)
        assert first <= sb.host_uid < first + count and other.host_uid != sb.host_uid
    else:
        assert sb.host_uid == os.getuid()


def test_host_uid_can_be_fixed_and_is_checked(make):
    if ROOT:
        require_bwrap()
        sb = make("bwrap", host_uid=65534)
        assert sb.host_uid == 65534
        assert sb.run("touch f").ok and os.stat(sb.workdir / "f").st_uid == 65534
    else:
        with pytest.raises(ValueError, match="SandboxConfig.host_uid.*own uid"):
            Sandbox(SandboxConfig(host_uid=os.getuid() + 1))
    with pytest.raises(ValueError, match="SandboxConfig.host_uid"):
        SandboxConfig(host_uid=0)


# A program that tries to open every file under /proc/sys for writing (opening writes
# nothing), /proc/sysrq-trigger too, and reports what it could open, and whether /sys exists.
_SYSCTL_PROBE = r"""
import json, os, sys
writable = []
for d, _, files in os.walk('/proc/sys'):
    for f in files:
        p = os.path.join(d, f)
        try:
            os.close(os.open(p, os.O_WRONLY))
            writable.append(p)
        except OSError:
            pass
try:
    os.close(os.open('/proc/sysrq-trigger', os.O_WRONLY))
    writable.append('/proc/sysrq-trigger')
except OSError:
    pass
print(json.dumps({"writable": writable, "sys": os.listdir('/sys') if os.path.isdir('/sys')
                  else None}))
"""


# Settings that belong to a namespace (the sandbox's own network, IPC, UTS, PID and user
# namespaces in bwrap mode; pid_max is per PID namespace since Linux 6.14), and ns_last_pid,
# whose capability check comes at write time (opening it for write proves nothing).
_NAMESPACED_SYSCTLS = ("/proc/sys/net/", "/proc/sys/fs/mqueue/", "/proc/sys/user/",
                       "/proc/sys/kernel/ns_last_pid", "/proc/sys/kernel/pid_max",
                       "/proc/sys/kernel/hostname",
                       "/proc/sys/kernel/domainname", "/proc/sys/kernel/msg",
                       "/proc/sys/kernel/sem", "/proc/sys/kernel/shm",
                       "/proc/sys/kernel/auto_msgmni")


def _namespaced_sysctl(path: str) -> bool:
    return path.startswith(_NAMESPACED_SYSCTLS)


def test_host_kernel_settings_are_not_writable(mode, make):
    sb = make(mode)
    r = sb.run([sb.python, "-c", _SYSCTL_PROBE], timeout=60)
    assert r.ok, r
    seen = json.loads(r.stdout)
    host_wide = [p for p in seen["writable"] if not _namespaced_sysctl(p)]
    assert host_wide == [], host_wide[:10]
    if mode.startswith("bwrap"):
        assert seen["sys"] is None
    caps = sb.capabilities()
    assert "not" in caps["proc_sys"] or "read-only" in caps["proc_sys"]
    if ROOT:  # the open twin: the same probe, run by this root process, finds the host's
        out = subprocess.run([sys.executable, "-c", _SYSCTL_PROBE], capture_output=True,
                             text=True, check=True).stdout
        opened = [p for p in json.loads(out)["writable"] if not _namespaced_sysctl(p)]
        assert "/proc/sys/kernel/core_pattern" in opened and len(opened) > 50


def test_root_only_files_stay_unreadable(mode, make, request_cleanup):
    """Root's 0600 file, and a 0700 root directory, bound into the sandbox (or, in rlimits
    mode, at their host path) are not readable; /etc/ssl/private is not listable."""
    require_root("the files must belong to another user than the commands'")
    d = Path(tempfile.mkdtemp(prefix="glm5-secret-"))
    request_cleanup.append(d)
    os.chmod(d, 0o755)
    (d / "secret").write_text("root only\n")
    os.chmod(d / "secret", 0o600)
    (d / "public").write_text("world readable\n")
    (d / "private").mkdir(mode=0o700)
    (d / "private" / "inside").write_text("behind a closed directory\n")
    os.chmod(d / "private" / "inside", 0o644)
    bwrap = mode.startswith("bwrap")
    where = "/data" if bwrap else str(d)
    sb = make(mode, **({"ro_binds": ((str(d), "/data"),)} if bwrap else {}))
    for cmd in (f"cat {where}/secret", f"cat {where}/private/inside", f"ls {where}/private"):
        r = sb.run(cmd)
        assert r.reason == "error" and "Permission denied" in r.stderr, (cmd, r)
        assert "root only" not in r.stdout and "behind" not in r.stdout
    if os.path.isdir("/etc/ssl/private"):
        r = sb.run("ls /etc/ssl/private")
        assert r.reason == "error" and "Permission denied" in r.stderr, r
    # the open twin: the same reads work on a file its permissions let through
    r = sb.run(f"cat {where}/public")
    assert r.ok and r.stdout == "world readable\n", r


@pytest.fixture
def request_cleanup():
    """Directories a test made outside tmp_path, removed after it."""
    dirs: list[Path] = []
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def test_setuid_files_give_nothing(mode, make, request_cleanup):
    """A setuid copy a command makes belongs to its unprivileged uid, on a nosuid mount that
    is not on the host's disk; a setuid-root program from the host runs without its
    privilege; every mount is nosuid (and nodev but /dev's device nodes)."""
    if not mode.startswith("bwrap"):
        pytest.skip("rlimits mode shows the host's mounts as they are (capabilities say so)")
    require_root("a setuid-root program can only be made by root")
    sb_plain = make(mode)
    r = sb_plain.run("cp /bin/true sut && chmod 6755 sut && ls -n sut")
    assert r.ok, r
    st = os.stat(sb_plain.workdir / "sut")
    assert st.st_mode & stat.S_ISUID and st.st_uid == sb_plain.host_uid != 0
    assert os.fstatvfs(sb_plain._mounts.work_fd).f_flag & os.ST_NOSUID
    # a setuid-root `id`, made by root on the host and bound in
    d = Path(tempfile.mkdtemp(prefix="glm5-suid-"))
    request_cleanup.append(d)
    os.chmod(d, 0o755)
    shutil.copy("/usr/bin/id", d / "id")
    os.chmod(d / "id", 0o4755)
    sb = make(mode, ro_binds=((str(d), "/suid"),))
    r = sb.run("/suid/id -u; /suid/id -u -r")
    assert r.ok and "0" not in r.stdout.split(), r  # neither euid nor uid became root
    r = sb.run("cat /proc/self/mountinfo")
    for line in r.stdout.splitlines():
        fields = line.split()
        point, opts = fields[4], fields[5].split(",")
        assert "nosuid" in opts, line
        assert "nodev" in opts or point.startswith("/dev/"), line
    # the open twin: the same program run by an unprivileged uid on the host does get root
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          str(d / "id"), "-u"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "0", out


# ------------------------------------------------------------------ attack: disk and /tmp
def test_disk_and_tmp_quotas(mode, make):
    if not mode.startswith("bwrap"):
        sb = make(mode)
        assert sb.capabilities()["limits"]["disk_bytes"] is None  # said, not pretended
        assert any("no disk" in g for g in sb.capabilities()["gaps"])
        pytest.skip("rlimits mode has no disk quota (capabilities say so)")
    mib = 1 << 20
    sb = make(mode, disk_bytes=8 * mib, tmp_bytes=4 * mib)
    caps = sb.capabilities()
    assert caps["limits"]["disk_bytes"].startswith(f"tmpfs size={8 * mib}")
    assert caps["tmpfs_ram_bytes"] == 12 * mib
    for cmd, where in (("fallocate -l 64M big", "ENOSPC"),
                       ("head -c 16M /dev/zero > big", "the work directory is full"),
                       ("head -c 16M /dev/zero > /tmp/big", "/tmp is full"),
                       ("mkdir many && cd many && i=0; while touch f$i; do i=$((i+1)); done;"
                        " exit 1", "every inode used")):
        r = sb.run(cmd)
        assert r.reason == "disk_limit" and where in r.detail, (cmd, r)
        assert sb.run("rm -rf big /tmp/big many").ok
    # nothing written counts on the host's disk: the work directory is the capped tmpfs
    v = os.fstatvfs(sb._mounts.work_fd)
    assert v.f_blocks * v.f_frsize == 8 * mib and v.f_files == 8 * mib // 1024
    # the open twin: under a larger cap the same write succeeds
    big = make(mode, disk_bytes=32 * mib)
    assert big.run("head -c 16M /dev/zero > big").ok
    assert os.path.getsize(big.workdir / "big") == 16 * mib
    with pytest.raises(OSError) as e:  # the host's own writes meet the cap too
        sb.write_file("host.bin", b"x" * (9 * mib))
    assert e.value.errno == errno.ENOSPC and "host.bin" not in sb.list_dir()


def test_tmpfs_memory_is_freed_on_close(make):
    """What a session's tmpfs holds is RAM (Shmem), counted and given back at close()."""
    require_bwrap()
    mib = 1 << 20
    before = shmem_kib()
    sb = make("bwrap", disk_bytes=16 * mib, tmp_bytes=16 * mib)
    assert sb.run("head -c 12M /dev/urandom > a && head -c 12M /dev/urandom > /tmp/b").ok
    assert shmem_kib() - before > 20 * 1024  # both files are in memory, not on disk
    assert sb.close() == []
    assert shmem_kib() - before < 4 * 1024


# ------------------------------------------------------------------ attack: cleanup
# A tree close() must remove: 1,500 nested directories, 3,000 files in one, directories
# without any permission (one holding files), a FIFO, a unix socket, and links to host paths
# (never followed: the host's side stays).
_HOSTILE_TREE = r"""
import os, socket, sys
host = sys.argv[1]
top = os.open('.', os.O_RDONLY)
os.mkdir('deep')
fd = os.open('deep', os.O_RDONLY)
for _ in range(1500):
    os.mkdir('d', dir_fd=fd)
    nfd = os.open('d', os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = nfd
os.close(fd)
os.mkdir('wide')
for i in range(3000):
    open(f'wide/f{i}', 'w').close()
os.makedirs('locked/inner')
open('locked/inner/x', 'w').write('x')
os.chmod('locked/inner', 0)
os.chmod('locked', 0)
os.mkfifo('fifo')
s = socket.socket(socket.AF_UNIX)
s.bind('sock')
os.symlink(host, 'hostlink')
os.mkdir('ro')
open('ro/f', 'w').close()
os.chmod('ro', 0o500)
print('built')
"""


def test_close_removes_any_tree(mode, make, tmp_path, session_root):
    host = tmp_path / "host_dir"
    host.mkdir()
    (host / "keep.txt").write_text("host data")
    sb = make(mode)
    r = sb.run([sb.python, "-c", _HOSTILE_TREE, str(host)], timeout=120)
    assert r.ok and r.stdout == "built\n", r
    workdir = sb.workdir
    assert sorted(sb.list_dir()) == ["deep", "fifo", "hostlink", "locked", "ro", "sock",
                                     "wide"]
    assert sb.close() == [] and sb.closed
    assert not os.path.exists(workdir)
    assert (host / "keep.txt").read_text() == "host data"  # the link was not followed
    if mode == "rlimits":
        assert not [n for n in os.listdir(session_root) if n.startswith(S.SESSION_PREFIX)]


def test_terminal_env_checkpoints_and_closes_a_hostile_tree(mode, monkeypatch, tmp_path):
    if mode != "bwrap":
        pytest.skip("the env's own default sandbox (bwrap here) is what episodes use")
    from glm5.rl.envs.workspace import TerminalEnv

    env = TerminalEnv()
    env.reset(0)
    r = env.sandbox.run([env.sandbox.python, "-c", _HOSTILE_TREE, str(tmp_path)], timeout=120)
    assert r.ok, r
    env.sandbox.write_file("notes/a.txt", "kept")
    state = env.state_dict()  # no recursion, bounded: the deep and wide trees do not break it
    assert state["files"]["notes/a.txt"] == "kept"
    env.close()
    assert env.sandbox is None


def test_close_reports_what_it_cannot_remove(make, monkeypatch):
    sb = make("rlimits")
    assert sb.run("mkdir -p a/b && touch a/b/stuck a/b/fine a/top").ok
    real_unlink = sandbox_fs.os.unlink

    def unlink(name, *a, **k):  # a planted failure: one entry that will not go
        if name == "stuck":
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_unlink(name, *a, **k)

    monkeypatch.setattr(sandbox_fs.os, "unlink", unlink)
    problems = sb.close()  # no exception
    assert problems[0].endswith("/work/a/b/stuck: Operation not permitted"), problems
    # then each directory above it, up to the session's own, which could not go either
    assert len(problems) == 5 and all(p.endswith(": Directory not empty")
                                      for p in problems[1:]), problems
    assert sb.cleanup_problems == problems and sb.closed
    assert sb.close() == []  # once only
    monkeypatch.setattr(sandbox_fs.os, "unlink", real_unlink)
    session = Path(problems[-1].rsplit(": ", 1)[0])
    assert session.name.startswith(S.SESSION_PREFIX) and (session / "work/a/b/stuck").exists()
    shutil.rmtree(session)


def test_remove_tree_never_recurses_nor_wanders(tmp_path):
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        p = tmp_path / "t"
        d = os.open(tmp_path, os.O_RDONLY)
        os.mkdir("t", dir_fd=d)
        fd = os.open("t", os.O_RDONLY, dir_fd=d)
        os.close(d)
        for _ in range(3000):  # deeper than Python's recursion limit and PATH_MAX
            os.mkdir("dir-with-a-long-name", dir_fd=fd)
            nfd = os.open("dir-with-a-long-name", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.close(fd)
        assert sandbox_fs.remove_tree(root, "t") == [] and not p.exists()
        assert sandbox_fs.remove_tree(root, "absent") == []
    finally:
        os.close(root)


def _run_child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(REPO))


_CRASHING_TRAINER = """
    import sys, time
    from glm5.rl.envs.sandbox import Sandbox, SandboxConfig
    mode, root_dir = sys.argv[1], sys.argv[2]
    sb = Sandbox(SandboxConfig(mode=mode, unsafe_rlimits_as_root=True,
                               disk_bytes=32 << 20), root_dir=root_dir)
    r = sb.run("head -c 16M /dev/urandom > data && mkdir -p x/y/z && echo made")
    assert r.ok, r
    print(sb.workdir, flush=True)
    time.sleep(120)
"""


def test_a_killed_trainer_leaves_nothing(mode, session_root):
    """SIGKILL the process that holds a session: in bwrap mode the kernel frees its tmpfs and
    nothing of it is on the host; in rlimits mode the next sandbox sweeps its directory."""
    if mode == "bwrap-setpriv":
        pytest.skip("the same stage as bwrap")
    before = shmem_kib()
    child = _run_child(_CRASHING_TRAINER, mode, str(session_root))
    line = child.stdout.readline().strip()
    assert line, child.stderr.read()
    held = shmem_kib() - before
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    child.stderr.close()
    if mode == "bwrap":
        assert held > 12 * 1024
        deadline = time.monotonic() + 10  # the stage sees its pipe close, then exits
        while shmem_kib() - before > 4 * 1024 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shmem_kib() - before < 4 * 1024
        parent = sandbox_stage.stage_parent()
        stages = [n for n in os.listdir(parent) if n.startswith(f".glm5-stage-{child.pid}-")]
        assert len(stages) == 1  # an empty mount point: the mounts were the stage's alone
        assert not os.listdir(os.path.join(parent, stages[0]))
        assert stages[0] in sandbox_stage.sweep_stage_dirs(parent)
    else:
        session = Path(line).parent
        assert session.exists() and session.name.startswith(f"{S.SESSION_PREFIX}{child.pid}-")
        assert S.sweep_sessions(session_root) == [session.name]
        assert not session.exists()


def test_a_killed_stage_costs_no_session(make):
    """SIGKILL the helper that made the mounts: open sessions keep their mounts (they hold
    the namespace) and run and close as before; the next session starts a new helper."""
    require_bwrap()
    sb = make("bwrap")
    assert sb.run("echo before > f").ok
    old = sandbox_stage.stage(userns=not ROOT)
    os.kill(old._proc.pid, signal.SIGKILL)
    old._proc.wait()
    r = sb.run("cat f; echo after >> f; df -k /work | tail -1")
    assert r.ok and r.stdout.startswith("before\n"), r
    assert sb.read_file("f") == b"before\nafter\n"
    other = make("bwrap")
    assert sandbox_stage.stage(userns=not ROOT) is not old
    assert other.run("true").ok and sb.close() == []


def test_a_forked_trainer_gets_its_own_stage(make):
    """multiprocessing's fork start method: the child makes sandboxes of its own (a new
    helper), and the parent's keep working."""
    require_bwrap()
    sb = make("bwrap")
    assert sb.run("true").ok
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only an exit status
        code = 1
        try:
            with Sandbox(SandboxConfig(mode="bwrap")) as child_sb:
                r = child_sb.run("echo child > f && cat f")
                code = 0 if r.ok and r.stdout == "child\n" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sb.run("echo parent").stdout == "parent\n"


def test_sweeps_leave_live_owners_alone(session_root):
    mine = Path(session_root) / f"{S.SESSION_PREFIX}{sandbox_stage.owner_tag()}-abc"
    mine.mkdir()
    foreign = Path(session_root) / f"{S.SESSION_PREFIX}not-ours"
    foreign.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = Path(session_root) / f"{S.SESSION_PREFIX}{dead.pid}-1-xyz"
    (gone / "a" / "b").mkdir(parents=True)
    assert S.sweep_sessions(session_root) == [gone.name]
    assert mine.exists() and foreign.exists() and not gone.exists()
    # a pid reused by a new process has another start time: still a leftover
    reused = Path(session_root) / f"{S.SESSION_PREFIX}{os.getpid()}-1-xyz"
    reused.mkdir()
    assert S.sweep_sessions(session_root) == [reused.name]


# --------------------------------------------------------------------- attack: rlimits mode
def test_rlimits_mode_is_refused_as_root_without_the_opt_in(monkeypatch, session_root):
    require_root("the refusal is root's")
    with pytest.raises(SandboxError, match="unsafe_rlimits_as_root"):
        Sandbox(SandboxConfig(mode="rlimits"))
    monkeypatch.setattr(S.shutil, "which", lambda name, *a, **k: None)  # no bwrap: auto
    with pytest.raises(SandboxError, match="refused as root"):
        Sandbox(SandboxConfig())
    rep = S.sandbox_report()
    assert rep["refused_as_root"] and any("refused" in w for w in rep["warnings"])
    with Sandbox(SandboxConfig(mode="rlimits", unsafe_rlimits_as_root=True),
                 root_dir=session_root) as sb:
        r = sb.run("id -u")
        assert r.ok and r.stdout.strip() == str(sb.host_uid) != "0"
    private = tempfile.mkdtemp()  # 0700: the commands' uid could not reach its work dir
    try:
        with pytest.raises(ValueError, match="Sandbox\\(root_dir\\)"):
            Sandbox(SandboxConfig(mode="rlimits", unsafe_rlimits_as_root=True),
                    root_dir=private)
    finally:
        os.rmdir(private)


_HOST_PROBE = r"""
import os, sys
pid = sys.argv[1]
for what in ('environ', 'fd', 'mem', 'root/etc/hostname'):
    try:
        p = f'/proc/{pid}/{what}'
        if what == 'fd':
            os.listdir(p)
        else:
            open(p, 'rb').close()
        print(what, 'open')
    except OSError as e:
        print(what, type(e).__name__)
"""


def test_rlimits_host_processes_are_out_of_reach_as_root(make, monkeypatch):
    """As root (opted in), commands run as an unprivileged uid: this process's environment,
    descriptors and memory, other root processes and root's cgroup files are out of reach."""
    require_root("as non-root the same uid's processes are reachable (a documented gap)")
    monkeypatch.setenv("GLM5_TEST_SECRET", "hunter2")
    sb = make("rlimits")
    r = sb.run([sb.python, "-c", _HOST_PROBE, str(os.getpid())])
    assert r.ok and r.stdout.split("\n")[:4] == [
        "environ PermissionError", "fd PermissionError", "mem PermissionError",
        "root/etc/hostname PermissionError"], r
    victim = subprocess.Popen(["sleep", "30"])
    try:
        r = sb.run(f"kill -9 {victim.pid}")
        assert r.reason == "error" and "Operation not permitted" in r.stderr, r
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    # a daemon that would move itself out of its cgroup cannot write the host's
    procs = [p for p in ("/sys/fs/cgroup/cgroup.procs", "/sys/fs/cgroup/pids/cgroup.procs",
                         "/sys/fs/cgroup/memory/cgroup.procs") if os.path.exists(p)]
    assert procs
    for p in procs:
        r = sb.run(f"echo $$ > {p}")
        assert r.reason == "error" and "Permission denied" in r.stderr, (p, r)
    # the open twin: the same probe as root opens them all
    out = subprocess.run([sys.executable, "-c", _HOST_PROBE, str(os.getpid())],
                         capture_output=True, text=True).stdout
    assert out.split("\n")[:4] == ["environ open", "fd open", "mem open",
                                   "root/etc/hostname open"], out


def test_rlimits_gaps_are_what_capabilities_say(make):
    """As non-root, rlimits mode cannot hide the user's own processes entirely: it says
    what it leaves open, and that is what is open (the twin of the root test above)."""
    if ROOT:
        pytest.skip("as root the commands' uid is not this process's")
    sb = make("rlimits")
    caps = sb.capabilities()
    assert caps["mode"] == "rlimits" and not caps["filesystem_isolated"]
    r = sb.run([sb.python, "-c", _HOST_PROBE, str(os.getpid())])
    reachable = any("/proc/<pid>/environ" in g for g in caps["gaps"])
    assert ("environ open" in r.stdout) == reachable, (caps["gaps"], r)
    if caps["network_isolated"]:  # a user namespace of its own: ptrace-class access closed
        assert not reachable and "environ PermissionError" in r.stdout
    victim = subprocess.Popen(["sleep", "30"])
    try:  # signals reach the user's own processes: said so
        assert any("signalled" in g or "signals" in g for g in caps["gaps"])
        assert sb.run(f"kill -9 {victim.pid}").ok
        assert victim.wait(timeout=5) == -9
    finally:
        victim.kill()
        victim.wait()


_TIOCSTI = r"""
import fcntl, os, sys, termios
try:
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_NOCTTY)
except OSError as e:
    print('refused open', e.errno)
    sys.exit(0)
try:
    fcntl.ioctl(fd, termios.TIOCSTI, b'x')
    print('injected')
except OSError as e:
    print('refused', e.errno)
"""


def test_no_keystrokes_into_a_host_terminal(mode, make):
    master, slave = pty.openpty()
    try:
        path = os.ttyname(slave)
        os.chmod(path, 0o666)  # the command may open it: only the ioctl stands in the way
        sb = make(mode, **({"ro_binds": ((path, "/hostpty"),)} if mode.startswith("bwrap")
                           else {}))
        where = "/hostpty" if mode.startswith("bwrap") else path
        r = sb.run([sb.python, "-c", _TIOCSTI, where])
        assert r.ok and r.stdout.startswith("refused"), r
        os.set_blocking(master, False)
        with pytest.raises(BlockingIOError):
            os.read(master, 16)  # nothing was typed into the terminal
        assert "ioctl(TIOCSTI)" in sb.capabilities()["seccomp_denied"]
        # the open twin: the same ioctl from this process reaches the terminal (where the
        # kernel still allows TIOCSTI at all)
        out = subprocess.run([sys.executable, "-c", _TIOCSTI, path], capture_output=True,
                             text=True).stdout
        if out.startswith("injected"):
            assert ROOT and os.read(master, 16) == b"x"
    finally:
        os.close(master)
        os.close(slave)


def _shm(key: int, size: int, flags: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.shmget(key, size, flags)


_SHM_READ = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
sid = libc.shmget(int(sys.argv[1]), 0, 0)
if sid < 0:
    print('shmget', ctypes.get_errno()); sys.exit(0)
addr = libc.shmat(sid, None, 0)
print('read', ctypes.string_at(addr, 6))
"""


def test_host_sysv_shared_memory_is_out_of_reach(mode, make):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    key = 0x6C6D0000 + os.getpid() % 0xFFFF
    sid = libc.shmget(key, 4096, 0o1000 | 0o666)  # IPC_CREAT
    assert sid >= 0, ctypes.get_errno()
    try:
        addr = libc.shmat(sid, None, 0)
        ctypes.memmove(addr, b"secret", 6)
        sb = make(mode)
        r = sb.run([sb.python, "-c", _SHM_READ, str(key)])
        assert r.ok and "secret" not in r.stdout, r
        if mode == "rlimits":
            assert r.stdout.split() == ["shmget", str(errno.EPERM)], r  # the filter's EPERM
            assert "shmget" in sb.capabilities()["seccomp_denied"]
            # the open twin: without the filter the same program reads the host's segment
            r = make(mode, seccomp=False).run([sb.python, "-c", _SHM_READ, str(key)])
            assert "secret" in r.stdout, r
        else:
            assert r.stdout.split() == ["shmget", str(errno.ENOENT)], r  # its own namespace
        libc.shmdt(ctypes.c_void_p(addr))
    finally:
        libc.shmctl(sid, 0, None)  # IPC_RMID


def test_hard_links_never_carry_host_files(make, session_root):
    """rlimits mode shares the host's filesystem: a command can hard-link a host file it may
    write into its work directory; the host-side file API refuses to read it and never
    writes through it."""
    host = Path(session_root) / "host-file.txt"
    host.write_text("host content\n")
    os.chmod(host, 0o666)
    sb = make("rlimits")
    r = sb.run(f"ln {host} linked")
    assert r.ok, r
    with pytest.raises(ValueError, match="one link"):
        sb.read_file("linked")
    sb.write_file("linked", "replaced")
    assert host.read_text() == "host content\n"
    assert sb.read_file("linked") == b"replaced"


def test_a_swapped_work_dir_is_not_followed(make, tmp_path):
    """A command that renames its work directory and puts a link to a host directory in its
    place: read_file / write_file keep to the directory the session made."""
    target = tmp_path / "host_target"
    target.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(target, 0o777)
    sb = make("rlimits")
    sb.write_file("mine.txt", "original")
    r = sb.run(f"cd .. && mv work moved && ln -s {target} work")
    if ROOT:  # the session directory is root's: the uid cannot rename its work directory
        assert r.reason == "error" and "Permission denied" in r.stderr, r
    else:
        assert r.ok, r
    sb.write_file("new.txt", "written")
    assert sb.read_file("mine.txt") == b"original" and sb.read_file("new.txt") == b"written"
    assert list(target.iterdir()) == []


# ------------------------------------------------------------------------------ ordinary work
def test_commands_run_and_output_is_captured(mode, make):
    sb = make(mode)
    r = sb.run([sb.python, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                "sys.exit(3)"])
    assert (r.returncode, r.stdout, r.stderr, r.reason) == (3, "out\n", "err\n", "error")
    assert r.detail == "exit status 3" and r.signal is None and r.wall_s > 0
    r = sb.run("echo hi; pwd", stdin=None)
    assert r.ok and r.returncode == 0
    assert r.stdout == f"hi\n{'/work' if mode.startswith('bwrap') else sb.workdir}\n"
    r = sb.run(["cat"], stdin="fed through stdin")
    assert r.ok and r.stdout == "fed through stdin"
    r = sb.run(["python", "-c", "import sys; print(sys.prefix)"])  # `python` on PATH is it
    assert r.ok and r.stdout.strip() == (S.SANDBOX_VENV if mode.startswith("bwrap") and
                                         sys.prefix != sys.base_prefix else sys.prefix)
    r = sb.run(["no-such-program-glm5"])
    assert r.reason == "error" and r.returncode != 0 and "no-such-program-glm5" in (
        r.stderr + r.detail)


def test_a_pytest_run_in_the_work_dir(mode, make):
    sb = make(mode, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    sb.write_file("pkg/test_tiny.py", "def test_add():\n    assert 1 + 1 == 2\n\n"
                  "def test_sub():\n    assert 2 - 1 == 1\n")
    cmd = [sb.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "pkg/test_tiny.py"]
    r = sb.run(cmd)
    assert r.ok, (r.detail, r.stdout, r.stderr)
    assert "2 passed" in r.stdout
    sb.write_file("pkg/test_tiny.py", "def test_add():\n    assert 1 + 1 == 3\n")
    r = sb.run(cmd)
    assert r.reason == "error" and r.returncode == 1 and "1 failed" in r.stdout


def test_output_cap_states_the_truncation(mode, make):
    sb = make(mode, output_bytes=1000)
    r = sb.run([sb.python, "-c", "import sys; sys.stdout.write('a' * 5000 + 'END'); "
                "sys.stderr.write('e' * 10)"])
    assert r.ok and r.stdout_truncated and not r.stderr_truncated
    assert r.stdout_bytes == 5003 and r.stderr_bytes == 10 and r.stderr == "e" * 10
    assert r.stdout.startswith("a" * 500) and r.stdout.endswith("a" * 497 + "END")
    assert "4003 bytes of stdout omitted" in r.stdout
    r = sb.run(["sh", "-c", "printf 1234567890"])  # under the cap: nothing omitted
    assert r.stdout == "1234567890" and not r.stdout_truncated


@pytest.mark.parametrize("launcher", ["programs", "preexec"])
def test_limits_reach_the_command(mode, make, monkeypatch, launcher):
    """bwrap commands start through /bin/sh + nsenter + setpriv + prlimit (no fork of this
    process), or through preexec_fn where one of them is missing; rlimits mode always uses
    preexec_fn."""
    if mode == "rlimits" and launcher == "programs":
        pytest.skip("rlimits mode always starts through preexec_fn")
    if launcher == "preexec":
        which = S.shutil.which
        monkeypatch.setattr(S.shutil, "which",
                            lambda n, *a, **k: None if n == "prlimit" else which(n, *a, **k))
    sb = make(mode, cpu_seconds=7, memory_bytes=300 << 20, file_size_bytes=5 << 20,
              open_files=40, max_processes=3)
    assert (sb._launcher(None) is None) == (launcher == "preexec")
    r = sb.run([sb.python, "-c", "import resource as R; print([R.getrlimit(getattr("
                "R, 'RLIMIT_' + n)) for n in ('CPU', 'AS', 'FSIZE', 'NOFILE', 'CORE')])"])
    assert r.ok, r
    assert r.stdout.strip() == str([(7, 8), (300 << 20, 300 << 20), (5 << 20, 5 << 20),
                                    (40, 40), (0, 0)])
    r = sb.run("id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status")  # either way
    uid_inside = sb.capabilities()["uid_inside"]
    assert r.ok and r.stdout.split() == [str(uid_inside), "CapEff:", "0000000000000000",
                                         "NoNewPrivs:", "1"], r
    if sb.capabilities()["limits"]["max_processes"].startswith("cgroup"):
        # the shell and three sleeps make four: one fork is refused, and counted
        r = sb.run("sleep 0.2 & sleep 0.2 & sleep 0.2 & wait")
        assert r.forks_refused >= 1 and "refused" in r.detail, r


def test_many_commands_in_one_session(mode, make):
    # each command's processes are released: 40 commands under a limit of 3 all run
    sb = make(mode, max_processes=3)
    results = [sb.run(["true"]) for _ in range(40)]
    assert all(r.ok for r in results), [r for r in results if not r.ok][:1]


def _reap_escaped(sb: Sandbox, marker: str) -> int:
    """Kill what a command left running that carries `marker`; 0 where the mode's
    containment holds. Only rlimits mode without a pids cgroup lets a setsid() child escape
    (its capabilities say so): there the escapee is killed and 0 returned too."""
    left = procs_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    if sb.capabilities()["containment"].startswith("process group"):
        return 0
    return len(left)


def test_work_dir_is_private_and_removed_on_close(mode, make, session_root):
    sb = make(mode)
    assert sb.workdir.is_dir()
    if mode == "rlimits":  # a host directory other users cannot list nor enter
        assert str(sb.workdir).startswith(str(session_root))
        assert (sb.workdir.parent.stat().st_mode & 0o066) == 0
        assert (sb.workdir.stat().st_mode & 0o077) == 0
    else:  # nowhere on the host: a tmpfs reached through this process's descriptor
        assert str(sb.workdir).startswith(f"/proc/{os.getpid()}/fd/")
        assert os.fstatvfs(sb._mounts.work_fd).f_bsize > 0
    assert sb.run("echo made-inside > note.txt").ok
    assert sb.read_file("note.txt") == b"made-inside\n"
    # a leftover background process is killed when the command ends, even one that left
    # its process group (the sleep 0.3 lets it get there)
    marker = f"7{uuid.uuid4().int % 10**6}.5"
    t = time.monotonic()
    r = sb.run(f"setsid sleep {marker} >/dev/null 2>&1 & sleep 0.3; echo started")
    assert r.ok and r.stdout == "started\n" and time.monotonic() - t < 5
    time.sleep(0.1)
    escaped = _reap_escaped(sb, marker)
    assert escaped == 0, escaped
    # one that keeps writing to the output pipe is killed when the command ends, not waited
    # for: nothing of it follows the command's last line
    marker = f"glm5-ticker-{uuid.uuid4().hex[:8]}"
    t = time.monotonic()
    r = sb.run(f"setsid sh -c 'while :; do echo tick; sleep 0.01; done # {marker}' & "
               "sleep 0.3; echo started")
    assert r.ok and "tick\n" in r.stdout and time.monotonic() - t < 1.5, r
    if not sb.capabilities()["containment"].startswith("process group"):  # (it escaped)
        assert r.stdout.split("started\n")[1].count("tick") <= 1, r.stdout
    time.sleep(0.1)
    assert _reap_escaped(sb, marker) == 0
    # and without a pids cgroup (max_processes=None), the process group's members are
    marker = f"7{uuid.uuid4().int % 10**6}.5"
    r = make(mode, max_processes=None).run(f"sleep {marker} >/dev/null 2>&1 & echo started")
    assert r.ok and r.stdout == "started\n"
    time.sleep(0.1)
    assert procs_with(marker) == []
    workdir = sb.workdir
    assert sb.close() == []
    assert not workdir.exists() and not workdir.parent.exists() or mode != "rlimits"
    assert not os.path.exists(workdir) and sb.closed
    with pytest.raises(RuntimeError, match="closed"):
        sb.run(["true"])
    with pytest.raises(RuntimeError, match="closed"):
        sb.read_file("note.txt")


@pytest.mark.parametrize("resolver", ["openat2", "walk"])
def test_host_files_are_read_through_no_link(make, monkeypatch, resolver):
    if resolver == "walk":  # kernels before 5.6: the component-by-component fallback
        monkeypatch.setattr(sandbox_fs, "openat2_available", lambda: False)
    sb = make("rlimits")
    assert sb.run("ln -s /etc/hostname link && mkdir d && ln -s /etc dlink").ok
    with pytest.raises(OSError):
        sb.read_file("link")
    with pytest.raises(OSError):
        sb.read_file("dlink/hostname")
    with pytest.raises(OSError):
        sb.write_file("dlink/glm5-escape", "x")
    assert not Path("/etc/glm5-escape").exists()
    with pytest.raises(OSError):
        sb.list_dir("dlink")
    assert sb.walk_files() == []  # links are not files of the work directory
    with pytest.raises(ValueError, match="without '..'"):
        sb.read_file("../outside")
    with pytest.raises(ValueError, match="relative path"):
        sb.write_file("/etc/passwd", "x")
    assert sb.run("mkfifo fifo").ok
    with pytest.raises(ValueError, match="regular file"):
        sb.read_file("fifo")


# --------------------------------------------------------------------------------- escapes
def _connect_program(port: int) -> str:
    return ("import socket, sys\n"
            "s = socket.socket(); s.settimeout(3)\n"
            f"try:\n    s.connect(('127.0.0.1', {port}))\n"
            "except OSError as e:\n    print('blocked', type(e).__name__, e); sys.exit(7)\n"
            "print('connected')\n")


def test_network_is_cut(mode, make):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        sb = make(mode)
        if not sb.capabilities()["network_isolated"]:  # no namespaces at all: said so
            assert any("network not isolated" in w for w in sb.capabilities()["warnings"])
            pytest.skip("no network namespace can be made here")
        r = sb.run([sb.python, "-c", _connect_program(port)])
        assert r.returncode == 7 and r.reason == "error" and "blocked" in r.stdout, r
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host
        # the open twin: with the network allowed the same program reaches the host
        sb_open = make(mode, network=True)
        assert not sb_open.capabilities()["network_isolated"]
        r = sb_open.run([sb_open.python, "-c", _connect_program(port)])
        assert r.ok and r.stdout == "connected\n", r
        conn, _ = server.accept()
        conn.close()
    finally:
        server.close()


def test_writing_outside_the_work_dir_fails(mode, make, tmp_path):
    if mode == "rlimits":
        pytest.skip("rlimits mode shows the host (capabilities say so)")
    sb = make(mode)
    name = f"glm5-escape-{uuid.uuid4().hex[:8]}"
    targets = [tmp_path / name, REPO / name, Path.home() / name, Path("/etc") / name,
               Path("/usr") / name, Path("/") / name, Path(S.SANDBOX_VENV) / name,
               Path(sys.base_prefix) / name]
    for t in targets:
        r = sb.run(f"echo x > '{t}'")
        assert not t.exists(), t
        if str(t).startswith("/tmp/"):  # the sandbox's own /tmp: a file there stays there
            continue
        assert r.reason == "error" and r.returncode != 0, (t, r)
        assert ("Read-only file system" in r.stderr or "nonexistent" in r.stderr
                or "No such file" in r.stderr or "Permission denied" in r.stderr), (t, r)
        assert not t.exists(), t
    # inside: /work is the host work directory, /tmp is the session's own
    assert sb.run(f"echo in > /work/{name} && echo t > /tmp/{name}").ok
    assert (sb.workdir / name).read_text() == "in\n"
    assert not (Path("/tmp") / name).exists()
    caps = sb.capabilities()
    assert caps["filesystem_isolated"] and caps["sessions_isolated"] and caps["pid_namespace"]
    r = sb.run("cat /etc/shadow /etc/gshadow")  # of /etc, only what programs need is there
    assert r.reason == "error" and "No such file" in r.stderr, r
    # no capabilities inside, and not uid 0 (65534 in a user namespace, else the host uid)
    r = sb.run("grep CapEff /proc/self/status; id -u")
    assert r.ok and r.stdout.split()[:2] == ["CapEff:", "0000000000000000"], r
    assert r.stdout.split()[2] == str(S.SANDBOX_UID if caps["user_namespace"]
                                      else sb.host_uid) != "0"


def test_extra_binds_are_read_only_and_the_interpreter_optional(make, tmp_path):
    require_bwrap()
    os.chmod(tmp_path, 0o755)  # the file must be readable by the commands' uid
    data = tmp_path / "data"
    data.mkdir()
    (data / "in.txt").write_text("host data")
    sb = make("bwrap", ro_binds=((str(data), "/data"),), python=False)
    assert sb.python == "python3"
    r = sb.run("cat /data/in.txt; ls /opt/venv")
    assert r.stdout == "host data" and "No such file" in r.stderr, r  # no venv without python
    r = sb.run("echo changed > /data/in.txt")
    assert r.reason == "error" and "Read-only file system" in r.stderr, r
    assert (data / "in.txt").read_text() == "host data"


def test_another_sessions_files_are_out_of_reach(make):
    require_bwrap()
    a, b = make("bwrap"), make("bwrap")
    assert a.run("echo top-secret > secret.txt").ok
    assert (a.workdir / "secret.txt").exists()
    for cmd in (f"cat '{a.workdir}/secret.txt'", f"ls '{a.workdir.parent}'",
                "cat /work/secret.txt"):
        r = b.run(cmd)
        assert r.reason == "error" and "top-secret" not in r.stdout, (cmd, r)
    r = b.run("ls -A /tmp /work")
    assert r.ok and r.stdout == "/tmp:\n\n/work:\n", r  # nothing of A's, nor of the host's
    r = b.run(["ps", "-e", "-o", "pid=,comm="])
    assert r.ok and r.stdout.split() == ["1", "bwrap", "2", "ps"], r  # its own namespace


def test_rlimits_mode_reports_what_it_does_not_enforce(make, caplog):
    caplog.set_level(logging.WARNING, logger="glm5.rl.envs")
    a, b = make("rlimits"), make("rlimits")
    caps = b.capabilities()
    assert caps["mode"] == "rlimits" and not caps["filesystem_isolated"]
    assert not caps["sessions_isolated"] and not caps["pid_namespace"]
    assert any("no filesystem isolation" in w for w in caps["warnings"])
    assert "no filesystem isolation" in caplog.text
    assert caps["network_isolated"] == (sandbox_probe.netns_probe() == "")
    assert caps["ipc"] == "System V IPC denied by seccomp"
    assert a.run("echo visible > f.txt").ok
    r = b.run(f"cat '{a.workdir}/f.txt'")
    if ROOT:  # each session has a uid of its own: A's 0700 work directory is closed to B
        assert r.reason == "error" and "Permission denied" in r.stderr, r
    else:  # what the report says is true: B reads A's file in this mode
        assert r.stdout == "visible\n"
    with pytest.raises(ValueError, match="ro_binds"):
        Sandbox(SandboxConfig(mode="rlimits", ro_binds=("/usr",),
                              unsafe_rlimits_as_root=True))


# The bomb wants 1 + 6 + 36 + 216 = 259 processes (each forks 6 children, 3 levels deep, and
# retries refused forks until killed): far past the limit of 12, yet bounded so that a broken
# limit cannot take the host down with it.
_FORK_BOMB = """
import os, sys, time
depth = made = 0
while made < 6 and depth < 3:
    try:
        pid = os.fork()
    except OSError:
        time.sleep(0.005)
        continue
    if pid == 0:
        depth, made = depth + 1, 0
    else:
        made += 1
time.sleep(60)
"""


def test_a_fork_bomb_is_bounded_and_killed(mode, make):
    sb = make(mode, max_processes=12)
    limit = sb.capabilities()["limits"]["max_processes"]
    assert limit is not None  # a pids cgroup, else RLIMIT_NPROC of a non-root uid
    marker = f"glm5-forkbomb-{uuid.uuid4().hex[:8]}"
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], len(procs_with(marker)))
            time.sleep(0.02)

    # RLIMIT_NPROC (no pids cgroup, non-root) counts the user's other tasks too: what they
    # were when the command started is the command's extra room
    others = 0
    if limit.startswith("RLIMIT_NPROC") and not ROOT:
        skip = os.readlink("/proc/self/ns/user") if mode.startswith("bwrap") else None
        others = sandbox_launch.tasks_of(sb.host_uid, skip)
    sampler = threading.Thread(target=sample)
    sampler.start()
    t = time.monotonic()
    try:
        r = sb.run([sb.python, "-c", _FORK_BOMB, marker], timeout=2)
    finally:
        stop.set()
        sampler.join()
    assert r.reason == "timeout", r
    assert time.monotonic() - t < 10
    if limit.startswith("cgroup"):  # the cgroup counts what it refused: reported
        assert r.forks_refused > 0 and f"refused {r.forks_refused} forks" in r.detail, r
    assert 6 <= peak[0] <= 12 + others, (peak, others)
    time.sleep(0.1)
    assert procs_with(marker) == []  # nothing left on the host
    assert sb.run(["true"]).ok  # and the session still works


def test_a_memory_bomb_hits_the_memory_limit(mode, make):
    sb = make(mode, memory_bytes=256 << 20)
    r = sb.run([sb.python, "-c", "b = bytearray(2 << 30); print('allocated')"])
    assert r.reason == "memory_limit" and "allocated" not in r.stdout, r
    assert "MemoryError" in r.stderr
    assert sb.run([sb.python, "-c", "b = bytearray(32 << 20); print(len(b))"]).ok
    # the open twin: without the limit the same allocation's failure would be "error"-free
    assert sandbox_config.classify(timed_out=False, rc=1, sig=None, cpu_s=0.0,
                                   stderr="MemoryError", config=SandboxConfig(memory_bytes=None),
                                   timeout=1.0, bwrap=False)[0] == "error"


def test_an_endless_loop_hits_the_cpu_limit(mode, make):
    sb = make(mode, cpu_seconds=1)
    t = time.monotonic()
    r = sb.run([sb.python, "-c", "while True: pass"])
    assert r.reason == "cpu_limit" and r.signal == 24, r  # SIGXCPU
    assert time.monotonic() - t < 10
    assert r.cpu_s >= 0.9 if mode == "rlimits" else r.cpu_s is None  # bwrap: not measured
    assert "CPU limit of 1 s" in r.detail


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "no-cgroup"])
def test_the_wall_clock_limit_kills_everything(mode, make, cgroup):
    sb = make(mode, cpu_seconds=None, max_processes=64 if cgroup else None)
    containment = sb.capabilities()["containment"]
    if mode.startswith("bwrap"):
        assert containment == "pid namespace"
    elif cgroup and containment != "cgroup":
        pytest.skip("no writable pids cgroup here")
    marker, escaper = (f"8{uuid.uuid4().int % 10**6}.5" for _ in range(2))
    t = time.monotonic()
    r = sb.run(f"sleep {marker} & setsid sleep {escaper} & sleep 60", timeout=1)
    wall = time.monotonic() - t
    assert r.reason == "timeout" and 1 <= wall < 4 and r.returncode == -9, r
    time.sleep(0.1)
    assert procs_with(marker) == []
    left = procs_with(escaper)
    for pid in left:  # the documented gap of rlimits mode without a cgroup, cleaned up
        os.kill(pid, 9)
    if containment.startswith("process group"):
        assert len(left) == 1  # what capabilities() says is true: setsid() escapes
    else:
        assert left == []


_SYSCALLS = """
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def report(name, r):
    e = ctypes.get_errno()
    print(name, 'ok' if r != -1 else errno.errorcode.get(e, e), flush=True)
for what in sys.argv[1:]:
    if what == 'unshare':
        report('unshare', libc.unshare(0x10000000))  # CLONE_NEWUSER
    elif what == 'clone':  # a raw clone(CLONE_NEWUSER | SIGCHLD), as fork
        r = libc.syscall(int(os.environ['NR_CLONE']), 0x10000000 | 17, 0, 0, 0, 0)
        if r == 0:
            os._exit(0)
        if r > 0:
            os.waitpid(r, 0)
        report('clone', r)
    elif what == 'clone3':  # clone3 with CLONE_NEWUSER: its flags sit in memory
        args = (ctypes.c_uint64 * 11)(0x10000000, 0, 0, 0, 17)  # flags, ..., exit_signal
        r = libc.syscall(int(os.environ['NR_CLONE3']), ctypes.byref(args), 88)
        if r == 0:
            os._exit(0)
        if r > 0:
            os.waitpid(r, 0)
        report('clone3', r)
    elif what == 'ptrace':
        report('ptrace', libc.ptrace(0, 0, 0, 0))  # PTRACE_TRACEME
"""


def test_denied_system_calls_fail_with_eperm(mode, make):
    lib, why = sandbox_seccomp.libseccomp()
    if lib is None:
        pytest.skip(why)
    env = {f"NR_{n.upper()}": str(lib.seccomp_syscall_resolve_name(n.encode()))
           for n in ("clone", "clone3")}
    sb = make(mode, env=env)
    caps = sb.capabilities()
    assert caps["seccomp"] and caps["seccomp_action"] == "errno"
    assert {"ptrace", "unshare", "mount", "bpf", "setns"} <= set(caps["seccomp_denied"])
    r = sb.run([sb.python, "-c", _SYSCALLS, "unshare", "clone", "clone3", "ptrace"])
    assert r.ok and r.stdout.split("\n")[:4] == [
        "unshare EPERM", "clone EPERM", "clone3 ENOSYS", "ptrace EPERM"], r
    # the open twin: the same calls go through without the filter
    sb_open = make(mode, seccomp=False, env=env)
    assert not sb_open.capabilities()["seccomp"]
    # (unshare last: after it the process's uid is unmapped and may not nest namespaces)
    r = sb_open.run([sb.python, "-c", _SYSCALLS, "clone", "clone3", "unshare"])
    assert r.ok and r.stdout.split("\n")[:3] == ["clone ok", "clone3 ok", "unshare ok"], r


def test_a_denied_system_call_can_end_the_command(mode, make):
    if sandbox_seccomp.libseccomp()[0] is None:
        pytest.skip(sandbox_seccomp.libseccomp()[1])
    sb = make(mode, seccomp_action="kill")
    r = sb.run([sb.python, "-c", _SYSCALLS, "ptrace"])
    assert r.reason == "seccomp" and r.signal == 31 and r.stdout == "", r  # SIGSYS
    assert sb.run([sb.python, "-c", "print('fine')"]).ok  # other calls are untouched


def test_the_file_size_limit(mode, make):
    sb = make(mode, file_size_bytes=1 << 20)
    r = sb.run([sb.python, "-c", "open('big', 'wb').write(b'x' * (2 << 20))"])
    assert r.reason == "file_size_limit" and "File too large" in r.stderr, r
    r = sb.run("head -c 2097152 /dev/zero > big2")  # SIGXFSZ for a program that keeps it
    assert r.reason == "file_size_limit" and r.signal == 25, r
    for f in ("big", "big2"):
        assert (sb.workdir / f).stat().st_size <= 1 << 20
    assert sb.run("head -c 1000 /dev/zero > small").ok


def test_too_many_open_files(mode, make):
    sb = make(mode, open_files=32)
    r = sb.run([sb.python, "-c", "fs = [open('/dev/null') for _ in range(64)]"])
    assert r.reason == "error" and "Too many open files" in r.stderr, r


# ---------------------------------------------------------------------------- reporting
def test_missing_libseccomp_is_reported_and_the_sandbox_runs_without(monkeypatch, make,
                                                                    caplog):
    caplog.set_level(logging.WARNING, logger="glm5.rl.envs")
    monkeypatch.setattr(sandbox_seccomp, "LIBSECCOMP", "libglm5-no-such-seccomp.so.2")
    sb = make("rlimits")
    caps = sb.capabilities()
    assert not caps["seccomp"] and caps["seccomp_denied"] == []
    assert "libglm5-no-such-seccomp" in caps["seccomp_error"]
    assert "no seccomp filter" in caplog.text
    assert sb.run(["true"]).ok


def test_bwrap_missing_falls_back_or_fails_as_asked(monkeypatch, make, caplog):
    caplog.set_level(logging.WARNING, logger="glm5.rl.envs")
    monkeypatch.setattr(S.shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(SandboxError, match="bwrap not found"):
        Sandbox(SandboxConfig(mode="bwrap"))
    sb = make("auto", unsafe_rlimits_as_root=ROOT)
    assert sb.mode == "rlimits" and sb.capabilities()["mode_note"] == "bwrap not found on PATH"
    assert "rlimits mode" in caplog.text


def test_sandbox_report_and_overhead():
    rep = S.sandbox_report()
    assert rep["mode"] == ("bwrap" if rep["bwrap"]["works"] else "rlimits")
    assert rep["enforced"]["mode"] == rep["mode"]
    assert set(rep) >= {"bwrap", "libseccomp", "pids_cgroup", "root", "warnings"}
    if IN_CI:
        assert rep["bwrap"]["works"], rep["bwrap"]
    assert not rep["refused_as_root"] or rep["mode"] == "rlimits"
    e = rep["enforced"]
    assert {"host_uid", "uid_inside", "no_new_privs", "proc_sys", "file_io", "gaps",
            "work_dir"} <= set(e) and not e["runs_as_host_root"]
    o = S.measure_overhead(runs=3)
    assert o["direct_ms"] > 0 and o["rlimits_ms"] > 0 and o["rlimits_session_ms"] > 0
    assert ("bwrap_ms" in o) == rep["bwrap"]["works"]
    with pytest.raises(ValueError, match="runs"):
        S.measure_overhead(runs=0)


@pytest.mark.parametrize("kwargs,match", [
    ({"cpu_seconds": 0}, "SandboxConfig.cpu_seconds"),
    ({"memory_bytes": 1024}, "SandboxConfig.memory_bytes"),
    ({"max_processes": True}, "SandboxConfig.max_processes"),
    ({"wall_seconds": -1}, "SandboxConfig.wall_seconds"),
    ({"output_bytes": 1}, "SandboxConfig.output_bytes"),
    ({"network": "no"}, "SandboxConfig.network"),
    ({"mode": "docker"}, "SandboxConfig.mode"),
    ({"seccomp_action": "trap"}, "SandboxConfig.seccomp_action"),
    ({"env": {"A=B": "x"}}, "SandboxConfig.env"),
    ({"ro_binds": "/usr"}, "SandboxConfig.ro_binds"),
    ({"ro_binds": ("/no/such/glm5",)}, "existing absolute host path"),
    ({"ro_binds": (("/usr", "/work/usr"),)}, "outside /work"),
    ({"ro_binds": (("/usr", "/tmp/usr"),)}, "outside /tmp"),
    ({"disk_bytes": 1024}, "SandboxConfig.disk_bytes"),
    ({"tmp_bytes": True}, "SandboxConfig.tmp_bytes"),
    ({"host_uid": 0}, "SandboxConfig.host_uid"),
    ({"host_uid": 2**32 - 1}, "SandboxConfig.host_uid"),
    ({"unsafe_rlimits_as_root": "yes"}, "SandboxConfig.unsafe_rlimits_as_root"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SandboxConfig(**kwargs)


def test_run_rejects_bad_arguments(make):
    sb = make("rlimits")
    for kw, match in (({"cmd": []}, r"Sandbox.run\(cmd\)"), ({"cmd": b"ls"}, r"run\(cmd\)"),
                      ({"cmd": ["ls", 1]}, r"run\(cmd\)"), ({"cmd": "  "}, r"run\(cmd\)"),
                      ({"cmd": ["true"], "timeout": 0}, r"run\(timeout\)"),
                      ({"cmd": ["true"], "stdin": 5}, r"run\(stdin\)")):
        with pytest.raises(ValueError, match=match):
            sb.run(**kw)
    with pytest.raises(ValueError, match=r"Sandbox\(config\)"):
        Sandbox({"mode": "rlimits"})  # type: ignore[arg-type]
