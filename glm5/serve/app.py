"""The OpenAI-compatible HTTP front end of the serving engine (FastAPI; `glm5 serve` runs it
under uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming by SSE),
``GET /v1/models``, ``GET /health`` (503 once shutdown has begun), ``GET /metrics``
(prometheus text, see `glm5.serve.metrics`). With ``allow_weight_updates`` (``glm5 serve
--allow-weight-updates``, for RL rollout engines; off by default, as a public server must not
take weights): ``POST /glm5/v1/weights`` (a `glm5.engine.weight_sync.WeightUpdate`'s bytes,
applied between engine steps, all or nothing) and ``GET /glm5/v1/weights`` (version and
checksums).

How a request maps onto the engine: each prompt x ``n`` becomes one engine request (choice
``i * n + j``; with a ``seed``, choice j samples with ``seed + j`` so the choices differ but
the response is reproducible). The response starts once every choice has its first output, so
that a request the engine refuses gets a plain HTTP error (400 naming the field, 429 with
``Retry-After``, 503 while draining) instead of a stream that fails. A choice whose generation
fails gets a 500 (non-streaming) or an SSE ``{"error": ...}`` event before ``[DONE]``
(streaming); other requests are not affected. A client that goes away (mid-stream, or while a
non-streaming request is generating) aborts its engine requests, which frees their pages in
the engine's next step. The app's lifespan ends with ``AsyncEngine.shutdown``: running requests
finish (drain) before the engine thread stops.

What a client may cost is bounded by a `glm5.serve.limits.ServeLimits` (body size and
timeouts here, through `glm5.serve.http.BodyLimit`; connections, header timeout and stalled
sockets in `glm5.serve.http.make_server`'s protocol): streams carry deltas and a choice whose
client stops reading is aborted after ``stream_backlog`` unread outputs; text is tokenized on a
thread pool of its own; at ``graceful_timeout`` after shutdown begins, what is still open ends
with a 503. Aborted requests are counted by reason in ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm5.engine.async_engine import AsyncEngine
from glm5.engine.outputs import RequestOutput
from glm5.engine.sampling import SEED_LIMIT, SamplingParams
from glm5.text.chat import ChatParser, ChatEvent
from glm5.serve.http import BodyLimit
from glm5.serve.limits import ServeLimits, min_tokens
from glm5.serve.metrics import ServerMetrics
from glm5.serve.protocol import (ChatCompletionRequest, CompletionRequest, chat_logprobs,
                                 completion_logprobs, error_body, field_name, lone_surrogate)
from glm5.serve.streams import (DONE, APIError, Choices, SSEResponse, check_failed, sse,
                                unless_disconnected)
from glm5.serve.weights import WEIGHTS_PATH, weight_routes

# Threads that tokenize and render chat templates (a pool of the server's own).
TOKENIZER_THREADS = 2


_ARG = re.compile(r"argument '(\w+)'")


def _sampling(req: Any, max_tokens: int, logprobs: int | None, seed: int | None,
              names: dict[str, str]) -> SamplingParams:
    """The request's `SamplingParams`; a value SamplingParams refuses is a 400 naming the
    request field (``names`` maps SamplingParams argument names to request field names)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=seed, stop=req.stop or (), stop_token_ids=req.stop_token_ids or (),
            ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs)
    except ValueError as e:
        m = _ARG.search(str(e))
        arg = m[1] if m else None
        field = names.get(arg, arg) if arg else None
        msg = str(e).removeprefix("glm5 SamplingParams: ")
        if m and field != arg:
            msg = msg.replace(f"argument '{arg}'", f"'{field}'")
        raise APIError(400, msg, field) from None


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Server:
    def __init__(self, engine: AsyncEngine, model_name: str, tokenizer: Any,
                 limits: ServeLimits) -> None:
        self.engine, self.model_name, self.tokenizer = engine, model_name, tokenizer
        self.limits = limits
        self.metrics = ServerMetrics(engine.stats)
        self.created = int(time.time())
        self.max_model_len = engine.engine.max_model_len
        self.open_choices: set[Choices] = set()
        # Tokenizing and rendering run here, never on the event loop (a long prompt takes
        # seconds); a pool of their own, so they cannot starve the engine's add / metrics.
        self._text_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="glm5-tok")
        self._longest_token: int | None = None

    # ------------------------------------------------------------------ shutdown
    def begin_shutdown(self) -> None:
        """Shutdown has begun (SIGTERM): no new requests; what is still open at
        ``limits.graceful_timeout`` ends with a 503 (an error event, in a stream)."""
        self.engine.stop_accepting()
        asyncio.get_running_loop().call_later(self.limits.graceful_timeout, self._end_open)

    def _end_open(self) -> None:
        for c in list(self.open_choices):
            c.end(APIError(503, f"glm5 serve: the server is shutting down and its graceful "
                           f"timeout ({self.limits.graceful_timeout:g} s) has passed: the "
                           f"response ends here"))

    # ------------------------------------------------------------------ text
    async def _in_text_pool(self, fn, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    def _encode(self, text: str, field: str) -> list[int]:
        """``text`` tokenized (call it in the text pool); a text that cannot fit the context
        by its bytes alone is refused before tokenizing, any tokenizer error is a 400 naming
        ``field``."""
        if self._longest_token is None:
            self._longest_token = self.tokenizer.longest_token_bytes
        n_bytes = len(text.encode("utf-8"))
        if min_tokens(n_bytes, self._longest_token) >= self.max_model_len:
            raise APIError(400, f"{field}: {n_bytes} bytes of text are at least "
                           f"{min_tokens(n_bytes, self._longest_token)} tokens; this model's "
                           f"context is {self.max_model_len} tokens (prompt + at least 1 "
                           f"generated)", field)
        try:
            return self.tokenizer.encode(text)
        except Exception as e:  # noqa: BLE001 - the tokenizer's own errors: bad input
            raise APIError(400, f"{field}: the text cannot be tokenized: "
                           f"{type(e).__name__}: {e}", field) from None

    def _encode_prompts(self, prompts: list) -> list:
        return [self._encode(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
                if isinstance(p, str) else p for i, p in enumerate(prompts)]

    # ------------------------------------------------------------------ shared
    def _check(self, req: Any) -> None:
        if req.model != self.model_name:
            raise APIError(400, f"model {req.model!r} is not served here; this server serves "
                           f"{self.model_name!r} (see /v1/models)", "model")
        bad = req.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], bad[0])
        bad = lone_surrogate(req)
        if bad is not None:
            field = bad[0]
            if isinstance(req, CompletionRequest) and len(req.prompt) == 1:
                field = field.replace("prompt[0]", "prompt", 1)  # one prompt: named as sent
            bad = (field, bad[1])
            raise APIError(400, f"{bad[0]}: expected valid Unicode text, got a lone surrogate "
                           f"(U+{ord(bad[1]):04X}; JSON escapes of a UTF-16 pair must come in "
                           f"pairs)", bad[0])
        limit = self.engine.engine.config.max_num_seqs
        if not 1 <= req.n <= limit:
            raise APIError(400, f"n expected an int in [1, {limit}] (the server's "
                           f"max_num_seqs), got {req.n}", "n")

    def _default_max_tokens(self, n_prompt: int) -> int:
        """Without max_tokens a chat turn may fill the context (and the cache) after its
        prompt; at least 1, so that a prompt that is already too long gets the engine's 400."""
        e = self.engine.engine
        cfg = e.config
        room = e.allocator.num_pages * cfg.page_size - 2 * cfg.num_speculative_tokens
        return max(1, min(self.max_model_len, room) - n_prompt)

    def _seeds(self, seed: int | None, n: int) -> list[int | None]:
        """Choice j samples with seed + j; each must be a seed of its own (< 2**63: above,
        torch's generator aliases smaller seeds)."""
        if seed is not None and seed + n - 1 >= SEED_LIMIT:
            raise APIError(400, f"seed: with n={n}, choice j samples with seed + j, so seed "
                           f"expected an int in [0, 2**63 - {n - 1}), got {seed}", "seed")
        return [None if seed is None else seed + j for j in range(n)]

    def _finish_reason(self, out: RequestOutput) -> str:
        return out.finish_reason or "stop"

    # ------------------------------------------------------------------ completions
    async def completions(self, req: CompletionRequest, http: Request) -> Response:
        self._check(req)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        lp = req.logprobs
        tok = req.return_token_ids
        seeds = self._seeds(req.seed, req.n)
        # return_token_ids needs the sampled tokens' logprobs even without a logprobs block
        engine_lp = 0 if lp is None and tok else lp
        params = [_sampling(req, max_tokens, engine_lp, s, {}) for s in seeds]
        prompts = req.prompt
        if self.tokenizer is not None and any(isinstance(p, str) for p in prompts):
            prompts = await self._in_text_pool(self._encode_prompts, prompts)
        cid = f"cmpl-{uuid.uuid4().hex}"
        subs = [(f"{cid}-{p * req.n + j}", prompt, params[j])
                for p, prompt in enumerate(prompts) for j in range(req.n)]
        choices = Choices(self, subs, http.scope)
        head = {"id": cid, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        try:
            await choices.start()
        except BaseException:
            await choices.close()
            raise
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._stream_completion(choices, head, lp is not None,
                                                        include_usage, req.n, tok))

        finals = await unless_disconnected(http, self._finals(choices))
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        body_choices = []
        for i, out in enumerate(finals):
            body_choices.append({
                "index": i, "text": out.text,
                "logprobs": (completion_logprobs(self.tokenizer, out.logprobs or [], 0)
                             if lp is not None else None),
                "finish_reason": self._finish_reason(out), "stop_reason": out.stop_reason,
                **(_token_fields(out.token_ids, out.logprobs, out.token_versions)
                   if tok else {})})
        firsts = finals[::req.n]  # one per prompt: its tokens are counted once
        usage = _usage(sum(len(o.prompt_token_ids) for o in firsts),
                       sum(len(o.token_ids) for o in finals),
                       sum(o.metrics.num_cached_prompt_tokens for o in firsts if o.metrics))
        return JSONResponse({**head, "choices": body_choices, "usage": usage})

    async def _finals(self, choices: Choices) -> list[RequestOutput]:
        """Each choice's finished output (a failed one raises), the choices closed after."""
        finals: list[RequestOutput | None] = [None] * choices.n
        try:
            async for i, out in choices.events():
                if out.finished:
                    check_failed(out)
                    self.metrics.observe(out)
                    finals[i] = out
        finally:
            await choices.close()
        return finals  # type: ignore[return-value]

    async def _stream(self, choices: Choices, head: dict,
                      emit: Callable[[int, RequestOutput], Iterable[str]],
                      usage: Callable[[list], dict] | None,
                      prelude: Sequence[str] = ()) -> AsyncIterator[str]:
        """The SSE tail both endpoints share: ``prelude``, then each output's chunks
        (``emit(i, out)``, after a failed request's check) with a finished output observed in
        the metrics, then the usage chunk (``usage(finals)``; None: not asked) and [DONE]. An
        APIError mid-stream becomes an error event and [DONE]; the choices are closed whatever
        happens (a client gone included)."""
        finals: list[RequestOutput | None] = [None] * choices.n
        try:
            for c in prelude:
                yield c
            try:
                async for i, out in choices.events():
                    if out.finished:
                        check_failed(out)
                    for c in emit(i, out):
                        yield c
                    if out.finished:
                        self.metrics.observe(out)
                        finals[i] = out
            except APIError as e:
                self.metrics.error(e.status)
                yield sse(error_body(e.status, e.message, e.param))
                yield DONE
                return
            if usage is not None:
                yield sse({**head, "choices": [], "usage": usage(finals)})
            yield DONE
        finally:
            await choices.close()

    def _stream_completion(self, choices: Choices, head: dict, logprobs: bool,
                           include_usage: bool, n: int,
                           token_ids: bool = False) -> AsyncIterator[str]:
        offsets = [0] * choices.n

        def emit(i: int, out: RequestOutput) -> Iterable[str]:
            block = None
            if logprobs and out.new_logprobs:
                block = completion_logprobs(self.tokenizer, out.new_logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in block["tokens"])
            ids = out.new_token_ids if token_ids else []
            if out.new_text or block is not None or ids or out.finished:
                yield sse({**head, "choices": [{
                    "index": i, "text": out.new_text,
                    "logprobs": block if logprobs else None,
                    "finish_reason": self._finish_reason(out) if out.finished else None,
                    "stop_reason": out.stop_reason if out.finished else None,
                    **(_token_fields(ids, out.new_logprobs, out.new_token_versions)
                       if token_ids else {})}]})

        def usage(finals: list) -> dict:
            done = [o for o in finals if o is not None]
            firsts = finals[::n]
            return _usage(sum(len(o.prompt_token_ids) for o in firsts if o),
                          sum(len(o.token_ids) for o in done),
                          sum(o.metrics.num_cached_prompt_tokens for o in firsts
                              if o and o.metrics))

        return self._stream(choices, head, emit, usage if include_usage else None)

    # ------------------------------------------------------------------ chat
    def _chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], bool, list | None]:
        """(prompt ids, thinking, tools shown to the model)."""
        if self.tokenizer is None:
            raise APIError(400, f"model {self.model_name!r} has no tokenizer (tokenizer.json in "
                           f"its directory): chat completions are unavailable; use "
                           f"/v1/completions with token ids", "messages")
        kw = dict(req.chat_template_kwargs or {})
        thinking = kw.pop("enable_thinking", True)
        messages = []
        for m in req.messages:
            d = m.model_dump(exclude_none=True)
            if d["role"] == "developer":
                d["role"] = "system"
            messages.append(d)
        tools = None
        if req.tools and req.tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools,
                                                      enable_thinking=thinking, **kw)
        except Exception as e:  # noqa: BLE001 - a template (untrusted) may raise anything
            msg = str(e).removeprefix("Tokenizer.apply_chat_template: ")
            raise APIError(400, f"the conversation cannot be rendered: {msg}", "messages") from None
        return self._encode(text, "messages"), thinking, tools

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        self._check(req)
        ids, thinking, tools = await self._in_text_pool(self._chat_prompt, req)
        if req.max_completion_tokens is not None:
            max_tokens, mt_name = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, mt_name = req.max_tokens, "max_tokens"
        if max_tokens is None:
            max_tokens = self._default_max_tokens(len(ids))
        lp = (req.top_logprobs or 0) if req.logprobs else None
        names = {"max_tokens": mt_name, "logprobs": "top_logprobs"}
        params = [_sampling(req, max_tokens, lp, s, names) for s in self._seeds(req.seed, req.n)]
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = Choices(self, [(f"{cid}-{j}", ids, params[j]) for j in range(req.n)],
                           http.scope)
        head = {"id": cid, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name}
        try:
            await choices.start()
        except APIError as e:
            if e.param == "max_tokens":
                e.param = mt_name
            raise
        except BaseException:
            await choices.close()
            raise
        parse_tools = tools is not None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            head["object"] = "chat.completion.chunk"
            return SSEResponse(self._stream_chat(choices, head, thinking, tools, parse_tools,
                                                  lp is not None, include_usage, len(ids)))

        finals = await unless_disconnected(http, self._finals(choices))
        if finals is None:
            return Response(status_code=499)
        body_choices = []
        for i, out in enumerate(finals):
            parser = ChatParser(thinking=thinking, tools=tools)
            events = _fold(parser.feed(out.text) + parser.finish(), parse_tools)
            reasoning = "".join(e.text for e in events if e.kind == "reasoning")
            content = "".join(e.text for e in events if e.kind == "content")
            calls = [_tool_call(e) for e in events if e.kind == "tool_call"]
            message: dict[str, Any] = {"role": "assistant",
                                       "content": content if content or not calls else None,
                                       "reasoning_content": reasoning or None}
            if calls:
                message["tool_calls"] = calls
            reason = self._finish_reason(out)
            body_choices.append({
                "index": i, "message": message,
                "logprobs": ({"content": chat_logprobs(self.tokenizer, out.logprobs or [])}
                             if lp is not None else None),
                "finish_reason": "tool_calls" if calls and reason == "stop" else reason,
                "stop_reason": out.stop_reason})
        m0 = finals[0].metrics
        usage = _usage(len(ids), sum(len(o.token_ids) for o in finals),
                       m0.num_cached_prompt_tokens if m0 else 0)
        return JSONResponse({**head, "choices": body_choices, "usage": usage})

    def _stream_chat(self, choices: Choices, head: dict, thinking: bool,
                     tools: list | None, parse_tools: bool, logprobs: bool,
                     include_usage: bool, n_prompt: int) -> AsyncIterator[str]:
        parsers = [ChatParser(thinking=thinking, tools=tools) for _ in range(choices.n)]
        n_calls = [0] * choices.n

        def chunk(i: int, delta: dict, lps: list | None = None, finish: str | None = None,
                  stop_reason: Any = None) -> str:
            c: dict[str, Any] = {"index": i, "delta": delta,
                                 "logprobs": {"content": lps} if lps is not None else None,
                                 "finish_reason": finish}
            if finish is not None:
                c["stop_reason"] = stop_reason
            return sse({**head, "choices": [c]})

        def emit(i: int, out: RequestOutput) -> Iterable[str]:
            events = parsers[i].feed(out.new_text) if out.new_text else []
            if out.finished:
                events += parsers[i].finish()
            deltas = []
            for e in _fold(events, parse_tools):
                if e.kind == "tool_call":
                    deltas.append({"tool_calls": [{"index": n_calls[i], **_tool_call(e)}]})
                    n_calls[i] += 1
                elif e.kind == "reasoning":
                    deltas.append({"reasoning_content": e.text})
                else:
                    deltas.append({"content": e.text})
            lps = (chat_logprobs(self.tokenizer, out.new_logprobs)
                   if logprobs and out.new_logprobs else None)
            if lps is not None and not deltas:
                deltas.append({})
            for k, d in enumerate(deltas):
                yield chunk(i, d, lps if k == 0 else None)
            if out.finished:
                reason = self._finish_reason(out)
                if n_calls[i] and reason == "stop":
                    reason = "tool_calls"
                yield chunk(i, {}, finish=reason, stop_reason=out.stop_reason)

        def usage(finals: list) -> dict:
            done = [o for o in finals if o is not None]
            m0 = done[0].metrics if done else None
            return _usage(n_prompt, sum(len(o.token_ids) for o in done),
                          m0.num_cached_prompt_tokens if m0 else 0)

        roles = [chunk(i, {"role": "assistant", "content": ""}) for i in range(choices.n)]
        return self._stream(choices, head, emit, usage if include_usage else None, roles)


