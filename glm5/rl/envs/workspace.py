"""Environments that work on files in a sandbox: a code-fix env (a small Python repository with
a bug and its pytest tests; reward from the tests run in the sandbox) and a terminal env (shell
tasks checked by the state they leave). Every command of an episode runs in the episode's own
`Sandbox` (glm5.rl.envs.sandbox): private work directory, no network, limits.
"""

from __future__ import annotations

import random
import re
from pathlib import PurePosixPath
from typing import Any, Callable

from glm5.rl.envs.base import register_env
from glm5.rl.envs.checks import syntax_check
from glm5.rl.envs.sandbox import Sandbox
from glm5.rl.envs.tools import ToolEnv, ToolError, tool_call

MAX_FILE_CHARS = 20_000
#: Entries a checkpoint's walk of the work directory looks at, at most.
MAX_STATE_ENTRIES = 10_000


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
        self.close()
        self.sandbox = Sandbox(self.sandbox_config)

    @staticmethod
    def _check_path(path: str) -> str:
        if not isinstance(path, str) or not path or path.startswith("/") or \
                any(p in ("..", ".") for p in PurePosixPath(path).parts):
            raise ToolError(f"path expected a relative path inside the work directory, got "
                            f"{path!r}")
        return path

    def text(self, path: str) -> str | None:
        """The text of a regular file of the work directory, None when there is none. Links
        are never followed: a sandboxed command may plant one pointing at a host file."""
        try:
            return self.sandbox.read_file(self._check_path(path),
                                          limit=4 * MAX_FILE_CHARS).decode(errors="replace")
        except (OSError, ValueError):
            return None

    def entries(self, path: str = "") -> list[str]:
        """Names in a directory of the work directory (not followed through links)."""
        try:
            return self.sandbox.list_dir(self._check_path(path) if path else "")
        except (OSError, ValueError):
            return []

    def read_file(self, path: str) -> str:
        """The text of a file of the work directory."""
        text = self.text(path)
        if text is None:
            raise ToolError(f"read_file: no regular file {path!r}")
        return text[:MAX_FILE_CHARS]

    def write_file(self, path: str, content: str) -> str:
        """Replace (or create) a file of the work directory."""
        self._check_path(path)
        if not isinstance(content, str) or len(content) > MAX_FILE_CHARS:
            raise ToolError(f"write_file: content expected text of at most {MAX_FILE_CHARS} "
                            f"characters")
        try:
            self.sandbox.write_file(path, content)
        except (OSError, ValueError) as e:
            raise ToolError(f"write_file: cannot write {path!r}: {e}") from None
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
        """The episode's counters and the work directory's regular files (links and special
        files are not state: they are never followed)."""
        files: dict[str, str] = {}
        # no recursion, bounded: a command may have built a tree thousands deep or wide
        for rel in self.sandbox.walk_files(skip_dirs=("__pycache__", ".pytest_cache"),
                                           max_entries=MAX_STATE_ENTRIES):
            text = self.text(rel)
            if text is not None:
                files[rel] = text
        return {"seed": self.seed, "turns": self.turns, "done": self.done, "files": files}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset(int(state["seed"]))
        for rel, text in state["files"].items():
            self.sandbox.write_file(self._check_path(rel), text)
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
        self.sandbox.write_file(f"{self.module}.py", buggy)
        self.sandbox.write_file(f"tests/test_{self.module}.py", tests)
        self.sandbox.write_file("pyproject.toml",
                                "[tool.pytest.ini_options]\npythonpath = ['.']\n")
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

    def demonstration(self) -> list[str]:
        """The expert's turns for the episode after ``reset``: write the fixed module (from
        `BUGS`), then a final answer."""
        if not self.module:
            raise RuntimeError("glm5 CodeFixEnv.demonstration: no episode; call reset()")
        fixed = next(b[2] for b in BUGS if b[0] == self.module)
        return [tool_call("write_file", path=f"{self.module}.py", content=fixed), "Fixed."]

    def check_answer(self, answer: str) -> tuple[float, dict[str, Any]]:
        syntax = syntax_check(self.text(f"{self.module}.py") or "", f"{self.module}.py")
        t = self.run_tests()
        total = t["passed"] + t["failed"] + t["errors"]
        reward = t["passed"] / total if total and syntax.ok else 0.0
        return reward, {"tests": t, "syntax": syntax.message}


# ------------------------------------------------------------------ terminal
# a task: (instruction, check(env) -> bool reading the work directory through the env's
# link-safe `text` / `entries`, files to start with, a shell command that does the task — the
# demonstration's)
TerminalTask = tuple[str, Callable[["WorkspaceEnv"], bool], dict[str, str], str]


def _task_mkdir(rng: random.Random) -> TerminalTask:
    name, word = f"out{rng.randint(1, 99)}", rng.choice(["hello", "world", "glm5"])
    return (f"Create a directory {name} holding a file a.txt whose content is exactly "
            f"'{word}' followed by a newline.",
            lambda env: env.text(f"{name}/a.txt") == word + "\n", {},
            f"mkdir {name} && echo {word} > {name}/a.txt")


def _task_count(rng: random.Random) -> TerminalTask:
    n = rng.randint(3, 40)
    lines = "".join(f"row {i}\n" for i in range(n))
    return ("Write the number of lines of data.txt, and nothing else, to count.txt.",
            lambda env: (env.text("count.txt") or "").strip() == str(n), {"data.txt": lines},
            "wc -l < data.txt > count.txt")


def _task_rename(rng: random.Random) -> TerminalTask:
    names = [f"f{i}" for i in range(rng.randint(2, 5))]
    files = {f"logs/{n}.log": n for n in names}
    return ("Rename every .log file in logs/ to the same name ending in .txt.",
            lambda env: all(env.text(f"logs/{n}.txt") == n for n in names)
            and not [e for e in env.entries("logs") if e.endswith(".log")], files,
            'for f in logs/*.log; do mv "$f" "${f%.log}.txt"; done')


TERMINAL_TASKS = (_task_mkdir, _task_count, _task_rename)


class TerminalEnv(WorkspaceEnv):
    """Shell tasks checked by the work directory's state when the agent replies without a tool
    call. Tools: shell, read_file, write_file. Reward 1 when the state is right, else 0."""

    name = "terminal"

    def __init__(self, max_turns: int = 10, sandbox_config: Any = None) -> None:
        super().__init__(max_turns, sandbox_config)
        self.tools = {"shell": self.shell, "read_file": self.read_file,
                      "write_file": self.write_file}
        self._check: Callable[[WorkspaceEnv], bool] = lambda env: False
        self._solution = ""

    def reset(self, seed: int) -> str:
        self._new_sandbox()
        self.seed, self.turns, self.done = seed, 0, False
        rng = random.Random(seed)
        task, self._check, files, self._solution = \
            TERMINAL_TASKS[rng.randrange(len(TERMINAL_TASKS))](rng)
        for rel, text in files.items():
            self.sandbox.write_file(rel, text)
        return f"{task} Tools: shell(command), read_file(path), write_file(path, content)."

    def demonstration(self) -> list[str]:
        """The expert's turns for the episode after ``reset`` (from the task's start state):
        one shell command that does the task, then a final answer."""
        if not self._solution:
            raise RuntimeError("glm5 TerminalEnv.demonstration: no episode; call reset()")
        return [tool_call("shell", command=self._solution), "Done."]

    def check_answer(self, answer: str) -> tuple[float, dict[str, Any]]:
        ok = bool(self._check(self))
        return float(ok), {"state_ok": ok}


register_env("codefix", CodeFixEnv)
register_env("terminal", TerminalEnv)
