"""TVM (llvm) lightning_indexer / fused indexer_topk / paged_indexer_topk kernels against the
references.

One module-scoped backend on a temporary build cache: each kernel variant compiles once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("tvm")

import glm5  # noqa: E402
import glm5.backends.selection  # noqa: E402
import paged_util  # noqa: E402
from glm5.ir.ops_dsa import indexer_topk_ref, lightning_indexer_ref  # noqa: E402
from glm5.kernels.tvm import indexer as ix  # noqa: E402
from glm5.kernels.tvm.build import TVMContext  # noqa: E402
from glm5.testing.cases import GENERATORS, PROFILES, HypothesisDraw  # noqa: E402
from glm5.testing.compare import assert_matches  # noqa: E402
from glm5.testing.parity import format_table, run_parity  # noqa: E402


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return TVMContext(cache_dir=tmp_path_factory.mktemp("tvm_indexer_cache"))


@pytest.fixture(scope="module")
def backend(ctx):
    b = glm5.Backend("cpu_idx_test", vendor="t", device_type="cpu")
    for op, fn, dtypes, supports in ix.kernels(lambda: ctx):
        b.kernel(op, dtypes=dtypes, supports=supports)(fn)
    return b


@pytest.fixture(scope="module")
def fns(backend):
    return backend.kernels["lightning_indexer"].fn, backend.kernels["indexer_topk"].fn


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(ix, "TILE_S", 48)  # a multiple of NS = 16
    monkeypatch.setattr(ix, "TILE_T", 8)


@pytest.fixture(params=["packed", "in place"])
def keys_read(request, monkeypatch):
    """Both key sources: packed once per call (prefill) and read in place (decode), whatever
    the call's shape (DIRECT_MAX_USES patched)."""
    monkeypatch.setattr(ix, "DIRECT_MAX_USES", -1 if request.param == "packed" else 10**9)
    return request.param


def _inputs(T, S, Hi, Di, dtype=torch.float32, seed=0, ints=False):
    g = torch.Generator().manual_seed(seed)
    if ints:  # small integers: every score is exact in fp32, in any summation order
        q = torch.randint(-2, 3, (T, Hi, Di), generator=g).to(dtype)
        k = torch.randint(-2, 3, (S, Di), generator=g).to(dtype)
        w = torch.randint(-2, 3, (T, Hi), generator=g).float()
    else:
        q = torch.randn(T, Hi, Di, generator=g).to(dtype)
        k = torch.randn(S, Di, generator=g).to(dtype)
        w = torch.randn(T, Hi, generator=g) * Hi ** -0.5
    return q, k, w


def _causal(T, S):
    ks = torch.zeros(T, dtype=torch.int32)
    ke = (torch.arange(T) + (S - T) + 1).clamp(0, S).to(torch.int32)
    return ks, ke


def _check_selection(idx, q, k, w, ks, ke, topk):
    """The kit's rule for indexer_topk: the -1 pattern of the reference (valid entries first,
    distinct, in range) and, position by position, the oracle's scores of what was selected
    within the lightning_indexer bound of the oracle's top-k. Returns the reference."""
    assert_matches("indexer_topk", idx, {"q": q, "k": k, "w": w, "k_start": ks, "k_end": ke,
                                         "topk": topk})
    return indexer_topk_ref(q, k, w, ks, ke, topk)


def test_parity(backend, keys_read):
    rows = run_parity(backend, ["lightning_indexer", "indexer_topk"], examples=10, seed=0)
    assert {(r.op, r.dtype) for r in rows} == {
        (op, dt) for op in ("lightning_indexer", "indexer_topk")
        for dt in ("float32", "bfloat16", "float16")}
    assert all(r.status == "pass" and r.examples == 10 for r in rows), format_table(rows)


def test_streams_many_tiles(fns, small_tiles, keys_read):
    """S far beyond the tile (48 keys), top-k spanning tiles, query blocks of 8."""
    _, topk_fn = fns
    T, S, Hi, Di = 21, 700, 4, 16
    q, k, w = _inputs(T, S, Hi, Di, seed=1)
    ks, ke = _causal(T, S)
    ks[3], ke[3] = 100, 500  # a middle range
    ks[5], ke[5] = 7, 7  # empty
    for topk in (1, 50, 130, 690, 800):
        idx = topk_fn(q, k, w, ks, ke, topk)
        ref = _check_selection(idx, q, k, w, ks, ke, topk)
        assert torch.equal(idx, ref)  # random scores: no ties, the order is exact too
        assert bool((idx[5] == -1).all())


