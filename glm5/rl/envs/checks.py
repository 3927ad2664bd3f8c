"""Checking a result three ways, as the GLM-5 seed's agentic environments do: a syntax check, a
differential test (the behaviour before vs after a change, on generated inputs) and a judge hook
(any callable scoring the answer — the policy model itself can serve).

Code under test never runs in this process: the differential test sends a script to a
``run(script) -> (returncode, stdout, stderr)`` callable — `sandbox_runner(sandbox)` for
untrusted code (glm5.rl.envs.sandbox), `subprocess_runner()` for trusted code only.
"""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

Runner = Callable[[str], tuple[int, str, str]]


@dataclass
class CheckResult:
    name: str  # "syntax" | "differential" | "judge"
    ok: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def syntax_check(source: str, filename: str = "<answer>") -> CheckResult:
    """Whether ``source`` parses as Python; the message names the line and column if not."""
    if not isinstance(source, str):
        return CheckResult("syntax", False, f"expected source text, got {type(source).__name__}")
    try:
        ast.parse(source, filename=filename)
    except SyntaxError as e:
        return CheckResult("syntax", False, f"{filename}:{e.lineno}:{e.offset}: {e.msg}",
                           {"line": e.lineno, "offset": e.offset})
    return CheckResult("syntax", True, "parses")


def subprocess_runner(timeout: float = 10.0) -> Runner:
    """Runs a script with this Python (isolated mode) in a child process. Not a sandbox: for
    trusted code; untrusted code goes through `sandbox_runner`."""
    def run(script: str) -> tuple[int, str, str]:
        try:
            p = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return -9, "", f"timed out after {timeout} s"
        return p.returncode, p.stdout, p.stderr
    return run


def sandbox_runner(sandbox: Any, timeout: float | None = None) -> Runner:
    """Runs a script with ``python3 -I -c`` inside a `glm5.rl.envs.sandbox.Sandbox`."""
    def run(script: str) -> tuple[int, str, str]:
        r = sandbox.run(["python3", "-I", "-c", script], timeout=timeout)
        return r.returncode, r.stdout, r.stderr
    return run


_HARNESS = """
import json, sys
src, func, inputs = json.loads({payload!r})
ns = {{"__name__": "answer"}}
exec(compile(src, "<answer>", "exec"), ns)
f = ns.get(func)
if not callable(f):
    print(json.dumps({{"fatal": f"no function {{func!r}}"}}))
    sys.exit(0)
for args in inputs:
    try:
        out = {{"value": repr(f(*args))}}
    except Exception as e:
        out = {{"raises": type(e).__name__}}
    print(json.dumps(out), flush=True)
"""


def _behaviour(run: Runner, source: str, func: str, inputs: list[list[Any]]
               ) -> tuple[list[dict] | None, str]:
    script = _HARNESS.format(payload=json.dumps([source, func, inputs]))
    code, out, err = run(script)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    if lines and "fatal" in lines[0]:
        return None, lines[0]["fatal"]
    if code != 0 or len(lines) != len(inputs):
        return None, (f"exit {code} after {len(lines)} of {len(inputs)} inputs: "
                      f"{err.strip()[-300:]}")
    return lines, ""


def generate_inputs(kinds: Sequence[str], n: int, seed: int = 0) -> list[list[Any]]:
    """n argument tuples; kinds per argument: "int" (-100..100), "nat" (0..20), "str"
    (short lowercase), "list[int]" (0-8 ints). Small values and edge cases (0, empty) first."""
    known = {"int", "nat", "str", "list[int]"}
    bad = [k for k in kinds if k not in known]
    if bad:
        raise ValueError(f"glm5 generate_inputs: kinds expected from {sorted(known)}, got "
                         f"{bad[0]!r}")
    rng = random.Random(seed)

    def one(kind: str, i: int) -> Any:
        if kind == "int":
            return [0, 1, -1][i] if i < 3 else rng.randint(-100, 100)
        if kind == "nat":
            return i if i < 3 else rng.randint(0, 20)
        if kind == "str":
            return ["", "a", "ab"][i] if i < 3 else "".join(
                rng.choice("abcxyz") for _ in range(rng.randint(0, 8)))
        return [[], [0], [2, 1]][i] if i < 3 else [rng.randint(-9, 9)
                                                    for _ in range(rng.randint(0, 8))]
    return [[one(k, i) for k in kinds] for i in range(n)]


def differential_test(before: str, after: str, func: str, inputs: list[list[Any]],
                      run: Runner, expect: str = "same") -> CheckResult:
    """Run ``func`` of both sources on every input (in ``run``'s process) and compare the
    results (repr) or the exception types. ``expect`` "same": a refactoring must not change
    behaviour; "different": a fix must change it on at least one input."""
    if expect not in ("same", "different"):
        raise ValueError(f"glm5 differential_test: expect expected 'same' or 'different', got "
                         f"{expect!r}")
    a, why_a = _behaviour(run, before, func, inputs)
    if a is None:
        return CheckResult("differential", False, f"before: {why_a}")
    b, why_b = _behaviour(run, after, func, inputs)
    if b is None:
        return CheckResult("differential", False, f"after: {why_b}")
    diffs = [i for i in range(len(inputs)) if a[i] != b[i]]
    details = {"inputs": len(inputs), "differ": len(diffs)}
    if diffs:
        i = diffs[0]
        details.update(first=inputs[i], before=a[i], after=b[i])
    if expect == "same":
        ok = not diffs
        msg = ("same behaviour on all inputs" if ok else
               f"{len(diffs)} of {len(inputs)} inputs differ; first {inputs[diffs[0]]!r}: "
               f"{a[diffs[0]]} -> {b[diffs[0]]}")
    else:
        ok = bool(diffs)
        msg = (f"behaviour changed on {len(diffs)} of {len(inputs)} inputs" if ok else
               "no input changes behaviour")
    return CheckResult("differential", ok, msg, details)


def judge_check(judge: Callable[[str, str], float], task: str, answer: str,
                threshold: float = 0.5) -> CheckResult:
    """``judge(task, answer)`` scores in [0, 1] (an LLM judge, a rubric, the policy itself);
    ok when the score reaches ``threshold``. A judge that fails or returns something else is a
    failed check, not an exception."""
    try:
        score = float(judge(task, answer))
    except Exception as e:  # noqa: BLE001 - a broken judge fails the check, visibly
        return CheckResult("judge", False, f"the judge failed: {type(e).__name__}: {e}")
    if not 0.0 <= score <= 1.0:
        return CheckResult("judge", False, f"the judge returned {score}, expected [0, 1]")
    return CheckResult("judge", score >= threshold, f"score {score:.3f} (threshold "
                                                   f"{threshold})", {"score": score})


def triple_check(after: str, *, before: str | None = None, func: str | None = None,
                 inputs: list[list[Any]] | None = None, run: Runner | None = None,
                 expect: str = "different", judge: Callable[[str, str], float] | None = None,
                 task: str = "") -> list[CheckResult]:
    """The three checks that apply: syntax always; differential when ``before``, ``func``,
    ``inputs`` and ``run`` are given; judge when ``judge`` is. A later check is skipped after a
    failed syntax check (its result says so)."""
    out = [syntax_check(after)]
    if not out[0].ok:
        return out
    if before is not None and func is not None and inputs is not None and run is not None:
        out.append(differential_test(before, after, func, inputs, run, expect))
    if judge is not None:
        out.append(judge_check(judge, task, after))
    return out
