"""The token layout of a multi-turn episode in the GLM-5 chat format.

An episode's tokens are the first prompt (the chat template with the environment's tools and
its first observation as the user message, ending in the generation prompt), then turns: what
the policy sampled, verbatim, and what the environment answered, rendered by the same chat
template the serving engine uses (`glm5.text.chat`) — a tool result as an ``<|observation|>``
``<tool_response>`` part, feedback as a ``<|user|>`` message — each followed by the next
generation prompt. Sampled ids are never re-tokenized: only the environment's text is encoded.

A turn ends on a stop token: ``<|observation|>`` (the model wants tool results), ``<|user|>``
or ``<|endoftext|>`` (its answer). The environment gets the turn's text without its reasoning
(the ``<think>`` part) and parses tool calls with the engine's parser (`glm5.rl.envs.tools`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from glm5.rl.envs.base import make_env
from glm5.text.bpe import DEFAULT_TEXT, build_tokenizer
from glm5.text.chat import (TOOL_CALL_OPEN, ChatParser, packaged_chat_template,
                            render_chat_template)

OBSERVATION_ROLES = ("tool", "user")
TRUNCATED = " …[truncated {n} tokens]"


class Dialogue:
    """Renders and encodes an episode's turns for one tokenizer (`glm5.text.tokenizer`).

    ``thinking``: the generation prompt opens ``<think>`` (the policy reasons first) or closes
    an empty ``<think></think>`` (it answers at once). ``max_observation_tokens``: an
    environment answer longer than this is cut, and the cut is said in the text the policy
    sees (never silently)."""

    def __init__(self, tokenizer: Any, thinking: bool = False,
                 max_observation_tokens: int = 256) -> None:
        if isinstance(max_observation_tokens, bool) or not isinstance(
                max_observation_tokens, int) or max_observation_tokens < 8:
            raise ValueError(f"glm5 Dialogue: max_observation_tokens expected an int >= 8, got "
                             f"{max_observation_tokens!r}")
        self.tok, self.thinking = tokenizer, bool(thinking)
        self.max_observation_tokens = max_observation_tokens
        stops = ("<|observation|>", "<|user|>", "<|endoftext|>")
        ids = {s: tokenizer.token_to_id(s) for s in stops}
        missing = [s for s, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"glm5 Dialogue: the tokenizer has no {missing[0]} token; a GLM "
                             f"chat tokenizer is expected")
        self.stop_token_ids = sorted(ids.values())
        # what the template renders for an empty conversation ([gMASK]<sop>): the prefix an
        # observation segment rendered on its own starts with
        self._head = self._render([], generation_prompt=False)

    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        return render_chat_template(self.tok.chat_template, messages, tools=tools or None,
                                    add_generation_prompt=generation_prompt,
                                    enable_thinking=self.thinking, where="glm5 Dialogue")

    def prompt_ids(self, observation: str, tools: Sequence[Mapping[str, Any]] | None = None,
                   system: str | None = None) -> list[int]:
        """The episode's first prompt: [system], the first observation as the user message, the
        tools declared, the generation prompt."""
        msgs = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": self.cut(observation)}]
        return self.tok.encode(self._render(msgs, True, tools))

    def observation_ids(self, observation: str, role: str,
                        last_token: int | None = None) -> list[int]:
        """The environment's answer to a turn and the next generation prompt, as ids to append
        after the turn's sampled ids. ``role``: "tool" (a tool result) or "user" (feedback).
        ``last_token``: the turn's last sampled id; when the policy already emitted the role
        token that opens this segment (it stopped on ``<|observation|>``), it is not repeated."""
        if role not in OBSERVATION_ROLES:
            raise ValueError(f"glm5 Dialogue.observation_ids: role expected one of "
                             f"{list(OBSERVATION_ROLES)}, got {role!r}")
        text = self._render([{"role": role, "content": self.cut(observation)}], True)
        if not text.startswith(self._head):  # pragma: no cover - a template without the head
            raise ValueError("glm5 Dialogue: the chat template does not start every "
                             "conversation with the same head; cannot render a segment")
        ids = self.tok.encode(text[len(self._head):])
        if last_token is not None and ids and ids[0] == last_token:
            ids = ids[1:]
        return ids

    def turn_text(self, turn_ids: Sequence[int]) -> str:
        """A sampled turn decoded: stop tokens and special tokens dropped; reasoning and
        tool-call markup kept (what the reward's text components read)."""
        return self.tok.decode([i for i in turn_ids if i not in self.stop_token_ids],
                               skip_special_tokens=True)

    def action(self, turn_ids: Sequence[int]) -> tuple[str, str | None]:
        """(action, reasoning) of a sampled turn: the text the environment acts on — the
        content and the tool-call markup, reasoning removed — and the reasoning (None)."""
        text = self.turn_text(turn_ids)
        parser = ChatParser(thinking=self.thinking)
        events = parser.feed(text) + parser.finish()
        reasoning = "".join(e.text for e in events if e.kind == "reasoning") or None
        return "".join(e.text for e in events if e.kind != "reasoning"), reasoning

    def assistant_ids(self, action: str) -> list[int]:
        """Ids of an assistant turn written out (a demonstration), with the stop token the
        policy should end it with: ``<|observation|>`` after a tool call, else
        ``<|user|>``."""
        stop = "<|observation|>" if TOOL_CALL_OPEN in action else "<|user|>"
        body = "</think>" + action if self.thinking else action
        return self.tok.encode(body) + [self.tok.token_to_id(stop)]

    def cut(self, text: str) -> str:
        """``text`` as the policy is shown it: cut to max_observation_tokens, the cut said."""
        if not isinstance(text, str):
            raise TypeError(f"glm5 Dialogue: an observation must be text, got "
                            f"{type(text).__name__}")
        ids = self.tok.encode(text)
        n = self.max_observation_tokens
        if len(ids) <= n:
            return text
        return self.tok.decode(ids[:n], skip_special_tokens=False) + \
            TRUNCATED.format(n=len(ids) - n)


def toy_tokenizer(out_dir: str | Path, vocab_size: int, env_names: Sequence[str] = (),
                  seeds: int = 8) -> Any:
    """A small GLM-style byte-level BPE (`glm5.text.bpe.build_tokenizer`) trained on its
    default text plus what episodes of ``env_names`` say: the chat template's tool preamble,
    first observations and demonstrations of ``seeds`` episodes each — so a tiny policy's
    episodes are short. Same arguments, same tokenizer. Returns it loaded."""
    parts = [DEFAULT_TEXT]
    for name in env_names:
        for seed in range(seeds):
            env = make_env(name)
            try:
                obs = env.reset(seed)
                specs = getattr(env, "tool_specs", None)
                parts.append(render_chat_template(
                    packaged_chat_template(), [{"role": "user", "content": obs}],
                    tools=specs() if callable(specs) else None, enable_thinking=False))
                demo = getattr(env, "demonstration", None)
                if callable(demo):
                    parts += demo()
            finally:
                close = getattr(env, "close", None)
                if callable(close):
                    close()
    return build_tokenizer(out_dir, vocab_size=vocab_size, text="\n".join(parts))
