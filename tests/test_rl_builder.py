"""The environment builder: test entries found by hand-made repositories' settings, and a
sandboxed run counting passes and failures."""

from __future__ import annotations

import os
import shutil

import pytest

from glm5.rl.envs.builder import build_and_test, find_test_entry, import_root


def _repo(tmp_path, files):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize("files,source,paths", [
    ({"pyproject.toml": "[tool.pytest.ini_options]\ntestpaths = ['checks', 'gone']\n",
      "checks/test_a.py": ""}, "pyproject.toml [tool.pytest.ini_options]", ["checks"]),
    ({"setup.cfg": "[tool:pytest]\ntestpaths = t1 t2\n", "t1/x.py": "", "t2/y.py": ""},
     "setup.cfg [tool:pytest]", ["t1", "t2"]),
    ({"pytest.ini": "[pytest]\naddopts = -q\n"}, "pytest.ini [pytest]", []),
    ({"tox.ini": "[testenv]\ncommands = pytest {posargs}\n"}, "tox.ini [testenv] commands", []),
    ({"tests/test_x.py": "", "pkg/tests/test_y.py": "", "docs/tests/z.py": ""},
     "conventional test directories", ["tests", "pkg/tests"]),
    ({"test_mod.py": "", "mod_test.py": "", "mod.py": ""}, "top-level test files",
     ["test_mod.py", "mod_test.py"]),
])
def test_find_test_entry(tmp_path, files, source, paths):
    e = find_test_entry(_repo(tmp_path, files))
    assert (e.runner, e.source, e.paths) == ("pytest", source, paths)


def test_no_entry_and_bad_repo(tmp_path):
    assert find_test_entry(_repo(tmp_path, {"mod.py": "x = 1\n"})) is None
    r = build_and_test(tmp_path)
    assert not r.ok and "no test entry found" in r.reason
    with pytest.raises(ValueError, match="repo expected a directory"):
        find_test_entry(tmp_path / "missing")


def test_import_root(tmp_path):
    assert import_root(_repo(tmp_path, {"src/pkg/__init__.py": ""})) == "src"
    assert import_root(tmp_path / "src") == "."


@pytest.mark.skipif(shutil.which("bwrap") is None and os.environ.get("CI") != "true",
                    reason="bubblewrap (bwrap) is not installed (CI installs it)")
def test_build_and_test_counts_in_the_sandbox(tmp_path):
    repo = _repo(tmp_path, {
        "pyproject.toml": "[tool.pytest.ini_options]\ntestpaths = ['tests']\n",
        "src/calc/__init__.py": "def add(a, b):\n    return a + b\n",
        "tests/test_calc.py": ("from calc import add\nimport pytest\n\n"
                               "def test_ok():\n    assert add(1, 2) == 3\n\n"
                               "def test_bad():\n    assert add(1, 1) == 3\n\n"
                               "@pytest.mark.skip\ndef test_skip():\n    pass\n\n"
                               "def test_escape():\n    open('/etc/glm5-escape', 'w')\n"),
    })
    r = build_and_test(repo, timeout=120)
    assert r.ok and r.entry.source.startswith("pyproject.toml")
    assert (r.passed, r.failed, r.skipped) == (1, 2, 1)  # the escape attempt fails, sandboxed
    assert not os.path.exists("/etc/glm5-escape")
    assert r.command[:3] == ["python", "-m", "pytest"] and r.seconds > 0


@pytest.mark.skipif(shutil.which("bwrap") is None and os.environ.get("CI") != "true",
                    reason="bubblewrap (bwrap) is not installed (CI installs it)")
def test_a_repository_larger_than_the_sandbox_is_reported(tmp_path):
    from glm5.rl.envs.sandbox import SandboxConfig

    repo = _repo(tmp_path, {"tests/test_a.py": "def test_a():\n    pass\n",
                            "blob.bin": "x" * (3 << 20)})
    r = build_and_test(repo, sandbox_config=SandboxConfig(mode="bwrap", disk_bytes=1 << 20))
    assert not r.ok and "does not fit the sandbox's work directory" in r.reason, r
    assert "disk_bytes=1048576" in r.reason
    r = build_and_test(repo, sandbox_config=SandboxConfig(mode="bwrap", disk_bytes=8 << 20))
    assert r.ok and r.passed == 1, r  # the open twin: room enough
