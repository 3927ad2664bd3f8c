"""The serving engine (glm5/engine) on the ``tiny`` preset in float32.

The oracle throughout is ``model.generate`` (greedy, the flat KV cache) and ``model.forward``
(a full forward, for logprobs): the engine's paged cache, chunked prefill, prefix reuse,
preemption, continuous batching and MTP drafts must not change a single greedy token. ``tiny``
has ``index_topk = 8``, so prompts longer than 8 tokens take the sparse path (the paged
indexer) and shorter ones the dense path; small pages (1, 4, 16 tokens) make block tables
long and shuffled.
"""

from __future__ import annotations

import asyncio
import copy
import functools

import pytest
import torch

from glm5 import ops
from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.engine import EngineConfig, LLMEngine, RequestRejected
from glm5.engine.cache_manager import CacheManager
from glm5.engine.sampling import SamplingParams

from engine_util import drive, run_all
from tolerances_model import assert_logits_close

N_NEW = 6  # tokens generated per request in the greedy comparisons


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(preset("tiny")).float().eval()


def _prompts(seed: int, lengths: list[int], vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


# Lengths on both sides of index_topk = 8 (dense / sparse), a repeat (its whole pages hit) and
# an extension of another prompt (a partial prefix hit).
PROMPTS = _prompts(1, [1, 3, 5, 8, 9, 12, 17])
PROMPTS += [list(PROMPTS[6]), PROMPTS[5] + [7, 8, 9, 10, 11]]


@functools.lru_cache(maxsize=None)
def _greedy_cached(model_id: int, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    m = _MODELS[model_id]
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), n)
    return tuple(out[0, len(prompt):].tolist())


_MODELS: dict[int, GLM5ForCausalLM] = {}


def greedy(model: GLM5ForCausalLM, prompt: list[int], n: int = N_NEW) -> list[int]:
    """``model.generate``'s greedy continuation (cached per model, prompt and length)."""
    _MODELS[id(model)] = model
    return list(_greedy_cached(id(model), tuple(prompt), n))


def make_engine(model: GLM5ForCausalLM, engine_cls: type = LLMEngine, **kw) -> LLMEngine:
    base = dict(page_size=4, num_pages=64, max_num_batched_tokens=32, chunk_size=8)
    base.update(kw)
    return engine_cls(model, EngineConfig(**base))


