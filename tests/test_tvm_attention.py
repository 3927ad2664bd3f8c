"""TVM (llvm) kernels for sparse_attention / attention: parity against the float64 oracle,
the build cache (load instead of rebuild, no rebuild for a new length), the absorbed-MLA case
where v is a view of k, odd head dims and the head-chunk split for few queries."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tvm")

import glm5  # noqa: E402
from glm5.ir.catalog import get_op  # noqa: E402
from glm5.kernels.tvm import sparse_attention as sa  # noqa: E402
from glm5.kernels.tvm.build import TVMContext  # noqa: E402
from glm5.testing.compare import assert_matches, check_example  # noqa: E402
from tolerances_model import LOGIT_TOL, REORDER_LOGIT_TOL  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tvm_cache")


@pytest.fixture(scope="module")
def ctx(cache_dir):
    return TVMContext(cache_dir=cache_dir)


@pytest.fixture(scope="module")
def fns(ctx):
    return {op: fn for op, fn, _, _ in sa.kernels(lambda: ctx)}


def _backend(ctx):
    b = glm5.Backend("cpu_tvm_test", vendor="t", device_type="cpu")
    for op, fn, dtypes, supports in sa.kernels(lambda: ctx):
        b.kernel(op, dtypes=dtypes, supports=supports)(fn)
    return b


def test_kernel_rows_shape(ctx):
    rows = sa.kernels(lambda: ctx)
    assert [r[0] for r in rows] == ["sparse_attention", "attention"]
    for _, fn, dtypes, supports in rows:
        assert callable(fn) and set(dtypes) == {torch.float32, torch.bfloat16}
        assert callable(supports)


def test_parity(ctx):
    from glm5.testing.parity import format_table, run_parity

    rows = run_parity(_backend(ctx), ["sparse_attention", "attention"], examples=10, seed=0)
    assert {(r.op, r.dtype) for r in rows} == {
        (op, dt) for op in ("sparse_attention", "attention") for dt in ("float32", "bfloat16")}
    assert all(r.status == "pass" and r.examples == 10 for r in rows), format_table(rows)


def _mqa(dtype, T=3, S=40, H=8, Dqk=576, Dv=512, K=100, seed=1):
    """Absorbed MLA at GLM-5's head dims (8 of the 64 heads): v = the first Dv columns of k.
    Dv = 512 is 64 vectors, 21 PV tiles of 3 and a narrower last tile of 1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, Dqk, generator=g).to(dtype)
    k = torch.randn(S, 1, Dqk, generator=g).to(dtype)
    idx = torch.randint(-1, S, (T, K), generator=g, dtype=torch.int32)
    idx[-1] = -1  # a query with no valid key
    return q, k, k[..., :Dv], idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mqa_v_view_of_k(fns, dtype):
    q, k, v, idx = _mqa(dtype)
    assert v.data_ptr() == k.data_ptr() and not v.is_contiguous()
    kv, vv = sa._kv(k, v)
    assert kv.data_ptr() == k.data_ptr() and vv.data_ptr() == k.data_ptr()  # read in place
    scale = q.shape[-1] ** -0.5
    op = get_op("sparse_attention")
    vals = {"q": q, "k": k, "v": v, "idx": idx, "scale": scale}
    verdict = check_example(op, fns["sparse_attention"], vals, dtype)
    assert verdict.ok, verdict.message
    out, lse = fns["sparse_attention"](q, k, v, idx, scale)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert bool(torch.isneginf(lse[-1]).all())
    # the same rows through dense attention over a range
    ks = torch.tensor([0, 5, 7], dtype=torch.int32)
    ke = torch.tensor([40, 5, 30], dtype=torch.int32)  # query 1: an empty range
    verdict = check_example(get_op("attention"), fns["attention"],
                            {"q": q, "k": k, "v": v, "k_start": ks, "k_end": ke,
                             "scale": scale}, dtype)
    assert verdict.ok, verdict.message


def test_mqa_view_of_noncontiguous_k(fns):
    # k with a non-unit inner stride is copied once; v (a prefix view of it) follows the copy.
    base = torch.randn(20, 1, 64)
    k = base[..., ::2]
    v = k[..., :16]
    kv, vv = sa._kv(k, v)
    assert kv.is_contiguous() and vv.data_ptr() == kv.data_ptr()
    q = torch.randn(2, 2, 32)
    idx = torch.randint(0, 20, (2, 7), dtype=torch.int32)
    out, lse = fns["sparse_attention"](q, k, v, idx, 0.2)
    assert_matches("sparse_attention", (out, lse), {"q": q, "k": k, "v": v, "idx": idx,
                                                    "scale": 0.2})


