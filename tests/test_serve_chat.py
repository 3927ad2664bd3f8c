"""Text in, text out (glm5.text.tokenizer, glm5.text.chat, glm5.text.bpe): a tokenizer
trained here on built-in text (nothing from a hub), the GLM-5 chat template against golden
strings written out by hand, the streaming chat parser against the one-shot parse under any
chunking, and the clear errors of a broken model directory."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from glm5.text.chat import (  # noqa: E402
    ChatEvent, ChatParser, ParsedChat, ToolCall, packaged_chat_template, parse_chat_output)
from glm5.text.tokenizer import Tokenizer  # noqa: E402
from glm5.text.bpe import EOS_TOKENS, MIN_VOCAB_SIZE, build_tokenizer  # noqa: E402

TOOL_DECL = ('<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user '
             'query.\n\nYou are provided with function signatures within <tools></tools> XML '
             'tags:\n<tools>\n')
TOOL_FORMAT = ('\n</tools>\n\nFor each function call, output the function name and arguments '
               'within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}'
               '</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key>'
               '<arg_value>{arg-value-2}</arg_value>...</tool_call>')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "天气 by city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "days": {"type": "integer"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, vocab_size=512)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


# --------------------------------------------------------------------------- tokenizer


def test_built_tokenizer_files_and_ids(tok, tok_dir):
    assert tok.vocab_size == 512
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["chat_template"] == packaged_chat_template()
    assert tok.eos_token_ids == frozenset(tok.token_to_id(t) for t in EOS_TOKENS)
    assert len(tok.eos_token_ids) == 3 and max(tok.eos_token_ids) < tok.vocab_size
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    # every GLM tag is one token: the model emits it as one id
    for tag in ("[gMASK]", "<sop>", "<|assistant|>", "<think>", "</tool_call>", "<arg_value>"):
        assert len(tok.encode(tag)) == 1, tag


@pytest.mark.parametrize("text", [
    "Hello, world!", "naïve café — 你好，世界 🙂👩‍💻 Ωmega", "def f(x):\n    return {\"k\": [1, 2]}\n",
    " leading and trailing spaces  ", "\t\n", "",
])
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_decode_skips_special_tokens_but_keeps_glm_tags(tok):
    text = "[gMASK]<sop><|user|>Weather?<|assistant|><think>hm</think>ok<tool_call>f</tool_call>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "Weather?<think>hm</think>ok<tool_call>f</tool_call>"


def test_build_tokenizer_is_deterministic(tmp_path, tok_dir):
    # another process: a hash seed of its own, so nothing may depend on dict/set order
    code = ("import sys; from glm5.text.bpe import build_tokenizer; "
            "build_tokenizer(sys.argv[1], vocab_size=512)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True,
                   env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == \
            hashlib.sha256((tok_dir / name).read_bytes()).hexdigest(), name


def test_build_tokenizer_small_vocab(tmp_path):
    with pytest.raises(ValueError, match=rf"build_tokenizer: vocab_size must be an int >= {MIN_VOCAB_SIZE}"):
        build_tokenizer(tmp_path, vocab_size=128)
    small = build_tokenizer(tmp_path, vocab_size=MIN_VOCAB_SIZE)   # bytes + added tokens only
    assert small.vocab_size == MIN_VOCAB_SIZE
    text = "naïve 你好 🙂 <tool_call>"
    assert small.decode(small.encode(text)) == text


def test_incremental_decoder_holds_split_characters(tok):
    text = "Hi 🙂 你好 👩‍💻 ok"
    ids = tok.encode(text)
    # the test is only meaningful if some character's bytes are split over tokens
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    dec = tok.incremental_decoder()
    pieces = [dec.push([i]) for i in ids]
    assert "" in pieces                                   # a split character was held back
    assert not any("\ufffd" in p for p in pieces)
    pieces.append(dec.flush())
    assert "".join(pieces) == dec.text == text == tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_incremental_decoder_equals_full_decode(tok, data):
    # any ids (invalid UTF-8, special tokens, tags) in any chunking
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=24), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    cuts = sorted(data.draw(st.sets(st.integers(0, len(ids))), label="cuts") | {0, len(ids)})
    dec = tok.incremental_decoder(skip_special_tokens=skip)
    out = [dec.push(ids[a:b]) for a, b in zip(cuts, cuts[1:])] + [dec.flush()]
    assert "".join(out) == tok.decode(ids, skip_special_tokens=skip)


# --------------------------------------------------------------------------- template


def test_template_system_and_user(tok):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 你好"}]
    assert tok.apply_chat_template(msgs) == \
        "[gMASK]<sop><|system|>You are terse.<|user|>Hi 你好<|assistant|><think>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == \
        "[gMASK]<sop><|system|>You are terse.<|user|>Hi 你好"


def test_template_thinking_off(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert tok.apply_chat_template(msgs, enable_thinking=False) == \
        "[gMASK]<sop><|user|>Hi<|assistant|><think></think>"


TOOL_TURN = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"celsius": 12}'},
]


def test_template_tool_call_and_response(tok):
    assert tok.apply_chat_template(TOOL_TURN) == (
        "[gMASK]<sop><|user|>Weather in Oslo?<|assistant|><think>Need the tool.</think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
        '<|observation|><tool_response>{"celsius": 12}</tool_response><|assistant|><think>')


def test_template_drops_reasoning_before_the_last_user_turn(tok):
    msgs = TOOL_TURN + [
        {"role": "assistant", "content": "It is 12 °C.", "reasoning_content": "Twelve."},
        {"role": "user", "content": "And Bergen?"}]
    expect = ("[gMASK]<sop><|user|>Weather in Oslo?<|assistant|></think>"
              "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
              "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
              '<|observation|><tool_response>{"celsius": 12}</tool_response>'
              "<|assistant|></think>It is 12 °C.<|user|>And Bergen?<|assistant|><think>")
    assert tok.apply_chat_template(msgs) == expect
    # clear_thinking=False keeps every turn's reasoning (a template variable passed through)
    kept = tok.apply_chat_template(msgs, clear_thinking=False)
    assert "<|assistant|><think>Need the tool.</think><tool_call>" in kept
    assert "<|assistant|><think>Twelve.</think>It is 12 °C.<|user|>" in kept


def test_template_tools_declared(tok):
    msgs = [{"role": "user", "content": "Weather?"}]
    tool_json = ('{"type": "function", "function": {"name": "get_weather", "description": '
                 '"天气 by city", "parameters": {"type": "object", "properties": {"city": '
                 '{"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}')
    assert tok.apply_chat_template(msgs, tools=[WEATHER, WEATHER]) == (
        "[gMASK]<sop>" + TOOL_DECL + tool_json + "\n" + tool_json + TOOL_FORMAT
        + "<|user|>Weather?<|assistant|><think>")


def test_template_consecutive_tool_results_share_one_observation(tok):
    msgs = [{"role": "user", "content": "u"},
            {"role": "assistant", "tool_calls": [
                {"function": {"name": "a", "arguments": {}}},
                {"function": {"name": "b", "arguments": {"x": [1, "é"], "y": None}}}]},
            {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "[gMASK]<sop><|user|>u<|assistant|></think><tool_call>a</tool_call><tool_call>b"
        '<arg_key>x</arg_key><arg_value>[1, "é"]</arg_value><arg_key>y</arg_key>'
        "<arg_value>null</arg_value></tool_call>"
        "<|observation|><tool_response>A</tool_response><tool_response>B</tool_response>")


@pytest.mark.parametrize("reasoning, content, calls", [
    ("Need the tool.", "Let me check.", [("get_weather", {"city": "Oslo", "days": 2})]),
    ("想一想：天气 🙂", "", [("get_weather", {"city": "北京"}), ("search", {"q": "a b", "n": 3.5,
                                                                    "opts": {"x": [1, None]}})]),
    ("Easy.", "It is 12 °C.\nBring a coat.", []),
])
def test_parse_then_render_reproduces_the_generation(tok, reasoning, content, calls):
    # what the model writes after the prompt, rendered back as history, is the same text
    prompt = tok.apply_chat_template(TOOL_TURN[:1])
    generated = reasoning + "</think>" + content + "".join(
        f"<tool_call>{name}" + "".join(
            f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>"
            for k, v in args.items()) + "</tool_call>" for name, args in calls)
    parsed = parse_chat_output(generated, tools=[WEATHER])
    assert parsed == ParsedChat(reasoning, content, [ToolCall(n, a) for n, a in calls])
    turn = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning,
            "tool_calls": [{"type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.tool_calls]}
    assert tok.apply_chat_template(TOOL_TURN[:1] + [turn], add_generation_prompt=False) == \
        prompt + generated


def test_packaged_template_fallback_and_overrides(tmp_path, tok_dir):
    d = tmp_path / "m"
    shutil.copytree(tok_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    t = Tokenizer.from_dir(d)
    assert t.chat_template_origin == "packaged" and t.chat_template == packaged_chat_template()
    assert t.apply_chat_template([{"role": "user", "content": "x"}]).startswith("[gMASK]<sop><|user|>x")
    # a list of named templates: "default" is used
    cfg["chat_template"] = [{"name": "default", "template": "{{ bos_token }}D{{ messages|length }}"},
                            {"name": "rag", "template": "R"}]
    cfg["bos_token"] = {"content": "[gMASK]", "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "[gMASK]D1"
    # chat_template.jinja beside it wins, as in transformers
    (d / "chat_template.jinja").write_text("J{{ enable_thinking }}", encoding="utf-8")
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template([], enable_thinking=False) == "JFalse"
    assert t.chat_template_origin == str(d / "chat_template.jinja")


@pytest.mark.slow
def test_rendering_matches_transformers(tok, tok_dir, monkeypatch):
    # the same template through transformers' own jinja set-up: whitespace handling, tojson,
    # the sandbox. (slow: importing transformers takes seconds)
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    turn = TOOL_TURN[1] | {"tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]}
    msgs = [{"role": "system", "content": "S"}, TOOL_TURN[0], turn, TOOL_TURN[2],
            {"role": "assistant", "content": "12 °C", "reasoning_content": "ok"},
            {"role": "user", "content": "more 🙂"}]
    for kw in ({}, {"enable_thinking": False}, {"add_generation_prompt": False},
               {"clear_thinking": False}):
        kw = {"add_generation_prompt": True, "enable_thinking": True} | kw
        assert tok.apply_chat_template(msgs, tools=[WEATHER], **kw) == \
            hf.apply_chat_template(msgs, tools=[WEATHER], tokenize=False, **kw)
    text = "Hi 你好 🙂<|user|><think>x</think>"
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------- errors


def test_from_dir_errors_name_the_file(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="Tokenizer.from_dir: model_dir .* is not a directory"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"Tokenizer.from_dir: .*tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)
    d = tmp_path / "m"
    shutil.copytree(tok_dir, d)
    (d / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a valid tokenizers file"):
        Tokenizer.from_dir(d)
    shutil.copy(tok_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token '<nope>' is not a token"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}), encoding="utf-8")
    with pytest.raises(ValueError, match="not valid Jinja"):
        Tokenizer.from_dir(d).apply_chat_template([])
    (d / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 100000]}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"generation_config\.json: 'eos_token_id' must be"):
        Tokenizer.from_dir(d)


def test_apply_chat_template_and_decode_errors(tok):
    bad_args = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\]\['tool_calls'\]\[0\]\[function\]\['arguments'\] "
                                         r"must be a JSON object, got invalid JSON"):
        tok.apply_chat_template(bad_args)
    with pytest.raises(ValueError, match=r"messages\[0\]\['role'\] must be a string"):
        tok.apply_chat_template([{"content": "x"}])
    with pytest.raises(ValueError, match="role must be 'system', 'user', 'assistant' or 'tool', got 'robot'"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"Tokenizer.decode: token id 512 is out of range \[0, 512\)"):
        tok.decode([1, 512])
    with pytest.raises(TypeError, match="Tokenizer.encode: text must be a str"):
        tok.encode(b"x")
    with pytest.raises(TypeError, match="Tokenizer.decode: ids must be a sequence of ints"):
        tok.decode([1.0])
    import torch  # the engine hands over tensors' ids: integer scalars are fine

    assert tok.decode(torch.tensor(tok.encode("Oslo 🙂"))) == "Oslo 🙂"


# --------------------------------------------------------------------------- chat parser


def coalesce(events: list[ChatEvent]) -> list[ChatEvent]:
    """Events with consecutive text of one kind merged (how text is split is not part of
    the contract; what it says and in which order is)."""
    out: list[ChatEvent] = []
    for e in events:
        if out and e.kind != "tool_call" and out[-1].kind == e.kind:
            out[-1] = ChatEvent(e.kind, out[-1].text + e.text)
        else:
            out.append(e)
    return out


def stream(text: str, cuts, thinking: bool = True, tools=None) -> list[ChatEvent]:
    parser = ChatParser(thinking=thinking, tools=tools)
    bounds = sorted(set(cuts) | {0, len(text)})
    events = [e for a, b in zip(bounds, bounds[1:]) for e in parser.feed(text[a:b])]
    return events + parser.finish()


def as_parsed(events: list[ChatEvent]) -> ParsedChat:
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    return ParsedChat(reasoning or None, "".join(e.text for e in events if e.kind == "content"),
                      [e.tool_call for e in events if e.kind == "tool_call"])


GENERATION = ("Let me think about Oslo 🙂.\n</think>\nI'll check.  <tool_call>get_weather"
              "<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
              "<arg_value>2</arg_value></tool_call>\n<tool_call>search\n<arg_key>q</arg_key>\n"
              "<arg_value>北京 天气</arg_value>\n</tool_call>")


def test_parse_whole_output():
    assert parse_chat_output(GENERATION) == ParsedChat(
        reasoning="Let me think about Oslo 🙂.", content="I'll check.",
        tool_calls=[ToolCall("get_weather", {"city": "Oslo", "days": 2}),
                    ToolCall("search", {"q": "北京 天气"})])
    assert parse_chat_output("Hi there", thinking=False) == ParsedChat(None, "Hi there", [])
    # reasoning that never closes stays reasoning; an empty think block gives reasoning None
    assert parse_chat_output("still thinking <tool") == ParsedChat("still thinking <tool", "", [])
    assert parse_chat_output("</think>Hi") == ParsedChat(None, "Hi", [])
    # a model that opens a think block itself when the prompt did not
    assert parse_chat_output("<think>hm</think>ok", thinking=False) == ParsedChat("hm", "ok", [])
    # ... or repeats the one the prompt opened
    assert parse_chat_output("<think>hm</think>ok", thinking=True) == ParsedChat("hm", "ok", [])


def test_parser_one_character_at_a_time():
    whole = stream(GENERATION, [])
    by_char = stream(GENERATION, range(len(GENERATION)))
    assert coalesce(by_char) == coalesce(whole)
    assert as_parsed(by_char) == parse_chat_output(GENERATION)
    assert [e.kind for e in coalesce(by_char)] == ["reasoning", "content", "tool_call", "tool_call"]


def test_parser_does_not_leak_a_split_tag():
    parser = ChatParser(thinking=False)
    assert parser.feed("Hello <tool") == [ChatEvent("content", "Hello")]
    assert parser.feed("_ca") == []
    events = parser.feed("ll>f<arg_key>k</arg_key><arg_value>[1]</arg_value></tool_call>")
    assert events == [ChatEvent("tool_call", "<tool_call>f<arg_key>k</arg_key><arg_value>[1]"
                                "</arg_value></tool_call>", ToolCall("f", {"k": [1]}))]
    assert parser.finish() == []
    # in reasoning only </think> is held; a "<" that cannot start a tag is released at once
    parser = ChatParser(thinking=True)
    assert parser.feed("a </thi") == [ChatEvent("reasoning", "a")]
    assert parser.feed("nk>b <x") == [ChatEvent("content", "b <x")]
    assert parser.finish() == []


def test_tool_call_arguments_are_json_decoded():
    text = ("<tool_call>f<arg_key>i</arg_key><arg_value>2</arg_value>"
            "<arg_key>x</arg_key><arg_value>-1.5e3</arg_value>"
            "<arg_key>b</arg_key><arg_value>true</arg_value>"
            "<arg_key>n</arg_key><arg_value>null</arg_value>"
            '<arg_key>o</arg_key><arg_value>{"a": [1, "é"]}</arg_value>'
            "<arg_key>s</arg_key><arg_value>Oslo 🙂</arg_value>"
            '<arg_key>q</arg_key><arg_value>"quoted"</arg_value>'
            "<arg_key>nan</arg_key><arg_value>NaN</arg_value>"
            "<arg_key>sp</arg_key><arg_value> two words </arg_value></tool_call>")
    (call,) = parse_chat_output(text, thinking=False).tool_calls
    assert call == ToolCall("f", {"i": 2, "x": -1500.0, "b": True, "n": None, "o": {"a": [1, "é"]},
                                  "s": "Oslo 🙂", "q": '"quoted"', "nan": "NaN", "sp": " two words "})
    # a parameter declared a string stays the string the model wrote
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>2</arg_value>" \
           "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
    assert parse_chat_output(text, thinking=False, tools=[WEATHER]).tool_calls == \
        [ToolCall("get_weather", {"city": "2", "days": 2})]


@pytest.mark.parametrize("text, content", [
    ("Sure: <tool_call>get_weather<arg_key>city</arg_key><arg_value>Os",        # never closed
     "Sure: <tool_call>get_weather<arg_key>city</arg_key><arg_value>Os"),
    ("a <tool_call><arg_key>k</arg_key><arg_value>v</arg_value></tool_call> b",  # no name
     "a <tool_call><arg_key>k</arg_key><arg_value>v</arg_value></tool_call> b"),
    ("<tool_call>f<arg_key>k</arg_key>v</tool_call>",                           # no arg_value
     "<tool_call>f<arg_key>k</arg_key>v</tool_call>"),
    ("<tool_call>f<arg_key>k</arg_key><arg_value>1</arg_value>"                 # key twice
     "<arg_key>k</arg_key><arg_value>2</arg_value></tool_call>",
     "<tool_call>f<arg_key>k</arg_key><arg_value>1</arg_value><arg_key>k</arg_key>"
     "<arg_value>2</arg_value></tool_call>"),
])
def test_malformed_tool_call_is_content(text, content):
    for cuts in ([], range(len(text))):
        events = stream(text, cuts, thinking=False)
        assert as_parsed(events) == ParsedChat(None, content, [])


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
             "<arg_value>", "</arg_value>", "<", "</", "<tool", "<thi", "think>", "_call>",
             " ", "  ", "\n", "a", "Oslo", "你好", "🙂", "2", '{"a": [1]}', "get_weather", "x y"]
CALL = st.builds(lambda name, kv: f"<tool_call>{name}" + "".join(
    f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in kv.items()) + "</tool_call>",
    st.sampled_from(["f", "get_weather"]),
    st.dictionaries(st.sampled_from(["city", "days", "q"]),
                    st.sampled_from(["Oslo", "2", "[1, 2]", "北京 天气", "true", ""]), max_size=3))


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.one_of(st.sampled_from(FRAGMENTS), CALL), max_size=14),
       thinking=st.booleans(), data=st.data())
def test_parser_any_chunking_equals_one_shot(pieces, thinking, data):
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label="cuts")
    events = stream(text, cuts, thinking=thinking, tools=[WEATHER])
    assert coalesce(events) == coalesce(stream(text, [], thinking=thinking, tools=[WEATHER]))
    assert as_parsed(events) == parse_chat_output(text, thinking=thinking, tools=[WEATHER])
    # nothing is emitted twice and no event is empty
    assert all(e.text for e in events)


def test_parser_misuse():
    parser = ChatParser()
    parser.finish()
    with pytest.raises(RuntimeError, match="ChatParser.feed: the parser has finished"):
        parser.feed("x")
    with pytest.raises(TypeError, match="ChatParser.feed: delta must be a str"):
        ChatParser().feed(b"x")
