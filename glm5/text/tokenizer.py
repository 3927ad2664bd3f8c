"""Text in, text out: the model directory's tokenizer (Hugging Face ``tokenizers`` file) and chat
template, and incremental detokenization for streaming.

A model directory holds (the Hugging Face layout; only ``tokenizer.json`` is required):

- ``tokenizer.json`` — the ``tokenizers`` model, with its added / special tokens;
- ``tokenizer_config.json`` — ``chat_template`` (a string, or a list of ``{"name", "template"}``),
  ``bos_token`` / ``eos_token`` / ``pad_token``, ``added_tokens_decoder``;
- ``chat_template.jinja`` — a chat template file, which wins over ``tokenizer_config.json``'s
  (as in transformers);
- ``generation_config.json`` — ``eos_token_id``: an int or a list (GLM stops on
  ``<|endoftext|>``, ``<|user|>`` and ``<|observation|>``).

Without a chat template the packaged GLM-5 one (``glm5/text/templates/glm5_chat.jinja``) is
used. ``tokenizers`` and ``jinja2`` (the ``glm5[serve]`` extra) are imported only here, lazily.
"""

from __future__ import annotations

import json
import operator
from pathlib import Path
from typing import Any, Mapping, Sequence

from glm5.text.chat import packaged_chat_template, render_chat_template

_REPLACEMENT = "\ufffd"


def _read_json(path: Path, where: str) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when the file does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, key: str, path: Path, where: str) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialized AddedToken.
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{where}: {path}: {key!r} must be a token string or "
                         f"{{'content': str}}, got {value!r}")
    return value


