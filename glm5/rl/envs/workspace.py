"""Environments that work on files in a sandbox: a code-fix env (a small Python repository with
a bug and its pytest tests; reward from the tests run in the sandbox) and a terminal env (shell
tasks checked by the state they leave). Every command of an episode runs in the episode's own
`Sandbox` (glm5.rl.envs.sandbox): private work directory, no network, limits.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Callable

from glm5.rl.envs.base import register_env
from glm5.rl.envs.checks import syntax_check
from glm5.rl.envs.tools import ToolEnv, ToolError

MAX_FILE_CHARS = 20_000


class WorkspaceEnv(ToolEnv):
    """A ToolEnv whose episode owns a sandbox; files are read and written inside its work
    directory only (paths are relative, no ``..``)."""

    def __init__(self, max_turns: int = 12, sandbox_config: Any = None) -> None:
        super().__init__()
        self.max_turns = max_turns
        self.sandbox_config = sandbox_config
        self.sandbox: Any = None
        self.seed = 0

    def _new_sandbox(self) -> None:
        from glm5.rl.envs.sandbox import Sandbox

        self.close()
        self.sandbox = Sandbox(self.sandbox_config)

    def _path(self, path: str) -> Path:
        if not isinstance(path, str) or not path or path.startswith("/") or \
                ".." in Path(path).parts:
            raise ToolError(f"path expected a relative path inside the work directory, got "
                            f"{path!r}")
        return Path(self.sandbox.workdir) / path

    def read_file(self, path: str) -> str:
        """The text of a file of the work directory."""
        p = self._path(path)
        if not p.is_file():
            raise ToolError(f"read_file: no file {path!r}")
        return p.read_text(errors="replace")[:MAX_FILE_CHARS]

    def write_file(self, path: str, content: str) -> str:
        """Replace (or create) a file of the work directory."""
        p = self._path(path)
        if not isinstance(content, str) or len(content) > MAX_FILE_CHARS:
            raise ToolError(f"write_file: content expected text of at most {MAX_FILE_CHARS} "
                            f"characters")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        return f"wrote {len(content)} characters to {path}"

    def shell(self, command: str) -> dict[str, Any]:
        """Run a bash command in the work directory (sandboxed)."""
        if not isinstance(command, str) or not command.strip():
            raise ToolError("shell: command expected non-empty text")
        r = self.sandbox.run(["bash", "-c", command], timeout=10)
        return {"exit": r.returncode, "stdout": r.stdout[-4000:], "stderr": r.stderr[-2000:],
                "reason": r.reason}

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

    def state_dict(self) -> dict[str, Any]:
        files = {str(p.relative_to(self.sandbox.workdir)): p.read_text(errors="replace")
                 for p in Path(self.sandbox.workdir).rglob("*") if p.is_file()
                 and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts}
        return {"seed": self.seed, "turns": self.turns, "done": self.done, "files": files}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset(int(state["seed"]))
        for rel, text in state["files"].items():
            p = self._path(rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        self.turns, self.done = int(state["turns"]), bool(state["done"])


# ------------------------------------------------------------------ code fix
# (module name, buggy source, fixed source, tests); the episode's seed picks one
BUGS: list[tuple[str, str, str, str]] = [
    ("clamp", "def clamp(x, lo, hi):\n    return max(lo, min(x, hi - 1))\n",
     "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
     "from clamp import clamp\n\ndef test_inside():\n    assert clamp(5, 0, 10) == 5\n\n"
     "def test_high():\n    assert clamp(12, 0, 10) == 10\n\ndef test_edge():\n"
     "    assert clamp(10, 0, 10) == 10\n\ndef test_low():\n    assert clamp(-3, 0, 10) == 0\n"),
    ("palindrome", "def is_palindrome(s):\n    return s == s[::-1]\n",
     "def is_palindrome(s):\n    t = ''.join(c.lower() for c in s if c.isalnum())\n"
     "    return t == t[::-1]\n",
     "from palindrome import is_palindrome\n\ndef test_plain():\n"
     "    assert is_palindrome('abba')\n\ndef test_case():\n    assert is_palindrome('Abba')\n\n"
     "def test_spaces():\n    assert is_palindrome('never odd or even')\n\ndef test_no():\n"
     "    assert not is_palindrome('abc')\n"),
    ("stats", "def mean(xs):\n    return sum(xs) // len(xs)\n",
     "def mean(xs):\n    return sum(xs) / len(xs)\n",
     "from stats import mean\n\ndef test_int():\n    assert mean([2, 4]) == 3\n\n"
     "def test_fraction():\n    assert mean([1, 2]) == 1.5\n\ndef test_one():\n"
     "    assert mean([7]) == 7\n"),
]


class CodeFixEnv(WorkspaceEnv):
    """A repository (src module + tests/test_*.py) with one bug. Tools: read_file, write_file,
    run_tests, shell. The final answer (a turn without a tool call) ends the episode; reward =
    the fraction of the tests that pass in the sandbox then (1.0: all)."""

    name = "codefix"

    def __init__(self, max_turns: int = 12, sandbox_config: Any = None) -> None:
        super().__init__(max_turns, sandbox_config)
        self.tools = {"read_file": self.read_file, "write_file": self.write_file,
                      "run_tests": self.run_tests, "shell": self.shell}
        self.module = ""

    def reset(self, seed: int) -> str:
        self._new_sandbox()
        self.seed, self.turns, self.done = seed, 0, False
        self.module, buggy, _, tests = BUGS[random.Random(seed).randrange(len(BUGS))]
        wd = Path(self.sandbox.workdir)
        (wd / f"{self.module}.py").write_text(buggy)
        (wd / "tests").mkdir()
        (wd / "tests" / f"test_{self.module}.py").write_text(tests)
        (wd / "pyproject.toml").write_text("[tool.pytest.ini_options]\npythonpath = ['.']\n")
        return (f"The tests in tests/ fail: fix {self.module}.py. Tools: read_file(path), "
                f"write_file(path, content), run_tests(), shell(command). Reply without a tool "
                f"call when done.")

    def run_tests(self) -> dict[str, Any]:
        """Run the repository's tests (pytest) in the sandbox; counts and the output's tail."""
        # no plugin autoload: the host environment's plugins (glm5's own among them) are not
        # the repository's, and may not even import inside the sandbox
        r = self.sandbox.run(["env", "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1", "python", "-m",
                              "pytest", "-q", "-p", "no:cacheprovider", "tests"], timeout=60)
        passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", r.stdout)) else 0
        failed = int(m.group(1)) if (m := re.search(r"(\d+) failed", r.stdout)) else 0
        errors = int(m.group(1)) if (m := re.search(r"(\d+) error", r.stdout)) else 0
        return {"passed": passed, "failed": failed, "errors": errors, "exit": r.returncode,
                "reason": r.reason, "output": r.stdout[-2000:]}

    def check_answer(self, answer: str) -> tuple[float, dict[str, Any]]:
        src = (Path(self.sandbox.workdir) / f"{self.module}.py")
        syntax = syntax_check(src.read_text() if src.is_file() else "", f"{self.module}.py")
        t = self.run_tests()
        total = t["passed"] + t["failed"] + t["errors"]
        reward = t["passed"] / total if total and syntax.ok else 0.0
        return reward, {"tests": t, "syntax": syntax.message}


# ------------------------------------------------------------------ terminal
def _task_mkdir(rng: random.Random) -> tuple[str, Callable[[Path], bool], dict[str, str]]:
    name, word = f"out{rng.randint(1, 99)}", rng.choice(["hello", "world", "glm5"])
    return (f"Create a directory {name} holding a file a.txt whose content is exactly "
            f"'{word}' followed by a newline.",
            lambda wd: (wd / name / "a.txt").is_file()
            and (wd / name / "a.txt").read_text() == word + "\n", {})


def _task_count(rng: random.Random) -> tuple[str, Callable[[Path], bool], dict[str, str]]:
    n = rng.randint(3, 40)
    lines = "".join(f"row {i}\n" for i in range(n))
    return ("Write the number of lines of data.txt, and nothing else, to count.txt.",
            lambda wd: (wd / "count.txt").is_file()
            and (wd / "count.txt").read_text().strip() == str(n), {"data.txt": lines})


def _task_rename(rng: random.Random) -> tuple[str, Callable[[Path], bool], dict[str, str]]:
    names = [f"f{i}" for i in range(rng.randint(2, 5))]
    files = {f"logs/{n}.log": n for n in names}
    return ("Rename every .log file in logs/ to the same name ending in .txt.",
            lambda wd: all((wd / "logs" / f"{n}.txt").read_text() == n
                           if (wd / "logs" / f"{n}.txt").is_file() else False for n in names)
            and not list((wd / "logs").glob("*.log")), files)


TERMINAL_TASKS = (_task_mkdir, _task_count, _task_rename)


class TerminalEnv(WorkspaceEnv):
    """Shell tasks checked by the work directory's state when the agent replies without a tool
    call. Tools: shell, read_file, write_file. Reward 1 when the state is right, else 0."""

    name = "terminal"

    def __init__(self, max_turns: int = 10, sandbox_config: Any = None) -> None:
        super().__init__(max_turns, sandbox_config)
        self.tools = {"shell": self.shell, "read_file": self.read_file,
                      "write_file": self.write_file}
        self._check: Callable[[Path], bool] = lambda wd: False

    def reset(self, seed: int) -> str:
        self._new_sandbox()
        self.seed, self.turns, self.done = seed, 0, False
        rng = random.Random(seed)
        task, self._check, files = TERMINAL_TASKS[rng.randrange(len(TERMINAL_TASKS))](rng)
        for rel, text in files.items():
            p = Path(self.sandbox.workdir) / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return f"{task} Tools: shell(command), read_file(path), write_file(path, content)."

    def check_answer(self, answer: str) -> tuple[float, dict[str, Any]]:
        ok = bool(self._check(Path(self.sandbox.workdir)))
        return float(ok), {"state_ok": ok}


register_env("codefix", CodeFixEnv)
register_env("terminal", TerminalEnv)
