"""`glm5 serve` against hostile and broken clients, on a live server (tiny preset, random
weights, a tokenizer trained on the spot), with the limits scaled down where the point is the
mechanism (64 KiB bodies, 1 s timeouts, a backlog of 8 outputs).

Each case here was a 500, an unbounded cost or a hang before the limits existed: a lone
surrogate, seeds and integers out of range, a client that stops reading its stream, a large
body, idle and half-sent connections, too many connections, SIGTERM with a stalled stream.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from glm5.engine.async_engine import AsyncEngine  # noqa: E402
from glm5.engine.engine import EngineConfig, LLMEngine, RequestRejected  # noqa: E402
from glm5.serve.app import build_app  # noqa: E402
from glm5.serve.limits import ServeLimits, min_tokens  # noqa: E402
from glm5.text.bpe import build_tokenizer  # noqa: E402
from serve_util import LiveServer, tiny_model_and_tokenizer  # noqa: E402

NAME = "tiny"
VOCAB = 512
CONTEXT = 1024
LIMITS = ServeLimits(max_body_bytes=64 * 1024, header_timeout=1.0, body_timeout=1.0,
                     timeout_keep_alive=5.0, max_header_bytes=8 * 1024, max_connections=48,
                     stream_backlog=8, stall_timeout=2.0, graceful_timeout=1.0,
                     send_buffer_bytes=16 * 1024)


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory):
    return tiny_model_and_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)


def _engine(model, tok, context: int = CONTEXT) -> LLMEngine:
    return LLMEngine(model, EngineConfig(page_size=16, num_pages=512, max_num_seqs=128,
                                         max_num_batched_tokens=2048, chunk_size=256,
                                         max_model_len=context, seed=0), tok)


def _serve(model_and_tok, limits: ServeLimits = LIMITS, context: int = CONTEXT) -> LiveServer:
    model, tok = model_and_tok
    engine = _engine(model, tok, context)
    live = LiveServer(build_app(AsyncEngine(engine), NAME, tok, limits=limits))
    live.engine, live.tok = engine, tok
    return live


@pytest.fixture(scope="module")
def srv(model_and_tok):
    live = _serve(model_and_tok)
    yield live
    live.stop()


def _metric(live, name: str, **labels) -> float:
    text = generate_latest(live.app.state.server.metrics.registry).decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _idle(live, timeout: float = 20.0) -> None:
    _wait(lambda: not live.engine.has_unfinished(), timeout,
          f"engine still busy: {list(live.engine.requests)}")


def _post(live, path: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(live.url + path, content=data,
                      headers={"content-type": "application/json"}, timeout=30, **kw)


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == r.status_code, body
    return body["error"]


# --------------------------------------------------------------------------- text that is not text
LONE = '"hi \\ud800 there"'  # JSON: a valid escape, decoding to a lone surrogate


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "tiny", "prompt": %s, "max_tokens": 2}' % LONE, "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", %s], "max_tokens": 2}' % LONE,
     "prompt[1]"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ok", "stop": [%s]}' % LONE, "stop[0]"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}'
     % LONE, "messages[0].content"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": %s}]}]}' % LONE, "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x"}],'
     ' "chat_template_kwargs": {"who": %s}}' % LONE, "chat_template_kwargs.who"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(srv, path, body, param):
    r = _post(srv, path, body.encode())
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == param and "surrogate" in err["message"]


def test_the_engine_refuses_a_prompt_its_tokenizer_cannot_take(model_and_tok):
    model, tok = model_and_tok
    engine = _engine(model, tok)
    with pytest.raises(RequestRejected) as e:
        engine.add_request("x", "hi \ud800 there")
    assert e.value.status == 400 and e.value.param == "prompt"
    assert "cannot be tokenized" in str(e.value)


# --------------------------------------------------------------------------- integers
@pytest.mark.parametrize("seed", [2**64, 2**100, -1, 2**63])
def test_seeds_out_of_range_are_400(srv, seed):
    r = _post(srv, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2,
                                       "seed": seed})
    assert r.status_code == 400 and _error(r)["param"] == "seed"


def test_the_largest_seeds_are_served_and_do_not_alias_small_ones(srv):
    def tokens(seed, n=1):
        r = _post(srv, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 6,
                                           "seed": seed, "n": n, "return_token_ids": True,
                                           "ignore_eos": True})
        assert r.status_code == 200, r.text
        return [c["token_ids"] for c in r.json()["choices"]]

    top = tokens(2**63 - 2, n=2)  # choice 1 samples with 2**63 - 1, the largest seed
    assert tokens(2**63 - 2) == top[:1] and tokens(2**63 - 1) == top[1:]
    small = tokens(0, n=2)  # torch takes seeds modulo 2**63: 2**63 + j would be j
    assert not set(map(tuple, top)) & set(map(tuple, small))
    r = _post(srv, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2,
                                       "seed": 2**63 - 1, "n": 2})
    assert r.status_code == 400 and _error(r)["param"] == "seed"  # choice 1 would be 2**63


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 2**100), ("max_tokens", -2**70), ("n", 2**64), ("top_k", 2**40),
    ("logprobs", 2**70), ("best_of", 2**64), ("stop_token_ids", [2**64]),
    ("prompt", [1, 2**64]), ("prompt", [[1], [2**40]]),
])
def test_every_integer_field_out_of_range_is_a_400_naming_it(srv, field, value):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, field: value}
    r = _post(srv, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert _error(r)["param"].split("[")[0] == field


@pytest.mark.parametrize("field", ["top_logprobs", "max_completion_tokens", "seed", "n"])
def test_chat_integer_fields_out_of_range(srv, field):
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
            field: 2**64}
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 400 and _error(r)["param"] == field


# Hostile bodies: whatever a client sends, the answer is never a 500 (that is kept for an
# engine failure) and the server keeps serving.
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False), st.text(max_size=8),
                    st.sampled_from(["\ud800", "a\udfffb", "<|user|>", "<tool_call>"]))
_value = st.recursive(_scalar, lambda c: st.lists(c, max_size=3)
                      | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6)
_FIELDS = ["prompt", "messages", "max_tokens", "n", "seed", "temperature", "top_p", "top_k",
           "stop", "stream", "logprobs", "top_logprobs", "stop_token_ids", "tools",
           "chat_template_kwargs", "min_p", "return_token_ids", "tool_choice", "unknown"]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       fields=st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=5),
       good_base=st.booleans())
def test_no_request_body_gets_a_500(srv, path, fields, good_base):
    base = ({"model": NAME, "prompt": "hi"} if path.endswith("/completions")
            and "chat" not in path else {"model": NAME, "messages": [
                {"role": "user", "content": "hi"}]}) if good_base else {}
    body = {**base, **fields, "max_tokens": 2} if good_base else fields
    r = _post(srv, path, json.dumps(body).encode())
    assert r.status_code in (200, 400, 429), (r.status_code, r.text, body)
    if r.status_code != 200:
        _error(r)


# --------------------------------------------------------------------------- stalled readers
def _raw_stream(live, body: dict, rcvbuf: int = 4096) -> socket.socket:
    """A client that sends a streaming request and then never reads."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", live.port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
              b"application/json\r\ncontent-length: " + str(len(data)).encode() + b"\r\n\r\n"
              + data)
    return s


