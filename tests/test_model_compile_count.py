"""No compilation per sequence length at the model level: a tiny GLM-5 served by the engine with
every op the Triton kernels serve routed to them (run by the interpreter on CPU tensors), decoding
across lengths that cross multiples of 16 and page boundaries, launches each kernel with one
specialization key (Triton's own, for sm_90: glm5.kernels.triton.compile_check) after its first
decode step. The kernel-level sweep (tests/test_triton_compile_count.py) feeds the launchers
fresh tensors; this one feeds them the views the model and the engine really pass (cache pages,
slices of projections, per-step index tensors), where an odd element offset would flip a
pointer's alignment bit and compile again."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the Triton kernels on CPU tensors (interpreter)")

import glm5  # noqa: E402
from glm5.kernels.triton import compile_check, registry  # noqa: E402


class _Spy:
    """Records the sm_90 specialization key of each launch, then launches the real kernel."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, compile_check.specialization_key(self.kernel, args,
                                                                         kwargs)))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def spied(monkeypatch):
    log: list[tuple[str, str]] = []
    for name, (mod, attr) in compile_check.entry_kernels().items():
        monkeypatch.setattr(mod, attr, _Spy(name, getattr(mod, attr), log))
    b = glm5.Backend("triton_on_cpu", vendor="test", device_type="cpu", priority=10_000)
    table = registry.default_table()
    for op, fn, dtypes, supports in registry.kernels(lambda op: table.get(op, {})):
        b.kernel(op, dtypes=dtypes, supports=supports)(fn)
    glm5.get_registry().register(b)
    with glm5.use_backend("triton_on_cpu"):
        yield log


def test_decode_compiles_each_kernel_once(spied):
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams

    torch.manual_seed(0)
    cfg = preset("tiny").replace(num_nextn_predict_layers=0)
    model = GLM5ForCausalLM(cfg).to(torch.bfloat16).eval()
    eng = LLMEngine(model, EngineConfig(max_num_seqs=2, page_size=16, num_pages=16,
                                        enable_prefix_cache=False, seed=0))
    # two sequences, prompts 13 and 6 tokens: decode lengths 14..34 and 7..18 cross 16 and 32
    # and page boundaries (and the indexer's top-8 selection starts early); "b" finishes first,
    # so the decode batch shrinks from 2 rows to 1 midway
    g = torch.Generator().manual_seed(1)
    for rid, n, new in (("a", 13, 21), ("b", 6, 12)):
        eng.add_request(rid, torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(),
                        SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    per_step: list[dict[str, set[str]]] = []
    while eng.has_unfinished():
        start = len(spied)
        eng.step()
        keys: dict[str, set[str]] = defaultdict(set)
        for name, key in spied[start:]:
            keys[name].add(key)
        per_step.append(keys)
    assert len(per_step) >= 20
    served = set().union(*per_step)
    # the model must really reach the DSA kernels through this backend
    assert {"indexer_topk_kernel", "sparse_attention_kernel"} <= served or \
        {"paged_indexer_topk_kernel", "sparse_attention_kernel"} <= served, served
    seen: dict[str, set[str]] = defaultdict(set)
    for keys in per_step[:2]:  # prefill and the first decode step compile what decode needs
        for name, ks in keys.items():
            seen[name] |= ks
    new = []
    for i, keys in enumerate(per_step[2:], start=2):
        for name, ks in keys.items():
            extra = ks - seen[name]
            if extra:
                new.append((i, name, len(extra)))
            seen[name] |= ks
    assert not new, f"(step, kernel, new variants) compiled after the first decode step: {new}"


def test_forward_compiles_each_kernel_once_across_lengths(spied):
    """The model's own forward (no engine: dense cache, non-paged indexer): the prompt lengths
    10 ... 33 (all above index_topk = 8: the sparse path) launch only the variants the first
    length did (a kernel may have several call sites, e.g. rope on queries and on keys)."""
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    torch.manual_seed(0)
    cfg = preset("tiny").replace(num_nextn_predict_layers=0)
    model = GLM5ForCausalLM(cfg).to(torch.bfloat16).eval()
    first: set[tuple[str, str]] = set()
    new = []
    for L in (9, 10, 16, 17, 31, 33):
        start = len(spied)
        with torch.inference_mode():
            model(torch.randint(0, cfg.vocab_size, (1, L)))
        got = set(spied[start:])
        if not first:
            first = got
        new += [(L, name) for name, _ in sorted(got - first)]
    assert {"indexer_topk_kernel", "sparse_attention_kernel"} <= {n for n, _ in first}, sorted(first)
    assert not new, f"(length, kernel) variants beyond those of length 9: {new}"
