"""glm5.cpu_threads: the one decision of how many threads torch's and TVM's CPU pools get
(affinity mask, cgroup CPU quota, GLM5_CPU_THREADS) and how idle pool threads wait (no
spinning: OMP_WAIT_POLICY=PASSIVE set by `import glm5` before torch loads OpenMP; TVM threads
neither pinned nor spinning). Why: docs/performance.md, "CPU under load"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from glm5 import cpu_threads
from glm5.cpu_threads import CPUThreadsError, ThreadDecision

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the decision
@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A fake machine: ``cpus`` in the affinity mask, cgroup files under tmp_path. Returns a
    function (cgroup lines, {relative path: text}) that writes /proc/self/cgroup and the cgroup
    files."""
    monkeypatch.delenv(cpu_threads.OVERRIDE, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(cpu_threads, "CGROUP_ROOT", str(root))
    self_cg = tmp_path / "self_cgroup"
    monkeypatch.setattr(cpu_threads, "SELF_CGROUP", str(self_cg))

    def setup(lines: str, files: dict[str, str], cpus: int = 8) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
        self_cg.write_text(lines)
        for rel, text in files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)

    return setup


def test_affinity_without_quota(machine):
    machine("0::/\n", {"cpu.max": "max 100000\n"}, cpus=6)
    assert cpu_threads.decide() == ThreadDecision(6, "affinity", 6, None, None)


def test_cgroup_v2_quota_caps_the_affinity(machine, tmp_path):
    machine("0::/\n", {"cpu.max": "200000 100000\n"})
    d = cpu_threads.decide()
    assert (d.threads, d.source, d.affinity, d.quota) == (2, "cgroup cpu quota", 8, 2.0)
    assert d.quota_file == str(tmp_path / "cgroup" / "cpu.max")


def test_cgroup_v2_tightest_ancestor_rounds_down(machine):
    # the job's own cgroup has no limit; its parent grants 1.5 CPUs: 2 threads would be
    # throttled every period, so 1
    machine("0::/jobs/one\n", {"jobs/cpu.max": "150000 100000", "jobs/one/cpu.max": "max 100000",
                               "cpu.max": "400000 100000"})
    d = cpu_threads.decide()
    assert (d.threads, d.source, d.quota) == (1, "cgroup cpu quota", 1.5)


def test_quota_above_the_affinity_leaves_the_affinity(machine):
    machine("0::/\n", {"cpu.max": "800000 100000"}, cpus=2)
    d = cpu_threads.decide()
    assert (d.threads, d.source, d.quota) == (2, "affinity", 8.0)


def test_small_quota_still_gets_one_thread(machine):
    machine("0::/\n", {"cpu.max": "50000 100000"})
    assert cpu_threads.decide().threads == 1


