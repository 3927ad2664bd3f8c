"""Captured decode steps per batch bucket (glm5.engine.graphs), on CPU with the eager stand-in
for CUDA-graph capture (`EagerCapture`: capture runs the forward once, replay runs it again into
the same output tensors): bucket choice, padding that neither reads nor writes the real rows'
cache, static buffers refilled for every replay, eager fallback. The real
`torch.cuda.CUDAGraph` path runs only where a GPU is (the last test).
"""

from __future__ import annotations

import pytest
import torch

from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.engine.graphs import DecodeGraphs, EagerCapture, bucket_for, check_buckets
from glm5.engine.sampling import SamplingParams

from test_engine import greedy, greedy_params, run_all
from tolerances_model import REORDER_LOGIT_TOL, assert_logits_close

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(preset("tiny")).float().eval()


def _engine(model, buckets=(1, 2, 4), capture=None, **kw) -> LLMEngine:
    base = dict(page_size=4, num_pages=64, max_num_batched_tokens=64, chunk_size=32)
    base.update(kw)
    eng = LLMEngine(model, EngineConfig(**base))
    assert eng.runner.graphs is None  # off on CPU by default
    eng.runner.graphs = eng.decode_graphs(capture or EagerCapture(), buckets)
    return eng


def test_bucket_choice():
    b = (1, 2, 4, 8, 16, 32)
    assert [bucket_for(n, b) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32, 33)] == \
        [1, 2, 4, 4, 8, 8, 16, 32, 32, None]
    assert bucket_for(3, (3, 6)) == 3 and bucket_for(4, (3, 6)) == 6
    assert check_buckets([1, 3, 5], "t") == (1, 3, 5)
    for bad in ((), (2, 1), (1, 1), (0, 2), (1.5,), (True,), "ab", 4):
        with pytest.raises(ValueError, match="'cuda_graph_buckets' expected increasing ints"):
            check_buckets(bad, "t")
    g = DecodeGraphs(lambda *a: None, torch.device("cpu"), (1, 2, 4), index_topk=8,
                     page_size=4, max_pages=5, scratch_pages=[9], capture=EagerCapture())
    assert g.key(3, 8) == (4, True) and g.key(3, 9) == (4, False) and g.key(5, 2) is None
    assert g._bound(True) == 8 and g._bound(False) == 20  # 5 pages of 4 keys
    g1 = DecodeGraphs(lambda *a: None, torch.device("cpu"), (1, 2), index_topk=8,
                      page_size=4, max_pages=1, scratch_pages=[9], capture=EagerCapture())
    assert g1._bound(True) == 4  # never past the block table
    with pytest.raises(ValueError, match=r"at most 5 sequences per bucket .* got 8"):
        DecodeGraphs(lambda *a: None, torch.device("cpu"), (1, 8), index_topk=8, page_size=4,
                     max_pages=5, scratch_pages=[9], capture=EagerCapture())


def test_config():
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        LLMEngine(GLM5ForCausalLM(preset("tiny")), EngineConfig(num_pages=8, cuda_graphs=True))
    with pytest.raises(ValueError, match="'cuda_graphs' expected None, True or False"):
        EngineConfig(cuda_graphs=1)
    with pytest.raises(ValueError, match="glm5 EngineConfig: argument 'cuda_graph_buckets'"):
        EngineConfig(cuda_graph_buckets=(4, 2))
    assert EngineConfig(cuda_graph_buckets=[2, 8]).cuda_graph_buckets == (2, 8)


# Prompts on both sides of index_topk = 8, and lengths that make the running batch shrink as
# requests finish: 5 sequences (above the largest bucket, 4), then 4 and 3 with a long context
# (bucket 4, the sparse path), then 2 and 1 short ones (buckets 2 and 1, the dense path).
LENS = [3, 4, 9, 12, 17, 10]
N_NEW = [6, 5, 4, 3, 1, 2]


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 128, (n,), generator=g).tolist() for n in LENS]


def test_greedy_tokens_unchanged_with_graphs(model):
    """The engine with captured decode steps emits model.generate's greedy tokens; steps of 5
    sequences (above the largest bucket) and steps with prefill chunks ran eager; every key
    was captured once and replayed after."""
    prompts = _prompts()
    eng = _engine(model)
    outs = run_all(eng, prompts, [greedy_params(n) for n in N_NEW])
    for p, n, o in zip(prompts, N_NEW, outs):
        assert o.token_ids == greedy(model, p, n), (len(p), o.token_ids)
    g = eng.runner.graphs
    keys = set(g._graphs)
    assert {b for b, _ in keys} == {1, 2, 4} and {d for _, d in keys} == {True, False}, keys
    assert g.captured == len(keys) == g.capture.captures
    assert g.replays > g.captured and g.eager > 0  # the 5-sequence steps
    assert g.capture.replays == g.replays


