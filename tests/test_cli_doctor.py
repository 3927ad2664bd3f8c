"""`glm5 doctor`: every section in text and in JSON, the warning (with its fix) when the RL
sandbox has to run in the weaker rlimits mode, `--strict`'s exit status, and no optional
dependency imported to report it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from glm5 import cli, doctor
from glm5.rl.envs import sandbox, sandbox_probe

SECTIONS = ("Python", "Torch", "CPU", "Backends",
            "Optional dependencies (found without importing them)",
            "Tuning cache (glm5 tune)", "RL sandbox (glm5.rl.envs.sandbox)", "Warnings")


def _doctor(capsys, *args: str) -> tuple[int, str]:
    rc = cli.main(["doctor", *args])
    return rc, capsys.readouterr().out


def _no_bwrap(monkeypatch, path: str | None) -> None:
    """Make the sandbox see bwrap as missing (``path`` None) or as refused by the kernel."""
    why = ("bwrap not found on PATH" if path is None else
           "bwrap cannot create a sandbox here (userns: exit 1: bwrap: No permissions to "
           "create new namespace)")
    info = sandbox_probe.BwrapInfo(path, False, False,
                                   "" if path is None else "bubblewrap 0.8.0", why)
    monkeypatch.setattr(sandbox_probe, "bwrap_probe", lambda: info)


def test_text_has_every_section(capsys):
    rc, out = _doctor(capsys)
    assert rc == 0
    lines = out.splitlines()
    for s in SECTIONS:
        assert s in lines, f"section {s!r} missing:\n{out}"
    from glm5.perf.measure import cpu_model
    import torch

    assert f"  version      {torch.__version__}" in lines
    assert any(ln.startswith("  model ") and cpu_model() in ln for ln in lines)
    # every discovered backend has a row, the reference always usable
    assert any(ln.split()[:3] == ["reference", "any", "yes"] for ln in lines), out
    for name, _, _ in doctor.OPTIONAL_DEPS:
        assert any(ln.split()[:1] == [name] for ln in lines), f"{name} not listed:\n{out}"
    mode = sandbox.sandbox_report()["mode"]
    assert any(ln.startswith(f"  mode         {mode}") for ln in lines), out
    # who commands run as, and what the mode leaves open, are stated
    runs = next(ln for ln in lines if ln.startswith("  runs as      host uid "))
    assert "no capabilities, no_new_privs" in runs
    assert ("one of their own per session" in runs) == (os.geteuid() == 0)
    assert any(ln.startswith("  file access  ") for ln in lines), out
    if mode == "bwrap":
        assert "  work dir     a tmpfs in a mount namespace" in out


def test_json_is_one_object_with_every_section(capsys):
    rc, out = _doctor(capsys, "--json")
    assert rc == 0
    r = json.loads(out)
    assert set(r) == {"python", "torch", "cpu", "backends", "plugins", "optional", "sandbox",
                      "tuning_cache", "warnings"}
    assert r["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert r["cpu"]["usable_cores"] >= 1 and r["cpu"]["torch_threads"] >= 1
    assert "torch_isa" in r["cpu"]["features"]
    names = {b["name"] for b in r["backends"]}
    assert {"reference", "cpu"} <= names
    assert next(b for b in r["backends"] if b["name"] == "reference")["available"] is True
    assert [d["name"] for d in r["optional"]] == [n for n, _, _ in doctor.OPTIONAL_DEPS]
    for d in r["optional"]:
        assert d["installed"] == (doctor.importlib.util.find_spec(d["name"]) is not None)
    assert r["sandbox"]["mode"] in ("bwrap", "rlimits")
    assert {"bwrap", "libseccomp", "pids_cgroup", "enforced"} <= set(r["sandbox"])


def test_weaker_sandbox_mode_warns_with_what_is_missing_and_the_fix(capsys, monkeypatch):
    _no_bwrap(monkeypatch, None)
    rc, out = _doctor(capsys)
    assert rc == 0  # a warning is not a failure without --strict
    assert "  mode         rlimits (WEAKER: no filesystem or process isolation)" in out
    assert "  bwrap        not usable: bwrap not found on PATH" in out
    warning = [ln for ln in out.splitlines() if ln.startswith("  WARNING (sandbox): ")]
    assert len(warning) >= 1, out
    w = warning[0]
    assert "weaker rlimits mode (bwrap not found on PATH)" in w
    assert "no mount namespace" in w and "writable" in w
    assert "no PID, IPC or UTS namespace" in w
    if os.geteuid() == 0:  # refused by default, and said so where the mode is shown
        assert "unsafe_rlimits_as_root" in w
        assert "; REFUSED as root unless unsafe_rlimits_as_root=True" in out
    fix = out.splitlines()[out.splitlines().index(w) + 1]
    assert fix.startswith("    fix: install bubblewrap (`apt-get install bubblewrap`")
    # the sandbox's own terse line is replaced by this one, not repeated
    assert "rlimits mode (bwrap not found on PATH): no filesystem isolation" not in out

    rc, out = _doctor(capsys, "--json")
    r = json.loads(out)
    assert r["sandbox"]["mode"] == "rlimits"
    w = r["warnings"][0]
    assert w["source"] == "sandbox" and "weaker rlimits mode" in w["message"]
    assert "apt-get install bubblewrap" in w["fix"]


def test_bwrap_refused_by_the_kernel_points_at_user_namespaces(capsys, monkeypatch):
    _no_bwrap(monkeypatch, "/usr/bin/bwrap")
    rc, out = _doctor(capsys, "--json")
    w = json.loads(out)["warnings"][0]
    assert "weaker rlimits mode (bwrap cannot create a sandbox here" in w["message"]
    assert "user namespaces" in w["fix"] and "apt-get" not in w["fix"]


def test_strict_exits_1_on_any_warning(capsys, monkeypatch):
    _no_bwrap(monkeypatch, None)
    assert _doctor(capsys, "--strict")[0] == 1
    assert _doctor(capsys, "--strict", "--json")[0] == 1
    assert _doctor(capsys)[0] == 0
    monkeypatch.undo()
    real = doctor.doctor_report
    monkeypatch.setattr(doctor, "doctor_report", lambda *a: {**real(*a), "warnings": []})
    rc, out = _doctor(capsys, "--strict")
    assert rc == 0 and "Warnings\n  none" in out
    one = {"source": "backends", "message": "plugin x failed", "fix": None}
    monkeypatch.setattr(doctor, "doctor_report", lambda *a: {**real(*a), "warnings": [one]})
    rc, out = _doctor(capsys, "--strict")
    assert rc == 1 and "  WARNING (backends): plugin x failed" in out


def test_a_sandbox_that_cannot_be_set_up_is_reported_not_raised(capsys, monkeypatch):
    def broken():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sandbox, "sandbox_report", broken)
    rc, out = _doctor(capsys, "--strict")
    assert rc == 1
    assert "  error        the sandbox could not be set up: OSError" in out
    assert "  WARNING (sandbox): the sandbox could not be set up" in out


def test_no_optional_dependency_is_imported():
    code = ("import contextlib, io, sys\nfrom glm5 import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    cli.main(['doctor', '--json'])\n"
            "print(sorted(m for m in %r if m in sys.modules))"
            % ([n for n, _, _ in doctor.OPTIONAL_DEPS] + ["torch_npu"],))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_tuning_cache_files_are_listed(capsys, monkeypatch, tmp_path):
    """The tuning cache's files with their ops and whether they apply (a stale one says so)."""
    from glm5.backends import tuning_cache as tc

    monkeypatch.setenv(tc.ENV, str(tmp_path))
    tc.write(tc.path_for("cuda", "NVIDIA-H200-sm90"), {"attention": {"BLOCK_N": 32}},
             {"kernels": tc.kernels_hash(), "device": "NVIDIA H200", "date": "d1"})
    tc.write(tc.path_for("cpu", "X-vnni-2t"), {"quant_linear": {"vnni/w8a8/float32": 8}},
             {"kernels": "0" * 16, "device": "X", "date": "d2"})
    rc, out = _doctor(capsys, "--json")
    files = {(f["backend"], f["key"]): f for f in json.loads(out)["tuning_cache"]["files"]}
    assert files[("cuda", "NVIDIA-H200-sm90")]["applied"] is True
    assert files[("cuda", "NVIDIA-H200-sm90")]["ops"] == ["attention"]
    assert files[("cpu", "X-vnni-2t")]["applied"] is False
    rc, out = _doctor(capsys)
    assert "cuda/NVIDIA-H200-sm90: attention; NVIDIA H200, d1: applied" in out
    assert "cpu/X-vnni-2t: quant_linear; X, d2: stale" in out
    monkeypatch.setenv(tc.ENV, "off")
    rc, out = _doctor(capsys)
    assert "(GLM5_TUNING_CACHE=off)" in out
