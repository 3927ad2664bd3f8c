"""Test assets built on the spot, so that no test needs a hub: a small GLM-style tokenizer.

``build_tokenizer(out_dir)`` trains a byte-level BPE on a few KB of built-in text (English,
Chinese, Japanese, accents, emoji, Python, JSON and GLM tool-call markup), adds GLM-5's special
tokens, and writes the files of a Hugging Face-layout model directory:

- ``tokenizer.json`` (byte-level BPE: any text encodes, nothing maps to an unknown token);
- ``tokenizer_config.json`` with the packaged GLM-5 chat template inlined, ``eos_token`` and
  ``pad_token`` = ``<|endoftext|>``, and ``added_tokens_decoder``;
- ``generation_config.json`` with ``eos_token_id`` = ids of ``<|endoftext|>``, ``<|user|>``,
  ``<|observation|>`` (what GLM stops on).

The same arguments give the same bytes on every run. ``tokenizers`` is imported lazily.
"""

from __future__ import annotations

import json
from pathlib import Path

from glm5.text.chat import packaged_chat_template
from glm5.text.tokenizer import Tokenizer as Glm5Tokenizer

# (content, special): special tokens are dropped by decode(skip_special_tokens=True); the
# think / tool-call tags are plain added tokens, kept by decode so the chat parser sees them
# (GLM's own tokenizer marks them the same way). Ids follow the trained vocabulary, in order.
GLM_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("[gMASK]", True), ("<sop>", True),
    ("<|system|>", True), ("<|user|>", True), ("<|assistant|>", True), ("<|observation|>", True),
    ("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<arg_key>", False), ("</arg_key>", False), ("<arg_value>", False), ("</arg_value>", False),
)
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
PAD_TOKEN = "<|endoftext|>"

# A byte-level BPE needs its 256 byte tokens; the added tokens come on top.
MIN_VOCAB_SIZE = 256 + len(GLM_ADDED_TOKENS)

DEFAULT_TEXT = """\
The quick brown fox jumps over the lazy dog. A serving engine batches requests continuously:
new requests join the running batch at every step, finished ones leave it, and the scheduler
keeps the number of tokens per step under a budget. Prefill is chunked so that a long prompt
does not stall the requests that are decoding. Pages of 64 tokens hold the latent cache.
Tokens per second, time to first token, and the latency of each token are what users measure.
Hello, world! How are you today? I am fine, thank you. What is the weather like in Oslo?
It is 12 degrees and cloudy. Tomorrow it will rain; bring an umbrella. Numbers: 0 1 2 3 4 5
6 7 8 9 10 42 100 256 1024 3.14159 -7 1e-5 2026.
Accents and symbols: café, naïve, façade, résumé, jalapeño, Zürich, Ångström, São Paulo,
Kraków, ½ ¾ ± × ÷ ° € £ ¥ © ™ → ← ↑ ↓ ∑ ∫ √ ∞ ≤ ≥ ≠ α β γ δ λ π σ Ω.
中文：你好，世界！今天天气很好。我们正在测试分词器和聊天模板。北京和上海的天气怎么样？
模型会先思考，然后调用工具，最后回答用户的问题。
日本語：こんにちは、世界。今日はいい天気ですね。東京の天気を教えてください。
한국어: 안녕하세요, 세계. Русский: Привет, мир! Ελληνικά: Γειά σου κόσμε. العربية: مرحبا بالعالم.
Emoji: 🙂 😀 🚀 🎉 👍 ❤️ 🌧️ ☀️ 🐍 🦊 👩‍💻 🇳🇴 — multi-byte characters split across tokens.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    out = [0, 1]
    while len(out) < n:
        out.append(out[-1] + out[-2])
    return out[:n]


class Request:
    def __init__(self, prompt: str, max_tokens: int = 16) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens

    def __repr__(self) -> str:
        return f"Request(prompt={self.prompt!r}, max_tokens={self.max_tokens})"


for i in range(10):
    if i % 2 == 0:
        print(i, "even")
    else:
        print(i, "odd")

{"name": "get_weather", "description": "Get the weather of a city", "parameters": {"type": "object",
 "properties": {"city": {"type": "string", "description": "City name, e.g. Oslo"},
 "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
 "required": ["city"]}}
{"city": "Oslo", "days": 3, "unit": "celsius", "ok": true, "missing": null, "tags": ["a", "b"]}
{"celsius": 12, "condition": "cloudy", "wind_kph": 18.5, "humidity": 0.81}
{"results": [{"title": "GLM-5", "url": "https://example.com/glm5"}, {"title": "天气", "score": 0.9}]}
<think>The user asks about the weather in Oslo. I should call the tool.</think>
<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>
<tool_response>{"celsius": 12, "condition": "cloudy"}</tool_response>
<think>The tool says 12 degrees and cloudy.</think>It is 12 °C and cloudy in Oslo.
<tool_call>search<arg_key>query</arg_key><arg_value>北京 天气</arg_value><arg_key>limit</arg_key><arg_value>5</arg_value></tool_call>
SELECT id, name FROM users WHERE age >= 18 ORDER BY name LIMIT 10;
x = [i * i for i in range(100) if i % 3 == 0]; y = {"k": x, "n": len(x)}
"""


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, text: str | None = None):
    """Train a GLM-style byte-level BPE tokenizer and write a model directory's tokenizer files
    into ``out_dir`` (created if missing); return it loaded through
    ``glm5.text.tokenizer.Tokenizer.from_dir``.

    ``vocab_size``: the largest vocabulary wanted, added tokens included; at least
    ``MIN_VOCAB_SIZE`` (273: 256 byte tokens + 17 GLM added tokens), so a model config used
    with it needs ``vocab_size >= 273`` (the ``tiny`` preset's 128 is too small: give it e.g.
    512). The trained vocabulary is smaller when ``text`` runs out of pairs to merge; the
    returned tokenizer's ``vocab_size`` is the real one. ``text``: the training text
    (default: ``DEFAULT_TEXT``, a few KB). Same arguments, same bytes."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )


    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"build_tokenizer: vocab_size must be an int >= {MIN_VOCAB_SIZE} (256 "
                         f"byte tokens + {len(GLM_ADDED_TOKENS)} GLM added tokens), got "
                         f"{vocab_size!r}; use a model config with a vocab this large")
    if text is None:
        text = DEFAULT_TEXT
    if not isinstance(text, str) or not text:
        raise ValueError(f"build_tokenizer: text must be a non-empty str, got {text!r:.80}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(GLM_ADDED_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    # Lines, not one string: training splits nothing across lines, as on a real corpus.
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    for content, special in GLM_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
    tok.save(str(out / "tokenizer.json"), pretty=True)

    ids = {content: tok.token_to_id(content) for content, _ in GLM_ADDED_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "eos_token": PAD_TOKEN,
        "pad_token": PAD_TOKEN,
        "added_tokens_decoder": {
            str(ids[content]): {"content": content, "lstrip": False, "normalized": False,
                                "rstrip": False, "single_word": False, "special": special}
            for content, special in GLM_ADDED_TOKENS},
        "chat_template": packaged_chat_template(),
    }
    generation = {"eos_token_id": [ids[t] for t in EOS_TOKENS], "pad_token_id": ids[PAD_TOKEN]}
    for name, data in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                                encoding="utf-8")
    return Glm5Tokenizer.from_dir(out)