def test_cgroup_v1_quota_at_the_mount_top(machine):
    # a container: /proc/self/cgroup names the host's path, the mount is the container's cgroup
    machine("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "300000", "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    d = cpu_threads.decide()
    assert (d.threads, d.source, d.quota) == (3, "cgroup cpu quota", 3.0)


def test_cgroup_v1_minus_one_is_no_quota(machine):
    machine("3:cpu,cpuacct:/\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert cpu_threads.decide() == ThreadDecision(8, "affinity", 8, None, None)


def test_override_wins_over_affinity_and_quota(machine, monkeypatch):
    machine("0::/\n", {"cpu.max": "100000 100000"}, cpus=2)
    monkeypatch.setenv(cpu_threads.OVERRIDE, "5")
    d = cpu_threads.decide()
    assert (d.threads, d.source, d.quota) == (5, "GLM5_CPU_THREADS", 1.0)


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5", "4 threads"])
def test_bad_override_is_a_clear_error(machine, monkeypatch, bad):
    machine("0::/\n", {})
    monkeypatch.setenv(cpu_threads.OVERRIDE, bad)
    with pytest.raises(CPUThreadsError) as e:
        cpu_threads.decide()
    msg = str(e.value)
    assert "GLM5_CPU_THREADS" in msg and "positive integer" in msg and repr(bad) in msg


def test_empty_override_is_unset(machine, monkeypatch):
    machine("0::/\n", {}, cpus=3)
    monkeypatch.setenv(cpu_threads.OVERRIDE, " ")
    assert cpu_threads.decide().source == "affinity"


def test_bad_override_stops_the_cpu_backend_before_tvm_starts(monkeypatch):
    from glm5.backends import cpu as cpu_backend

    monkeypatch.setattr(cpu_backend, "_ctx", None)
    monkeypatch.setenv(cpu_threads.OVERRIDE, "many")
    with pytest.raises(CPUThreadsError, match="GLM5_CPU_THREADS"):
        cpu_backend.context()
    assert cpu_backend._ctx is None


# ----------------------------------------------------------------------------- applying it
class FakeTorchThreads:
    """torch.get/set_num_threads without touching the real pool."""

    def __init__(self, monkeypatch, n: int) -> None:
        self.n = n
        monkeypatch.setattr(torch, "get_num_threads", lambda: self.n)
        monkeypatch.setattr(torch, "set_num_threads", self.set)

    def set(self, n: int) -> None:
        self.n = n


def test_apply_sets_tvm_pool_knobs_and_keeps_the_users(machine):
    machine("0::/\n", {"cpu.max": "300000 100000"})
    env = {"TVM_THREAD_POOL_SPIN_COUNT": "50"}  # the user's own choice is kept
    out = cpu_threads.apply(env)
    assert env == {"TVM_NUM_THREADS": "3", "TVM_BIND_THREADS": "0",
                   "TVM_THREAD_POOL_SPIN_COUNT": "50"}
    assert out["tvm_env"] == env and out["decision"].threads == 3


def test_apply_lowers_torch_to_the_quota(machine, monkeypatch):
    machine("0::/\n", {"cpu.max": "200000 100000"})
    t = FakeTorchThreads(monkeypatch, 8)  # torch's default: the affinity mask
    out = cpu_threads.apply({})
    assert t.n == 2 and out["torch_threads"] == 2


def test_apply_never_raises_torch_without_the_override(machine, monkeypatch):
    machine("0::/\n", {})
    t = FakeTorchThreads(monkeypatch, 1)  # the user chose 1 thread
    cpu_threads.apply({})
    assert t.n == 1


def test_apply_override_sets_torch_both_ways(machine, monkeypatch):
    machine("0::/\n", {}, cpus=2)
    t = FakeTorchThreads(monkeypatch, 2)
    env = {cpu_threads.OVERRIDE: "3"}
    cpu_threads.apply(env)
    assert t.n == 3 and env["TVM_NUM_THREADS"] == "3"


def test_apply_leaves_torch_to_omp_num_threads(machine, monkeypatch):
    machine("0::/\n", {"cpu.max": "100000 100000"})
    t = FakeTorchThreads(monkeypatch, 4)
    cpu_threads.apply({"OMP_NUM_THREADS": "4"})
    assert t.n == 4


def test_cpu_backend_sets_the_knobs_before_tvm_starts(monkeypatch):
    from glm5.backends import cpu as cpu_backend

    monkeypatch.setattr(cpu_backend, "_ctx", None)
    for k in ("TVM_NUM_THREADS", "TVM_BIND_THREADS", "TVM_THREAD_POOL_SPIN_COUNT",
              cpu_threads.OVERRIDE):
        monkeypatch.setenv(k, "")  # so that teardown restores what was there before
        monkeypatch.delenv(k)
    FakeTorchThreads(monkeypatch, torch.get_num_threads())
    cpu_backend.context()
    want = cpu_threads.tvm_env(cpu_threads.decide())
    assert {k: os.environ[k] for k in want} == want
    assert want["TVM_BIND_THREADS"] == "0" and want["TVM_THREAD_POOL_SPIN_COUNT"] == "0"


# ----------------------------------------------------------------------------- OpenMP waiting
def test_quiet_openmp_sets_passive_before_openmp_loads(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_openmp_loaded", lambda: False)
    env: dict[str, str] = {}
    s = cpu_threads.quiet_openmp(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"} and s["by"] == "glm5" and not s["spinning"]


def test_quiet_openmp_keeps_the_users_policy(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_openmp_loaded", lambda: False)
    env = {"OMP_WAIT_POLICY": "active"}
    s = cpu_threads.quiet_openmp(env)
    assert env == {"OMP_WAIT_POLICY": "active"} and s["spinning"]
    assert cpu_threads.spinning_warning() is None  # the user asked for it


def test_quiet_openmp_after_openmp_loaded_warns(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_openmp_loaded", lambda: True)
    env: dict[str, str] = {}
    s = cpu_threads.quiet_openmp(env)
    # setting it now would not reach this process's pool, only child processes
    assert env == {} and s["spinning"]
    assert "OMP_WAIT_POLICY=PASSIVE" in cpu_threads.spinning_warning()


def _libgomp_spin_count(code: str) -> tuple[str | None, dict]:
    """Run ``code`` in a fresh Python; libgomp's spin count as it prints it at start-up, and
    the JSON the code prints last."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    spin = [line.split("=", 1)[1].strip().strip("'") for line in out.stderr.splitlines()
            if line.strip().startswith("GOMP_SPINCOUNT")]
    return (spin[0] if spin else None), json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh Pythons importing torch
def test_import_glm5_first_makes_torchs_openmp_sleep():
    """End to end, as libgomp itself reports it: glm5 imported before torch -> spin count 0;
    torch first -> libgomp spins and glm5 says so (doctor, the cpu backend's warning)."""
    report = ("import json; from glm5 import cpu_threads as c; "
              "print(json.dumps(c.openmp_state()))")
    spin, state = _libgomp_spin_count("import glm5, torch; torch.ones(1); " + report)
    if spin is None:
        pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT to read)")
    assert spin == "0" and state == {"policy": "PASSIVE", "by": "glm5", "spinning": False}
    spin, state = _libgomp_spin_count("import torch, glm5; " + report)
    assert spin != "0" and state["spinning"]


# ----------------------------------------------------------------------------- TVM placement
@pytest.mark.slow  # a fresh Python running a TVM kernel
def test_tvm_pool_size_from_the_decision_and_the_process_affinity_kept():
    """In a fresh process given one CPU and GLM5_CPU_THREADS=n (n: the machine's CPUs, at most
    4; TVM caps its pool there, and its own default is half of them): TVM's pool and torch's
    have n threads, and every thread stays on the one CPU. (TVM pinned its calling thread to
    CPU 0 when its pool started, even where the process may only run on another CPU, and each
    worker to one core; TVM_BIND_THREADS=0 leaves the mask the process was given.)"""
    pytest.importorskip("tvm")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2 or cpus[-1] == 0:
        pytest.skip("needs 2 CPUs: one to run on, CPU 0 for TVM to move the thread to")
    code = textwrap.dedent(f"""
        import json, os
        os.sched_setaffinity(0, {{{cpus[-1]}}})
        import glm5, torch
        x = torch.randn(4, 64)
        with glm5.use_backend("cpu"):
            glm5.ops.rms_norm(x, torch.ones(64), 1e-6)
        from glm5.kernels.tvm.sparse_attention import threads
        print(json.dumps({{"tvm_threads": threads(), "torch_threads": torch.get_num_threads(),
                          "affinity": [sorted(os.sched_getaffinity(int(t)))
                                       for t in os.listdir("/proc/self/task")]}}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")]))
    for k in ("TVM_BIND_THREADS", "TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        env.pop(k, None)
    n = min(os.cpu_count() or 1, 4)
    env[cpu_threads.OVERRIDE] = str(n)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["tvm_threads"] == n and r["torch_threads"] == n, r
    assert all(a == [cpus[-1]] for a in r["affinity"]), r


# ----------------------------------------------------------------------------- glm5 doctor
def test_doctor_reports_the_decision_and_warns_on_a_bad_override(monkeypatch):
    from glm5 import doctor

    monkeypatch.setenv(cpu_threads.OVERRIDE, "3")
    r = doctor.doctor_report([], [])
    th = r["cpu"]["threads"]
    assert (th["threads"], th["source"], th["error"]) == (3, "GLM5_CPU_THREADS", None)
    text = doctor.format_report(r, lambda rows: "")
    assert "cpu threads  3 (from GLM5_CPU_THREADS" in text and "OpenMP wait" in text
    assert not [w for w in r["warnings"] if w["source"] == "cpu" and "GLM5_CPU" in w["message"]]
    monkeypatch.setenv(cpu_threads.OVERRIDE, "lots")
    r = doctor.doctor_report([], [])
    assert "GLM5_CPU_THREADS" in r["cpu"]["threads"]["error"]
    assert [w for w in r["warnings"] if w["source"] == "cpu" and "'lots'" in w["message"]]