def greedy_params(n: int = N_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def assert_pages_returned(eng: LLMEngine) -> None:
    """Nothing runs or waits, and every page is free or held by the prefix cache alone."""
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.requests
    alloc = eng.allocator
    assert alloc.num_free + eng.radix.num_cached_pages == alloc.num_pages
    for p in range(alloc.num_pages):
        assert alloc.refcount(p) == (1 if p in eng.radix else 0), p


# --------------------------------------------------------------------------- 1. greedy parity
@pytest.mark.parametrize("chunk,page,prefix", [
    (1, 4, True), (3, 1, False), (3, 16, True), (64, 4, False), (64, 16, True), (3, 4, True),
])
def test_greedy_matches_generate(model, chunk, page, prefix):
    eng = make_engine(model, chunk_size=chunk, page_size=page, enable_prefix_cache=prefix,
                      num_pages=(64 * 4) // page + 8, max_num_batched_tokens=max(chunk, 24))
    outs = run_all(eng, PROMPTS, greedy_params())
    for p, o in zip(PROMPTS, outs):
        assert o.finish_reason == "length", o.error
        assert o.token_ids == greedy(model, p), (len(p), o.token_ids)
    if prefix:  # the repeated prompt and the extension reuse the cached pages
        assert eng.scheduler.stats.prompt_tokens_hit > 0
    else:
        assert eng.scheduler.stats.prompt_tokens_hit == 0
    assert_pages_returned(eng)


# --------------------------------------------------------------------------- 2. paged forward
def _paged_run(model, cache, table, steps):
    """Run ``steps`` (each a list of (sequence, start, tokens)) on the paged cache of ``cache``
    (a CacheManager); returns {sequence: {position: hidden [D]}}."""
    from glm5.engine.runner import Batch

    got: dict[int, dict[int, torch.Tensor]] = {}
    ps, pool = cache.page_size, cache.pool
    for step in steps:
        ids, pos, seq = [], [], []
        for b, start, toks in step:
            ids += toks
            pos += range(start, start + len(toks))
            seq += [b] * len(toks)
        batch = Batch(torch.tensor(ids), torch.tensor(pos), torch.tensor(seq, dtype=torch.int32),
                      table, [])
        slots = cache.slot_rows(batch.block_table, batch.seq, batch.positions)
        st = model.paged_step(batch.positions, slots, table, batch.seq, ps)
        with torch.no_grad():
            h = model.hidden_states_paged(batch.ids, st, pool.latent, pool.index_keys)
        for r, (b, p) in enumerate(zip(seq, pos)):
            got.setdefault(b, {})[p] = h[r]
    return got


@pytest.mark.parametrize("lens,split", [((3, 5), 2), ((4, 13), 6)], ids=["dense", "sparse"])
def test_paged_forward_matches_flat_cache(model, monkeypatch, lens, split):
    """hidden_states_paged over a shuffled block table (two sequences in one batch, the second
    prefilled in two chunks, then two decode steps each) == hidden_states with the flat KVCache
    (prefill, then one token at a time) for every position."""
    ps, n_dec = 4, 2
    seqs = _prompts(7, [n + n_dec for n in lens])
    la, lb = lens
    cache = CacheManager(16, ps, model=model)
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(16, generator=g)
    assert not torch.equal(perm, torch.arange(16))
    table = torch.stack((perm[:5], perm[5:10])).to(torch.int32)  # 5 pages of 4 >= 15 tokens
    A, B = seqs
    steps = [
        [(0, 0, A[:la]), (1, 0, B[:split])],  # A's prompt, B's first chunk
        [(1, split, B[split:lb]), (0, la, A[la:la + 1])],  # B's second chunk with A's decode
        [(0, la + 1, A[la + 1:la + 2]), (1, lb, B[lb:lb + 1])],
        [(1, lb + 1, B[lb + 1:lb + 2])],
    ]
    calls = []
    real = ops.paged_indexer_topk
    monkeypatch.setattr(ops, "paged_indexer_topk", lambda *a: calls.append(1) or real(*a))
    got = _paged_run(model, cache, table, steps)
    # the dense case attends to all keys through the block table; the sparse one selects
    assert bool(calls) == (max(lens) > model.config.index_topk)
    for b, (s, n) in enumerate(zip(seqs, lens)):
        cache = model.new_cache(1, len(s))
        with torch.no_grad():
            ref = [model.hidden_states(torch.tensor([s[:n]]), cache)[0]]
            for t in s[n:]:
                ref.append(model.hidden_states(torch.tensor([[t]]), cache)[0])
        ref = torch.cat(ref)
        paged = torch.stack([got[b][p] for p in range(len(s))])
        # Flat prefill may run MLA in MHA mode while the paged cache always runs MQA (absorbed):
        # the same math in another order, so the whole-model bound (LOGIT_TOL) on the hidden
        # states and the logits.
        assert_logits_close(paged, ref, what=f"hidden states of sequence {b}")
        with torch.no_grad():
            lp, _ = model.logits_and_hidden(paged)
            lr, _ = model.logits_and_hidden(ref)
        assert_logits_close(lp, lr, what=f"logits of sequence {b}")


# --------------------------------------------------------------------------- 3. MTP
MTP_PROMPTS = [PROMPTS[1], PROMPTS[4], PROMPTS[6]]  # 3, 9 and 17 tokens


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_greedy_equals_plain_greedy(model, k):
    eng = make_engine(model, num_speculative_tokens=k)
    outs = run_all(eng, MTP_PROMPTS, greedy_params())
    for p, o in zip(MTP_PROMPTS, outs):
        assert o.token_ids == greedy(model, p)
    assert eng.stats.drafted > 0  # drafts were proposed and verified
    assert eng.stats.drafted == sum(o.metrics.num_drafted for o in outs)
    assert eng.stats.accepted == sum(o.metrics.num_accepted for o in outs)
    assert_pages_returned(eng)


def test_mtp_step_of_prefill_chunks_only(model):
    """A step whose items are all non-final prefill chunks samples nothing: the MTP layer still
    writes its cache for them and drafts nothing (it used to index with an empty float tensor
    and fail the request)."""
    eng = make_engine(model, num_speculative_tokens=1, chunk_size=4)
    (out,) = run_all(eng, [PROMPTS[6]], greedy_params())  # 17 tokens: 4 chunk-only steps
    assert out.finish_reason == "length" and out.token_ids == greedy(model, PROMPTS[6])


def test_mtp_logits_match_flat_mtp_layer(model):
    """Every draft distribution the engine samples from == model.mtp_logits over the flat
    sequence (hidden states of positions 0 .. L-2, tokens 1 .. L-1; last row), within
    LOGIT_TOL: chunked prefill, decodes that accept drafts (sampled, where the random model's
    near-uniform distributions accept most) and reject them, and prefix reuse — a prompt
    diverging from a cached one right after a page boundary, and a GRPO pair of one prompt of
    whole pages whose samples differ — where a shared page's MTP entry at its last position
    (made with the token after it) must not be the other request's."""
    A = PROMPTS[5]  # 12 tokens: 3 whole pages
    prompts = [A, A[:8] + [5, 6, 7], A, PROMPTS[4]]
    params = [SamplingParams(max_tokens=N_NEW, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(len(prompts) - 1)] + [greedy_params()]  # greedy: rejections
    eng = make_engine(model, num_speculative_tokens=1, chunk_size=5)
    seen: dict = {}
    real_schedule, real_mtp = eng.scheduler.schedule, eng.runner.mtp
    eng.scheduler.schedule = lambda: seen.__setitem__("items", real_schedule()) or seen["items"]
    eng.runner.mtp = lambda *a, **kw: seen.setdefault("mtp", real_mtp(*a, **kw))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    checked = 0
    for _ in drive(eng):
        if "mtp" not in seen:
            continue
        drafting = [it.req for it in seen["items"] if it.sample]
        for req, got in zip(drafting, seen["mtp"][0]):
            if req.status.value == "finished":
                continue
            full = req.prompt_ids + req.output_ids
            with torch.no_grad():
                _, h = model.forward_with_hidden(torch.tensor([full[:-1]]))
                ref = model.mtp_logits(h, torch.tensor([full[1:]]))[0, -1]
            assert_logits_close(got, ref, what=f"MTP logits of {req.request_id} at {len(full)}")
            checked += 1
        seen.clear()
    assert checked >= 12
    assert 0 < eng.stats.accepted < eng.stats.drafted
    assert eng.scheduler.stats.prompt_tokens_hit > 0


class _OracleDrafts(LLMEngine):
    """Drafts the true greedy continuation (``wrong``: each draft + 1 mod V, never right)."""

    oracle: dict[tuple[int, ...], list[int]] = {}
    wrong = False

    def _draft(self, items, batch, hn, new_tokens, fails):
        k, V = self.config.num_speculative_tokens, self.model.config.vocab_size
        out = {}
        for i, it in enumerate(items):
            if i in fails or not it.sample:
                continue
            req = it.req
            done = len(req.output_ids) + len(new_tokens[i])  # committed after drafting
            d = self.oracle[tuple(req.prompt_ids)][done:done + k]
            assert len(d) == k, "the oracle continuation is too short"
            out[i] = ([(t + 1) % V if self.wrong else t for t in d], [None] * k)
        return out


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_oracle_drafts_all_accepted_wrong_drafts_none(model, k):
    # the greedy continuation beyond max_tokens too: the last step drafts past the end
    oracle = {tuple(p): greedy(model, p, N_NEW + 5) for p in MTP_PROMPTS}
    plain = make_engine(model)
    run_all(plain, MTP_PROMPTS, greedy_params())
    steps = {}
    for wrong in (False, True):
        eng = make_engine(model, _OracleDrafts, num_speculative_tokens=k)
        eng.oracle, eng.wrong = oracle, wrong
        outs = run_all(eng, MTP_PROMPTS, greedy_params())
        for p, o in zip(MTP_PROMPTS, outs):
            assert o.token_ids == oracle[tuple(p)][:N_NEW]
        assert eng.stats.drafted > 0
        assert eng.stats.accepted == (0 if wrong else eng.stats.drafted)
        steps[wrong] = eng.stats.steps
        assert_pages_returned(eng)
    # every accepted draft saves a step: k + 1 tokens per decode step instead of 1
    assert steps[False] < plain.stats.steps
    assert steps[True] == plain.stats.steps


def test_mtp_sampled_seeded(model):
    """Sampling with MTP drafts: tokens in range, max_tokens each, the acceptance counters
    consistent, and a seeded run reproducible."""
    params = [SamplingParams(max_tokens=N_NEW, temperature=1.0, seed=s, ignore_eos=True)
              for s in (11, 12, 13)]
    runs = []
    for _ in range(2):
        eng = make_engine(model, num_speculative_tokens=2)
        outs = run_all(eng, MTP_PROMPTS, params)
        V = model.config.vocab_size
        for o in outs:
            assert len(o.token_ids) == N_NEW and all(0 <= t < V for t in o.token_ids)
        s = eng.stats
        assert 0 <= s.accepted <= s.drafted and s.drafted > 0
        assert s.drafted == sum(o.metrics.num_drafted for o in outs)
        assert s.accepted == sum(o.metrics.num_accepted for o in outs)
        assert s.generation_tokens == len(outs) * N_NEW
        runs.append([o.token_ids for o in outs])
        assert_pages_returned(eng)
    assert runs[0] == runs[1]


# --------------------------------------------------------------------------- 4. preemption
@pytest.mark.parametrize("k", [0, 1])
def test_preemption_by_recompute_loses_nothing(model, k):
    """8 pages of 4 tokens for requests that need up to 6 each: running requests are preempted
    (pages freed, recomputed later) and every output is still the greedy one."""
    prompts = [PROMPTS[i] for i in (4, 5, 6, 3)]  # 9, 12, 17, 8 tokens
    eng = make_engine(model, num_pages=8, num_speculative_tokens=k, enable_prefix_cache=False)
    outs = run_all(eng, prompts, greedy_params())
    assert eng.scheduler.stats.preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == eng.scheduler.stats.preemptions
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length" and o.token_ids == greedy(model, p)
    assert eng.allocator.num_free == eng.allocator.num_pages


# --------------------------------------------------------------------------- 5. prefix cache
@pytest.mark.parametrize("n_prompt", [13, 12], ids=["partial-page", "full-prompt-match"])
def test_prefix_cache_grpo_group_prefills_once(model, n_prompt):
    """One prompt, 8 samples: the prompt is prefilled once. A prompt of whole pages (12 = 3 x 4)
    is matched entirely: the last page is copied (copy on write) and its last token
    recomputed, so the shared page is never written."""
    prompt = _prompts(5, [n_prompt])[0]
    G = 8
    prefilled, hit = {}, 0
    for prefix in (True, False):
        eng = make_engine(model, enable_prefix_cache=prefix)
        copies = []
        real_copy = eng.pool.copy_page
        eng.scheduler.copy_page = lambda s, d: copies.append((s, d)) or real_copy(s, d)
        outs = run_all(eng, [prompt] * G, greedy_params(4))
        for o in outs:
            assert o.token_ids == greedy(model, prompt, 4)
        prefilled[prefix] = eng.scheduler.stats.prefill_tokens
        s = eng.scheduler.stats
        assert s.prompt_tokens_queried == G * n_prompt
        if prefix:
            whole = n_prompt // 4 * 4
            # every sample after the first reuses the full pages; a full match leaves the
            # last token to recompute (its logits are needed)
            hit = whole - 1 if whole == n_prompt else whole
            assert s.prompt_tokens_hit == (G - 1) * hit
            assert [o.metrics.num_cached_prompt_tokens for o in outs] == [0] + [hit] * (G - 1)
            assert len(copies) == (G - 1 if whole == n_prompt else 0)
        else:
            assert s.prompt_tokens_hit == 0 and not copies
        assert_pages_returned(eng)
    # once (each later sample computes only its tokens past the cached pages), against once
    # per sample without the cache
    assert prefilled[True] == n_prompt + (G - 1) * (n_prompt - hit) < 2 * n_prompt
    assert prefilled[False] == G * n_prompt


def test_prefix_cache_reuse_after_finish_and_eviction(model):
    """Pages cached by finished requests serve later ones; when the cache fills, unreferenced
    leaves are evicted for new requests and outputs stay greedy."""
    eng = make_engine(model, num_pages=10)
    first = run_all(eng, [PROMPTS[6]], greedy_params())  # 17 + 6 tokens: 5 pages cached
    assert eng.radix.num_cached_pages == 5
    again = run_all(eng, [PROMPTS[6], PROMPTS[5], PROMPTS[4]], greedy_params())
    assert again[0].metrics.num_cached_prompt_tokens == 16
    assert eng.radix.evictable_pages() == eng.radix.num_cached_pages
    for p, o in zip([PROMPTS[6], PROMPTS[6], PROMPTS[5], PROMPTS[4]], first + again):
        assert o.token_ids == greedy(model, p)
    assert_pages_returned(eng)


# --------------------------------------------------------------------------- 6. scheduler
def _record_schedule(eng: LLMEngine) -> list[list[tuple[str, int, int, bool]]]:
    """Wrap Scheduler.schedule: every step's items as (request id, start, n tokens, decode),
    and the running batch's size after scheduling."""
    log: list = []
    real = eng.scheduler.schedule

    def schedule():
        items = real()
        log.append(([(it.req.request_id, it.start, len(it.tokens),
                      it.req.num_tokens - it.start == 1) for it in items],
                    len(eng.scheduler.running)))
        return items

    eng.scheduler.schedule = schedule
    return log


@pytest.mark.parametrize("k", [0, 2])
def test_scheduler_limits_every_step(model, k):
    seqs, budget, chunk = 3, 10, 4
    eng = make_engine(model, max_num_seqs=seqs, max_num_batched_tokens=budget, chunk_size=chunk,
                      num_speculative_tokens=k)
    log = _record_schedule(eng)
    prompts = PROMPTS[:7]
    outs = run_all(eng, prompts, greedy_params())
    for p, o in zip(prompts, outs):
        assert o.token_ids == greedy(model, p)
    mixed = False
    for items, running in log:
        assert 0 < len(items) <= seqs and running <= seqs
        assert sum(n for _, _, n, _ in items) <= budget
        assert len({r for r, *_ in items}) == len(items)  # a request once per step
        for _, _, n, decode in items:
            assert n <= (1 + k if decode else chunk)
        kinds = {decode for *_, decode in items}
        mixed |= kinds == {True, False}
    assert mixed  # chunked prefills shared steps with decodes
    assert max(len(items) for items, _ in log) == seqs  # the limit was reached
    assert max(sum(n for _, _, n, _ in items) for items, _ in log) == budget


def test_continuous_batching_join_and_leave(model):
    """A short request added while a long one runs starts at the next step and finishes (and
    leaves the batch) while the long one is still decoding."""
    eng = make_engine(model)
    log = _record_schedule(eng)
    eng.add_request("long", PROMPTS[5], greedy_params(12))
    for _ in range(3):
        eng.step()
    eng.add_request("short", PROMPTS[2], greedy_params(2))
    done = {}
    for outs in drive(eng):
        for o in outs:
            if o.finished:
                done[o.request_id] = (o, len(log))
    ids = [{r for r, *_ in items} for items, _ in log]
    assert ids[3] == {"long", "short"}  # joined the running batch at once
    assert done["short"][1] < done["long"][1]  # left before the long one finished
    assert ids[done["short"][1]] == {"long"}
    assert done["long"][0].token_ids == greedy(model, PROMPTS[5], 12)
    assert done["short"][0].token_ids == greedy(model, PROMPTS[2], 2)


# --------------------------------------------------------------------------- 7. stops, outputs
def _first_new(seq: list[int]) -> int:
    """An index j >= 1 whose token does not occur before it (stopping there is unambiguous)."""
    return next(j for j in range(1, len(seq)) if seq[j] not in seq[:j])


def test_stop_token_ids_eos_and_max_tokens(model, monkeypatch):
    p = PROMPTS[4]
    ref = greedy(model, p)
    j = _first_new(ref)
    eng = make_engine(model)
    outs = run_all(eng, [p, p], [greedy_params(stop_token_ids=[ref[j]]), greedy_params(3)])
    assert outs[0].token_ids == ref[:j + 1]  # the stop token is generated, then it ends
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", ref[j])
    assert outs[1].token_ids == ref[:3]
    assert (outs[1].finish_reason, outs[1].stop_reason) == ("length", None)
    # EOS: the model config's eos_token_id ends a request unless ignore_eos
    monkeypatch.setattr(model, "config", model.config.replace(eos_token_id=ref[j]))
    eng = make_engine(model)
    outs = run_all(eng, [p, p], [SamplingParams(max_tokens=N_NEW, temperature=0), greedy_params()])
    assert outs[0].token_ids == ref[:j + 1]
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", ref[j])
    assert outs[1].token_ids == ref and outs[1].finish_reason == "length"
    assert eng.stats.finished == 2 and eng.stats.generation_tokens == j + 1 + N_NEW


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    try:
        from glm5.text.bpe import build_tokenizer
    except ImportError as e:  # pragma: no cover - helper CHAT's module
        pytest.skip(f"glm5.text.bpe.build_tokenizer is not available: {e}")
    pytest.importorskip("tokenizers")
    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    torch.manual_seed(0)
    m = GLM5ForCausalLM(preset("tiny").replace(vocab_size=tok.vocab_size)).float().eval()
    return m, tok


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_with_tokenizer(text_model, include):
    """A stop string spanning two generated tokens ends the request at the token completing it;
    the text is cut before it (or after it with include_stop_str_in_output), and the streamed
    pieces add up to the final text."""
    m, tok = text_model
    prompt = "Hello, world! The quick brown fox"
    ids = tok.encode(prompt)
    ref = greedy(m, ids, 8)
    b = len(tok.decode(ref[:1]))
    stop = tok.decode(ref)[b - 1:b + 1]  # the last character of token 0, the first of token 1
    assert len(stop) == 2 and stop not in tok.decode(ref[:1])
    eng = LLMEngine(m, EngineConfig(page_size=4, num_pages=32), tokenizer=tok)
    eng.add_request("s", prompt, SamplingParams(max_tokens=8, temperature=0, stop=[stop],
                                                include_stop_str_in_output=include))
    streamed, final = "", None
    for outs in drive(eng):
        for o in outs:
            streamed += o.new_text
            final = o if o.finished else final
    assert final.token_ids == ref[:2]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    full = tok.decode(ref[:2])
    cut = full.index(stop) + (len(stop) if include else 0)
    assert final.text == full[:cut] == streamed
    assert_pages_returned(eng)


@pytest.mark.parametrize("temperature,k", [(0.0, 0), (0.7, 1)])
def test_logprobs_match_float64_log_softmax(model, temperature, k):
    """The logprob of every sampled token (and the top-3) == float64 log_softmax(logits / T) of
    a full model.forward over the prompt and the generated tokens. Bound 1e-4: log_softmax moves
    by at most 2 max|d logit|, and the engine's logits sit within LOGIT_TOL (1e-4) of the
    largest |logit| (~0.5 for tiny's random weights) of the forward's: 2 * 0.5e-4 = 1e-4."""
    prompts = [PROMPTS[2], PROMPTS[6]]
    params = SamplingParams(max_tokens=N_NEW, temperature=temperature, seed=5, logprobs=3,
                            ignore_eos=True)
    eng = make_engine(model, num_speculative_tokens=k)
    outs = run_all(eng, prompts, params)
    T = temperature or 1.0
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([p + o.token_ids]))[0].double()
        assert float(logits.abs().max()) < 1.0  # the premise of the 1e-4 bound
        lp = torch.log_softmax(logits / T, -1)[len(p) - 1:-1]
        assert len(o.logprobs) == len(o.token_ids) == N_NEW
        for j, (t, entry) in enumerate(zip(o.token_ids, o.logprobs)):
            assert entry.token_id == t
            assert abs(entry.logprob - float(lp[j, t])) <= 1e-4
            top = torch.topk(lp[j], 4)
            gap = float(top.values[2] - top.values[3])
            assert [i for i, _ in entry.top] == top.indices[:3].tolist() or gap < 1e-4
            for (i, v) in entry.top:
                assert abs(v - float(lp[j, i])) <= 1e-4
        if temperature == 0:
            assert o.token_ids == greedy(model, p)


# --------------------------------------------------------------------------- 8. failures
def _unused_token(model, prompts: list[list[int]]) -> int:
    used = {t for p in prompts for t in p + greedy(model, p)}
    return max(set(range(2, model.config.vocab_size)) - used)


def test_error_in_a_step_fails_only_that_request(model, monkeypatch):
    others = [PROMPTS[2], PROMPTS[6]]
    marker = _unused_token(model, others)
    bad = PROMPTS[4][:4] + [marker] + PROMPTS[4][4:]
    real = model.hidden_states_paged

    def forward(input_ids, *a, **kw):
        if bool((input_ids == marker).any()):
            raise RuntimeError("planted failure")
        return real(input_ids, *a, **kw)

    monkeypatch.setattr(model, "hidden_states_paged", forward)
    eng = make_engine(model, chunk_size=3)  # the marker sits in the second chunk
    outs = run_all(eng, [others[0], bad, others[1]], greedy_params())
    assert outs[1].finish_reason == "error" and "planted failure" in outs[1].error
    assert outs[1].finished and outs[1].token_ids == []
    for p, o in zip(others, (outs[0], outs[2])):
        assert o.finish_reason == "length" and o.error is None and o.token_ids == greedy(model, p)
    assert (eng.stats.failed, eng.stats.finished) == (1, 2)
    assert_pages_returned(eng)


def test_non_finite_logits_fail_only_their_request(model):
    others = [PROMPTS[2], PROMPTS[6]]
    marker = _unused_token(model, others)
    broken = copy.deepcopy(model)
    with torch.no_grad():  # a NaN embedding: NaN logits for every sequence holding the token
        broken.model.embed_tokens.weight[marker] = float("nan")
    eng = make_engine(broken)
    outs = run_all(eng, [others[0], PROMPTS[4] + [marker], others[1]], greedy_params())
    assert outs[1].finish_reason == "error" and "not finite" in outs[1].error
    for p, o in zip(others, (outs[0], outs[2])):
        assert o.finish_reason == "length" and o.token_ids == greedy(model, p)
    assert eng.stats.failed == 1
    assert_pages_returned(eng)


def test_error_while_committing_fails_only_that_request(text_model):
    """An error after the forward, while one request's tokens are committed (here: its
    detokenizer rejects an id past the tokenizer's vocabulary, which a model whose embedding
    is padded beyond the tokenizer can sample), fails that request only. It used to re-run
    every item of the step alone, committing the requests before it twice (each token
    doubled)."""
    _, tok = text_model
    torch.manual_seed(0)
    m = GLM5ForCausalLM(preset("tiny").replace(vocab_size=tok.vocab_size + 64)).float().eval()
    prompts = [tok.encode(t) for t in ("Hello, world!", "The quick brown fox", "café naïve")]
    refs = [greedy(m, p, 5) for p in prompts]
    past = [any(t >= tok.vocab_size for t in r) for r in refs]
    assert past == [False, True, True]  # the premise: the model samples ids past the tokenizer
    eng = LLMEngine(m, EngineConfig(page_size=4, num_pages=64), tokenizer=tok)
    outs = run_all(eng, prompts, greedy_params(5))
    assert outs[0].finish_reason == "length" and outs[0].token_ids == refs[0]
    assert outs[0].text == tok.decode(refs[0])
    for o, r in zip(outs[1:], refs[1:]):
        assert o.finish_reason == "error" and "out of range" in o.error
        bad = next(j for j, t in enumerate(r) if t >= tok.vocab_size)
        assert o.token_ids == r[:bad + 1]  # up to the token that failed, each once
    assert_pages_returned(eng)


def _held_pages(eng: LLMEngine) -> int:
    return sum(eng.allocator.refcount(p) for p in range(eng.allocator.num_pages))


def test_abort_frees_pages(model):
    eng = make_engine(model, max_num_seqs=2)
    for i, p in enumerate((PROMPTS[6], PROMPTS[5], PROMPTS[4])):
        eng.add_request(f"r{i}", p, greedy_params())
    eng.step()
    eng.step()
    assert eng.requests["r1"].pages and "r2" in [r.request_id for r in eng.scheduler.waiting]
    eng.abort("r1")  # running
    eng.abort("r2")  # waiting
    eng.abort("nobody")  # unknown (or finished meanwhile): ignored
    outs = {o.request_id: o for o in eng.step()}
    assert outs["r1"].finish_reason == outs["r2"].finish_reason == "abort"
    assert outs["r1"].finished and eng.stats.aborted == 2
    # only r0's block table and the prefix cache hold pages now
    assert _held_pages(eng) == len(eng.requests["r0"].pages) + eng.radix.num_cached_pages
    rest = eng.run_to_completion()
    assert [o.request_id for o in rest] == ["r0"]
    assert rest[0].token_ids == greedy(model, PROMPTS[6])
    assert_pages_returned(eng)


# --------------------------------------------------------------------------- 9. admission
def test_admission_rejections(model):
    eng = make_engine(model, num_pages=4, max_model_len=24, long_prompt_tokens=10,
                      long_prompt_qps=0.001, long_prompt_burst=2)
    V = model.config.vocab_size

    def rejected(prompt, params=None, rid="x") -> RequestRejected:
        before = dict(eng.requests), len(eng.scheduler.waiting)
        with pytest.raises(RequestRejected) as e:
            eng.add_request(rid, prompt, params or greedy_params(2))
        assert (dict(eng.requests), len(eng.scheduler.waiting)) == before  # nothing queued
        return e.value

    assert rejected([]).status == 400
    e = rejected([3, V])
    assert (e.status, e.param) == (400, "prompt") and f"[0, {V})" in str(e)
    assert rejected([3, -1]).status == 400
    assert rejected("text without a tokenizer").status == 400
    e = rejected([3] * 24)  # prompt >= context
    assert (e.status, e.param) == (400, "prompt") and "24" in str(e)
    e = rejected([3] * 20, greedy_params(5))  # 20 + 5 > 24
    assert (e.status, e.param) == (400, "max_tokens")
    e = rejected([3] * 10, greedy_params(8))  # 18 tokens need 5 pages of 4; the cache has 4
    assert (e.status, e.param) == (400, "max_tokens") and "pages" in str(e)
    eng.add_request("a", [3] * 4, greedy_params(2))
    e = rejected([5], rid="a")
    assert (e.status, e.param) == (400, "request_id")
    # prompts over long_prompt_tokens: a burst of 2, then 429 with Retry-After; short ones pass
    eng.add_request("long1", [4] * 11, greedy_params(1))
    eng.add_request("long2", [4] * 11, greedy_params(1))
    e = rejected([4] * 11, greedy_params(1), rid="long3")
    assert e.status == 429 and e.retry_after is not None and e.retry_after > 100
    eng.add_request("short", [4] * 10, greedy_params(1))
    assert eng.stats.rejected == 9
    outs = eng.run_to_completion()
    assert sorted(o.request_id for o in outs) == ["a", "long1", "long2", "short"]


@pytest.mark.parametrize("kw,needle", [
    ({"max_num_seqs": 0}, "'max_num_seqs' expected an int >= 1"),
    ({"page_size": True}, "'page_size' expected an int >= 1"),
    ({"num_pages": 0}, "'num_pages' expected None or an int >= 1"),
    ({"num_speculative_tokens": 9}, "'num_speculative_tokens' expected an int in [0, 8]"),
    ({"long_prompt_qps": float("inf")}, "'long_prompt_qps' expected a finite number > 0"),
    ({"chunk_size": 64, "max_num_batched_tokens": 32}, "'chunk_size' expected <="),
])
def test_engine_config_validation(kw, needle):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    assert "EngineConfig" in str(e.value) and needle in str(e.value)


def test_engine_needs_mtp_layer_for_drafts():
    m = GLM5ForCausalLM(preset("tiny"), with_mtp=False)
    with pytest.raises(ValueError, match="num_speculative_tokens needs a checkpoint with an MTP"):
        LLMEngine(m, EngineConfig(num_speculative_tokens=1, num_pages=8))


# --------------------------------------------------------------------------- 10. LLM, async
def test_llm_generate_in_prompt_order(model):
    import glm5

    prompts = [PROMPTS[6], PROMPTS[0], PROMPTS[4], PROMPTS[2]]  # longest first
    llm = glm5.LLM(model, page_size=4, num_pages=64, chunk_size=4)
    outs = llm.generate(prompts, greedy_params())
    assert [o.prompt_token_ids for o in outs] == prompts
    for p, o in zip(prompts, outs):
        assert o.finished and o.token_ids == greedy(model, p)
    one = llm.generate(PROMPTS[3], greedy_params(2))  # a single prompt of ids
    assert len(one) == 1 and one[0].token_ids == greedy(model, PROMPTS[3])[:2]
    with pytest.raises(TypeError, match="unknown argument"):
        glm5.LLM(model, pages=4)
    # a rejected prompt rejects the call and leaves nothing behind: the prompts before it
    # are not left queued to run (unseen) in a later call
    with pytest.raises(RequestRejected):
        llm.generate([PROMPTS[3], []], greedy_params(2))
    assert not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_free + llm.engine.radix.num_cached_pages == 64


def test_async_engine_concurrent_and_early_close(model):
    from glm5.engine.async_engine import AsyncEngine

    eng = make_engine(model)
    aeng = AsyncEngine(eng)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[6]]

    async def collect(rid, p):
        last = None
        async for o in aeng.generate(rid, p, greedy_params()):
            last = o
        return last

    async def early(rid, p):
        agen = aeng.generate(rid, p, greedy_params(20))
        first = await agen.__anext__()
        await agen.aclose()  # a client that goes away mid-stream
        return first

    async def main():
        outs = await asyncio.gather(*(collect(f"c{i}", p) for i, p in enumerate(prompts)),
                                    early("gone", PROMPTS[5]))
        for _ in range(500):  # the abort lands in the engine thread's next step
            if not eng.has_unfinished():
                break
            await asyncio.sleep(0.01)
        return outs, await aeng.shutdown(timeout=10)

    try:
        outs, drained = asyncio.run(main())
    finally:
        aeng._stop = True
    assert drained
    for p, o in zip(prompts, outs[:3]):
        assert o.finished and o.token_ids == greedy(model, p)
    assert not outs[3].finished
    assert eng.stats.aborted == 1
    assert_pages_returned(eng)