def _decode_state(model, n_seqs: int = 3):
    """An engine (no graphs yet) whose n_seqs requests are prefilled; their next decode
    inputs: (ids, positions, pages), with pages for two more tokens each (what the scheduler
    would allocate)."""
    eng = _engine(model)
    eng.runner.graphs = None
    for i, p in enumerate(_prompts()[1:1 + n_seqs]):
        eng.add_request(f"r{i}", p, greedy_params(8))
    eng.step()
    reqs = list(eng.requests.values())
    assert all(not r.in_prefill for r in reqs)
    ids = [r.output_ids[-1] for r in reqs]
    pos = [r.num_tokens - 1 for r in reqs]
    ps = eng.config.page_size
    for r, p in zip(reqs, pos):
        r.pages += eng.allocator.alloc(max(0, (p + 1) // ps + 1 - len(r.pages)))
    return eng, ids, pos, [list(r.pages) for r in reqs]


def _snapshot(eng):
    return [t.clone() for t in eng.pool.tensors()]


def _changed_pages(eng, before) -> set[int]:
    ps = eng.pool.page_size
    out = set()
    for a, b in zip(before, eng.pool.tensors()):
        rows = (a != b).any(-1).nonzero().flatten()
        out |= {int(r) // ps for r in rows}
    return out


def test_replay_matches_eager_and_padding_stays_in_the_scratch_page(model):
    """3 sequences in bucket 4: the real rows' logits match the eager forward, the cache
    changes only in the slots written and in the scratch page; the next step (new tokens and
    positions in the same buffers) replays the same capture and matches eager again."""
    eng, ids, pos, pages = _decode_state(model)
    g = eng.decode_graphs(EagerCapture(), (4,))
    for step in range(2):
        before = _snapshot(eng)
        logits, hn = g.run(ids, pos, pages)
        assert logits.shape[0] == hn.shape[0] == 3
        own = {pages[r][pos[r] // 4] for r in range(3)}
        changed = _changed_pages(eng, before)
        scratch = set(eng.pool.scratch_pages)
        assert changed <= own | scratch, changed
        if step == 0:  # the padded row wrote its key (the same one again later)
            assert changed & scratch
        got = logits.clone()
        ref, _ = eng.runner.main(torch.tensor(ids), torch.tensor(pos),
                                 torch.arange(3, dtype=torch.int32), _table(pages),
                                 max(pos) + 1)
        assert_logits_close(got, ref, what=f"graph step {step} vs eager")
        assert (g.captured, g.replays) == (1, step + 1)
        ids = [int(t) for t in got.argmax(-1)]
        pos = [p + 1 for p in pos]


def _table(pages):
    width = max(len(p) for p in pages)
    t = torch.full((len(pages), width), -1, dtype=torch.int32)
    for r, p in enumerate(pages):
        t[r, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return t


@pytest.mark.parametrize("n_seqs", [1, 3])
def test_padded_rows_do_not_change_real_rows(model, n_seqs):
    """The real rows' outputs do not depend on the padding: garbage (NaN) in the scratch page
    leaves them bit for bit as they were, and bucket 8 (more padded rows) gives what bucket 4
    gives within reordering."""
    eng, ids, pos, pages = _decode_state(model, n_seqs)
    clean = _snapshot(eng)
    g4 = eng.decode_graphs(EagerCapture(), (4,))
    ref = g4.run(ids, pos, pages)[0].clone()
    ps, first = eng.pool.page_size, eng.pool.scratch_pages[0]
    for t, c in zip(eng.pool.tensors(), clean):
        t.copy_(c)
        t[first * ps:] = float("nan")  # the scratch pages are the pool's last
    got = g4.run(ids, pos, pages)[0]
    assert torch.equal(got, ref)
    for t, c in zip(eng.pool.tensors(), clean):
        t.copy_(c)
    g8 = eng.decode_graphs(EagerCapture(), (8,))
    assert_logits_close(g8.run(ids, pos, pages)[0], ref, tol=REORDER_LOGIT_TOL,
                        what="bucket 8 vs bucket 4")


def test_capture_failure_runs_eager_and_is_not_retried(model):
    """A capture that raises (an op that synchronises, say) leaves the step to the eager path,
    once per key: the engine's tokens are unchanged."""
    calls = []

    def failing(fn):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    prompts = _prompts()[:2]
    eng = _engine(model, capture=failing)
    outs = run_all(eng, prompts, greedy_params(6))
    for p, o in zip(prompts, outs):
        assert o.token_ids == greedy(model, p, 6)
    g = eng.runner.graphs
    # 5 decode steps of 2 sequences, on the dense path (ranges 6..8) then the sparse one
    assert g.captured == g.replays == 0 and len(calls) == len(g._failed) == 2
    assert g.eager == 5 and "not permitted" in next(iter(g._failed.values()))


def test_too_many_pages_or_mtp_runs_eager(model):
    """A sequence with more pages than the buffers hold runs eager; so does an engine with MTP
    drafts (their steps are not plain decodes)."""
    eng, ids, pos, pages = _decode_state(model, 2)
    g = eng.decode_graphs(EagerCapture(), (2,))
    g.max_pages = 1
    assert g.run(ids, pos, pages) is None and g.eager == 1 and g.captured == 0
    eng = _engine(model, num_speculative_tokens=1)
    run_all(eng, _prompts()[:2], greedy_params(4))
    assert eng.runner.graphs.captured == eng.runner.graphs.replays == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_on_gpu(model):
    """On a GPU the default engine captures its decode steps (torch.cuda.CUDAGraph) and emits
    the tokens the eager engine emits."""
    m = GLM5ForCausalLM(preset("tiny")).float().eval()
    m.load_state_dict(model.state_dict())
    m = m.cuda()
    prompts = _prompts()
    params = [greedy_params(n) for n in N_NEW]
    cfg = dict(page_size=4, num_pages=64, max_num_batched_tokens=64, chunk_size=32)
    on = LLMEngine(m, EngineConfig(**cfg))
    off = LLMEngine(m, EngineConfig(cuda_graphs=False, **cfg))
    assert on.runner.graphs is not None and off.runner.graphs is None
    got = [o.token_ids for o in run_all(on, prompts, params)]
    want = [o.token_ids for o in run_all(off, prompts, params)]
    assert got == want
    assert on.runner.graphs.captured >= 1 and on.runner.graphs.replays > on.runner.graphs.captured