def test_scores_match_reference(fns, small_tiles, keys_read):
    li_fn, _ = fns
    T, S, Hi, Di = 19, 333, 5, 8  # Hi = 5: one register block of 4 heads plus a tail head
    q, k, w = _inputs(T, S, Hi, Di, torch.bfloat16, seed=2)
    ks = torch.randint(0, 200, (T,), dtype=torch.int32)
    ke = (ks + torch.randint(0, 200, (T,), dtype=torch.int32)).clamp(max=S)
    out = li_fn(q, k, w, ks, ke)
    ref = lightning_indexer_ref(q.double(), k.double(), w.double(), ks, ke)
    assert out.dtype == torch.float32 and out.shape == (T, S) and out.is_contiguous()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin) and bool(torch.isneginf(out[~fin]).all())
    assert_matches("lightning_indexer", out, {"q": q, "k": k, "w": w, "k_start": ks, "k_end": ke})


def test_exact_ties(fns, small_tiles, keys_read):
    """Many equal scores (integer inputs, duplicated keys, all-zero scores): indices must be
    exactly the reference's, ties to the smaller index, across tile boundaries."""
    _, topk_fn = fns
    T, S, Hi, Di = 10, 300, 2, 4
    q, k, w = _inputs(T, S, Hi, Di, seed=3, ints=True)
    k[150:] = k[:150]  # every key twice
    k[40:60] = 0  # a run of zero scores (+0.0 and -0.0 when w < 0)
    w[0] = -1.0
    ks, ke = _causal(T, S)
    ks[1] = 10
    for topk in (5, 64, 170, 299, 310):
        idx = topk_fn(q, k, w, ks, ke, topk)
        ref = indexer_topk_ref(q, k, w, ks, ke, topk)
        assert torch.equal(idx, ref), topk
    # Every score equal: the selection is the range's first topk indices.
    q1 = torch.ones(3, Hi, Di)
    k1 = torch.ones(S, Di)
    w1 = torch.ones(3, Hi)
    ks1 = torch.tensor([0, 37, 250], dtype=torch.int32)
    ke1 = torch.tensor([S, 290, 251], dtype=torch.int32)
    idx = topk_fn(q1, k1, w1, ks1, ke1, 100)
    assert torch.equal(idx, indexer_topk_ref(q1, k1, w1, ks1, ke1, 100))
    assert idx[1].tolist() == list(range(37, 137))


