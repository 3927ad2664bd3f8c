"""The GLM-5 chat format, both ways: conversations rendered to prompt text by a Jinja chat
template (the model directory's, else the packaged ``templates/glm5_chat.jinja``), and the
assistant's generated text parsed back into reasoning, content and structured tool calls —
incrementally, for streaming (``ChatParser``), or at once (``parse_chat_output``).

Generated text looks like (thinking on: the generation prompt already opened ``<think>``)::

    reasoning</think>content<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>

Parsing rules (the same for any chunking of the text):

- ``</think>`` ends reasoning; ``<think>`` in content starts reasoning again (and one inside
  reasoning is dropped: a model may repeat the ``<think>`` the generation prompt opened).
- ``<tool_call>NAME(<arg_key>K</arg_key><arg_value>V</arg_value>)*</tool_call>`` is one tool
  call (whitespace between the tags is allowed, as GLM-4.5 wrote it). A value that is valid
  JSON of a non-string type is decoded (``2`` -> 2, ``{"a": 1}`` -> dict); anything else stays
  the raw string — unless the declared tool's parameter schema says ``"type": "string"``, then
  it is always the raw string (the format cannot tell ``"2"`` from ``2`` on its own).
- A tool call that never closes, or whose inside is not that grammar, is content, verbatim.
- Each reasoning / content segment (text between two tags, or a tag and either end) is
  stripped of surrounding whitespace, as the template strips them when it renders a turn, so
  rendering a parsed turn back reproduces the text the model wrote.
- Reasoning that never closes stays reasoning (generation stopped while thinking).

jinja2 is imported only when a template is compiled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Literal, Mapping, Sequence

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ARG_KEY_OPEN, ARG_KEY_CLOSE = "<arg_key>", "</arg_key>"
ARG_VALUE_OPEN, ARG_VALUE_CLOSE = "<arg_value>", "</arg_value>"

PACKAGED_TEMPLATE = "templates/glm5_chat.jinja"


# --------------------------------------------------------------------------- rendering


def packaged_chat_template() -> str:
    """The GLM-5 chat template shipped in the wheel (``glm5/text/templates/glm5_chat.jinja``)."""
    return resources.files("glm5.text").joinpath(PACKAGED_TEMPLATE).read_text(encoding="utf-8")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML and always writes ASCII; chat templates
    # expect plain json.dumps (transformers overrides the filter the same way).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str):
    """Compile a chat template the way transformers does: jinja2's ImmutableSandboxedEnvironment
    (templates from a model directory are untrusted), ``trim_blocks`` and ``lstrip_blocks``,
    the loop-controls extension, a ``tojson`` filter that keeps non-ASCII, ``raise_exception``
    and ``strftime_now``. Returns a ``jinja2.Template``; raises ``ValueError`` for a template
    that is not valid Jinja."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(source, str):
        raise TypeError(f"compile_chat_template: source must be a str, got {type(source).__name__}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"compile_chat_template: the chat template is not valid Jinja "
                         f"(line {e.lineno}: {e.message})") from e