def test_odd_head_dims(fns):
    # Dqk = 6 (2-lane vectors), Dv = 3 (scalar), 3 query heads per KV head (1-head tiles)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 6, 6, generator=g)
    k = torch.randn(19, 2, 6, generator=g)
    v = torch.randn(19, 2, 3, generator=g)
    idx = torch.randint(-1, 19, (4, 70), generator=g, dtype=torch.int32)
    out, lse = fns["sparse_attention"](q, k, v, idx, 0.4)
    assert assert_matches("sparse_attention", (out, lse), {"q": q, "k": k, "v": v, "idx": idx,
                                                    "scale": 0.4}).ok


def test_new_length_does_not_rebuild(ctx, fns):
    H, Hk, Dqk, Dv = 4, 2, 16, 8
    g = torch.Generator().manual_seed(3)
    n_builds = None
    for T, S, K in ((2, 9, 5), (7, 33, 20), (1, 130, 100), (11, 4, 3)):
        q = torch.randn(T, H, Dqk, generator=g)
        k = torch.randn(S, Hk, Dqk, generator=g)
        v = torch.randn(S, Hk, Dv, generator=g)
        idx = torch.randint(-1, S, (T, K), generator=g, dtype=torch.int32)
        out, lse = fns["sparse_attention"](q, k, v, idx, 0.3)
        assert_matches("sparse_attention", (out, lse), {"q": q, "k": k, "v": v, "idx": idx,
                                                        "scale": 0.3})
        ks = torch.randint(0, S + 1, (T,), generator=g, dtype=torch.int32)
        ke = torch.maximum(ks, torch.randint(0, S + 1, (T,), generator=g, dtype=torch.int32))
        out, lse = fns["attention"](q, k, v, ks, ke, 0.3)
        assert_matches("attention", (out, lse), {"q": q, "k": k, "v": v, "k_start": ks,
                                                 "k_end": ke, "scale": 0.3})
        if n_builds is None:
            n_builds = len(ctx.builds)  # the first lengths built (or loaded) the variants
    assert len(ctx.builds) == n_builds


