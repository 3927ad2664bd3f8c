"""Per-request sampling for the serving engine: `SamplingParams`, the processed distribution
(temperature, top-k, top-p, min-p), seeded sampling that does not depend on the rest of the
batch, logprobs of the sampled tokens (what an RL trainer recomputes), speculative rejection
sampling for MTP drafts, and stop-string search over streamed text.

Definitions (one place; the engine and its tests rely on them):

- **Processed distribution** of a sampled row: ``z = logits / temperature``; top-k keeps the
  entries ``>= `` the k-th largest (ties with the k-th are all kept); top-p then keeps, in
  descending order of ``softmax(z)`` with ties broken by the smaller index, every entry whose
  mass *before* it is ``< top_p`` (the smallest prefix whose mass reaches ``top_p``; the first
  entry is always kept); min-p then keeps entries with ``p_i >= min_p * max_j p_j``. Masked
  entries are ``-inf``; ``target_probs`` is their softmax.
- **Greedy** rows (``temperature < 1e-5``, as vLLM: below it the tempered distribution is
  one-hot unless two logits lie within ~1e-4, and logits / T heads for float32 overflow; or
  ``top_k == 1``) take the first maximum of the logits; their processed logits are the logits
  unchanged and their target distribution is one-hot at that token.
- **Logprobs** are ``log_softmax(logits / T)`` with ``T = temperature`` (``T = 1`` for rows with
  ``temperature < 1e-5``): the temperature-scaled distribution *before* top-k / top-p / min-p
  truncation, i.e. what a trainer recomputes from the same weights (the ``token_logprobs`` op).
  A token outside the truncated support never gets sampled, but its logprob is still finite.
- **Seeds**: every row owns a ``torch.Generator``; ``sample`` draws one uniform per sampled row
  from that row's generator only (``speculative_verify`` two), and greedy rows draw nothing. So a
  seeded request produces the same tokens from the same logits whatever else is in the batch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glm5.ir.opdef import value_checks

# Largest top-n a request may ask for (as vLLM / the OpenAI API).
MAX_LOGPROBS = 20
# Temperatures below this are greedy (see the module docstring).
GREEDY_TEMPERATURE = 1e-5


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


# torch's CPU generator takes its seed modulo 2**63 (2**63 seeds like 0): seeds at or above it
# would alias smaller ones, so they are refused.
SEED_LIMIT = 2**63


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples (see the module docstring for the exact definitions).

    ``max_tokens`` >= 1 tokens are generated at most. ``temperature`` >= 0 (0: greedy);
    ``top_p`` in (0, 1]; ``top_k`` 0 or -1 is off, else >= 1; ``min_p`` in [0, 1) (0: off).
    ``seed``: None draws a fresh generator from OS entropy, an int in [0, 2**63) makes the
    request reproducible. ``stop`` strings (a str or a sequence of them, stored as a tuple) and
    ``stop_token_ids`` end the request; ``ignore_eos`` keeps going past the EOS token;
    ``include_stop_str_in_output`` keeps the matched stop string in the text. ``logprobs``:
    None for none, 0 for the sampled token's logprob, n in 1..20 for it plus the top-n.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"glm5 SamplingParams: argument '{name}' expected {expected}, "
                              f"got {getattr(self, name)!r}")

        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        put("max_tokens", int(self.max_tokens))
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0")
        put("temperature", float(self.temperature))
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:  # NaN fails the comparison
            raise bad("top_p", "in (0, 1]")
        put("top_p", float(self.top_p))
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "0 or -1 (off) or an int >= 1")
        put("top_k", int(self.top_k))
        if not _is_real(self.min_p) or not 0 <= self.min_p < 1:
            raise bad("min_p", "in [0, 1)")
        put("min_p", float(self.min_p))
        if self.seed is not None:
            if not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
                raise bad("seed", "None or an int in [0, 2**63)")
            put("seed", int(self.seed))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "a non-empty string or a sequence of non-empty strings")
        put("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, Sequence) or isinstance(ids, str) \
                or not all(_is_int(t) and t >= 0 for t in ids):
            raise bad("stop_token_ids", "a sequence of ints >= 0")
        put("stop_token_ids", tuple(int(t) for t in ids))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        if self.logprobs is not None:
            if not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise bad("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")
            put("logprobs", int(self.logprobs))

    @property
    def greedy(self) -> bool:
        """True when the row takes the argmax: temperature below 1e-5 (0 included) or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device``, seeded with ``seed`` or from fresh OS entropy when
    None. A CPU generator works with logits on any device (one uniform per row is copied over)
    and gives the same draws on every machine, so "cpu" is the recommended device."""
    if seed is not None and (not _is_int(seed) or not 0 <= seed < SEED_LIMIT):
        raise ValueError(f"glm5 make_generator: argument 'seed' expected None or an int in "
                         f"[0, 2**63), got {seed!r}")
    g = torch.Generator(device=torch.device(device))
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


# --------------------------------------------------------------------------- validation
def _check_logits(fn: str, logits: torch.Tensor, params: Sequence[SamplingParams],
                  name: str = "logits") -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = (f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        raise ValueError(f"glm5 {fn}: argument '{name}' expected a floating tensor [N, V], "
                         f"got {got}")
    if logits.shape[1] < 1:
        raise ValueError(f"glm5 {fn}: argument '{name}' expected V >= 1, got shape "
                         f"{tuple(logits.shape)}")
    if len(params) != logits.shape[0]:
        raise ValueError(f"glm5 {fn}: argument 'params' expected {logits.shape[0]} "
                         f"SamplingParams (one per row of '{name}'), got {len(params)}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"glm5 {fn}: argument 'params' expected SamplingParams, item {i} "
                             f"is a {type(p).__name__}")
    # NaN or +inf anywhere, or a row with no finite entry, has no distribution. One reduction
    # finds all three: the row max propagates NaN and is +inf or -inf exactly then. A value
    # check: on a device only under GLM5_STRICT=1 (glm5.ir.opdef.value_checks); the engine
    # finds such rows itself, in the one read of its step.
    if not value_checks(logits):
        return
    bad = ~torch.isfinite(logits.amax(-1))
    if bool(bad.any()):
        rows = bad.nonzero().flatten()[:8].tolist()
        raise ValueError(f"glm5 {fn}: argument '{name}' expected finite values (-inf allowed, "
                         f"not a whole row), rows {rows} hold NaN / +inf or are all -inf")


def _check_generators(fn: str, generators: Sequence[torch.Generator], n: int) -> None:
    if len(generators) != n or not all(isinstance(g, torch.Generator) for g in generators):
        raise ValueError(f"glm5 {fn}: argument 'generators' expected {n} torch.Generator "
                         f"(one per row), got {len(generators)} item(s)")


def _check_tokens(fn: str, name: str, tokens: torch.Tensor, n: int, v: int) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.shape != (n,) \
            or tokens.dtype not in (torch.int64, torch.int32):
        got = (f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor)
               else type(tokens).__name__)
        raise ValueError(f"glm5 {fn}: argument '{name}' expected an int64 or int32 tensor [{n}], "
                         f"got {got}")
    if n and value_checks(tokens) and bool(((tokens < 0) | (tokens >= v)).any()):
        raise ValueError(f"glm5 {fn}: argument '{name}' expected token ids in [0, {v}), got "
                         f"min {int(tokens.min())} max {int(tokens.max())}")


# --------------------------------------------------------------------------- distributions
def _col(values: list, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=like.device)[:, None]


def _scale(p: SamplingParams) -> float:
    """The temperature that logprobs (and a sampled row's logits) are divided by."""
    return p.temperature if p.temperature >= GREEDY_TEMPERATURE else 1.0


def _processed(z: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`processed_logits` on validated input: float32 [N, V]."""
    z = z.float()
    n, v = z.shape
    if n == 0:
        return z.clone()
    greedy = [p.greedy for p in params]
    z = z / _col([1.0 if g else _scale(p) for p, g in zip(params, greedy)], z)
    ks = [v if g or p.top_k <= 0 else min(p.top_k, v) for p, g in zip(params, greedy)]
    tps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    mps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
    keep = None
    if min(ks) < v or min(tps) < 1.0:
        # Stable sort: equal values keep index order, so top-p ties go to the smaller index.
        sz, si = torch.sort(z, dim=-1, descending=True, stable=True)
        keep_sorted = torch.ones_like(sz, dtype=torch.bool)
        if min(ks) < v:
            kth = sz.gather(1, _col(ks, z, torch.int64) - 1)
            keep_sorted &= sz >= kth
        if min(tps) < 1.0:
            p = torch.softmax(sz.masked_fill(~keep_sorted, float("-inf")), dim=-1)
            # Mass strictly before each entry, as an exclusive prefix sum: exactly 0 for the
            # first entry, which is therefore always kept (top_p > 0). Rows with top_p = 1 are
            # exempt: their float32 "before" can round up to 1 over a tail of tiny
            # probabilities, which would mask that tail only when another row in the batch
            # turned this path on.
            before = torch.cat((torch.zeros_like(p[:, :1]), p.cumsum(-1)[:, :-1]), dim=1)
            tp = _col(tps, z)
            keep_sorted &= (before < tp) | (tp >= 1.0)
        keep = torch.zeros_like(keep_sorted).scatter(1, si, keep_sorted)
    if max(mps) > 0.0:
        # p_i / p_max = exp(z_i - z_max); the max is never masked above, and the ratio is the
        # same before and after renormalising, so this needs no softmax.
        zmax = z.max(dim=-1, keepdim=True).values
        by_min_p = torch.exp(z - zmax) >= _col(mps, z)
        keep = by_min_p if keep is None else keep & by_min_p
    return z if keep is None else z.masked_fill(~keep, float("-inf"))


def _target(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`target_probs` on validated input."""
    probs = torch.softmax(_processed(logits, params), dim=-1)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        one_hot = torch.zeros_like(probs[rows])
        one_hot.scatter_(1, logits[rows].float().argmax(-1, keepdim=True), 1.0)
        probs[rows] = one_hot
    return probs


def processed_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Logits [N, V] (any float dtype) -> float32 [N, V]: divided by the row's temperature, then
    top-k, top-p and min-p masks applied (masked entries ``-inf``); greedy rows unchanged."""
    _check_logits("processed_logits", logits, params)
    return _processed(logits, params)


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row is sampled from, float32 [N, V]: softmax of
    `processed_logits`, one-hot at the first argmax for greedy rows."""
    _check_logits("target_probs", logits, params)
    return _target(logits, params)


# --------------------------------------------------------------------------- sampling
def _uniforms(generators: Sequence[torch.Generator], rows: list[int], k: int,
              device: torch.device) -> torch.Tensor:
    """float64 [len(rows), k] uniforms in [0, 1), row r drawn from ``generators[r]`` alone."""
    draws = [torch.rand(k, generator=generators[r], device=generators[r].device,
                        dtype=torch.float64).to(device) for r in rows]
    return torch.stack(draws) if draws else torch.empty(0, k, dtype=torch.float64, device=device)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index [R] int64 drawn from each row of non-negative ``weights`` [R, V] (any positive
    total; need not be normalised) by inverse CDF with uniforms ``u`` [R] in [0, 1)."""
    cdf = weights.double().cumsum(-1)
    # right=True: the first index whose cdf exceeds the target, so a zero-weight entry (equal
    # cdf to its left) is never chosen. In float64, u * total < total for every u < 1 (the
    # product loses at most one ulp and never rounds up to a normal total; a positive sum of
    # float32 weights is always normal in float64), so the index stays at or before the last
    # positive weight.
    # The clamp changes nothing for such weights; rows a device did not check (NaN, all zero)
    # still get an id in range rather than V (an out-of-range id would fault a later kernel).
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    return idx.clamp_(max=weights.shape[-1] - 1)


@dataclass
class SampleOutput:
    """What `sample` returns for a batch of N rows.

    ``tokens`` int64 [N]; ``logprobs`` float32 [N]: each token's logprob under
    ``log_softmax(logits / T)`` (the untruncated temperature-scaled distribution, what an RL
    trainer recomputes; see the module docstring); ``top_ids`` int64 [N, n] and
    ``top_logprobs`` float32 [N, n]: the n most likely tokens under the same logprobs, in
    descending order, ties by the smaller id, with n = min(V, max over rows of
    ``params.logprobs``) — every row gets n columns, a row that asked for fewer slices its
    own; both None when no row asks for top-n."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def _logprobs(logits: torch.Tensor, params: Sequence[SamplingParams], tokens: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    lp = torch.log_softmax(logits.float() / _col([_scale(p) for p in params], logits), dim=-1)
    tok_lp = lp.gather(1, tokens.long()[:, None]).squeeze(1)
    n = min(max((p.logprobs or 0 for p in params), default=0), lp.shape[1])
    if n == 0:
        return tok_lp, None, None
    vals, ids = torch.topk(lp, n, dim=-1)
    # topk leaves the choice among equal values unspecified. Where values equal to the n-th
    # extend past the selection, redo those rows with a stable sort (smaller id first); then
    # order every selection by (value descending, id ascending).
    tie = (lp >= vals[:, -1:]).sum(-1) > n
    if bool(tie.any()):
        rows = tie.nonzero().flatten()
        sv, si = torch.sort(lp[rows], dim=-1, descending=True, stable=True)
        vals[rows], ids[rows] = sv[:, :n], si[:, :n]
    ids, by_id = torch.sort(ids, dim=-1)
    vals = vals.gather(1, by_id)
    vals, by_val = torch.sort(vals, dim=-1, descending=True, stable=True)
    return tok_lp, ids.gather(1, by_val), vals


def token_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams], tokens: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprobs of ``tokens`` [N] (chosen elsewhere, e.g. accepted speculative drafts) under
    ``logits`` [N, V], with the same definition and top-n as `sample`: returns
    (float32 [N], int64 [N, n] or None, float32 [N, n] or None)."""
    _check_logits("token_logprobs", logits, params)
    _check_tokens("token_logprobs", "tokens", tokens, logits.shape[0], logits.shape[1])
    return _logprobs(logits, params, tokens)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator]) -> SampleOutput:
    """One token per row of ``logits`` [N, V] (any float dtype, any device).

    Greedy rows take the first maximum; sampled rows draw one float64 uniform from their own
    generator and invert the CDF of `target_probs` (so a seeded row's token does not depend on
    the other rows). Everything else is vectorised over the batch."""
    tokens = sample_tokens(logits, params, generators, "sample")
    return SampleOutput(tokens, *_logprobs(logits, params, tokens))


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator], fn: str = "sample_tokens"
                  ) -> torch.Tensor:
    """`sample`'s tokens alone, int64 [N] on the logits' device, without the logprobs (the
    engine takes the logprobs of the tokens it keeps, after verifying drafts, in one batch)."""
    _check_logits(fn, logits, params)
    _check_generators(fn, generators, logits.shape[0])
    n = logits.shape[0]
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        tokens[rows] = logits[rows].float().argmax(-1)
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        probs = torch.softmax(_processed(logits[rows], [params[i] for i in sampled]), dim=-1)
        u = _uniforms(generators, sampled, 1, logits.device)[:, 0]
        tokens[rows] = _inverse_cdf(probs, u)
    return tokens


def speculative_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                       draft_probs: torch.Tensor | None, params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023) for one draft
    position per row: returns (accepted bool [N], token int64 [N]).

    With p = `target_probs` (target_logits [N, V]) and q = ``draft_probs`` [N, V] — the
    distribution each draft token in ``draft_tokens`` [N] was actually drawn from — draft d is
    accepted with probability min(1, p[d] / q[d]); otherwise the token is drawn from
    normalise(max(p - q, 0)) (from p where that is all zero, which only rounding can cause).
    The output token is then distributed exactly as p. Each sampled row draws two uniforms
    from its own generator, accepted or not. Greedy rows: accepted = (d == argmax), token =
    argmax; ``draft_probs`` may be None only when every row is greedy."""
    fn = "speculative_verify"
    _check_logits(fn, target_logits, params, "target_logits")
    n, v = target_logits.shape
    _check_generators(fn, generators, n)
    _check_tokens(fn, "draft_tokens", draft_tokens, n, v)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if draft_probs is None:
        if sampled:
            raise ValueError(f"glm5 {fn}: argument 'draft_probs' is None but rows {sampled[:8]} "
                             f"sample (temperature > 0): rejection sampling needs the draft "
                             f"distribution [N, V]")
    elif not isinstance(draft_probs, torch.Tensor) or draft_probs.shape != (n, v) \
            or not draft_probs.is_floating_point():
        got = (f"{tuple(draft_probs.shape)} {draft_probs.dtype}"
               if isinstance(draft_probs, torch.Tensor) else type(draft_probs).__name__)
        raise ValueError(f"glm5 {fn}: argument 'draft_probs' expected a floating tensor "
                         f"[{n}, {v}], got {got}")
    elif sampled and value_checks(draft_probs) \
            and not bool((draft_probs[sampled] >= 0).all()):  # NaN fails too
        raise ValueError(f"glm5 {fn}: argument 'draft_probs' expected probabilities >= 0 in "
                         f"the sampled rows, got a negative or NaN entry")
    dev = target_logits.device
    draft_tokens = draft_tokens.long()
    accepted = torch.empty(n, dtype=torch.bool, device=dev)
    token = torch.empty(n, dtype=torch.int64, device=dev)
    if greedy:
        rows = torch.tensor(greedy, device=dev)
        best = target_logits[rows].float().argmax(-1)
        accepted[rows] = draft_tokens[rows] == best
        token[rows] = best
    if sampled:
        rows = torch.tensor(sampled, device=dev)
        p = torch.softmax(_processed(target_logits[rows], [params[i] for i in sampled]), -1)
        q = draft_probs[rows].float()
        d = draft_tokens[rows]
        u = _uniforms(generators, sampled, 2, dev)
        pd = p.gather(1, d[:, None]).squeeze(1).double()
        qd = q.gather(1, d[:, None]).squeeze(1).double()
        # u < p/q without the division: q[d] = 0 (d impossible for the draft) accepts whenever
        # p[d] > 0, and p[d] = 0 never accepts.
        acc = u[:, 0] * qd < pd
        residual = (p - q).clamp_min(0.0)
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        resampled = _inverse_cdf(residual, u[:, 1])
        accepted[rows] = acc
        token[rows] = torch.where(acc, d, resampled)
    return accepted, token


# --------------------------------------------------------------------------- stop strings
def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The first stop string in ``text`` that ends after position ``start`` (the text appended
    since the last check begins at ``start``; earlier text was already checked), as
    (index where it begins, the stop), or None.

    "First" means the occurrence that ends first — where a check after every character would
    have stopped, so the answer does not depend on how the text was chunked — and among those
    ending at the same place, the one that begins first (the longest)."""
    if not isinstance(text, str):
        raise ValueError(f"glm5 find_stop: argument 'text' expected a str, got "
                         f"{type(text).__name__}")
    if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"glm5 find_stop: argument 'stops' expected a sequence of non-empty "
                         f"strings, got {stops!r}")
    if not _is_int(start) or not 0 <= start <= len(text):
        raise ValueError(f"glm5 find_stop: argument 'start' expected an int in [0, "
                         f"{len(text)}] (len(text)), got {start!r}")
    best: tuple[int, int, str] | None = None
    for s in stops:
        # Occurrences beginning at or after here end after `start`; str.find gives the first.
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return None if best is None else (best[1], best[2])