def _normalize_messages(messages: Sequence[Mapping[str, Any]], where: str) -> list[dict[str, Any]]:
    """Copies of ``messages`` as templates expect them: OpenAI tool-call ``arguments`` (a JSON
    string) decoded to a dict, ``reasoning`` accepted as the name of ``reasoning_content``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"{where}: messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"{where}: messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str):
            raise ValueError(f"{where}: messages[{i}]['role'] must be a string, got {role!r}")
        m = dict(m)
        if m.get("reasoning_content") is None and isinstance(m.get("reasoning"), str):
            m["reasoning_content"] = m["reasoning"]
        calls = m.get("tool_calls")
        if calls is not None:
            if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
                raise ValueError(f"{where}: messages[{i}]['tool_calls'] must be a list, "
                                 f"got {type(calls).__name__}")
            m["tool_calls"] = [_normalize_tool_call(tc, f"{where}: messages[{i}]['tool_calls'][{j}]")
                               for j, tc in enumerate(calls)]
        out.append(m)
    return out


def _normalize_tool_call(tc: Any, where: str) -> dict[str, Any]:
    if not isinstance(tc, Mapping):
        raise ValueError(f"{where} must be a dict, got {type(tc).__name__}")
    tc = dict(tc)
    nested = isinstance(tc.get("function"), Mapping)
    f = dict(tc["function"]) if nested else tc
    name_at = f"{where}{'[function]' if nested else ''}"
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise ValueError(f"{name_at}['name'] must be a non-empty string, got {f.get('name')!r}")
    args = f.get("arguments")
    if args is None:
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{name_at}['arguments'] must be a JSON object, got invalid JSON "
                             f"({e.msg} at position {e.pos}): {args[:80]!r}") from e
    if not isinstance(args, Mapping):
        raise ValueError(f"{name_at}['arguments'] must be a JSON object (a dict), "
                         f"got {type(args).__name__}")
    f["arguments"] = dict(args)
    if nested:
        tc["function"] = f
    return tc


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *,
                         tools: Sequence[Mapping[str, Any]] | None = None,
                         add_generation_prompt: bool = True, enable_thinking: bool = True,
                         where: str = "render_chat_template", **extra: Any) -> str:
    """Render ``messages`` (OpenAI-style dicts) with the chat template ``source``. ``tools`` are
    OpenAI tool declarations (``{"type": "function", "function": {...}}``); ``extra`` are more
    template variables (``bos_token``, ``clear_thinking``, ...). Errors name ``where``."""
    import jinja2

    msgs = _normalize_messages(messages, where)
    if tools is not None:
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise TypeError(f"{where}: tools must be a list of dicts or None, "
                            f"got {type(tools).__name__}")
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping):
                raise TypeError(f"{where}: tools[{i}] must be a dict, got {type(t).__name__}")
        tools = [dict(t) for t in tools] or None
    template = compile_chat_template(source)
    try:
        return template.render(messages=msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                               enable_thinking=enable_thinking, **extra)
    except jinja2.TemplateError as e:
        raise ValueError(f"{where}: the chat template failed: {e}") from e


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: the function ``name`` and its ``arguments`` (values JSON-decoded
    where they are JSON of a non-string type, else the raw strings)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ChatEvent:
    """One piece of parsed output. ``kind`` "reasoning" / "content": ``text`` is new text of
    that kind. ``kind`` "tool_call": ``tool_call`` is the call and ``text`` its raw markup."""

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    tool_call: ToolCall | None = None


@dataclass
class ParsedChat:
    """A whole parsed assistant turn: ``reasoning`` (None when there was none), ``content``
    (stripped; "" when none) and ``tool_calls`` in order."""

    reasoning: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def _string_params(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, set[str]]:
    """For each declared tool, the parameters whose schema type is a string (``"string"`` or a
    list whose only non-null type is ``"string"``): their values are never JSON-decoded."""
    out: dict[str, set[str]] = {}
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping):
            raise TypeError(f"ChatParser: tools[{i}] must be a dict, got {type(tool).__name__}")
        f = tool.get("function", tool)
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
            continue
        props = (f.get("parameters") or {}).get("properties") or {}
        names = set()
        for pname, schema in props.items() if isinstance(props, Mapping) else ():
            t = schema.get("type") if isinstance(schema, Mapping) else None
            types = [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []
            if [x for x in types if x != "null"] == ["string"]:
                names.add(pname)
        out[f["name"]] = names
    return out


def _reject_constant(name: str) -> Any:
    # NaN / Infinity are not JSON; a value spelled so stays a string.
    raise ValueError(name)


def _decode_value(raw: str, keep_string: bool) -> Any:
    if keep_string:
        return raw
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw
    return raw if isinstance(value, str) else value


def _parse_tool_call(inner: str, string_params: Mapping[str, set[str]]) -> ToolCall | None:
    """The call inside ``<tool_call>...</tool_call>``, or None when it is not the grammar."""
    cut = inner.find(ARG_KEY_OPEN)
    name = (inner if cut < 0 else inner[:cut]).strip()
    if not name or any(c in name for c in "<>\n"):
        return None
    keep = string_params.get(name, set())
    rest = "" if cut < 0 else inner[cut:]
    args: dict[str, Any] = {}
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(ARG_KEY_OPEN):
            return None
        end = rest.find(ARG_KEY_CLOSE)
        if end < 0:
            return None
        key = rest[len(ARG_KEY_OPEN):end].strip()
        rest = rest[end + len(ARG_KEY_CLOSE):].lstrip()
        if not key or key in args or not rest.startswith(ARG_VALUE_OPEN):
            return None
        end = rest.find(ARG_VALUE_CLOSE)
        if end < 0:
            return None
        args[key] = _decode_value(rest[len(ARG_VALUE_OPEN):end], key in keep)
        rest = rest[end + len(ARG_VALUE_CLOSE):]
    return ToolCall(name=name, arguments=args)


def _held_prefix(buf: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``tags``:
    text that may still become a tag and so cannot be emitted yet."""
    longest = max(len(t) for t in tags) - 1
    for n in range(min(longest, len(buf)), 0, -1):
        tail = buf[-n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0


class ChatParser:
    """Incremental parser of one assistant turn in the GLM-5 format (rules in the module
    docstring). ``thinking``: whether generation starts inside ``<think>`` (the generation
    prompt opened it: ``enable_thinking=True``). ``tools``: the request's tool declarations,
    used only to keep string-typed argument values as strings.

    ``feed(delta)`` returns the events the new text completes; text that may be the start of a
    tag (``"<too"``) or whitespace that may end a segment is held back until it is decided.
    ``finish()`` returns the rest. Any chunking of a text gives the same events as
    ``parse_chat_output`` on the whole text, up to how text events are split."""

    # a <think> repeated inside reasoning (the prompt already opened one) is dropped
    _REASONING_TAGS = (THINK_CLOSE, THINK_OPEN)
    _CONTENT_TAGS = (THINK_OPEN, TOOL_CALL_OPEN)

    def __init__(self, thinking: bool = True, tools: Sequence[Mapping[str, Any]] | None = None):
        self._mode: Literal["reasoning", "content", "tool"] = "reasoning" if thinking else "content"
        self._string_params = _string_params(tools)
        self._buf = ""          # unconsumed text (a possible tag start, in text modes)
        self._scan = 0          # in a tool call: where to look for </tool_call> next
        self._started = False   # the current segment has had non-whitespace text
        self._ws = ""           # whitespace held at the end of the current segment
        self._events: list[ChatEvent] = []
        self._finished = False

    # -- output helpers

    def _text(self, kind: str, text: str) -> None:
        if not self._started:
            text = text.lstrip()
            if not text:
                return
            self._started = True
        core = text.rstrip()
        if core:
            self._push(ChatEvent(kind, self._ws + core))
            self._ws = text[len(core):]
        else:
            self._ws += text

    def _push(self, event: ChatEvent) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and event.kind != "tool_call" and last.kind == event.kind:
            self._events[-1] = ChatEvent(event.kind, last.text + event.text)
        else:
            self._events.append(event)

    def _end_segment(self) -> None:
        self._started, self._ws = False, ""

    # -- the state machine

    def feed(self, delta: str) -> list[ChatEvent]:
        """Parse ``delta`` (new generated text); return the events it completes."""
        if self._finished:
            raise RuntimeError("ChatParser.feed: the parser has finished; make a new one")
        if not isinstance(delta, str):
            raise TypeError(f"ChatParser.feed: delta must be a str, got {type(delta).__name__}")
        self._buf += delta
        self._run(final=False)
        return self._take()

    def finish(self) -> list[ChatEvent]:
        """End of generation: emit what was held back. An unclosed tool call becomes content."""
        if self._finished:
            return []
        self._run(final=True)
        if self._mode == "tool":
            self._text("content", TOOL_CALL_OPEN + self._buf)
        elif self._buf:
            self._text(self._mode, self._buf)
        self._buf = ""
        self._end_segment()
        self._finished = True
        return self._take()

    def _take(self) -> list[ChatEvent]:
        out, self._events = self._events, []
        return out

    def _run(self, final: bool) -> None:
        while self._buf:
            if self._mode == "tool":
                end = self._buf.find(TOOL_CALL_CLOSE, self._scan)
                if end < 0:
                    # a long call fed in small pieces is scanned once, not once per piece
                    self._scan = max(0, len(self._buf) - len(TOOL_CALL_CLOSE) + 1)
                    return
                self._scan = 0
                inner, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_CLOSE):]
                raw = TOOL_CALL_OPEN + inner + TOOL_CALL_CLOSE
                call = _parse_tool_call(inner, self._string_params)
                self._mode = "content"
                if call is None:
                    self._text("content", raw)   # malformed: the model's text, verbatim
                else:
                    self._end_segment()
                    self._push(ChatEvent("tool_call", raw, call))
                continue
            tags = self._REASONING_TAGS if self._mode == "reasoning" else self._CONTENT_TAGS
            hits = [(i, t) for t in tags if (i := self._buf.find(t)) >= 0]
            if hits:
                at, tag = min(hits)
                self._text(self._mode, self._buf[:at])
                self._buf = self._buf[at + len(tag):]
                if tag != TOOL_CALL_OPEN:
                    self._end_segment()
                # else the segment stays open: a malformed call continues it verbatim
                self._mode = {THINK_CLOSE: "content", THINK_OPEN: "reasoning",
                              TOOL_CALL_OPEN: "tool"}[tag]
                continue
            hold = 0 if final else _held_prefix(self._buf, tags)
            self._text(self._mode, self._buf[:len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold:]
            return


def parse_chat_output(text: str, thinking: bool = True,
                      tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedChat:
    """Parse a whole assistant turn (see ``ChatParser`` for ``thinking`` and ``tools``)."""
    if not isinstance(text, str):
        raise TypeError(f"parse_chat_output: text must be a str, got {type(text).__name__}")
    parser = ChatParser(thinking=thinking, tools=tools)
    events = parser.feed(text) + parser.finish()
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    return ParsedChat(reasoning=reasoning or None,
                      content="".join(e.text for e in events if e.kind == "content"),
                      tool_calls=[e.tool_call for e in events if e.kind == "tool_call"])