class Tokenizer:
    """A model directory's tokenizer and chat template (build one with ``from_dir``).

    ``vocab_size``: number of token ids, added tokens included (ids are ``0..vocab_size-1``;
    the model's embedding may be larger). ``eos_token_ids``: every id that ends generation.
    """

    def __init__(self, backend: Any, *, chat_template: str, chat_template_origin: str,
                 eos_token_ids: frozenset[int], special_tokens: Mapping[str, str | None]):
        self._tok = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.chat_template: str = chat_template
        self.chat_template_origin: str = chat_template_origin   # a path, or "packaged"
        self.special_tokens: dict[str, str | None] = dict(special_tokens)
        pad = self.special_tokens.get("pad_token")
        self.pad_token_id: int | None = None if pad is None else backend.token_to_id(pad)

    @property
    def longest_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers: the longest entry of
        the vocabulary (added tokens included) in UTF-8 (a byte-level BPE entry is a char per
        byte, 1 or 2 bytes of UTF-8 each, so this over-counts: a safe bound)."""
        cached = getattr(self, "_longest", None)
        if cached is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            cached = self._longest = max((len(k.encode("utf-8", "surrogatepass"))
                                          for k in vocab), default=1)
        return cached

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load the tokenizer of a Hugging Face-layout model directory (see the module
        docstring). Raises ``FileNotFoundError`` / ``ValueError`` naming the file at fault."""
        where = "Tokenizer.from_dir"
        try:
            from tokenizers import AddedToken
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError(f"{where}: needs the `tokenizers` package "
                              f"(pip install 'glm5[serve]')") from e
        root = Path(model_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"{where}: model_dir {str(model_dir)!r} is not a directory")
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"{where}: {tok_path} not found: a model directory needs a "
                                    f"tokenizer.json (a Hugging Face `tokenizers` file)")
        try:
            backend = HFTokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{where}: {tok_path} is not a valid tokenizers file: {e}") from e

        cfg_path = root / "tokenizer_config.json"
        cfg = _read_json(cfg_path, where) or {}
        # Added tokens the config declares but tokenizer.json lacks are added, at their ids.
        decoder = cfg.get("added_tokens_decoder") or {}
        if not isinstance(decoder, Mapping):
            raise ValueError(f"{where}: {cfg_path}: 'added_tokens_decoder' must be an object "
                             f"of id -> token, got {type(decoder).__name__}")
        for key in sorted(decoder, key=lambda k: int(k) if str(k).isdigit() else -1):
            entry = decoder[key]
            if not str(key).isdigit() or not isinstance(entry, Mapping) \
                    or not isinstance(entry.get("content"), str):
                raise ValueError(f"{where}: {cfg_path}: added_tokens_decoder[{key!r}] must map "
                                 f"a token id to {{'content': str, ...}}, got {entry!r}")
            want, content = int(key), entry["content"]
            have = backend.token_to_id(content)
            if have is None:
                added = AddedToken(content, special=bool(entry.get("special", False)),
                                   normalized=bool(entry.get("normalized", False)),
                                   lstrip=bool(entry.get("lstrip", False)),
                                   rstrip=bool(entry.get("rstrip", False)),
                                   single_word=bool(entry.get("single_word", False)))
                (backend.add_special_tokens if added.special else backend.add_tokens)([added])
                have = backend.token_to_id(content)
            if have != want:
                raise ValueError(f"{where}: {cfg_path}: added token {content!r} has id {want} "
                                 f"there but {have} in {tok_path}")

        special = {k: _token_content(cfg.get(k), k, cfg_path, where)
                   for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        for k, token in special.items():
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"{where}: {cfg_path}: {k} {token!r} is not a token of {tok_path}")
        eos = set()
        if special["eos_token"] is not None:
            eos.add(backend.token_to_id(special["eos_token"]))
        gen_path = root / "generation_config.json"
        gen = _read_json(gen_path, where) or {}
        gen_eos = gen.get("eos_token_id")
        gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else gen_eos
        vocab = backend.get_vocab_size(with_added_tokens=True)
        if not isinstance(gen_eos, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in gen_eos):
            raise ValueError(f"{where}: {gen_path}: 'eos_token_id' must be a token id or a list "
                             f"of token ids in [0, {vocab}), got {gen.get('eos_token_id')!r}")
        eos.update(gen_eos)

        template, origin = cls._find_chat_template(root, cfg, cfg_path, where)
        return cls(backend, chat_template=template, chat_template_origin=origin,
                   eos_token_ids=frozenset(eos), special_tokens=special)

    @staticmethod
    def _find_chat_template(root: Path, cfg: Mapping[str, Any], cfg_path: Path,
                            where: str) -> tuple[str, str]:
        jinja_path = root / "chat_template.jinja"
        if jinja_path.is_file():
            return jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        tpl = cfg.get("chat_template")
        if tpl is None:
            return packaged_chat_template(), "packaged"
        if isinstance(tpl, list):
            # transformers' named templates: "default" serves chat (a "tool_use" one is not
            # needed by GLM templates, which handle tools themselves).
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
            tpl = named.get("default")
            if not isinstance(tpl, str):
                raise ValueError(f"{where}: {cfg_path}: 'chat_template' is a list without a "
                                 f"{{'name': 'default', 'template': str}} entry")
        if not isinstance(tpl, str):
            raise ValueError(f"{where}: {cfg_path}: 'chat_template' must be a string or a list "
                             f"of named templates, got {type(tpl).__name__}")
        return tpl, f"{cfg_path}:chat_template"

    # ----------------------------------------------------------------- ids <-> text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text (``<|user|>``) become their
        ids. ``add_special_tokens`` applies the tokenizer's post-processor (GLM chat prompts
        carry ``[gMASK]<sop>`` themselves, so the default is False)."""
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: text must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def _check_ids(self, ids: Sequence[int], where: str) -> list[int]:
        try:
            # operator.index: ints, numpy / torch integers; a float or a str is an error
            out = [operator.index(i) for i in ids]
        except TypeError as e:
            raise TypeError(f"{where}: ids must be a sequence of ints: {e}") from e
        for i in out:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"{where}: token id {i} is out of range [0, {self.vocab_size})")
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. ``skip_special_tokens`` drops tokens marked special (role tokens,
        ``[gMASK]``, ``<|endoftext|>``); GLM's ``<think>`` / ``<tool_call>`` family are plain
        added tokens and always decode. Invalid UTF-8 decodes to U+FFFD."""
        return self._tok.decode(self._check_ids(ids, "Tokenizer.decode"),
                                skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        """A decoder for a stream of generated ids (see ``IncrementalDecoder``)."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (an exact vocabulary entry), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id``, or None."""
        return self._tok.id_to_token(int(token_id))

    # ----------------------------------------------------------------- chat

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, enable_thinking: bool = True,
                            **extra: Any) -> str:
        """Render an OpenAI-style conversation to prompt text with this model's chat template.
        Tool-call ``arguments`` may be JSON strings (as OpenAI sends them) or dicts; the
        special tokens (``bos_token``, ``eos_token``, ...) and ``extra`` are template
        variables. Raises ``ValueError`` naming the message at fault."""
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(extra)
        return render_chat_template(self.chat_template, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    enable_thinking=enable_thinking,
                                    where="Tokenizer.apply_chat_template", **variables)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={sorted(self.eos_token_ids)}, "
                f"chat_template={self.chat_template_origin!r})")


class IncrementalDecoder:
    """Turns generated ids into text as they arrive, for streaming.

    ``push(ids)`` returns the text the new ids complete; a trailing U+FFFD (a UTF-8 character
    whose bytes are split over tokens) is held back until the next push completes it, so a
    partial character is never emitted. ``flush()`` returns what is left at the end.
    ``"".join(pushes) + flush() == tokenizer.decode(all ids)``; ``text`` is everything so far.

    Each push decodes only the ids since the last emission plus the ones before them (the
    offsets technique of vLLM's ``detokenize_incrementally``): a decoder that drops the
    leading space of a text's first token sees the same first token in both decodes.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0    # first id of the decode window
        self._read = 0      # ids before this are emitted
        self.text = ""

    def _window(self, end: int) -> str:
        return self._tokenizer._tok.decode(self._ids[self._prefix:end],
                                           skip_special_tokens=self._skip)

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the new text they complete ("" while a character is split)."""
        self._ids.extend(self._tokenizer._check_ids(ids, "IncrementalDecoder.push"))
        prefix_text = self._window(self._read)
        new_text = self._window(len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of the stream: the text still held back (a U+FFFD for bytes never completed)."""
        delta = self._window(len(self._ids))[len(self._window(self._read)):]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