def test_rows_without_keys_and_small_shapes(fns, keys_read):
    li_fn, topk_fn = fns
    Hi, Di = 4, 16
    # No query has a valid key: all −1 (and all −inf scores).
    q, k, w = _inputs(4, 30, Hi, Di, seed=4)
    ks = torch.tensor([0, 5, 30, 12], dtype=torch.int32)
    idx = topk_fn(q, k, w, ks, ks.clone(), 8)
    assert idx.shape == (4, 8) and bool((idx == -1).all())
    assert bool(torch.isneginf(li_fn(q, k, w, ks, ks.clone())).all())
    # T = 1 (decode), topk > S (a -1 tail), and topk > the range.
    q, k, w = _inputs(1, 9, Hi, Di, seed=5)
    ks, ke = torch.tensor([2], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    idx = topk_fn(q, k, w, ks, ke, 12)
    ref = _check_selection(idx, q, k, w, ks, ke, 12)
    assert torch.equal(idx, ref) and idx[0, 7:].tolist() == [-1] * 5
    # A topk far beyond S: the scratch is sized by min(topk, S), the rest of each row is −1.
    idx = topk_fn(q, k, w, ks, ke, 100_000)
    assert idx.shape == (1, 100_000) and torch.equal(idx[:, :12], ref)
    assert bool((idx[:, 7:] == -1).all())
    # Model-style call: bf16 q/k with fp32 w.
    q, k, w = _inputs(3, 40, Hi, Di, torch.bfloat16, seed=6)
    ks, ke = _causal(3, 40)
    idx = topk_fn(q, k, w, ks, ke, 16)
    _check_selection(idx, q, k, w, ks, ke, 16)


@pytest.mark.parametrize("hb", [4, 8])
def test_register_blocks_of_either_width(backend, monkeypatch, hb, keys_read):
    """Both head blockings (8 on AVX-512 hosts, 4 elsewhere; either runs on any x86 host) with
    full blocks and a tail: Hi = 11 is one or two full blocks plus 3 heads."""
    monkeypatch.setattr(ix, "heads_per_block", lambda: hb)
    li_fn, topk_fn = backend.kernels["lightning_indexer"].fn, backend.kernels["indexer_topk"].fn
    T, S, Hi, Di = 13, 200, 11, 8
    q, k, w = _inputs(T, S, Hi, Di, seed=12)
    ks, ke = _causal(T, S)
    assert_matches("lightning_indexer", li_fn(q, k, w, ks, ke),
                   {"q": q, "k": k, "w": w, "k_start": ks, "k_end": ke})
    qi, ki, wi = _inputs(T, S, Hi, Di, seed=13, ints=True)
    assert torch.equal(topk_fn(qi, ki, wi, ks, ke, 40), indexer_topk_ref(qi, ki, wi, ks, ke, 40))
    _check_selection(topk_fn(q, k, w, ks, ke, 40), q, k, w, ks, ke, 40)


def test_heads_per_block_follows_the_cpu(monkeypatch):
    from glm5 import host_cpu

    monkeypatch.setattr(host_cpu, "_flags", [frozenset({"avx2", "fma", "avx512f"})])
    assert ix.heads_per_block() == 8
    monkeypatch.setattr(host_cpu, "_flags", [frozenset({"avx2", "fma"})])
    assert ix.heads_per_block() == 4
    monkeypatch.setattr(host_cpu, "_flags", [None])  # no /proc/cpuinfo
    assert ix.heads_per_block() == 4 and host_cpu.missing("avx2") == "no /proc/cpuinfo"


def test_decode_reads_keys_in_place_prefill_packs(ctx, monkeypatch):
    """The key source follows the reads per key: a decode call (each key read once or a few
    times) scores k in place, a prefill call packs it; both give the same indices."""
    calls = []
    real = ix._key_source
    monkeypatch.setattr(ix, "_key_source", lambda k, rows, direct: calls.append(direct)
                        or real(k, rows, direct))
    n = ix.DIRECT_MAX_USES
    assert ix.keys_direct(n * 100, 100) and not ix.keys_direct(n * 100 + 1, 100)
    q, k, w = _inputs(40, 300, 4, 16, seed=20)
    for T_, want in ((1, True), (4, True), (40, False)):
        ks, ke = torch.zeros(T_, dtype=torch.int32), torch.full((T_,), 300, dtype=torch.int32)
        calls.clear()
        ix.indexer_topk(lambda: ctx, q[:T_], k, w[:T_], ks, ke, 32)
        assert calls == [want], T_


@pytest.mark.parametrize("Di", [16, 40])
def test_in_place_keys_of_a_strided_view(fns, keys_read, Di):
    """k as a non-contiguous view (every other row of a bigger cache), S not a multiple of the
    16-key chunk: the in-place read goes through a contiguous copy, the packed one gathers.
    Di = 40: two 16 x 16 register transposes and 8 dims one by one."""
    li_fn, topk_fn = fns
    q, k2, w = _inputs(3, 2 * 203, 4, Di, torch.bfloat16, seed=21)
    k = k2[::2]
    ks, ke = torch.tensor([0, 5, 190], dtype=torch.int32), torch.tensor([203, 100, 203],
                                                                         dtype=torch.int32)
    v = {"q": q, "k": k, "w": w, "k_start": ks, "k_end": ke}
    assert_matches("lightning_indexer", li_fn(q, k, w, ks, ke), v)
    _check_selection(topk_fn(q, k, w, ks, ke, 20), q, k, w, ks, ke, 20)


def test_claims_and_declines(backend):
    e = backend.kernels["indexer_topk"]
    assert e.dtypes == frozenset({torch.float32, torch.bfloat16, torch.float16})
    q, k, w = _inputs(2, 5, 2, 4)
    r = torch.zeros(2, dtype=torch.int32)
    assert e.accepts((q, k, w, r, r, 3))
    assert not e.accepts((q.double(), k.double(), w.double(), r, r, 3))
    assert not e.accepts((q, k.bfloat16(), w, r, r, 3))  # mixed q/k dtypes
    assert not e.accepts((q, k, w.double(), r, r, 3))


def test_builds_once(ctx, fns):
    """Symbolic T and S: new lengths reuse the built kernels (one per key source: packed for
    prefill-like calls, in place for decode-like ones)."""
    _, topk_fn = fns
    n = len(ctx.builds)
    for T, S in ((3, 17), (9, 60), (2, 5), (1, 33), (40, 41), (5, 300), (17, 18)):
        q, k, w = _inputs(T, S, 3, 8, seed=T)
        ks, ke = _causal(T, S)
        topk_fn(q, k, w, ks, ke, 4)
    assert len(ctx.builds) - n <= 2  # at most the (Hi=3, Di=8, fp32) packed and in-place


# --------------------------------------------------------------------------- paged_indexer_topk
def _paged_fn(backend):
    return backend.kernels["paged_indexer_topk"].fn


def test_paged_parity(backend, keys_read):
    """The kit's paged cases (shuffled pools, shared prefixes, -1 pages, k_len mid-page and on
    page boundaries) through every tier of the default profile, in each dtype."""
    rows = run_parity(backend, ["paged_indexer_topk"], examples=10, seed=0)
    assert {r.dtype for r in rows} == {"float32", "bfloat16", "float16"}
    assert all(r.status == "pass" and r.examples == 10 for r in rows), format_table(rows)


@given(data=st.data(), integer=st.booleans(), dtype=st.sampled_from(list(ix.DTYPES)))
def test_paged_is_indexer_topk_on_the_sequence_keys_mapped(backend, data, integer, dtype,
                                                           keys_read):
    """Paged == this backend's indexer_topk over each query's logical keys, mapped to pool
    rows, exactly: a TVM score does not depend on where its key sits in the packed buffer, so
    even random inputs select and order identically (integer inputs add exact ties, which must
    go to the smaller logical position)."""
    v = GENERATORS["paged_indexer_topk"](HypothesisDraw(data, PROFILES["smoke"]), dtype)
    if integer:
        v = paged_util.integer_valued(v, data.draw(st.integers(0, 2**16)))
    glm5.get_op("paged_indexer_topk").validate((), v)
    got = _paged_fn(backend)(*paged_util.args(v))
    want = paged_util.unpaged_then_mapped(backend.kernels["indexer_topk"].fn, v)
    assert torch.equal(got, want)
    if integer:
        assert torch.equal(got, glm5.get_op("paged_indexer_topk").reference(
            *paged_util.args(v)))
    assert_matches("paged_indexer_topk", got, v)


def _decode_batch(n_seq, lens, ps, Hi=4, Di=16, seed=0, dtype=torch.float32):
    """One decode query per sequence (interleaved order), a shuffled pool, -1 past each
    sequence's pages."""
    g = torch.Generator().manual_seed(seed)
    P = max(-(-n // ps) for n in lens) + 1
    pages = sum(-(-n // ps) for n in lens) + 2
    perm = torch.randperm(pages, generator=g).tolist()
    table = torch.full((n_seq, P), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for p in range(-(-n // ps)):
            table[b, p] = perm.pop()
    seq = torch.randperm(n_seq, generator=g).to(torch.int32)
    q, k, w = _inputs(n_seq, pages * ps, Hi, Di, dtype, seed)
    q, w = q[: n_seq], w[: n_seq]
    return {"q": q, "k": k, "w": w, "block_table": table, "seq": seq,
            "k_len": torch.tensor(lens, dtype=torch.int32)[seq.long()], "page_size": ps}


@pytest.mark.parametrize("batch_keys", [150, ix.PAGED_BATCH_KEYS])
def test_paged_streams_many_tiles_and_blocks(backend, small_tiles, monkeypatch, batch_keys, keys_read):
    """Tiles of 48 keys, blocks of 8 queries: a prefill chunk of 21 queries of one sequence
    (three blocks of one sequence, causal k_len crossing page and tile boundaries) and, in
    the same call, decode queries of other sequences interleaved with it; sequences packed
    together up to 150 keys (700 | 130 | 64 + 0 + 47: batches of one and of three sequences)
    or all at once."""
    monkeypatch.setattr(ix, "PAGED_BATCH_KEYS", batch_keys)
    ps, T = 16, 21
    lens = [700, 130, 64, 0, 47]
    v = _decode_batch(len(lens), lens, ps, seed=7)
    g = torch.Generator().manual_seed(8)
    qp, _, wp = _inputs(T, 1, 4, 16, seed=9)
    kl = torch.arange(T, dtype=torch.int32) + 700 - T + 1
    at = torch.randint(0, T, (len(lens),), generator=g).sort().values
    order = torch.argsort(torch.cat((torch.arange(T), at)), stable=True)
    v["q"] = torch.cat((qp, v["q"]))[order]
    v["w"] = torch.cat((wp, v["w"]))[order]
    v["seq"] = torch.cat((torch.zeros(T, dtype=torch.int32), v["seq"]))[order]
    v["k_len"] = torch.cat((kl, v["k_len"]))[order]
    fn = _paged_fn(backend)
    for topk in (1, 50, 130, 800):
        v["topk"] = topk
        got = fn(*paged_util.args(v))
        assert torch.equal(got, paged_util.unpaged_then_mapped(
            backend.kernels["indexer_topk"].fn, v)), topk
        assert_matches("paged_indexer_topk", got, v)
        empty = v["seq"] == 3  # the sequence of length 0
        assert bool((got[empty] == -1).all())


def test_paged_strict_served_by_the_cpu_backend(monkeypatch):
    """Under GLM5_STRICT=1 (a reference fallback is an error) glm5.ops.paged_indexer_topk runs
    the cpu kernel natively in every dtype it claims, on a decode batch in interleaved order."""
    monkeypatch.setenv("GLM5_STRICT", "1")
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    glm5.reset_registry()
    op = glm5.get_op("paged_indexer_topk")
    for dtype in ix.DTYPES:
        v = _decode_batch(6, [5, 64, 63, 1, 130, 0], 8, dtype=dtype, seed=3)
        v["topk"] = 32
        assert glm5.backends.selection.kernel_for(op, v) == ("cpu", "native")
        assert_matches(op, glm5.ops.paged_indexer_topk(**v), v)


def test_paged_claims_and_declines(backend):
    e = backend.kernels["paged_indexer_topk"]
    assert e.dtypes == frozenset(ix.DTYPES)
    v = _decode_batch(2, [3, 5], 2)
    a = paged_util.args({**v, "topk": 4})
    assert e.accepts(a)
    assert not e.accepts((a[0].double(), a[1].double(), a[2].double(), *a[3:]))
    assert not e.accepts((a[0], a[1].bfloat16(), *a[2:]))


# --------------------------------------------------------------------------- fp8 pool rows
def test_fp8_rows_dequantize_every_code_exactly(ctx):
    """`fp8_rows.dequantized_rows`: every finite e4m3 code (normal, subnormal, both zeros,
    both signs) times scales 2^-40 .. 2^20, 0 and 3 (products of at most 6 significant bits:
    exact in bf16), gathered through rows in any order and repeated, equals torch's float8 ->
    fp32 conversion times the scale, bit for bit; no rows gives an empty result."""
    from glm5.kernels.tvm.fp8_rows import dequantized_rows

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).repeat(6, 1)
    scale = torch.tensor([1.0, 2.0 ** -40, 2.0 ** 20, 0.0, 2.0 ** -7, 3.0])
    rows = torch.tensor([5, 0, 3, 1, 2, 4, 0, 5], dtype=torch.int64)
    got = dequantized_rows(lambda: ctx, codes, scale, rows)
    want = (codes.float() * scale[:, None])[rows]
    finite = torch.isfinite(want)  # 0x7F / 0xFF are NaN: not made by glm5.ir.fp8
    assert got.dtype == torch.bfloat16 and got.shape == (8, 256)
    assert int((~finite).sum()) == 2 * 8
    assert torch.equal(got.float()[finite], want[finite])
    assert dequantized_rows(lambda: ctx, codes, scale, rows[:0]).shape == (0, 256)


def test_fp8_rows_quantize_as_the_op_defines(ctx):
    """`fp8_rows.e4m3_rows` (the cpu fp8 indexers' quantizer) equals `glm5.ir.fp8.e4m3_rows`
    bit for bit on every grid value, tie and +-1 ulp around it, power-of-two and floored
    scales, fp32 and bf16 input, any leading shape."""
    from fp8_cases import e4m3_stress_rows
    from glm5.ir.fp8 import e4m3_rows as oracle
    from glm5.kernels.tvm.fp8_rows import e4m3_rows

    x = e4m3_stress_rows()
    for xx in (x, x.bfloat16(), x[:60].reshape(3, 20, 128)):
        got = e4m3_rows(lambda: ctx, xx)
        assert got.dtype == torch.bfloat16 and got.shape == xx.shape
        assert torch.equal(got.float(), oracle(xx)), xx.dtype
    with pytest.raises(ValueError, match="argument 'x' expected float32 or bfloat16"):
        e4m3_rows(lambda: ctx, x.half())
