"""Host reads ("synchronisations") per decode step, counted on CPU (glm5.testing.syncs).

A GPU decode step stalls the host at every read of a device value. The counter sees those
reads as aten ops on any device; value checks (index ranges) are made to behave as on a device
(`checks_as_on_device`), and the ops run the Triton kernel library (through the interpreter
here; on a GPU the real backend), so what is counted is what a GPU step would do: the engine's
one read of the sampled tokens. The value checks themselves stay on for CPU tensors and under
GLM5_STRICT=1, with the errors they always gave.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

import glm5
from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.engine.sampling import SamplingParams
from glm5.ir.catalog import OPS
from glm5.ir.opdef import checks_as_on_device, value_checks
from glm5.testing.syncs import HostReadCounter, count_host_reads

from conftest import accelerators_off_policy

I32 = torch.int32
HERE = os.path.basename(__file__)

# The documented budget (docs/performance.md, "Decode without host round trips"): a decode step
# without MTP drafts or logprobs reads the sampled tokens (with the logits' finiteness flags) in
# one transfer, and nothing else.
DECODE_READS = 1


def decode_read_budget(logprobs: int | None, k: int) -> int:
    """The most host reads a decode step makes (the same table as the docs): the tokens; with
    logprobs one more, with a top-n three more (ids, values, the tie test) and one where top-n
    values tie; with k MTP drafts one per further verified depth and one per drafted depth."""
    reads = DECODE_READS
    if logprobs is not None:
        reads += 1 + (4 if logprobs else 0)
    return reads + 2 * k


# --------------------------------------------------------------------------- the counter
def _read_kinds(fn) -> list[str]:
    with HostReadCounter() as c:
        fn()
    return [r.kind for r in c.reads]


X = torch.arange(6)


@pytest.mark.parametrize("fn,kinds", [
    (lambda: X[2].item(), ["item"]),
    (lambda: int(X[1]), ["item"]),
    (lambda: float(X.sum()), ["item"]),
    (lambda: bool((X > 3).any()), ["item"]),
    (lambda: torch.equal(X, X), ["equal"]),
    (lambda: X.nonzero(), ["shape-from-values"]),
    (lambda: X[X > 2], ["shape-from-values"]),
    (lambda: X.clone().index_put_((X > 2,), torch.tensor(0)), ["shape-from-values"]),
    (lambda: torch.masked_select(X, X > 2), ["shape-from-values"]),
    (lambda: torch.unique(X), ["shape-from-values"]),
    (lambda: torch.repeat_interleave(X, X), ["shape-from-values"]),
    (lambda: torch.bincount(X, minlength=8), ["shape-from-values"]),
    (lambda: X.tolist(), ["tolist"]),
    (lambda: X.numpy(), ["numpy"]),
    # no read: ordinary ops, integer indexing, shapes given by the caller
    (lambda: (X * 2 + 1)[torch.tensor([0, 3])].sum(), []),
    (lambda: torch.repeat_interleave(X, X, output_size=15), []),
    (lambda: torch.zeros(8, dtype=torch.long).scatter_add_(0, X, torch.ones_like(X)), []),
    (lambda: torch.where(X > 2, X, -1).cumsum(0), []),
], ids=["item", "int", "float", "bool-any", "equal", "nonzero", "mask-index", "mask-put",
        "masked_select", "unique", "repeat_interleave", "bincount", "tolist", "numpy",
        "plain-ops", "repeat-with-size", "scatter-add", "where"])
def test_counter_kinds(fn, kinds):
    assert _read_kinds(fn) == kinds


def test_counter_names_the_frame_and_restores_torch():
    orig = torch.Tensor.tolist
    with HostReadCounter() as c:
        X.tolist()
        line = _line_after()
        X[0].item()
    assert c.count == 2
    assert c.reads[1].where.endswith(f"{HERE}:{line + 1} in "
                                     f"test_counter_names_the_frame_and_restores_torch")
    assert f"{HERE}:{line - 1}" in c.reads[0].where
    assert "2 host read(s)" in c.report() and "item (aten._local_scalar_dense" in c.report()
    assert torch.Tensor.tolist is orig  # the wrapper is gone after the block
    with HostReadCounter() as c2:
        pass
    X.tolist()
    assert c2.count == 0


def _line_after() -> int:
    import inspect

    return inspect.currentframe().f_back.f_lineno


# --------------------------------------------------------------------------- the value checks
def _paged(**over):
    q, k, w = torch.randn(4, 2, 4), torch.randn(8, 4), torch.rand(4, 2)
    a = dict(q=q, k=k, w=w, block_table=torch.tensor([[2, 3, -1], [1, -1, -1]], dtype=I32),
             seq=torch.tensor([0, 0, 1, 0], dtype=I32), k_len=torch.tensor([3, 4, 2, 0], dtype=I32),
             page_size=2, topk=4)
    a.update(over)
    return "paged_indexer_topk", a


def _paged_fp8(**over):
    _, a = _paged()
    codes = a.pop("k").to(torch.float8_e4m3fn)
    a = dict(q=a.pop("q"), k=codes, k_scale=torch.ones(8), **a)
    a.update(over)
    return "paged_indexer_topk_fp8", a


def _prolog(slots):
    T, D, Rq, H, Dn, Dr, Rkv, N = 2, 8, 4, 2, 2, 4, 3, 4
    return "mla_prolog", dict(
        x=torch.randn(T, D), w_qa=torch.randn(Rq, D), g_qa=torch.ones(Rq),
        w_qb=torch.randn(H * (Dn + Dr), Rq), w_kva=torch.randn(Rkv + Dr, D),
        g_kva=torch.ones(Rkv), w_uk=torch.randn(H, Dn, Rkv), cos=torch.ones(T, Dr // 2),
        sin=torch.zeros(T, Dr // 2), eps=1e-6, kv_cache=torch.zeros(N, Rkv + Dr),
        slots=torch.tensor(slots, dtype=I32), absorb=True)


def _sparse(idx):
    return "sparse_attention", dict(q=torch.randn(2, 4, 8), k=torch.randn(5, 2, 8),
                                    v=torch.randn(5, 2, 4), idx=torch.tensor(idx, dtype=I32),
                                    scale=1.0)


def _attention(ks, ke):
    return "attention", dict(q=torch.randn(2, 4, 8), k=torch.randn(5, 2, 8),
                             v=torch.randn(5, 2, 4), k_start=torch.tensor(ks, dtype=I32),
                             k_end=torch.tensor(ke, dtype=I32), scale=1.0)


def _experts(ids):
    return "moe_experts", dict(x=torch.randn(2, 4), ids=torch.tensor(ids, dtype=I32),
                               weights=torch.rand(2, 2), w13=torch.randn(3, 6, 4),
                               w2=torch.randn(3, 4, 3))


def _targets(t):
    return "token_logprobs", dict(h=torch.randn(3, 4), w_vocab=torch.randn(10, 4),
                                  targets=torch.tensor(t, dtype=I32), temperature=1.0)


BAD = {
    "sparse-idx": (_sparse([[0, 1, 2], [0, 5, 1]]), "'idx' expected entries in [0, 5) or -1"),
    "attention-range": (_attention([0, 3], [5, 2]), "k_start[1]=3 > k_end[1]=2"),
    "moe-ids": (_experts([[0, 1], [3, 2]]), "'ids' expected entries in [0, 3) or -1"),
    "targets": (_targets([1, -1, 2]), "'targets' expected ids in [0, 10)"),
    "prolog-slots": (_prolog([1, 1]), "expected distinct cache rows"),
    "paged-seq": (_paged(seq=torch.tensor([0, 2, 1, 0], dtype=I32)), "seq[1]=2"),
    "paged-table": (_paged(block_table=torch.tensor([[2, 2, -1], [1, -1, -1]], dtype=I32)),
                    "page 2 twice"),
    "paged-fp8-scale": (_paged_fp8(k_scale=torch.tensor([1.0] * 5 + [-2.0] + [1.0] * 2)),
                        "'k_scale' expected finite entries >= 0, got k_scale[5]=-2.0"),
    "paged-fp8-seq": (_paged_fp8(seq=torch.tensor([0, 2, 1, 0], dtype=I32)), "seq[1]=2"),
}


def _validate(case):
    name, args = case
    return OPS[name].validate((), dict(args))


@pytest.mark.parametrize("key", list(BAD))
def test_value_checks_on_cpu_and_strict_skipped_as_on_device(key, monkeypatch):
    """Bad indices: the clear error on CPU tensors and under GLM5_STRICT=1 even as on a device;
    as on a device without it, validation passes and reads nothing."""
    case, needle = BAD[key]
    monkeypatch.delenv("GLM5_STRICT", raising=False)
    with pytest.raises(glm5.OpInputError) as cpu:
        _validate(case)
    assert str(cpu.value).startswith(f"glm5.{case[0]}: argument ") and needle in str(cpu.value)
    with count_host_reads() as reads:  # as on a device
        _validate(case)
    assert reads.count == 0, reads.report()
    monkeypatch.setenv("GLM5_STRICT", "1")
    with checks_as_on_device(), pytest.raises(glm5.OpInputError) as strict:
        _validate(case)
    assert str(strict.value) == str(cpu.value)


def test_value_checks_switch():
    t = torch.zeros(3, dtype=I32)
    assert value_checks(t) and value_checks(t, None)
    assert not value_checks(t.to("meta"))
    with checks_as_on_device():
        assert not value_checks(t)
    assert value_checks(t)  # restored


# --------------------------------------------------------------------------- a decode step
@pytest.fixture(scope="module")
def model() -> GLM5ForCausalLM:
    """``tiny`` cut to two layers, still one of each kind (dense MLP with the indexer, MoE with
    the shared selection): the interpreter runs a step in well under a second."""
    torch.manual_seed(0)
    cfg = preset("tiny").replace(num_hidden_layers=2, indexer_types=["full", "shared"],
                                 mlp_layer_types=["dense", "sparse"])
    return GLM5ForCausalLM(cfg).float().eval()


@pytest.fixture
def device_kernels(tmp_path, monkeypatch):
    """The name of a backend serving the model's ops as a GPU does: on a GPU the cuda backend
    (None: default selection), else the Triton library on CPU tensors through the interpreter
    (a test backend; glm5's CPU backends are disabled, as they are absent on a GPU)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda", None
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (tests/conftest.py)")
    from glm5.backends import vendor
    from glm5.backends.api import Backend
    from glm5.backends.cuda import TUNING
    from glm5.backends.registry import get_registry

    monkeypatch.setenv("GLM5_PLUGINS", accelerators_off_policy(tmp_path))
    glm5.reset_registry()
    b = Backend("t_device_kernels", vendor="test", device_type="cpu", priority=100,
                settings={"tuning_table": str(TUNING)})
    vendor.register_rows(b, vendor.triton_rows(b))
    get_registry().register(b)
    return "cpu", b.name


def _decoding_engine(model, device: str, backend: str | None, lengths: list[int],
                     logprobs: int | None = None, k: int = 0) -> LLMEngine:
    """An engine whose requests (prompts of ``lengths``, greedy and sampled alternately) are
    past their prefill and first decode step, from now on on ``backend``'s kernels (the two
    steps before ran on the reference's when emulating: the interpreter is slow)."""
    m = model.to(device)
    eng = LLMEngine(m, EngineConfig(page_size=4, num_pages=64, max_num_batched_tokens=64,
                                    chunk_size=32, cuda_graphs=False, num_speculative_tokens=k))
    for i, n in enumerate(lengths):
        eng.add_request(f"r{i}", list(range(3 + 25 * i, 3 + 25 * i + n)),  # no shared prefix
                        SamplingParams(max_tokens=8, temperature=0.0 if i % 2 == 0 else 0.8,
                                       seed=i, ignore_eos=True, logprobs=logprobs))
    eng.backend = "reference" if backend else None
    eng.step()  # prefill: every prompt fits one chunk
    assert all(not r.in_prefill for r in eng.requests.values())
    eng.step()  # the first decode step (not counted)
    eng.backend = backend
    return eng


@pytest.mark.parametrize("lengths", [[3], [9, 12, 5, 17]], ids=["batch1-dense", "batch4-sparse"])
def test_decode_step_reads_only_the_sampled_tokens(model, device_kernels, lengths):
    """A decode step (batch 1 within index_topk: dense attention; batch 4 past it: the paged
    indexer) makes DECODE_READS host reads, and the tokens it reads are the ones it emits."""
    device, backend = device_kernels
    eng = _decoding_engine(model, device, backend, lengths)
    context = max(r.num_tokens for r in eng.requests.values())
    assert (context > model.config.index_topk) == (len(lengths) > 1)  # the path named
    with count_host_reads() as reads:
        outs = eng.step()
    assert reads.count == DECODE_READS, reads.report()
    assert reads.reads[0].where.split(" in ")[-1] == "_sample"
    assert sorted(o.request_id for o in outs) == [f"r{i}" for i in range(len(lengths))]
    assert all(len(o.new_token_ids) == 1 for o in outs)


def test_decode_step_reads_with_the_fp8_index_cache(model, device_kernels):
    """With dsa_indexer_dtype='fp8' (the fp8 key pool, paged_indexer_topk_fp8's kernel: q
    quantized on the device) a sparse decode step still reads only the sampled tokens."""
    device, backend = device_kernels
    m8 = GLM5ForCausalLM(model.config.replace(dsa_indexer_dtype="fp8")).float().eval()
    m8.load_state_dict(model.state_dict())
    eng = _decoding_engine(m8, device, backend, [9, 12, 5, 17])
    assert max(r.num_tokens for r in eng.requests.values()) > m8.config.index_topk
    calls = []
    real = glm5.ops.paged_indexer_topk_fp8
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(glm5.ops, "paged_indexer_topk_fp8", lambda *a: calls.append(1) or real(*a))
        with count_host_reads() as reads:
            outs = eng.step()
    assert calls and reads.count == DECODE_READS, reads.report()
    assert len(outs) == 4


@pytest.mark.parametrize("logprobs,k", [(0, 0), (3, 0), (None, 1)],
                         ids=["logprobs", "top3-logprobs", "mtp1"])
def test_decode_step_reads_with_logprobs_and_mtp(model, device_kernels, logprobs, k):
    """Logprobs and MTP drafts add the documented reads, no more (batch 2, sparse path)."""
    device, backend = device_kernels
    eng = _decoding_engine(model, device, backend, [9, 12], logprobs, k)
    with count_host_reads() as reads:
        outs = eng.step()
    assert DECODE_READS < reads.count <= decode_read_budget(logprobs, k), reads.report()
    assert len(outs) == 2
    if logprobs is not None:
        assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in outs)