STALL_BODY = {"model": NAME, "messages": [{"role": "user", "content": "Tell me a story."}],
              "n": 4, "max_tokens": 900, "logprobs": True, "top_logprobs": 20, "stream": True,
              "ignore_eos": True}


def _read_all(s: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection."""
    s.settimeout(timeout)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _drained_until_closed(s: socket.socket, timeout: float) -> bool:
    """Read what the server sent; True once the server has closed (EOF or reset)."""
    s.settimeout(timeout)
    try:
        while s.recv(1 << 20):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_client_that_stops_reading_is_aborted_and_its_pages_freed(model_and_tok):
    live = _serve(model_and_tok, ServeLimits(**{**LIMITS.__dict__, "stall_timeout": 60.0}))
    eng = live.engine
    s = _raw_stream(live, STALL_BODY)
    try:
        _wait(lambda: eng.stats.generation_tokens > 0, 30, "the stream did not start")
        _idle(live, timeout=60)  # aborted: 4 x 900 tokens would take far longer to finish
        generated = eng.stats.generation_tokens
        # the engine ran at most stream_backlog (+ the merge queue) steps past what the
        # socket took: far short of max_tokens
        assert generated < 4 * 900 / 4, generated
        assert _metric(live, "glm5_stream_backlog_aborts_total") == 4  # each choice
        assert eng.allocator.num_free + eng.radix.num_cached_pages == eng.allocator.num_pages
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        s.close()
        live.stop()
    assert _metric(live, "glm5_requests_aborted_total", reason="stalled") == 1


def test_a_socket_that_stays_unwritable_is_dropped(srv):
    _idle(srv)
    stalled0 = _metric(srv, "glm5_requests_aborted_total", reason="stalled")
    t0 = time.monotonic()
    s = _raw_stream(srv, STALL_BODY)
    try:
        _wait(lambda: _metric(srv, "glm5_requests_aborted_total", reason="stalled")
              == stalled0 + 1, 30, "the stalled stream was not dropped")
        assert time.monotonic() - t0 >= LIMITS.stall_timeout
        assert _drained_until_closed(s, 10)  # what the kernel held, then the close
    finally:
        s.close()
    _idle(srv)
    eng = srv.engine
    assert eng.allocator.num_free + eng.radix.num_cached_pages == eng.allocator.num_pages


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# 16 stalled streams (n=4, top-20 logprobs) may cost the server this much RSS, all told: what
# each holds is its transport buffer (64 KiB high water + one chunk) and 8 outputs per choice.
STALLED_RSS_BOUND = 32 << 20


def test_16_stalled_streams_cost_bounded_memory(model_and_tok):
    live = _serve(model_and_tok, ServeLimits(**{**LIMITS.__dict__, "stall_timeout": 60.0}))
    socks = []
    try:
        _post(live, "/v1/chat/completions", {**STALL_BODY, "stream": False, "max_tokens": 4,
                                             "n": 4})  # warm up: first-call allocations
        rss0 = _rss()
        socks = [_raw_stream(live, STALL_BODY) for _ in range(16)]
        _wait(lambda: live.engine.has_unfinished(), 30, "the streams did not start")
        _wait(lambda: _metric(live, "glm5_stream_backlog_aborts_total") >= 16 * 4, 120,
              "not every stalled choice was aborted")
        _idle(live, timeout=60)
        grew = _rss() - rss0
        print(f"\n16 stalled streams: server RSS +{grew / 2**20:.1f} MiB")
        assert grew < STALLED_RSS_BOUND, grew
        assert live.engine.stats.generation_tokens < 16 * 4 * 900 / 2
    finally:
        for s in socks:
            s.close()
        live.stop()


def test_a_client_that_leaves_mid_stream_is_counted(srv):
    _idle(srv)
    gone0 = _metric(srv, "glm5_requests_aborted_total", reason="client_gone")
    stalled0 = _metric(srv, "glm5_requests_aborted_total", reason="stalled")
    aborted0 = srv.engine.stats.aborted
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30, json={
            "model": NAME, "prompt": "hi", "max_tokens": 500, "stream": True,
            "ignore_eos": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    _idle(srv)
    assert srv.engine.stats.aborted == aborted0 + 1  # the engine stopped it ...
    deadline = time.monotonic() + 10
    while (_metric(srv, "glm5_requests_aborted_total", reason="client_gone") == gone0
           and time.monotonic() < deadline):
        time.sleep(0.02)
    # ... and it is counted once, as a client that left (not as a stalled one)
    assert _metric(srv, "glm5_requests_aborted_total", reason="client_gone") == gone0 + 1
    assert _metric(srv, "glm5_requests_aborted_total", reason="stalled") == stalled0


# --------------------------------------------------------------------------- bodies
def test_a_body_over_the_limit_is_413_before_it_is_read(srv):
    too0 = _metric(srv, "glm5_requests_aborted_total", reason="too_large")
    s = socket.create_connection(("127.0.0.1", srv.port))
    try:  # announce 20 MB, send 1 KB: the 413 comes without the rest
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: 20000000\r\n\r\n" + b"{" * 1024)
        head = _read_all(s, 5)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert b"max_body_bytes" in head
    finally:
        s.close()
    assert _metric(srv, "glm5_requests_aborted_total", reason="too_large") == too0 + 1


def test_a_chunked_body_over_the_limit_is_413(srv):
    def chunks():
        for _ in range(100):
            yield b"x" * 4096

    r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and "max_body_bytes" in _error(r)["message"]


def test_unknown_fields_are_ignored_within_the_body_limit(srv):
    r = _post(srv, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2,
                                       "some_new_openai_field": "x" * 40_000})
    assert r.status_code == 200
    r = _post(srv, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2,
                                       "some_new_openai_field": "x" * 70_000})
    assert r.status_code == 413


def _health_latencies(live, stop: threading.Event) -> list[float]:
    out = []
    with httpx.Client(timeout=10) as c:
        while not stop.is_set():
            t = time.monotonic()
            assert c.get(live.url + "/health").status_code == 200
            out.append(time.monotonic() - t)
            time.sleep(0.005)
    return out


def test_health_answers_within_100_ms_while_maximal_prompts_are_refused(model_and_tok):
    context = 512  # small enough that a body under the limit can be refused on its bytes
    live = _serve(model_and_tok, context=context)
    tok = live.tok
    limit = LIMITS.max_body_bytes - 200
    by_bytes = "the quick brown fox " * (limit // 20)  # refused on its bytes alone
    assert min_tokens(len(by_bytes), tok.longest_token_bytes) >= context
    room = 4 * tok.longest_token_bytes * (context - 1)
    tokenized = ("the quick brown fox " * (room // 20))[:min(room, limit)]  # tokenized, too long
    assert min_tokens(len(tokenized), tok.longest_token_bytes) < context
    assert len(tok.encode(tokenized)) >= context
    srv = live
    stop = threading.Event()
    lat: list[float] = []
    poller = threading.Thread(target=lambda: lat.extend(_health_latencies(srv, stop)))
    poller.start()
    try:
        time.sleep(0.1)
        answers = []
        threads = [threading.Thread(target=lambda p=p: answers.append(_post(
            srv, "/v1/completions", {"model": NAME, "prompt": p, "max_tokens": 1})))
            for p in (by_bytes, tokenized) * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(0.1)
    finally:
        stop.set()
        poller.join(30)
    live.stop()
    assert len(answers) == 6 and all(r.status_code == 400 for r in answers)
    assert all(_error(r)["param"] == "prompt" for r in answers)
    assert sum("bytes of text" in _error(r)["message"] for r in answers) == 3
    assert len(lat) >= 5 and max(lat) < 0.1, max(lat)


def test_tokenizing_runs_off_the_event_loop(model_and_tok, monkeypatch):
    live = _serve(model_and_tok)
    tok = live.tok
    threads: list[str] = []
    real = tok.encode

    def slow_encode(text, *a, **k):  # a tokenizer that takes a second (a multi-MB prompt)
        threads.append(threading.current_thread().name)
        time.sleep(1.0)
        return real(text, *a, **k)

    monkeypatch.setattr(tok, "encode", slow_encode)
    try:
        stop = threading.Event()
        lat: list[float] = []
        poller = threading.Thread(target=lambda: lat.extend(_health_latencies(live, stop)))
        poller.start()
        r = _post(live, "/v1/chat/completions", {"model": NAME, "max_tokens": 1,
                                                  "messages": [{"role": "user",
                                                                "content": "hi"}]})
        stop.set()
        poller.join(30)
        assert r.status_code == 200
        assert threads and all(n.startswith("glm5-tok") for n in threads), threads
        assert len(lat) >= 5 and max(lat) < 0.1, max(lat)
    finally:
        monkeypatch.undo()
        live.stop()


# --------------------------------------------------------------------------- connections
def test_idle_and_half_sent_connections_are_closed(srv):
    t0 = time.monotonic()
    idle = socket.create_connection(("127.0.0.1", srv.port))
    half = socket.create_connection(("127.0.0.1", srv.port))
    trickle = socket.create_connection(("127.0.0.1", srv.port))
    timeouts0 = _metric(srv, "glm5_requests_aborted_total", reason="timeout")
    try:
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        for b in b"GET /health HTTP/1.1\r\n":  # one byte at a time, never the whole head
            try:
                trickle.sendall(bytes([b]))
            except OSError:
                break  # closed by the server: what this checks
            time.sleep(0.1)
            if time.monotonic() - t0 > LIMITS.header_timeout + 1:
                break
        for s in (idle, half, trickle):
            assert _drained_until_closed(s, LIMITS.header_timeout + 3)
        assert time.monotonic() - t0 < LIMITS.header_timeout + 4
        half.settimeout(1)
    finally:
        for s in (idle, half, trickle):
            s.close()
    assert _metric(srv, "glm5_requests_aborted_total", reason="timeout") >= timeouts0 + 2


def test_a_half_sent_request_gets_a_408(srv):
    s = socket.create_connection(("127.0.0.1", srv.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        head = _read_all(s, LIMITS.header_timeout + 3)
        assert head.startswith(b"HTTP/1.1 408") and b"header_timeout" in head
    finally:
        s.close()


def test_a_body_that_does_not_arrive_gets_a_408(srv):
    s = socket.create_connection(("127.0.0.1", srv.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: 100\r\n\r\n{\"model\"")
        head = _read_all(s, LIMITS.body_timeout + 3)
        assert head.startswith(b"HTTP/1.1 408") and b"body_timeout" in head
    finally:
        s.close()


def test_connections_over_the_cap_get_a_503_and_the_server_recovers(srv):
    cap = LIMITS.max_connections
    refused0 = _metric(srv, "glm5_http_connections_refused_total")
    held = []
    try:
        for _ in range(cap + 8):
            held.append(socket.create_connection(("127.0.0.1", srv.port)))
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", srv.port))
        extra.settimeout(5)
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")
        extra.close()
        assert _metric(srv, "glm5_http_connections_refused_total") >= refused0 + 9
        assert _metric(srv, "glm5_http_connections_open") <= cap
    finally:
        for s in held:
            s.close()
    # the idle ones time out, or closed: the server answers again
    _wait(lambda: _metric(srv, "glm5_http_connections_open") <= 1, 10, "connections stay open")
    assert httpx.get(srv.url + "/health").status_code == 200


# --------------------------------------------------------------------------- shutdown
def test_at_the_graceful_timeout_open_streams_get_a_final_error_event(model_and_tok):
    live = _serve(model_and_tok)
    events = []
    try:
        with httpx.stream("POST", live.url + "/v1/completions", timeout=30, json={
                "model": NAME, "prompt": "hi", "max_tokens": 900, "stream": True,
                "ignore_eos": True}) as r:
            lines = r.iter_lines()
            events.append(next(lines))
            stopper = threading.Thread(target=live.stop)
            t0 = time.monotonic()
            stopper.start()
            events += [x for x in lines if x]
        took = time.monotonic() - t0
        stopper.join(30)
    finally:
        if live.thread.is_alive():
            live.stop()
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == 503 and "graceful timeout" in err["message"]
    assert LIMITS.graceful_timeout <= took < LIMITS.graceful_timeout + 5
    assert _metric(live, "glm5_requests_aborted_total", reason="shutdown") == 1
    assert not live.engine.has_unfinished()


# --------------------------------------------------------------------------- glm5 serve
def _start_cli(tmp_path, model_and_tok, *extra, nofile: int | None = None):
    model, _ = model_and_tok
    model.save_pretrained(tmp_path)
    build_tokenizer(tmp_path, VOCAB)

    def lower_nofile():
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, "-m", "glm5.cli", "serve", str(tmp_path), "--port", "0",
         "--served-model-name", NAME, "--page-size", "16", "--num-pages", "256",
         "--max-model-len", str(CONTEXT), "--log-level", "warning", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=lower_nofile)
    deadline = time.monotonic() + 120
    while True:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        if " at http://" in line:
            url = line.split(" at ")[1].split()[0].removesuffix("/v1")
            return proc, url, int(url.rsplit(":", 1)[1])


def test_cli_sigterm_with_a_stalled_client_exits_after_the_graceful_timeout(tmp_path,
                                                                           model_and_tok):
    proc, url, port = _start_cli(tmp_path, model_and_tok, "--graceful-timeout", "2",
                                 "--stall-timeout", "600", "--stream-backlog", "100000")
    s = None
    try:
        class Live:  # what _raw_stream needs
            pass

        live = Live()
        live.port = port
        s = _raw_stream(live, STALL_BODY)
        time.sleep(3)  # it generates, and the socket fills
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        took = time.monotonic() - t0
        assert rc == -signal.SIGTERM
        assert took < 2 + 5 + 5, took  # graceful timeout + uvicorn's margin + start-up slack
    finally:
        if s is not None:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_options_and_their_errors(tmp_path, capsys):
    from glm5.cli import main

    assert main(["serve", str(tmp_path), "--max-body-bytes", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-body-bytes" in err and err.count("\n") == 1
    assert main(["serve", str(tmp_path), "--stall-timeout", "nan"]) == 2
    assert "--stall-timeout" in capsys.readouterr().err


def test_cli_many_connections_under_a_low_descriptor_limit(tmp_path, model_and_tok):
    """With 512 descriptors (a cap of 256 connections), 400 connections: the server refuses the excess with a 503 instead
    of failing accept with EMFILE, and answers again once the idle ones time out."""
    proc, url, port = _start_cli(tmp_path, model_and_tok, "--header-timeout", "2",
                                 nofile=512)
    held = []
    try:
        refused = 0
        for _ in range(400):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break  # the client's own descriptors
        time.sleep(0.5)
        for s in held:
            s.settimeout(0.01)
            try:
                if s.recv(64).startswith(b"HTTP/1.1 503"):
                    refused += 1
            except (TimeoutError, BlockingIOError):
                pass
        assert refused >= len(held) - 256, (refused, len(held))
        for s in held:
            s.close()
        held = []
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 200
    finally:
        for s in held:
            s.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        err = proc.stderr.read()
        assert "Too many open files" not in err and "EMFILE" not in err, err[-2000:]


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_body_bytes"):
        ServeLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="stall_timeout"):
        ServeLimits(stall_timeout=float("inf"))
    with pytest.raises(ValueError, match="max_connections"):
        ServeLimits(max_connections=True)
    assert ServeLimits(max_connections=None).connection_cap() >= 16


def test_headers_over_the_limit_are_a_400_and_closed(srv):
    s = socket.create_connection(("127.0.0.1", srv.port))
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (2 * LIMITS.max_header_bytes))
        head = _read_all(s, 5)
        assert head.startswith(b"HTTP/1.1 400"), head
    except (BrokenPipeError, ConnectionResetError):
        pass  # closed while the rest was still being sent: refused all the same
    finally:
        s.close()
    assert httpx.get(srv.url + "/health").status_code == 200
