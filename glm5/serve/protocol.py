"""The OpenAI-compatible wire format of `glm5 serve`: request bodies (pydantic models), error
bodies, and the logprob blocks of responses.

Requests are validated strictly (a string is not a number, 1 is not ``true``): a malformed
field is a 400 naming it (``glm5.serve.app`` turns pydantic's errors into OpenAI-style error
bodies). Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI fields
keep working; known fields glm5 cannot honour (``presence_penalty`` != 0, ``logit_bias``,
``echo``, ``best_of`` > 1, ``suffix``, a ``tool_choice`` other than "auto" / "none", a
``response_format`` other than text) are refused with a 400 naming them rather than ignored.
Value ranges (temperature >= 0, top_p in (0, 1], ...) are checked once, by
`glm5.engine.sampling.SamplingParams`; its errors become 400s naming the request field.
Integers are bounded here, before any arithmetic on them: ``seed`` in [0, 2**63) (choice j
samples with seed + j, so seed + n - 1 < 2**63 too), every other integer field (and each token id) in [-2**31, 2**31).
Text must be valid Unicode: a lone UTF-16 surrogate (a JSON ``"\ud800"`` escape without
its pair) anywhere in the body is a 400 naming the field (`lone_surrogate`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from glm5.engine.sampling import SEED_LIMIT

# Strict types (no "1" for 1, no 1 for true); fields this server does not know are ignored.
_STRICT = ConfigDict(strict=True, extra="ignore")

INT_LIMIT = 2**31
# An integer request field: bounded before anything computes with it.
Int32 = Annotated[int, Field(ge=-INT_LIMIT, lt=INT_LIMIT)]
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = _STRICT
    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int32 = 1
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions (``extra_body`` in the openai client)
    top_k: Int32 | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int32] | None = None
    include_stop_str_in_output: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field set to something glm5 does not do, else None."""
        if self.presence_penalty:
            return "presence_penalty", "presence_penalty is not supported (send 0 or omit it)"
        if self.frequency_penalty:
            return "frequency_penalty", "frequency_penalty is not supported (send 0 or omit it)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of either
    (one choice group per prompt). ``logprobs``: None, or n in 0..20 (the sampled token's
    logprob plus the top n, as the legacy completions API). ``return_token_ids`` (a glm5
    extension, for RL rollouts: token in, token out): each choice also carries ``token_ids``
    (the sampled ids), ``token_logprobs`` (the engine's logprob of each, as ``logprobs`` 0 would
    give) and ``token_versions`` (the weights version each was sampled with); streamed chunks
    carry those of their new tokens."""

    prompt: Any = Field(...)
    logprobs: Int32 | None = None
    return_token_ids: bool = False
    echo: bool = False
    best_of: Int32 | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        if isinstance(v, str):
            return [v]
        if not isinstance(v, list) or not v:
            raise ValueError("prompt expected a string, a list of token ids, or a non-empty "
                             "list of those")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return [_token_ids(v, "prompt")]
        out: list[str | list[int]] = []
        for i, p in enumerate(v):
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, list) and p and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append(_token_ids(p, f"prompt[{i}]"))
            else:
                raise ValueError(f"prompt[{i}] expected a string or a non-empty list of token "
                                 f"ids (ints), got {type(p).__name__}")
        return out

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported (use n)"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


def _token_ids(ids: list[int], where: str) -> list[int]:
    for j, t in enumerate(ids):
        if not -INT_LIMIT <= t < INT_LIMIT:
            raise ValueError(f"{where}[{j}] expected a token id (an int in [-2**31, 2**31)), "
                             f"got {t}")
    return list(ids)


def lone_surrogate(req: BaseModel) -> tuple[str, str] | None:
    """(field path, the surrogate) of the first string in ``req`` (fields it ignores not
    included) holding a lone UTF-16 surrogate, which no tokenizer can take; else None."""
    stack: list[tuple[str, Any]] = [("", req.model_dump(exclude_none=True))]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    return path, v[e.start]
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError as e:
                        return (f"{path}.{k!a}" if path else f"{k!a}"), k[e.start]
                stack.append((f"{path}.{k}" if path else str(k), x))
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(BaseModel):
    """One conversation message. ``content``: a string, a list of parts (``{"type": "text",
    "text": ...}``) or null; assistant messages may carry ``tool_calls`` and
    ``reasoning_content``, tool messages ``tool_call_id``. "developer" is taken as "system"."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: str


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``chat_template_kwargs`` (an extra-body field, as in
    vLLM): template variables, e.g. ``{"enable_thinking": false}``. ``tool_choice``: "auto"
    (default when tools are given) or "none" (the tools are not shown to the model and tool-call
    markup stays text). ``logprobs`` / ``top_logprobs``: the sampled tokens' logprobs and the
    top n (0..20)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", ("tool_choice expected 'auto' or 'none' (forcing a tool call "
                                   "is not supported)")
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", "response_format other than {'type': 'text'} is not supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        kw = self.chat_template_kwargs or {}
        if "enable_thinking" in kw and not isinstance(kw["enable_thinking"], bool):
            return "chat_template_kwargs", "chat_template_kwargs.enable_thinking expected a bool"
        return super().unsupported()


# --------------------------------------------------------------------------- errors
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                500: "internal_server_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"),
                      "param": param, "code": status}}


# The names pydantic gives a union's members in an error location ("str", "list[int]",
# "function-after[...]", a model's class name): not request fields.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|[A-Z]\w*)$")


def field_name(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error location as the request field it names: ``("body", "messages", 0,
    "role")`` -> ``"messages[0].role"``; None for the body itself."""
    out = ""
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and _UNION_TAG.match(p):
            break  # the rest of the path is inside one member of a union
        else:
            out += f".{p}" if out else str(p)
    return out or None


# --------------------------------------------------------------------------- logprobs
def token_text(tokenizer: Any, token_id: int) -> str:
    """How a token is shown in logprobs: its text (special tokens included; a byte that is part
    of a longer UTF-8 character shows as U+FFFD), or ``token_id:N`` without a tokenizer."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    except Exception:  # noqa: BLE001 - an id the tokenizer lacks (the model's vocab is larger)
        return f"token_id:{token_id}"


def completion_logprobs(tokenizer: Any, lps: list[Any], offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` block of tokens ``lps`` (`TokenLogprob`s) whose text
    starts at character ``offset`` of the choice's text."""
    tokens, token_lp, top, offsets = [], [], [], []
    for lp in lps:
        s = token_text(tokenizer, lp.token_id)
        tokens.append(s)
        token_lp.append(lp.logprob)
        top.append({token_text(tokenizer, t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Any, lps: list[Any]) -> list[dict[str, Any]]:
    """The chat ``logprobs.content`` entries of tokens ``lps`` (`TokenLogprob`s)."""
    def entry(t: int, v: float) -> dict[str, Any]:
        s = token_text(tokenizer, t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    return [{**entry(lp.token_id, lp.logprob),
             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
