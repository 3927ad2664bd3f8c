"""A request's life in the engine: its tokens, its pages, how much of it the cache holds."""

from __future__ import annotations

import enum
from typing import Any

import torch

from glm5.engine.outputs import RequestMetrics, TokenLogprob
from glm5.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One sequence. Its cache holds positions 0 .. num_computed - 1 of ``all_ids``; the engine
    computes the rest (a prefill, chunked; a decode step is the case of one token left) and
    samples once it reaches the end. After a preemption ``num_computed`` is 0 again and the
    prompt and the tokens generated so far are recomputed (nothing is lost)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 generator: torch.Generator, arrival: float, decoder: Any = None,
                 output_kind: str = "cumulative") -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.output_versions: list[int] = []  # the engine's weights version per output token
        self.params = params
        self.generator = generator
        self.status = Status.WAITING
        self.pages: list[int] = []  # the block table: page ids of logical pages 0, 1, ...
        self.num_computed = 0
        self.drafts: list[int] = []  # MTP drafts to verify in the next step
        self.draft_probs: list[torch.Tensor | None] = []  # their draft distributions (sampled)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.decoder = decoder  # an IncrementalDecoder when the engine has a tokenizer
        self.text = ""
        self.stop_at: int | None = None  # text length to cut at (a stop string)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(arrival=arrival, num_prompt_tokens=len(prompt_ids))
        self.sent_tokens = 0  # outputs already reported
        self.sent_text = 0
        self.aborted = False
        self.output_kind = output_kind  # "cumulative" | "delta" (see RequestOutput)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    def tokens(self, a: int, b: int) -> list[int]:
        n = len(self.prompt_ids)
        if b <= n:
            return self.prompt_ids[a:b]
        return (self.prompt_ids + self.output_ids)[a:b]

    @property
    def in_prefill(self) -> bool:
        """More than one known token is missing from the cache (a prompt, or a recompute)."""
        return self.num_tokens - self.num_computed > 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={len(self.prompt_ids)}, "
                f"out={len(self.output_ids)}, computed={self.num_computed})")