def test_second_context_loads_from_cache(ctx, fns, cache_dir):
    q, k, v, idx = _mqa(torch.float32)
    fns["sparse_attention"](q, k, v, idx, 0.25)  # built (or already built) in ctx
    ctx2 = TVMContext(cache_dir=cache_dir)
    fn2 = dict((op, fn) for op, fn, _, _ in sa.kernels(lambda: ctx2))["sparse_attention"]
    out2, lse2 = fn2(q, k, v, idx, 0.25)
    assert [b["how"] for b in ctx2.builds] == ["loaded"]
    out, lse = fns["sparse_attention"](q, k, v, idx, 0.25)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_head_chunks_when_few_queries(fns, monkeypatch, T):
    # Fewer queries than threads: each query's head tiles are split over work items (3 head
    # tiles here, split 3 / 2 ways, also unevenly); the result must not change.
    monkeypatch.setattr(sa, "threads", lambda: 8)
    H, Hk, Dqk, Dv, S = 12, 3, 16, 8, 50
    assert sa.head_chunks(T, H, Hk, Dqk, Dv) == min(3, -(-8 // T))
    g = torch.Generator().manual_seed(T)
    q = torch.randn(T, H, Dqk, generator=g)
    k = torch.randn(S, Hk, Dqk, generator=g)
    v = torch.randn(S, Hk, Dv, generator=g)
    idx = torch.randint(-1, S, (T, 30), generator=g, dtype=torch.int32)
    out, lse = fns["sparse_attention"](q, k, v, idx, 0.3)
    assert_matches("sparse_attention", (out, lse), {"q": q, "k": k, "v": v, "idx": idx,
                                                    "scale": 0.3})
    ks = torch.zeros(T, dtype=torch.int32)
    ke = torch.full((T,), S, dtype=torch.int32)
    out, lse = fns["attention"](q, k, v, ks, ke, 0.3)
    assert_matches("attention", (out, lse), {"q": q, "k": k, "v": v, "k_start": ks, "k_end": ke,
                                             "scale": 0.3})


def test_block_rows_rule(monkeypatch):
    # Golden cases for the key-block pass rule: small-preset absorbed MLA, fp32 rows of 160
    # (640 B), q [T, 8, 160]: per-query state 8*160*4 + 2*8*128*4 = 13 312 B.
    monkeypatch.setattr(sa, "BLOCK_BYTES", 64_000)  # 100 rows
    monkeypatch.setattr(sa, "MIN_REUSE", 2)
    monkeypatch.setattr(sa, "MIN_GATHER_PER_STATE", 3)
    k = torch.zeros(5000, 1, 160)
    v = k[..., :128]  # a view of k: its bytes are not counted twice

    def idx(T, K, top):
        i = torch.zeros(T, K, dtype=torch.int32)
        i[0, 0] = top  # the largest used row sets S, not k's length
        return i

    def q(T, dtype=torch.float32):
        return torch.zeros(T, 8, 160, dtype=dtype)

    # S = 1000 rows = 640 000 B: 10 blocks of 100, but K = 256 gathers 163 840 B per query =
    # 4.1x three times the state -> at most 4 passes of 250 rows
    assert sa.block_rows(idx(64, 256, 999), q(64), k, v) == (250, 4)
    # K = 128: 81 920 B per query -> 2 passes; K = 64: one pass
    assert sa.block_rows(idx(64, 128, 999), q(64), k, v) == (500, 2)
    assert sa.block_rows(idx(64, 64, 999), q(64), k, v) == (1000, 1)
    # the used rows fit one block: one pass over them
    assert sa.block_rows(idx(64, 256, 99), q(64), k, v) == (100, 1)
    # too little reuse (T*K = 1024 < 2 * 1000 gathers): one pass
    assert sa.block_rows(idx(4, 256, 999), q(4), k, v) == (1000, 1)
    # a separate v adds its row bytes: 1152 B per row -> 18 blocks by size, 294 912 B gathered
    # per query -> at most 7 passes: blocks of 143 rows
    assert sa.block_rows(idx(64, 256, 999), q(64), k, torch.zeros(5000, 1, 128)) == (143, 7)
    # bf16 q and k: 320 B rows, 10 752 B of state -> 81 920 / 32 256 -> 2 passes
    kb = k.bfloat16()
    assert sa.block_rows(idx(64, 256, 999), q(64, torch.bfloat16), kb, kb[..., :128]) == (500, 2)
    # no valid row at all
    assert sa.block_rows(torch.full((3, 4), -1, dtype=torch.int32), q(3), k, v) == (1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_block_passes(fns, monkeypatch, dtype):
    # Force several passes on small shapes: queries whose rows span all blocks, one with all
    # rows in one block, one with none valid, −1 holes everywhere, a short last block.
    monkeypatch.setattr(sa, "MIN_GATHER_PER_STATE", 0)
    monkeypatch.setattr(sa, "MIN_REUSE", 0)
    H, Dqk, Dv, S, K, T = 8, 40, 32, 203, 48, 9
    g = torch.Generator().manual_seed(11)
    q = torch.randn(T, H, Dqk, generator=g).to(dtype)
    k = torch.randn(S, 1, Dqk, generator=g).to(dtype)
    v = k[..., :Dv]
    idx = torch.randint(-1, S, (T, K), generator=g, dtype=torch.int32)
    idx[2] = torch.randint(150, S, (K,), generator=g, dtype=torch.int32)  # last blocks only
    idx[4] = -1  # no valid key
    idx[6, : K // 2] = -1
    single = fns["sparse_attention"](q, k, v, idx, 0.2)
    monkeypatch.setattr(sa, "BLOCK_BYTES", 50 * Dqk * k.element_size())  # 50-row blocks
    bs, nb = sa.block_rows(idx, q, *sa._kv(k, v))
    assert nb == 5 and bs == 41
    vals = {"q": q, "k": k, "v": v, "idx": idx, "scale": 0.2}
    verdict = check_example(get_op("sparse_attention"), fns["sparse_attention"], vals, dtype)
    assert verdict.ok, verdict.message
    out, lse = fns["sparse_attention"](q, k, v, idx, 0.2)
    assert torch.equal(out[4], torch.zeros_like(out[4])) and bool(torch.isneginf(lse[4]).all())
    # the passes only reorder the fp32 sums (not bit for bit): each result is a correct one
    assert_matches("sparse_attention", single, vals, what="one pass")
    assert_matches("sparse_attention", (out, lse), vals, what="five passes")


def test_key_block_passes_with_head_chunks(fns, monkeypatch):
    # Decode-like: fewer queries than threads (head tiles split over work items) and several
    # passes at once.
    monkeypatch.setattr(sa, "threads", lambda: 8)
    monkeypatch.setattr(sa, "MIN_GATHER_PER_STATE", 0)
    monkeypatch.setattr(sa, "MIN_REUSE", 0)
    monkeypatch.setattr(sa, "BLOCK_BYTES", 30 * 3 * 16 * 4)  # 30-row blocks of k
    H, Hk, Dqk, Dv, S, T = 12, 3, 16, 8, 100, 2
    g = torch.Generator().manual_seed(4)
    q = torch.randn(T, H, Dqk, generator=g)
    k = torch.randn(S, Hk, Dqk, generator=g)
    v = torch.randn(S, Hk, Dv, generator=g)
    idx = torch.randint(-1, S, (T, 40), generator=g, dtype=torch.int32)
    idx[0, 0] = S - 1
    assert sa.block_rows(idx, q, k, v)[1] > 1 and sa.head_chunks(T, H, Hk, Dqk, Dv) > 1
    out, lse = fns["sparse_attention"](q, k, v, idx, 0.3)
    assert_matches("sparse_attention", (out, lse), {"q": q, "k": k, "v": v, "idx": idx,
                                                    "scale": 0.3})


def test_model_forward_with_key_block_passes(monkeypatch):
    # The model's sparse prefill on the cpu backend with the passes forced on (tiny shapes never
    # reach BLOCK_BYTES): the passes really run, and the logits equal the one-pass logits and
    # the reference backend's to fp32 rounding.
    from hf_oracle import randomize

    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    cfg = preset("tiny").replace(index_topk=16)
    m = randomize(GLM5ForCausalLM(cfg), seed=0).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    passes = []
    real = sa.block_rows

    def spy(idx, q, k, v):
        r = real(idx, q, k, v)
        passes.append(r[1])
        return r

    monkeypatch.setattr(sa, "block_rows", spy)
    with torch.inference_mode():
        with glm5.use_backend("reference"):
            ref = m(ids)
        with glm5.use_backend("cpu"):
            one = m(ids)
            assert passes and max(passes) == 1
            passes.clear()
            # blocks of 16 absorbed-MLA latent rows (fp32 kv_lora + rope)
            monkeypatch.setattr(sa, "BLOCK_BYTES",
                                16 * 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))
            monkeypatch.setattr(sa, "MIN_REUSE", 0)
            monkeypatch.setattr(sa, "MIN_GATHER_PER_STATE", 0)
            many = m(ids)
    assert passes and min(passes) > 1, passes
    # model-level (tests/tolerances_model.py), absolute at the logit scale: the passes only
    # reorder fp32 sums (REORDER_LOGIT_TOL); the reference backend is another implementation
    scale = float(ref.abs().amax())
    torch.testing.assert_close(many, one, rtol=0, atol=REORDER_LOGIT_TOL * scale)
    torch.testing.assert_close(many, ref, rtol=0, atol=LOGIT_TOL * scale)



@pytest.mark.parametrize("op", ["attention", "sparse_attention"])
def test_nan_key_reaches_exactly_the_queries_that_see_it(fns, op):
    # The kernel's expf clamps its argument with min/max, which drop a NaN: a NaN score came out
    # as a finite (or -inf) output. The reference gives NaN to every query that sees the key and
    # leaves the others alone; so must the kernel.
    g = torch.Generator().manual_seed(3)
    T, S = 4, 9
    q = torch.randn(T, 4, 16, generator=g)
    k = torch.randn(S, 1, 16, generator=g)
    v = torch.randn(S, 1, 8, generator=g)
    k[5, 0, 3] = float("nan")
    if op == "attention":
        args = (q, k, v, torch.zeros(T, dtype=torch.int32),
                torch.tensor([3, 6, 9, 5], dtype=torch.int32), 0.3)
    else:
        idx = torch.tensor([[0, 1, 2, -1], [4, 5, 6, -1], [5, 8, 0, 1], [1, 2, 3, 4]],
                           dtype=torch.int32)
        args = (q, k, v, idx, 0.3)
    out, lse = fns[op](*args)
    sees = torch.tensor([False, True, True, False])
    assert out[sees].isnan().all() and lse[sees].isnan().all()
    assert out[~sees].isfinite().all() and lse[~sees].isfinite().all()
    # and the rows that do not see it are still right (judged on their own inputs)
    rest = [a[~sees] if isinstance(a, torch.Tensor) and a.shape[0] == T and a is not k
            and a is not v else a for a in args]
    names = [p.name for p in get_op(op).params]
    assert_matches(op, (out[~sees], lse[~sees]), dict(zip(names, rest)))