def test_planted_reads_are_counted(model, device_kernels, monkeypatch):
    """The counter sees a read planted in the model's forward and one in the engine's step,
    and names where each was made."""
    device, backend = device_kernels
    eng = _decoding_engine(model, device, backend, [9, 12])
    real_fwd = type(eng.model).hidden_states_paged

    def planted_forward(self, input_ids, *a, **k):
        input_ids.max().item()  # planted
        return real_fwd(self, input_ids, *a, **k)

    real_commit = LLMEngine._commit

    def planted_commit(self, items, new_tokens, fails, drafts, logits, owner):
        bool(torch.isfinite(logits).all())  # planted
        return real_commit(self, items, new_tokens, fails, drafts, logits, owner)

    monkeypatch.setattr(eng.model, "hidden_states_paged",
                        types.MethodType(planted_forward, eng.model))
    monkeypatch.setattr(eng, "_commit", types.MethodType(planted_commit, eng))
    with count_host_reads() as reads:
        eng.step()
    assert reads.count == DECODE_READS + 2, reads.report()
    where = sorted(r.where.split(" in ")[-1] for r in reads.reads)
    assert where == ["_sample", "planted_commit", "planted_forward"], reads.report()


def test_sampler_value_checks(monkeypatch):
    """`sample` refuses a NaN row on CPU tensors and under GLM5_STRICT=1; as on a device it
    reads nothing and still returns ids in range (the engine fails such rows itself)."""
    from glm5.engine.sampling import make_generator, sample

    logits = torch.randn(3, 6)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=0.7)] * 3

    def gens():
        return [make_generator(i) for i in range(3)]

    with pytest.raises(ValueError, match=r"glm5 sample: argument 'logits' .* rows \[1\]"):
        sample(logits, params, gens())
    with count_host_reads() as reads:
        tokens = sample(logits, params, gens()).tokens
    assert reads.count == 0, reads.report()
    assert tokens.min() >= 0 and tokens.max() < 6, tokens
    monkeypatch.setenv("GLM5_STRICT", "1")
    with checks_as_on_device(), pytest.raises(ValueError, match=r"rows \[1\]"):
        sample(logits, params, gens())