def _token_fields(ids: list[int], lps: list | None, versions: list[int]) -> dict[str, Any]:
    """``return_token_ids``: the ids ``ids``, the engine's logprob of each and the weights
    version each was sampled with."""
    return {"token_ids": list(ids), "token_logprobs": [x.logprob for x in lps or []],
            "token_versions": list(versions)}


def _fold(events: list[ChatEvent], parse_tools: bool) -> list[ChatEvent]:
    """Without tools (or with tool_choice "none") tool-call markup is the model's text."""
    if parse_tools:
        return events
    return [ChatEvent("content", e.text) if e.kind == "tool_call" else e for e in events]


def _tool_call(e: ChatEvent) -> dict[str, Any]:
    call = e.tool_call
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name,
                         "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def build_app(engine: AsyncEngine, model_name: str, tokenizer: Any = None,
              drain_timeout: float = 60.0, allow_weight_updates: bool = False,
              limits: ServeLimits | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``model_name``. ``tokenizer`` (a
    `glm5.text.tokenizer.Tokenizer`; None: token-id prompts only, no chat) renders chat
    prompts and shows tokens in logprobs. When the app shuts down (uvicorn's lifespan, after
    SIGINT / SIGTERM) the engine drains its running requests (up to ``drain_timeout`` s).
    ``allow_weight_updates``: serve the weight endpoints (`glm5.serve.weights.weight_routes`); without it they
    are 404s. ``limits``: what clients may do (`glm5.serve.limits.ServeLimits`; default: its
    defaults); the body limits apply under any ASGI server, the connection limits under
    `glm5.serve.http.make_server`."""
    if not isinstance(engine, AsyncEngine):
        raise TypeError(f"glm5 build_app: engine expected an AsyncEngine, got "
                        f"{type(engine).__name__}")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"glm5 build_app: model_name expected a non-empty string, got "
                         f"{model_name!r}")
    if not isinstance(allow_weight_updates, bool):
        raise TypeError(f"glm5 build_app: allow_weight_updates expected a bool, got "
                        f"{allow_weight_updates!r}")
    if limits is None:
        limits = ServeLimits()
    if not isinstance(limits, ServeLimits):
        raise TypeError(f"glm5 build_app: limits expected a ServeLimits, got "
                        f"{type(limits).__name__}")
    srv = _Server(engine, model_name, tokenizer, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown(drain_timeout)
        srv._text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="glm5", lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(BodyLimit, limits=limits, metrics=srv.metrics,
                       exempt=(WEIGHTS_PATH,) if allow_weight_updates else ())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        srv.metrics.error(400)
        errors = exc.errors()
        if not errors:
            return APIError(400, "the request body is not valid").response()
        first = errors[0]
        if first.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON: "
                            f"{first.get('ctx', {}).get('error', first.get('msg'))}").response()
        param = field_name(tuple(first.get("loc", ())))
        msgs = []
        for e in errors:  # a union field fails once per member: say each reason once
            if field_name(tuple(e.get("loc", ()))) == param:
                msg = str(e.get("msg", "")).removeprefix("Value error, ")
                if msg not in msgs:
                    msgs.append(msg)
        where = f"{param}: " if param else "the request body: "
        return APIError(400, where + "; or ".join(msgs), param).response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        srv.metrics.error(exc.status)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        srv.metrics.error(exc.status_code)
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # No request body leads here by design (bad input is a 400, an engine failure a 500
        # that says so): this is a bug, answered in the API's format and counted.
        srv.metrics.error(500)
        return JSONResponse(error_body(500, f"glm5 serve: internal error (a bug in glm5 "
                                       f"serve): {type(exc).__name__}: {exc}"), 500)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await srv.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await srv.chat(body, request)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": srv.created, "owned_by": "glm5",
                "max_model_len": srv.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} is not served here; this server serves "
                           f"{model_name!r}", "model")
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        if not engine.accepting:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        body = await asyncio.to_thread(srv.metrics.render)  # the snapshot takes the engine lock
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    weight_routes(app, engine, allow_weight_updates)
    return app
