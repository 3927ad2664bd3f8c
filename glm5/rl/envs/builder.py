"""The environment builder: given a local Python repository, find its test entry, build a
runnable environment for it and run its tests in a sandbox, reporting the command, the
pass / fail counts and the time.

Where the test entry comes from, in order: pytest settings (pyproject.toml
[tool.pytest.ini_options], pytest.ini, tox.ini [pytest], setup.cfg [tool:pytest]) and their
testpaths; tox.ini's [testenv] commands naming pytest; conventional test directories (tests/,
test/, testing/, <package>/tests); top-level test_*.py files. The environment: the repository
copied into the sandbox's work directory, its import root on PYTHONPATH (src/ for a src
layout), the interpreter and installed packages of this environment read-only, no network,
pytest's plugin autoload off (plugins of this environment are not the repository's).
"""

from __future__ import annotations

import configparser
import errno
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5.rl.envs.sandbox import Sandbox, SandboxConfig

_SKIP_DIRS = {".git", ".tox", ".venv", "venv", "build", "dist", "__pycache__", "docs"}


@dataclass
class TestEntry:
    runner: str  # "pytest"
    paths: list[str]  # test paths relative to the repository ([] : pytest's own discovery)
    source: str  # where it was found, e.g. "pyproject.toml [tool.pytest.ini_options]"


@dataclass
class BuildReport:
    repo: str
    ok: bool  # a test entry was found and the tests ran (collected at least one)
    reason: str
    command: list[str] = field(default_factory=list)
    entry: TestEntry | None = None
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    output_tail: str = ""


def _testpaths(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [str(v) for v in value]
    return []


def _ini(path: Path, section: str) -> dict[str, str] | None:
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read(path)
    except configparser.Error:
        return None
    return dict(cp[section]) if cp.has_section(section) else None


def find_test_entry(repo: str | Path) -> TestEntry | None:
    """The repository's test entry, or None when it has no tests this can find."""
    r = Path(repo)
    if not r.is_dir():
        raise ValueError(f"glm5 find_test_entry: repo expected a directory, got {str(r)!r}")
    pp = r / "pyproject.toml"
    if pp.is_file():
        try:
            data = tomllib.loads(pp.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            data = {}
        opts = data.get("tool", {}).get("pytest", {}).get("ini_options")
        if isinstance(opts, dict):
            return TestEntry("pytest", _existing(r, _testpaths(opts.get("testpaths"))),
                             "pyproject.toml [tool.pytest.ini_options]")
    for name, section in (("pytest.ini", "pytest"), ("tox.ini", "pytest"),
                          ("setup.cfg", "tool:pytest")):
        if (r / name).is_file():
            opts = _ini(r / name, section)
            if opts is not None:
                return TestEntry("pytest", _existing(r, _testpaths(opts.get("testpaths", ""))),
                                 f"{name} [{section}]")
    if (r / "tox.ini").is_file():
        env = _ini(r / "tox.ini", "testenv") or {}
        if "pytest" in env.get("commands", ""):
            return TestEntry("pytest", [], "tox.ini [testenv] commands")
    dirs = [d for d in ("tests", "test", "testing") if (r / d).is_dir()]
    dirs += [str(p.relative_to(r)) for p in sorted(r.glob("*/tests"))
             if p.is_dir() and p.parent.name not in _SKIP_DIRS]
    if dirs:
        return TestEntry("pytest", dirs, "conventional test directories")
    files = (sorted(p.name for p in r.glob("test_*.py"))
             + sorted(p.name for p in r.glob("*_test.py")))
    if files:
        return TestEntry("pytest", files, "top-level test files")
    return None


def _existing(repo: Path, paths: list[str]) -> list[str]:
    return [p for p in paths if (repo / p).exists()]


def import_root(repo: Path) -> str:
    """Where the repository's packages import from: src/ for a src layout, else the root."""
    return "src" if (repo / "src").is_dir() else "."


_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped)")


def build_and_test(repo: str | Path, sandbox_config: Any = None, timeout: float = 600.0
                   ) -> BuildReport:
    """Find the test entry, build the environment in a fresh sandbox, run the tests there."""
    r = Path(repo)
    entry = find_test_entry(r)
    if entry is None:
        return BuildReport(str(r), False, "no test entry found (no pytest settings, tox "
                           "commands, test directories or test files)")
    cfg = sandbox_config or SandboxConfig(cpu_seconds=int(timeout), wall_seconds=timeout,
                                          memory_bytes=2 << 30, max_processes=128,
                                          disk_bytes=1 << 30, tmp_bytes=256 << 20)
    t0 = time.perf_counter()
    with Sandbox(cfg) as sb:
        try:
            sb.copy_in(r, "repo", ignore=sorted(_SKIP_DIRS - {"docs"}))
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            return BuildReport(str(r), False, f"the repository does not fit the sandbox's "
                               f"work directory (disk_bytes={cfg.disk_bytes}): {e}")
        cmd = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *entry.paths]
        full = ["env", "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1", f"PYTHONPATH={import_root(r)}",
                "bash", "-c", 'cd repo && exec "$@"', "_", *cmd]
        res = sb.run(full, timeout=timeout)
    seconds = time.perf_counter() - t0
    counts: dict[str, int] = {}
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    for n, kind in _COUNT.findall(tail):
        counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
    rep = BuildReport(str(r), False, "", cmd, entry, counts.get("passed", 0),
                      counts.get("failed", 0), counts.get("error", 0), counts.get("skipped", 0),
                      seconds, res.stdout[-3000:] + res.stderr[-1000:])
    ran = rep.passed + rep.failed + rep.errors + rep.skipped
    if res.reason != "ok" and res.returncode not in (1,):
        rep.reason = f"the test run ended: {res.reason} ({res.detail})"
    elif ran == 0:
        rep.reason = f"no test ran (pytest exit {res.returncode})"
    else:
        rep.ok = True
        rep.reason = "tests ran" + ("" if res.returncode == 0 else " (some failed)")
    return rep
