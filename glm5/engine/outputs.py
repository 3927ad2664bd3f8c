"""What the engine hands back per request and step."""

from __future__ import annotations

from dataclasses import dataclass, field

OUTPUT_KINDS = ("cumulative", "delta")


@dataclass
class TokenLogprob:
    """A sampled token's logprob (log_softmax(logits / T), see glm5.engine.sampling) and, when
    asked for, the top-n alternatives as (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival: float  # time.monotonic() when the request was added
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    num_drafted: int = 0  # MTP draft tokens proposed / accepted
    num_accepted: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """A request's state after an engine step: ``new_*`` since its previous output.

    A request added with ``output_kind="delta"`` (what a streaming server wants: each queued
    output is O(new tokens), not O(tokens so far)) gets outputs whose cumulative fields
    (``token_ids``, ``text``, ``logprobs``, ``token_versions``) are empty until the final
    one, which carries them all; ``new_*`` fields are always set."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str = ""
    new_text: str = ""
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    metrics: RequestMetrics | None = None
    token_versions: list[int] = field(default_factory=list)  # weights version per token_ids[i]
    new_token_versions: list[int] = field(default_factory=list)  # per new_token_ids[i]
    # the HTTP status a server answers a failed request with (None: 500, an engine failure);
    # 503 when the engine itself was lost (a rank of a multi-rank server died)
    error_status: int | None = None
