"""Multi-turn tool use in the GLM-5 chat format: an assistant turn is parsed by the serving
engine's own parser (`glm5.text.chat.parse_chat_output`, the module the chat template shares),
its tool calls are run and their results come back as the next observation; a turn without a
tool call is the final answer. A malformed or unknown tool call, or bad arguments, is an error
observation the agent can correct — never an exception.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable

from glm5.rl.envs.base import StepResult
from glm5.text.chat import TOOL_CALL_OPEN, parse_chat_output

TOOL_SYNTAX = ("<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>"
               "...</tool_call>")


def tool_call(name: str, **args: Any) -> str:
    """An assistant turn calling one tool in the GLM-5 chat format, as a model emits it (no
    role or stop tokens). Values are written as given (str() of them): the parser decodes a
    value that is valid JSON of another type (``"3"`` -> 3), so a string argument must not
    look like a number. Used for demonstrations (expert turns) and tests."""
    inner = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return f"<tool_call>{name}{inner}</tool_call>"


class ToolError(Exception):
    """A tool refused its arguments; the message goes back to the agent."""


class ToolEnv:
    """Base of tool-using environments. Subclasses fill ``self.tools`` (name -> callable taking
    keyword arguments, returning JSON-able results) and implement `check_answer`."""

    name = "tools"
    max_turns = 10
    observation_role = "tool"  # its answers are tool results (<|observation|>)

    def __init__(self) -> None:
        self.tools: dict[str, Callable[..., Any]] = {}
        self.turns = 0
        self.done = False

    def check_answer(self, answer: str) -> tuple[float, dict[str, Any]]:
        """The reward for the agent's final ``answer`` and a dict of details; every tool
        environment defines it."""
        raise NotImplementedError(
            f"{type(self).__name__}.check_answer: a ToolEnv subclass must define "
            "check_answer(answer) -> (reward, info)")

    def tool_specs(self) -> list[dict[str, Any]]:
        """The tools as OpenAI-style function declarations (for the chat template)."""
        out = []
        for name, fn in self.tools.items():
            params = inspect.signature(fn).parameters
            props = {p: {"type": "integer" if params[p].annotation in (int, "int") else
                         "string"} for p in params}
            required = [p for p in params if params[p].default is inspect.Parameter.empty]
            out.append({"type": "function", "function": {
                "name": name, "description": (fn.__doc__ or "").strip().split("\n")[0],
                "parameters": {"type": "object", "properties": props, "required": required}}})
        return out

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"glm5 {type(self).__name__}.step: the episode is over; call "
                               f"reset()")
        self.turns += 1
        last = self.turns >= self.max_turns
        if not isinstance(action, str):
            return self._error(f"expected the assistant turn as text, got "
                               f"{type(action).__name__}", last)
        parsed = parse_chat_output(action, thinking=False)
        if not parsed.tool_calls:
            if TOOL_CALL_OPEN in parsed.content:
                return self._error(f"malformed tool call; the syntax is {TOOL_SYNTAX}", last)
            reward, info = self.check_answer(parsed.content)
            self.done = True
            return StepResult(f"Final answer received: {parsed.content.strip()!r}.", reward,
                              True, info)
        results = []
        for call in parsed.tool_calls:
            fn = self.tools.get(call.name)
            if fn is None:
                results.append({"tool": call.name, "error": f"unknown tool; tools: "
                                f"{sorted(self.tools)}"})
                continue
            try:
                inspect.signature(fn).bind(**call.arguments)
            except TypeError as e:
                results.append({"tool": call.name, "error": f"bad arguments: {e}"})
                continue
            try:
                results.append({"tool": call.name, "result": fn(**call.arguments)})
            except ToolError as e:
                results.append({"tool": call.name, "error": str(e)})
        self.done = last
        return StepResult(json.dumps(results, ensure_ascii=False), 0.0, last,
                          {"tool_calls": [c.name for c in parsed.tool_calls]})

    def _error(self, msg: str, last: bool) -> StepResult:
        self.done = last
        return StepResult(f"Error: {msg}.", 0.0, last, {"error": msg})
