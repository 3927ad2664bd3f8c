"""A verifiable reasoning environment: countdown. The agent gets numbers and a target and must
write an arithmetic expression (+ - * / and parentheses) using each given number at most once
whose value is exactly the target. Checking is exact (fractions), by parsing the expression's
syntax tree — nothing is evaluated as Python. A wrong answer gets feedback and another try,
up to ``max_attempts``: a multi-turn episode.
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from fractions import Fraction
from typing import Any

from glm5.rl.envs.base import StepResult, register_env

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}
MAX_EXPRESSION_CHARS = 200


class ExpressionError(ValueError):
    """The answer is not a valid countdown expression (the message says why)."""


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """(exact value, the integer literals used) of an arithmetic expression of non-negative
    integers, + - * /, unary minus and parentheses. Anything else is an ExpressionError."""
    if not isinstance(expr, str):
        raise ExpressionError(f"expected an expression as text, got {type(expr).__name__}")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ExpressionError(f"syntax error: {e.msg}") from None
    used: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and b == 0:
                raise ExpressionError("division by zero")
            return _OPS[type(node.op)](a, b)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            used.append(node.value)
            return Fraction(node.value)
        raise ExpressionError(f"only integers, + - * / and parentheses are allowed, found "
                              f"{type(node).__name__}")

    return ev(tree), used


class CountdownEnv:
    """params: ``n_numbers`` (count of numbers given), ``max_number``, ``max_attempts``."""

    name = "countdown"
    observation_role = "user"  # its feedback is a user message

    def __init__(self, n_numbers: int = 4, max_number: int = 25, max_attempts: int = 3) -> None:
        for k, v, lo in (("n_numbers", n_numbers, 2), ("max_number", max_number, 2),
                         ("max_attempts", max_attempts, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"glm5 CountdownEnv: {k} expected an int >= {lo}, got {v!r}")
        self.n_numbers, self.max_number, self.max_attempts = n_numbers, max_number, max_attempts
        self.numbers: list[int] = []
        self.target = 0
        self.expression = ""  # how reset() built the target: the demonstration's answer
        self.attempts = 0
        self.solved = False

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.numbers = [rng.randint(1, self.max_number) for _ in range(self.n_numbers)]
        # the target is reachable: a random expression over a random subset of the numbers
        k = rng.randint(2, self.n_numbers)
        pick = rng.sample(self.numbers, k)
        value, expr, product = Fraction(pick[0]), str(pick[0]), True
        for x in pick[1:]:
            op = rng.choice("+-*" if value > x else "+*")
            value = value + x if op == "+" else value - x if op == "-" else value * x
            # evaluated left to right: only a sum or difference under a product needs brackets
            expr = f"({expr})*{x}" if op == "*" and not product else f"{expr}{op}{x}"
            product = op == "*"  # the expression's top level is now a product (or a number)
        self.target, self.expression = int(value), expr
        self.attempts, self.solved = 0, False
        return self._prompt()

    def _prompt(self) -> str:
        return (f"Numbers: {' '.join(map(str, self.numbers))}. Target: {self.target}. Write one "
                f"expression with + - * / and parentheses using each number at most once.")

    def step(self, action: str) -> StepResult:
        if self.solved or self.attempts >= self.max_attempts:
            raise RuntimeError("glm5 CountdownEnv.step: the episode is over; call reset()")
        self.attempts += 1
        left = self.max_attempts - self.attempts
        try:
            value, used = evaluate(action)
        except ExpressionError as e:
            return self._fail(f"Invalid expression: {e}.", left, {"error": str(e)})
        extra = Counter(used) - Counter(self.numbers)
        if extra:
            return self._fail(f"Invalid: {sorted(extra.elements())} not available (each number "
                              f"at most once).", left, {"error": "numbers"})
        if value == self.target:
            self.solved = True
            return StepResult("Correct.", 1.0, True, {"value": str(value)})
        return self._fail(f"{action.strip()} = {value}, not {self.target}.", left,
                          {"value": str(value)})

    def demonstration(self) -> list[str]:
        """The expert's turns for the episode after ``reset``: the expression the target was
        built from (each number at most once, exact value = target)."""
        if not self.expression:
            raise RuntimeError("glm5 CountdownEnv.demonstration: no episode; call reset() "
                               "(or load a state that holds its expression)")
        return [self.expression]

    def _fail(self, msg: str, left: int, info: dict[str, Any]) -> StepResult:
        done = left == 0
        return StepResult(msg + ("" if done else f" {left} attempt(s) left."), 0.0, done, info)

    def state_dict(self) -> dict[str, Any]:
        return {"numbers": self.numbers, "target": self.target, "attempts": self.attempts,
                "solved": self.solved, "expression": self.expression}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.numbers = [int(x) for x in state["numbers"]]
        self.target, self.attempts = int(state["target"]), int(state["attempts"])
        self.solved = bool(state["solved"])
        # checkpoints written before demonstrations existed hold no expression
        self.expression = str(state.get("expression", ""))


register_env("countdown", CountdownEnv)
