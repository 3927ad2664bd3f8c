"""`glm5 serve`'s HTTP API against a live uvicorn server on 127.0.0.1, driven by the official
``openai`` client (and httpx where a test needs the raw response).

The model is the ``tiny`` preset (vocabulary 512, random weights, float32) with a tokenizer
trained on the spot (`glm5.text.bpe.build_tokenizer`). Oracles: ``model.generate``
(greedy) and ``model.forward`` for what the server returns, `parse_chat_output` of the decoded
greedy continuation for chat turns, and token counts for completeness.

Random weights never write a tool call, so `_TestEngine` scripts the sampled tokens of requests
whose prompt holds the ``<tool_call>`` token (every prompt rendered with tools does: the
template's tool instructions show the format): the model, pages, scheduler, detokenizer, chat
parser and server all run for real; only the choice of token is fixed. A prompt holding the
``<|endoftext|>`` token (which no rendered chat holds) makes its own sampling raise, to check that a failure stays in its
request.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from glm5.engine.async_engine import AsyncEngine  # noqa: E402
from glm5.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from glm5.serve.app import build_app  # noqa: E402
from glm5.text.chat import parse_chat_output  # noqa: E402
from glm5.text.bpe import build_tokenizer  # noqa: E402
from serve_util import LiveServer, tiny_model_and_tokenizer  # noqa: E402

NAME = "glm5-tiny-test"
VOCAB = 512
LONG_PROMPT = 512  # prompts over this many tokens are rate-limited (burst 1, 0.01 per second)
CONTEXT = 1024
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}},
                   "required": ["city"]}}}]
# What the scripted engine "generates" for a tool-call prompt (thinking on: the generation
# prompt already opened <think>), then <|observation|>, where GLM stops after a call.
SCRIPT_TEXT = ("Let me check.</think>I will look it up.<tool_call>get_weather<arg_key>city"
               "</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>3"
               "</arg_value></tool_call>")


class _TestEngine(LLMEngine):
    """The real engine, but requests whose prompt holds ``tool_id`` sample ``script`` (then
    ``eos``) and requests whose prompt holds ``poison_id`` raise in sampling."""

    script: list[int]
    tool_id: int
    poison_id: int
    eos: int

    def _sample(self, items, logits, owner):
        for i in set(owner):
            if self.poison_id in items[i].req.prompt_ids:
                raise RuntimeError("planted sampling failure")
        out, fails = super()._sample(items, logits, owner)
        for i, toks in out.items():
            req = items[i].req
            if self.tool_id in req.prompt_ids:
                k = len(req.output_ids)
                out[i] = [(self.script[k] if k < len(self.script) else self.eos, toks[0][1])]
        return out, fails


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory):
    return tiny_model_and_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)


def _engine(model, tok, cls=LLMEngine, **cfg) -> LLMEngine:
    settings = dict(page_size=16, num_pages=256, max_num_batched_tokens=1024, chunk_size=256,
                    max_model_len=CONTEXT, long_prompt_tokens=LONG_PROMPT, long_prompt_qps=0.01,
                    long_prompt_burst=1, seed=0)
    settings.update(cfg)
    return cls(model, EngineConfig(**settings), tok)


@pytest.fixture(scope="module")
def srv(model_and_tok):
    model, tok = model_and_tok
    _TestEngine.script = tok.encode(SCRIPT_TEXT)
    _TestEngine.tool_id = tok.token_to_id("<tool_call>")
    _TestEngine.poison_id = tok.token_to_id("<|endoftext|>")
    _TestEngine.eos = tok.token_to_id("<|observation|>")
    engine = _engine(model, tok, _TestEngine)
    ae = AsyncEngine(engine)
    live = LiveServer(build_app(ae, NAME, tok))
    live.model, live.tok, live.engine, live.ae = model, tok, engine, ae
    yield live
    live.stop()


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), n)[0, len(ids):].tolist()


def _wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished():
        assert time.monotonic() < deadline, f"engine still busy: {list(engine.requests)}"
        time.sleep(0.01)


# --------------------------------------------------------------------------- models, health
def test_models_and_health(srv, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    r = httpx.get(srv.url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


# --------------------------------------------------------------------------- completions
def test_completion_plain_and_streamed_equal_the_models_greedy_tokens(srv, client):
    prompt = "Hello, world! How are you today?"
    ids = srv.tok.encode(prompt)
    want = srv.tok.decode(_greedy(srv.model, ids, 8))
    extra = {"ignore_eos": True}
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body=extra)
    assert r.object == "text_completion" and r.model == NAME and len(r.choices) == 1
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 8)
    assert r.usage.total_tokens == len(ids) + 8

    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=8,
                                            temperature=0, stream=True, extra_body=extra,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want
    assert len([t for t in texts if t]) >= 2  # really streamed, not one piece
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_completion_token_ids_several_prompts_n_and_logprobs(srv, client):
    p1 = srv.tok.encode("The quick brown fox")
    p2 = srv.tok.encode("中文：你好")
    r = client.completions.create(model=NAME, prompt=[p1, p2], max_tokens=3, temperature=0,
                                  n=2, logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    g1, g2 = _greedy(srv.model, p1, 3), _greedy(srv.model, p2, 3)
    for c, (ids, gen) in zip(r.choices, [(p1, g1), (p1, g1), (p2, g2), (p2, g2)]):
        assert c.text == srv.tok.decode(gen)
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
        assert lp.tokens == [srv.tok.decode([t], skip_special_tokens=False) for t in gen]
        # the sampled tokens' logprobs are log_softmax of the model's logits (temperature 0
        # reports T = 1), and greedy tokens are the top-1
        with torch.no_grad():
            logits = srv.model(torch.tensor([ids + gen]))[0, len(ids) - 1:-1].double()
        ref = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(gen)]
        assert lp.token_logprobs == pytest.approx(ref.tolist(), abs=1e-4)
        for k in range(3):
            assert len(lp.top_logprobs[k]) <= 3
            assert max(lp.top_logprobs[k].values()) == pytest.approx(lp.token_logprobs[k])
        assert lp.text_offset[0] == 0
    assert r.usage.prompt_tokens == len(p1) + len(p2)  # each prompt counted once
    assert r.usage.completion_tokens == 12


def test_seeded_sampling_is_reproducible_and_choices_differ(srv, client):
    kw = dict(model=NAME, prompt="Tokens per second", max_tokens=6, temperature=1.0, seed=7,
              n=2, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # choice j samples with seed + j


def test_stop_string_ends_the_text(srv, client):
    prompt = "Numbers: 0 1 2 3"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:5]  # a stop string the greedy continuation is known to contain
    assert stop
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=10,
                                         temperature=0, stop=[stop], stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


# --------------------------------------------------------------------------- chat
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the weather like in Oslo?"}]


def _expected_chat(srv, messages, n, thinking=True, tools=None):
    text = srv.tok.apply_chat_template(messages, tools=tools, enable_thinking=thinking)
    ids = srv.tok.encode(text)
    gen = _greedy(srv.model, ids, n)
    return ids, parse_chat_output(srv.tok.decode(gen), thinking=thinking, tools=tools)


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_completion_and_stream(srv, client, thinking):
    ids, want = _expected_chat(srv, MESSAGES, 8, thinking)
    extra = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": thinking}}
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8,
                                       temperature=0, extra_body=extra)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant"
    assert (msg.content or "") == want.content
    assert getattr(msg, "reasoning_content", None) == want.reasoning
    assert not msg.tool_calls and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 8)
    if thinking:  # random weights: 8 tokens of reasoning that never closes
        assert want.reasoning

    chunks = list(client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        extra_body=extra, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want.content
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == (want.reasoning or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_tool_call(srv, client):
    messages = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS,
                                       temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.reasoning_content == "Let me check."
    assert c.message.content == "I will look it up."
    [call] = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 3}
    assert r.usage.completion_tokens == len(srv.tok.encode(SCRIPT_TEXT)) + 1  # + the stop token

    chunks = list(client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS,
                                                 temperature=0, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        "Let me check."
    assert "".join(d.content or "" for d in deltas) == "I will look it up."
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            cur = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            cur["id"] = cur["id"] or tc.id
            cur["name"] += tc.function.name or ""
            cur["arguments"] += tc.function.arguments or ""
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "days": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The call sent back with its result renders, and the model's next turn runs.
    follow = messages + [c.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 12}'}]
    r2 = client.chat.completions.create(model=NAME, messages=follow, max_tokens=2,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens == len(srv.tok.encode(srv.tok.apply_chat_template(
        [messages[0], {"role": "assistant", "content": "I will look it up.",
                       "reasoning_content": "Let me check.",
                       "tool_calls": [{"type": "function", "function": {
                           "name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}}]},
         follow[2]])))


def test_tool_choice_none_keeps_the_markup_as_text(srv, client):
    # Without tools in the prompt the script is triggered by a <tool_call> in the message.
    messages = [{"role": "user", "content": "Echo <tool_call> please"}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS,
                                       tool_choice="none", temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content.startswith("I will look it up.<tool_call>get_weather<arg_key>")


def test_chat_logprobs(srv, client):
    ids, _ = _expected_chat(srv, MESSAGES, 3)
    gen = _greedy(srv.model, ids, 3)
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [srv.tok.decode([t], skip_special_tokens=False)
                                          for t in gen]
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.bytes == list(e.token.encode())


# --------------------------------------------------------------------------- errors
def _error(resp) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert body["error"]["code"] == resp.status_code
    return body["error"]


@pytest.mark.parametrize("body,param", [
    ({"model": NAME, "prompt": "hi", "temperature": -1}, "temperature"),  # SamplingParams
    ({"model": NAME, "prompt": "hi", "temperature": "hot"}, "temperature"),  # the type
    ({"model": NAME, "prompt": "hi", "top_p": 2}, "top_p"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": NAME, "prompt": "hi", "stop": 3}, "stop"),
    ({"model": NAME, "prompt": "hi", "n": 0}, "n"),
    ({"model": NAME, "prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": NAME, "prompt": []}, "prompt"),
    ({"model": NAME, "prompt": [[1, 2], "x", 3]}, "prompt"),
    ({"model": NAME, "prompt": [1, VOCAB + 5]}, "prompt"),  # token id outside the vocabulary
    ({"model": "gpt-4", "prompt": "hi"}, "model"),
    ({"prompt": "hi"}, "model"),
])
def test_completion_400_names_the_field(srv, body, param):
    r = httpx.post(srv.url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": NAME}, "messages"),
    ({"model": NAME, "messages": []}, "messages"),
    ({"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"model": NAME, "messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": -0.5},
     "temperature"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
      "top_logprobs": 30}, "top_logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}],
      "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": "required", "tools": TOOLS}, "tool_choice"),
    ({"model": NAME, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"model": NAME, "messages": [{"role": "assistant", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages"),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, "model"),
])
def test_chat_400_names_the_field(srv, body, param):
    r = httpx.post(srv.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == param, err


def test_openai_client_sees_400_for_bad_temperature(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"


def test_not_json_and_unknown_path(srv):
    r = httpx.post(srv.url + "/v1/completions", content=b"{nope",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in _error(r)["message"]
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and _error(r)["type"] == "not_found_error"


def test_prompt_longer_than_the_context_is_400(srv, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[5] * (CONTEXT + 10), max_tokens=1)
    assert e.value.body["param"] == "prompt" and str(CONTEXT) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # fits, but not with max_tokens
        client.completions.create(model=NAME, prompt=[5] * 50, max_tokens=CONTEXT)
    assert e.value.body["param"] == "max_tokens"


def test_long_prompt_over_its_rate_is_429_with_retry_after(srv):
    body = {"model": NAME, "prompt": [7] * (LONG_PROMPT + 1), "max_tokens": 1}
    ok = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert ok.status_code == 200, ok.text  # the burst admits one
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 429
    assert _error(r)["param"] == "prompt" and _error(r)["type"] == "rate_limit_error"
    # one token refills in 1 / 0.01 s
    assert 1 <= int(r.headers["Retry-After"]) <= 100
    short = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": [7] * LONG_PROMPT})
    assert short.status_code == 200  # at the threshold: not limited


def test_failing_request_fails_alone(srv):
    poison = srv.tok.encode("x<|endoftext|>y")
    good = srv.tok.encode("Hello")
    want = srv.tok.decode(_greedy(srv.model, good, 6))

    async def run():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)

        async def bad_plain():
            with pytest.raises(openai.InternalServerError) as e:
                await c.completions.create(model=NAME, prompt=poison, max_tokens=4)
            assert "planted sampling failure" in e.value.body["message"]

        async def bad_stream():
            s = await c.completions.create(model=NAME, prompt=poison, max_tokens=4,
                                           stream=True)
            with pytest.raises(openai.APIError, match="planted sampling failure"):
                async for _ in s:
                    pass

        async def good_one():
            r = await c.completions.create(model=NAME, prompt=good, max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
            return r.choices[0].text

        out = await asyncio.gather(bad_plain(), bad_stream(), good_one(), good_one())
        await c.close()
        return out

    _, _, a, b = asyncio.run(run())
    assert a == b == want
    _wait_idle(srv.engine)


# --------------------------------------------------------------------------- resources
def test_disconnect_mid_stream_frees_pages(srv, client):
    eng = srv.engine
    _wait_idle(eng)
    total = eng.allocator.num_pages
    free0, cached0 = eng.allocator.num_free, eng.radix.num_cached_pages
    assert free0 + cached0 == total  # idle: every page is free or only in the prefix cache
    aborted0 = eng.stats.aborted
    prompt = [11 + i % 200 for i in range(40)]  # 2 full pages of 16 + 8 tokens
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert eng.allocator.num_free < free0  # the request holds pages
    stream.close()  # the client goes away mid-stream
    t0 = time.monotonic()
    _wait_idle(eng, timeout=5.0)  # 200 tokens would take far longer: it was aborted
    assert time.monotonic() - t0 < 5.0
    assert eng.stats.aborted == aborted0 + 1
    assert not eng.scheduler.running and not eng.scheduler.waiting
    # Its full pages went to the prefix cache (no request holds them), the rest are free.
    cached = eng.radix.num_cached_pages
    assert cached > cached0
    assert eng.allocator.num_free == free0 - (cached - cached0)
    assert all(eng.allocator.refcount(p) == 0 or p in eng.radix
               for p in range(total))


def test_disconnect_while_waiting_for_a_plain_response_aborts_it(srv):
    eng = srv.engine
    _wait_idle(eng)
    aborted0 = eng.stats.aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", timeout=1.0,
                   json={"model": NAME, "prompt": [9] * 20, "max_tokens": 200,
                         "temperature": 0, "ignore_eos": True})
    _wait_idle(eng, timeout=5.0)
    assert eng.stats.aborted == aborted0 + 1
    assert eng.allocator.num_free + eng.radix.num_cached_pages == eng.allocator.num_pages


def test_sse_response_closes_its_generator_when_the_client_leaves_during_a_send():
    """A client that disconnects while the server is blocked writing to it (the generator is
    suspended at a ``yield``, not waiting on the engine): the generator's cleanup — which
    aborts the engine requests — must still run when the response ends."""
    from glm5.serve.streams import SSEResponse as _SSEResponse

    cleaned: list[bool] = []

    async def body():
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
        finally:
            cleaned.append(True)

    async def run():
        sent_start = asyncio.Event()

        async def receive():
            await sent_start.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                sent_start.set()
            else:
                await asyncio.Event().wait()  # the socket never drains

        gen = body()  # referenced here: it cannot be collected (and closed) meanwhile
        await _SSEResponse(gen)({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        # checked before asyncio.run's own shutdown_asyncgens would close it
        assert cleaned == [True]

    asyncio.run(run())


# --------------------------------------------------------------------------- metrics
def _scrape(srv) -> dict[str, float]:
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())
                                   if k != "le")
            if "le" in s.labels:
                key += f"[le={s.labels['le']}]"
            out[key] = s.value
    return out


def test_metrics_move_with_the_work_done(srv, client):
    _wait_idle(srv.engine)
    before = _scrape(srv)
    for name in ("glm5_num_requests_waiting", "glm5_num_requests_running",
                 "glm5_cache_usage_ratio", "glm5_prefix_cache_hit_rate",
                 "glm5_spec_decode_draft_tokens_total", "glm5_spec_decode_accepted_tokens_total",
                 "glm5_time_to_first_token_seconds_count",
                 "glm5_time_per_output_token_seconds_count",
                 "glm5_e2e_request_latency_seconds_count"):
        assert name in before, name
    # 20 tokens: one full page of 16 the second request finds in the prefix cache
    prompt = (srv.tok.encode("Pages of 64 tokens hold the latent cache.") * 4)[:20]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    after = _scrape(srv)

    def d(name):
        return after[name] - before.get(name, 0.0)

    assert d("glm5_generation_tokens_total") == 10
    assert d("glm5_prompt_tokens_total") == 2 * len(prompt)
    assert d("glm5_requests_total{outcome=finished}") == 2
    for h in ("glm5_time_to_first_token_seconds", "glm5_time_per_output_token_seconds",
              "glm5_e2e_request_latency_seconds"):
        assert d(h + "_count") == 2 and d(h + "_sum") > 0
        assert d(h + "_bucket[le=+Inf]") == 2
    # the second request found the first's full pages (prompt tokens 0 .. 15) cached
    assert again.usage.prompt_tokens_details.cached_tokens == 16
    assert d("glm5_prefix_cache_hit_tokens_total") == 16
    assert d("glm5_prefix_cache_queried_tokens_total") == 2 * len(prompt)
    hit, queried = after["glm5_prefix_cache_hit_tokens_total"], \
        after["glm5_prefix_cache_queried_tokens_total"]
    assert after["glm5_prefix_cache_hit_rate"] == pytest.approx(hit / queried)
    eng = srv.engine
    assert after["glm5_cache_pages_free"] == eng.allocator.num_free
    assert after["glm5_cache_usage_ratio"] == pytest.approx(
        1 - eng.allocator.num_free / eng.allocator.num_pages)
    assert after["glm5_num_requests_running"] == 0 == after["glm5_num_requests_waiting"]


def test_separate_apps_have_separate_registries(model_and_tok):
    model, tok = model_and_tok
    ae = AsyncEngine(_engine(model, tok))
    try:
        a, b = build_app(ae, "a", tok), build_app(ae, "b", tok)  # would raise on a clash
        assert a.state.server.metrics.registry is not b.state.server.metrics.registry
    finally:
        asyncio.run(ae.shutdown(5))


# --------------------------------------------------------------------------- load
def test_128_concurrent_requests_all_answered_completely(srv):
    n, tokens = 128, 4

    async def run():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)

        async def one(i: int):
            if i % 2:
                r = await c.completions.create(model=NAME, prompt=f"Request number {i}:",
                                               max_tokens=tokens, logprobs=0,
                                               extra_body={"ignore_eos": True})
                return (r.choices[0].finish_reason, r.usage.completion_tokens,
                        len(r.choices[0].logprobs.tokens))
            s = await c.completions.create(model=NAME, prompt=f"Request number {i}:",
                                           max_tokens=tokens, logprobs=0, stream=True,
                                           extra_body={"ignore_eos": True})
            got, reason = 0, None
            async for ch in s:
                got += len(ch.choices[0].logprobs.tokens) if ch.choices[0].logprobs else 0
                reason = ch.choices[0].finish_reason or reason
            return reason, got, got

        out = await asyncio.gather(*(one(i) for i in range(n)))
        await c.close()
        return out

    t0 = time.monotonic()
    out = asyncio.run(run())
    took = time.monotonic() - t0
    assert out == [("length", tokens, tokens)] * n, out
    _wait_idle(srv.engine)
    print(f"\n128 concurrent requests x {tokens} tokens: {took:.1f} s")


# --------------------------------------------------------------------------- shutdown
def test_shutdown_drains_the_running_request(model_and_tok):
    model, tok = model_and_tok
    engine = _engine(model, tok)
    ae = AsyncEngine(engine)
    live = LiveServer(build_app(ae, NAME, tok))
    try:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
        stream = c.completions.create(model=NAME, prompt="Hello, world!", max_tokens=12,
                                      temperature=0, stream=True, logprobs=0,
                                      extra_body={"ignore_eos": True})
        it = iter(stream)
        got = [next(it)]
        drained: list[bool] = []
        t = threading.Thread(target=lambda: drained.append(asyncio.run(ae.shutdown(60))))
        t.start()
        deadline = time.monotonic() + 10
        while ae.accepting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.has_unfinished()  # the stream is still running ...
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x"})
        assert r.status_code == 503 and _error(r)["type"] == "service_unavailable_error"
        got += list(it)  # ... and finishes whole
        t.join(60)
        assert drained == [True]
        assert sum(len(ch.choices[0].logprobs.tokens) for ch in got) == 12
        assert got[-1].choices[0].finish_reason == "length"
        assert "".join(ch.choices[0].text for ch in got) == tok.decode(
            _greedy(model, tok.encode("Hello, world!"), 12))
    finally:
        live.stop()


# --------------------------------------------------------------------------- glm5 serve
def test_cli_serve_errors_are_one_line(tmp_path, capsys):
    from glm5.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "MODEL_DIR" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--chunk-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm5 serve: ") and "--chunk-size" in err and err.count("\n") == 1
    assert main(["serve", str(tmp_path), "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--max-decode-slowdown", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--max-decode-slowdown" in err and "finite number > 1" in err
    assert main(["serve", str(tmp_path), "--max-decode-slowdown", "fast"]) == 2
    assert "expected a number > 1 or 'off'" in capsys.readouterr().err


def test_cli_serve_port_in_use_is_one_line(model_and_tok, tmp_path, capsys):
    import socket

    from glm5.cli import main

    model, _ = model_and_tok
    model.save_pretrained(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", str(tmp_path), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("glm5 serve: cannot listen on 127.0.0.1:") and err.count("\n") == 1


def test_cli_serve_answers_and_drains_on_sigterm(model_and_tok, tmp_path):
    model, _ = model_and_tok
    model.save_pretrained(tmp_path)
    build_tokenizer(tmp_path, VOCAB)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "glm5.cli", "serve", str(tmp_path), "--port", "0",
         "--served-model-name", "tiny", "--page-size", "16", "--num-pages", "64",
         "--max-model-len", "256", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            if " at http://" in line:
                url = line.split(" at ")[1].split()[0]
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        stream = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16,
                                           temperature=0, stream=True, logprobs=True,
                                           extra_body={"ignore_eos": True})
        it = iter(stream)
        chunks = [next(it), next(it)]
        proc.send_signal(signal.SIGTERM)  # graceful: the open stream finishes first
        chunks += list(it)
        assert sum(len(ch.choices[0].logprobs.content) for ch in chunks
                   if ch.choices and ch.choices[0].logprobs) == 16
        assert chunks[-1].choices[0].finish_reason == "length"
        # uvicorn re-raises the signal once it has shut down gracefully
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_serve_socket_accepts_connections_before_uvicorn_runs():
    """`glm5 serve` prints its URL before uvicorn starts: the socket must already listen, so a
    client connecting at once waits instead of being refused."""
    import socket

    from glm5.cli import _listen_socket

    sock = _listen_socket("127.0.0.1", 0)
    try:
        addr = sock.getsockname()[:2]
        try:
            c = socket.create_connection(addr, timeout=5)
        except ConnectionRefusedError:
            pytest.fail("glm5 serve's socket refused a connection: it is not listening yet")
        with c:
            assert c.getpeername()[:2] == addr  # connected (waiting in the backlog)
    finally:
        sock.close()


def test_cli_serve_max_decode_slowdown_off_means_no_budget():
    import argparse

    from glm5.cli.serve import ENGINE_OPTIONS, _given, _slowdown

    ns = argparse.Namespace(**{k: None for k in ENGINE_OPTIONS})
    ns.max_decode_slowdown = _slowdown("off")
    assert _given(ns, ENGINE_OPTIONS) == {"max_decode_slowdown": None}
    ns.max_decode_slowdown = _slowdown("3")
    assert _given(ns, ENGINE_OPTIONS) == {"max_decode_slowdown": 3.0}
