"""Ascend vendor-op bindings (glm5/backends/ascend/npu_ops.py) run against the CPU contract
emulators (glm5/backends/ascend/contract.py), judged against the float64 oracles by the kit
(glm5.testing.compare: each op's error model); the emulators' own contract checks (they reject
what the documented torch_npu ops reject) and semantics (an emulator call that computes a glm5
op is judged as that op; an intermediate by the bound of the closest op's error model,
tests/kit_bounds.py, or exactly where an exact identity holds); and the bindings' ``supports``
predicates (they decline what the ops cannot express). No tolerance lives here."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from glm5.backends.ascend import contract, npu_ops
from glm5.ir.catalog import OPS
from glm5.ir.quant_formats import quantize_weight
from glm5.testing.cases import GENERATORS, PROFILES, HypothesisDraw, Maker
from glm5.testing.compare import Verdict, assert_matches, check_example, judge
from kit_bounds import output_bound

I32 = torch.int32
ROWS = {r[0]: r for r in npu_ops.vendor_kernels(lambda: contract)}
BINDING_OPS = ("indexer_topk", "sparse_attention", "mla_prolog", "quant_linear", "moe_experts",
               "moe_route")


def _args(op: str, values: dict) -> tuple:
    return tuple(values[n] for n in OPS[op].param_names)


def _judge(op: str, values: dict, dtype: torch.dtype) -> Verdict:
    """Validate the case, require the binding to accept it, run binding + emulator; the
    kit's verdict against the float64 reference (the caller asserts it)."""
    values, _ = OPS[op].validate((), values)
    _, fn, dtypes, supports = ROWS[op]
    assert dtype in dtypes
    assert supports(*_args(op, values)), f"{op}: supports() declined an expressible case"
    return check_example(OPS[op], fn, values, dtype)


def _within(got: torch.Tensor, oracle: torch.Tensor, bound: torch.Tensor) -> bool:
    """|got - oracle| <= bound elementwise (oracle and bound from kit_bounds.output_bound)."""
    return bool(((got.double() - oracle).abs() <= bound).all())


def _route_vals(logits, bias, top_k, n_group, topk_group, norm, scaling) -> dict:
    return {"logits": logits, "bias": bias, "top_k": top_k, "n_group": n_group,
            "topk_group": topk_group, "norm_topk_prob": norm, "routed_scaling": scaling}


# =========================================================================== structure
def test_no_torch_npu_import_anywhere():
    root = Path(npu_ops.__file__).parent
    for name in ("npu_ops.py", "contract.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            assert not any(m.split(".")[0] == "torch_npu" for m in mods), (name, mods)


def test_vendor_kernels_rows_resolve_npu_lazily():
    calls = []

    def npu():
        calls.append(1)
        return contract

    rows = npu_ops.vendor_kernels(npu)
    assert [r[0] for r in rows] == list(BINDING_OPS)
    assert not calls  # resolved at kernel-call time, not at registration
    for op, fn, dtypes, supports in rows:
        assert op in OPS and callable(fn) and callable(supports)
        assert dtypes and all(isinstance(d, torch.dtype) for d in dtypes)
    by_op = {r[0]: r for r in rows}
    by_op["moe_route"][1](torch.randn(2, 8), torch.zeros(8), 2, 1, 1, True, 1.0)
    assert calls


def test_contract_exposes_the_vendor_names_the_bindings_call():
    src = Path(npu_ops.__file__).read_text()
    called = set(re.findall(r"npu\(\)\.(\w+)", src))
    assert called == {"npu_lightning_indexer", "npu_sparse_flash_attention", "npu_mla_prolog_v3",
                      "npu_quant_matmul", "npu_weight_quant_batchmatmul", "npu_dynamic_quant",
                      "npu_grouped_matmul", "npu_swiglu", "npu_moe_gating_top_k"}
    for name in called:
        assert name in contract.__all__ and callable(getattr(contract, name))


# =========================================================================== indexer_topk
def _indexer_case(d: HypothesisDraw, dtype: torch.dtype) -> dict:
    m = Maker(d, dtype)
    Hi = d.int(1, 4)
    mode = d.choice(("prefill_batch", "random", "decode", "ties"))
    if mode == "prefill_batch":  # packed causal sequences, unaligned starts, leading empty rows
        ks, ke, S = [], [], 0
        for _ in range(d.int(1, 3)):
            n_q, prefix = d.int(1, 4), d.int(0, 150)
            n_k = prefix + n_q - d.int(0, 1)  # -1: the first query sees no key
            ks += [S] * n_q
            ke += [S + max(0, n_k - n_q + i + 1) for i in range(n_q)]
            S += max(n_k, 1)
        T = len(ks)
    else:
        T, S = d.int(1, 6), d.int(1, 300)
        if mode == "decode":
            ks = [0] * T
            ke = [d.int(0, S) for _ in range(T)]
        else:
            a = [d.int(0, S) for _ in range(T)]
            b = [d.int(0, S) for _ in range(T)]
            ks, ke = [min(x, y) for x, y in zip(a, b)], [max(x, y) for x, y in zip(a, b)]
    q = m.randn(T, Hi, 128)
    k = m.randn(S, 128)
    w = m.randn(T, Hi, scale=Hi ** -0.5)
    if mode == "ties":  # small integers: exact scores with many ties, decided by index
        q, k = m.randint(-1, 2, T, Hi, 128).to(dtype), m.randint(-1, 2, S, 128).to(dtype)
        w = m.randint(1, 3, T, Hi).to(dtype)
    return {"q": q, "k": k, "w": w, "k_start": torch.tensor(ks, dtype=I32),
            "k_end": torch.tensor(ke, dtype=I32), "topk": d.int(1, min(S + 2, 2048))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@given(data=st.data())
def test_indexer_topk_binding_matches_reference(dtype, data):
    v = _judge("indexer_topk", _indexer_case(HypothesisDraw(data), dtype), dtype)
    assert v.ok, v.message


def test_indexer_topk_exact_ties_to_smaller_index():
    g = torch.Generator().manual_seed(0)
    T, S, Hi = 5, 200, 2
    q = torch.randint(-1, 2, (T, Hi, 128), generator=g).to(torch.bfloat16)
    k = torch.randint(-1, 2, (S, 128), generator=g).to(torch.bfloat16)
    w = torch.randint(1, 3, (T, Hi), generator=g).to(torch.bfloat16)
    ks = torch.tensor([0, 3, 10, 131, 20], dtype=I32)
    ke = torch.tensor([200, 64, 10, 200, 23], dtype=I32)  # an empty row, a 3-key row
    fn = ROWS["indexer_topk"][1]
    got = fn(q, k, w, ks, ke, 40)
    want = OPS["indexer_topk"].reference(q.double(), k.double(), w.double(), ks, ke, 40)
    assert got.dtype == I32 and torch.equal(got, want)


def test_indexer_segments_reproduce_every_range():
    # rightDownCausal over the inferred batches must give back each query's [k_start, k_end).
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        T, S = int(torch.randint(1, 12, (1,), generator=g)), 40
        a = torch.randint(0, S + 1, (T,), generator=g)
        b = torch.randint(0, S + 1, (T,), generator=g)
        ks, ke = torch.minimum(a, b).tolist(), torch.maximum(a, b).tolist()
        if T > 3:  # splice in a causal run
            ks[1:4] = [5, 5, 5]
            ke[1:4] = [9, 10, 11]
        segs = npu_ops._indexer_segments(ks, ke)
        assert segs[0][0] == 0 and segs[-1][1] == T
        for (t0, t1, start, n_k) in segs:
            for i, t in enumerate(range(t0, t1)):
                lim = contract._causal_limit(3, t1 - t0, n_k, i)
                assert (start, start + lim) == (ks[t], ke[t])
    assert npu_ops._indexer_segments([0, 0, 0, 7], [0, 1, 2, 9]) == [(0, 3, 0, 2), (3, 4, 7, 2)]


def test_indexer_aligned_starts_page_without_copy():
    k = torch.randn(256, 128)
    segs = [(0, 1, 0, 200), (1, 2, 128, 100)]
    cache, table = npu_ops._page_keys(k, segs, 128)
    assert cache.data_ptr() == k.data_ptr() and cache.shape == (2, 128, 1, 128)
    assert table.tolist() == [[0, 1], [1, 0]]
    cache, table = npu_ops._page_keys(k, [(0, 1, 5, 130)], 128)  # unaligned: gathered blocks
    assert table.tolist() == [[2, 3]] and torch.equal(cache.reshape(-1, 128)[256:386], k[5:135])


def test_indexer_topk_supports_declines():
    sup = npu_ops.indexer_topk_supports
    ks, ke = torch.zeros(2, dtype=I32), torch.ones(2, dtype=I32)

    def case(Hi=4, Di=128, dt=torch.bfloat16, topk=8):
        return (torch.zeros(2, Hi, Di, dtype=dt), torch.zeros(5, Di, dtype=dt),
                torch.zeros(2, Hi, dtype=dt), ks, ke, topk)

    assert sup(*case())
    assert not sup(*case(Di=64))  # D must be 128
    assert not sup(*case(Hi=65))  # N1 <= 64
    assert not sup(*case(dt=torch.float32))  # fp16 / bf16 only
    assert not sup(*case(topk=2049)) and sup(*case(topk=4096))


# --------------------------------------------------------------------------- emulator: LI
def _li_inputs(T=4, N1=2, S=40, bs=16, dt=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, N1, 128, generator=g).to(dt)
    nb = math.ceil(S / bs)
    key = torch.randn(nb, bs, 1, 128, generator=g).to(dt)
    w = torch.randn(T, N1, generator=g).to(dt)
    kw = dict(actual_seq_lengths_query=torch.tensor([T], dtype=I32),
              actual_seq_lengths_key=torch.tensor([S], dtype=I32),
              block_table=torch.arange(nb, dtype=I32)[None], layout_query="TND",
              layout_key="PA_BSND", sparse_count=8, sparse_mode=3)
    return q, key, w, kw


def test_emulator_li_right_down_causal_and_padding():
    q, key, w, kw = _li_inputs(T=4, S=40)
    idx, vals = contract.npu_lightning_indexer(q, key, w, **kw)
    assert idx.shape == (4, 1, 8) and idx.dtype == I32 and vals.numel() == 0
    flat = key.reshape(-1, 128)[:40].float()
    for i in range(4):
        lim = 40 - 4 + i + 1  # rightDownCausal: keys j <= S2 - S1 + i
        s = (torch.relu(torch.einsum("hd,sd->hs", q[i].float(), flat[:lim])) *
             w[i].float()[:, None]).sum(0)
        assert torch.equal(idx[i, 0], torch.sort(s, descending=True, stable=True).indices[:8]
                           .to(I32))
    kw["actual_seq_lengths_key"] = torch.tensor([5], dtype=I32)  # fewer keys than sparse_count
    idx, _ = contract.npu_lightning_indexer(q, key, w, **kw)
    assert (idx[0, 0, :2] >= 0).all() and (idx[0, 0, 2:] == -1).all()  # valid first, -1 tail
    kw["sparse_mode"] = 0
    idx, _ = contract.npu_lightning_indexer(q, key, w, **kw)
    assert ((idx >= 0).sum(-1) == 5).all()


@pytest.mark.parametrize("change, match", [
    (dict(layout_query="BNSD"), "layout_query"),
    (dict(layout_key="PA_TND"), "layout_key"),
    (dict(sparse_count=2049), "sparse_count"),
    (dict(sparse_mode=1), "sparse_mode"),
    (dict(actual_seq_lengths_query=None), "actual_seq_lengths_query"),
    (dict(actual_seq_lengths_key=torch.tensor([49], dtype=I32)), "block_table"),
    (dict(block_table=torch.zeros(1, 1, dtype=I32)), "block_table"),
    (dict(return_value=True), "return_value"),
    (dict(next_tokens=0), "pre_tokens"),
])
def test_emulator_li_rejects_contract_violations(change, match):
    q, key, w, kw = _li_inputs(S=40)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        contract.npu_lightning_indexer(q, key, w, **kw)


def test_emulator_li_rejects_bad_shapes_and_dtypes():
    q, key, w, kw = _li_inputs(N1=65)
    with pytest.raises(ValueError, match="N1 <= 64"):
        contract.npu_lightning_indexer(q, key, w, **kw)
    q, key, w, kw = _li_inputs()
    with pytest.raises(ValueError, match="multiple of 16"):
        contract.npu_lightning_indexer(q, torch.zeros(3, 20, 1, 128, dtype=q.dtype), w, **kw)
    with pytest.raises(ValueError, match="D = 128"):
        contract.npu_lightning_indexer(q[..., :64].contiguous(), key[..., :64].contiguous(),
                                       w, **kw)
    with pytest.raises(ValueError, match="dtype"):
        contract.npu_lightning_indexer(q.float(), key.float(), w, **kw)
    kw["actual_seq_lengths_query"] = torch.tensor([3, 2], dtype=I32)  # prefix sums decrease
    with pytest.raises(ValueError, match="prefix sum"):
        contract.npu_lightning_indexer(q, key, w, **kw)


# =========================================================================== sparse_attention
def _sfa_case(d: HypothesisDraw, dtype: torch.dtype) -> dict:
    m = Maker(d, dtype)
    T, H, S = d.int(1, 4), d.choice((1, 2, 4)), d.int(1, 20)
    K = d.int(1, S + 2)
    mag = d.choice((0.1, 1.0, 3.0))
    q = m.randn(T, H, 576, scale=mag)
    k = m.randn(S, 1, 576, scale=mag, noncontig=False)
    rows = []
    for _ in range(T):
        r = torch.full((K,), -1, dtype=torch.int64)
        n = min(K, S)
        r[:n] = m.perm(S)[:n]
        if d.flag():  # -1 anywhere, valid entries not first
            r = torch.where(m.randint(0, 3, K) == 0, torch.full_like(r, -1), r)[m.perm(K)]
        rows.append(r)
    idx = torch.stack(rows).to(I32)
    if d.flag():
        idx[d.int(0, T - 1)] = -1  # a query with no valid key
    return {"q": q, "k": k, "v": k[..., :512], "idx": idx, "scale": 576 ** -0.5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@given(data=st.data())
def test_sparse_attention_binding_matches_reference(dtype, data):
    v = _judge("sparse_attention", _sfa_case(HypothesisDraw(data), dtype), dtype)
    assert v.ok, v.message


def test_sparse_attention_empty_row_and_holes():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, 576, generator=g).to(torch.bfloat16)
    k = torch.randn(12, 1, 576, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[-1, 3, -1, 7], [-1, -1, -1, -1], [0, 11, 5, -1]], dtype=I32)
    out, lse = ROWS["sparse_attention"][1](q, k, k[..., :512], idx, 0.05)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    assert_matches("sparse_attention", (out, lse),
                   {"q": q, "k": k, "v": k[..., :512], "idx": idx, "scale": 0.05},
                   dtype=torch.bfloat16)


def test_sparse_attention_supports_declines():
    sup = npu_ops.sparse_attention_supports
    k = torch.zeros(6, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 3, dtype=I32)
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    assert sup(q, k, k[..., :512], idx, 1.0)
    assert sup(q, k, k[..., :512].clone(), idx, 1.0)  # equal values after a copy
    assert not sup(q, k, torch.ones(6, 1, 512, dtype=torch.bfloat16), idx, 1.0)  # not k's prefix
    assert not sup(torch.zeros(2, 3, 576, dtype=torch.bfloat16), k, k[..., :512], idx, 1.0)
    k2 = torch.zeros(6, 2, 576, dtype=torch.bfloat16)
    assert not sup(q, k2, k2[..., :512], idx, 1.0)  # Hk = 2
    k3 = torch.zeros(6, 1, 192, dtype=torch.bfloat16)
    assert not sup(torch.zeros(2, 4, 192, dtype=torch.bfloat16), k3, k3[..., :128], idx, 1.0)
    assert not sup(q.float(), k.float(), k.float()[..., :512], idx, 1.0)


# --------------------------------------------------------------------------- emulator: SFA
def _sfa_inputs(layout_kv="PA_BSND", T=3, N1=2, S=40, bs=16):
    g = torch.Generator().manual_seed(5)
    dt = torch.bfloat16
    q = torch.randn(T, N1, 512, generator=g).to(dt)
    qr = torch.randn(T, N1, 64, generator=g).to(dt)
    nb = math.ceil(S / bs)
    if layout_kv == "PA_BSND":
        key = torch.randn(nb, bs, 1, 512, generator=g).to(dt)
        kr = torch.randn(nb, bs, 1, 64, generator=g).to(dt)
        extra = dict(block_table=torch.arange(nb, dtype=I32)[None],
                     actual_seq_lengths_kv=torch.tensor([S], dtype=I32))
    else:
        key = torch.randn(S, 1, 512, generator=g).to(dt)
        kr = torch.randn(S, 1, 64, generator=g).to(dt)
        extra = dict(actual_seq_lengths_kv=torch.tensor([S], dtype=I32))
    si = torch.tensor([[[5, 0, 39, -1]], [[1, 2, -1, -1]], [[38, 39, 7, 8]]], dtype=I32)
    kw = dict(actual_seq_lengths_query=torch.tensor([T], dtype=I32), query_rope=qr,
              key_rope=kr, sparse_block_size=1, layout_query="TND", layout_kv=layout_kv,
              sparse_mode=3, attention_mode=2, **extra)
    return q, key, si, kw


def _sfa_as_sparse_attention(q, key, kw, idx) -> dict:
    """glm5 sparse_attention's arguments equivalent to an emulator call on a TND key: query |
    query_rope and key | key_rope joined, v the latent prefix of k, ``idx`` the keys each query
    attends once the emulator's causal rule is applied."""
    qc = torch.cat((q, kw["query_rope"]), -1)
    kc = torch.cat((key, kw["key_rope"]), -1)
    return {"q": qc, "k": kc, "v": kc[..., :512], "idx": torch.as_tensor(idx, dtype=I32),
            "scale": 0.05}


def _max_scores(vals: dict) -> torch.Tensor:
    """float64 [T, H]: the largest scaled score over each query's valid keys."""
    idx = vals["idx"]
    kg = vals["k"].double()[idx.long().clamp(min=0), 0]  # [T, K, Dqk]
    s = torch.einsum("thd,tkd->thk", vals["q"].double(), kg) * vals["scale"]
    return s.masked_fill((idx < 0)[:, None, :], float("-inf")).amax(-1)


def test_emulator_sfa_semantics_causal_and_lse():
    q, key, si, kw = _sfa_inputs("TND")
    kw["return_softmax_lse"] = True
    out, smax, ssum = contract.npu_sparse_flash_attention(q, key, key, si, 0.05, **kw)
    assert out.shape == (3, 2, 512) and smax.shape == ssum.shape == (1, 3, 2)
    # rightDownCausal, 3 queries over 40 keys: query i sees j <= 37 + i, so query 0 drops index
    # 39 and the call is glm5's sparse_attention over the keys left; out and
    # lse = softmax_max + log(softmax_sum) are that op's outputs, judged by the kit.
    vals = _sfa_as_sparse_attention(q, key, kw, [[5, 0, -1, -1], [1, 2, -1, -1],
                                                 [38, 39, 7, 8]])
    assert_matches("sparse_attention", (out, smax[0] + ssum[0].log()), vals,
                   dtype=torch.bfloat16)
    # softmax_max is the largest scaled score. sparse_attention's lse bound holds the fp32 score
    # error of the largest-magnitude score (acc sqrt(Dqk) m, plus the sum over K and the log),
    # so it bounds the error of any one score, the maximum included.
    _, b = output_bound("sparse_attention", vals, "lse", torch.bfloat16)
    assert _within(smax[0], _max_scores(vals), b)
    kw["sparse_mode"] = 0  # no causal rule: index 39 counts
    out0, smax0, ssum0 = contract.npu_sparse_flash_attention(q, key, key, si, 0.05, **kw)
    vals0 = _sfa_as_sparse_attention(q, key, kw, si[:, 0])
    assert_matches("sparse_attention", (out0, smax0[0] + ssum0[0].log()), vals0,
                   dtype=torch.bfloat16)
    _, b0 = output_bound("sparse_attention", vals0, "lse", torch.bfloat16)
    assert _within(smax0[0], _max_scores(vals0), b0)


@pytest.mark.parametrize("change, match", [
    (dict(attention_mode=0), "attention_mode"),
    (dict(layout_query="BNSD"), "layout_query"),
    (dict(layout_kv="BSND"), "layout_kv"),  # BSND key needs a BSND query
    (dict(return_softmax_lse=True), "return_softmax_lse"),  # not with PA_BSND
    (dict(sparse_block_size=3), "sparse_block_size"),
    (dict(sparse_mode=2), "sparse_mode"),
    (dict(query_rope=None), "query_rope"),
])
def test_emulator_sfa_rejects_contract_violations(change, match):
    q, key, si, kw = _sfa_inputs()
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        contract.npu_sparse_flash_attention(q, key, key, si, 0.05, **kw)


def test_emulator_sfa_rejects_bad_indices_heads_and_blocks():
    q, key, si, kw = _sfa_inputs()
    bad = si.clone()
    bad[0, 0] = torch.tensor([-1, 3, 4, 5], dtype=I32)  # -1 before valid entries
    with pytest.raises(ValueError, match="valid entries first"):
        contract.npu_sparse_flash_attention(q, key, key, bad, 0.05, **kw)
    bad[0, 0] = torch.tensor([40, 3, 4, 5], dtype=I32)  # beyond the kv length
    with pytest.raises(ValueError, match=r"entries in \[0, 40\)"):
        contract.npu_sparse_flash_attention(q, key, key, bad, 0.05, **kw)
    with pytest.raises(ValueError, match="value"):
        contract.npu_sparse_flash_attention(q, key, key.clone(), si, 0.05, **kw)
    q3 = torch.zeros(3, 3, 512, dtype=torch.bfloat16)
    kw3 = dict(kw, query_rope=torch.zeros(3, 3, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="N1 in"):
        contract.npu_sparse_flash_attention(q3, key, key, si, 0.05, **kw3)
    q, key, si, kw = _sfa_inputs(bs=16)
    key20 = torch.zeros(3, 20, 1, 512, dtype=torch.bfloat16)
    kw["key_rope"] = torch.zeros(3, 20, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        contract.npu_sparse_flash_attention(q, key20, key20, si, 0.05, **kw)


# =========================================================================== mla_prolog
def _prolog_case(seed: int, T: int, H: int, dtype=torch.bfloat16, D=7168, Rq=1536, Dn=128):
    g = torch.Generator().manual_seed(seed)
    Dr, Rkv = 64, 512
    th = torch.rand(T, Dr // 2, generator=g, dtype=torch.float64) * 2 * math.pi
    N = T + 3
    slots = torch.randperm(N, generator=g)[:T].to(I32)
    slots[0] = -1
    return {
        "x": torch.randn(T, D, generator=g).to(dtype),
        "w_qa": (torch.randn(Rq, D, generator=g) * D ** -0.5).to(dtype),
        "g_qa": (1 + 0.1 * torch.randn(Rq, generator=g)).to(dtype),
        "w_qb": (torch.randn(H * (Dn + Dr), Rq, generator=g) * Rq ** -0.5).to(dtype),
        "w_kva": (torch.randn(Rkv + Dr, D, generator=g) * D ** -0.5).to(dtype),
        "g_kva": (1 + 0.1 * torch.randn(Rkv, generator=g)).to(dtype),
        "w_uk": (torch.randn(H, Dn, Rkv, generator=g) * Dn ** -0.5).to(dtype),
        "cos": th.cos().to(dtype), "sin": th.sin().to(dtype), "eps": 1e-5,
        "kv_cache": torch.randn(N, Rkv + Dr, generator=g).to(dtype), "slots": slots,
        "absorb": True,
    }


@pytest.mark.parametrize("seed, T, H", [(0, 1, 1), (1, 3, 2)])
def test_mla_prolog_binding_matches_reference(seed, T, H):
    # DeepSeek-V3 sizes: the only shapes the torch_npu page documents for the prolog.
    v = _judge("mla_prolog", _prolog_case(seed, T, H), torch.bfloat16)
    assert v.ok, v.message


def _rope_check(values: dict, q_pe: torch.Tensor, c_q: torch.Tensor) -> bool:
    """q_pe must be glm5's interleaved rope of the rope part of (c_q @ w_qb^T) rounded to bf16
    (the prolog rounds each matmul output to bf16): within the rope op's bound (bf16) for that
    input."""
    H = values["w_uk"].shape[0]
    q = (c_q.float() @ values["w_qb"].float().T).to(torch.bfloat16)
    pe = q.reshape(q.shape[0], H, -1)[..., 128:]
    want, b = output_bound("rope", {"x": pe, "cos": values["cos"], "sin": values["sin"],
                                    "interleaved": True}, "y", torch.bfloat16)
    return _within(q_pe, want, b)


def test_mla_prolog_rope_layout_and_cache_rows(monkeypatch):
    vals = _prolog_case(2, 2, 1)
    cache = vals["kv_cache"].clone()
    fn = ROWS["mla_prolog"][1]
    q_main, q_pe, c_q = fn(*_args("mla_prolog", dict(vals, kv_cache=cache)))
    assert q_main.shape == (2, 1, 512) and q_pe.shape == (2, 1, 64) and c_q.shape == (2, 1536)
    assert _rope_check(vals, q_pe, c_q)
    # slot -1 leaves the cache alone; the written row's rope half is interleaved like glm5's:
    # the kit judges the outputs and the cache as written (untouched rows without slack)
    untouched = [r for r in range(cache.shape[0]) if r not in vals["slots"].tolist()]
    assert torch.equal(cache[untouched], vals["kv_cache"][untouched])
    assert_matches("mla_prolog", (q_main, q_pe, c_q), dict(vals, kv_cache=cache), before=vals,
                   dtype=torch.bfloat16)
    # the check above can fail: without re-interleaving, the rope output is half-split
    monkeypatch.setattr(npu_ops, "_interleave_halves", lambda x: x)
    bad_cache = vals["kv_cache"].clone()
    q_main, q_pe_bad, c_q = fn(*_args("mla_prolog", dict(vals, kv_cache=bad_cache)))
    assert not _rope_check(vals, q_pe_bad, c_q)
    v = judge("mla_prolog", (q_main, q_pe_bad, c_q), dict(vals, kv_cache=bad_cache), before=vals,
              dtype=torch.bfloat16)
    assert not v.ok and v.message.startswith("q_pe:"), v.message


def test_mla_prolog_v2_and_v3_agree():
    vals = _prolog_case(3, 2, 2)
    T = 2
    args = (vals["x"], vals["w_qa"].t().contiguous(), vals["w_qb"].t().contiguous(),
            vals["w_uk"], vals["w_kva"].t().contiguous(), vals["g_qa"], vals["g_kva"],
            torch.cat((vals["sin"],) * 2, -1), torch.cat((vals["cos"],) * 2, -1))
    caches = [(torch.zeros(1, 16, 1, 512, dtype=torch.bfloat16),
               torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)) for _ in range(2)]
    ci = torch.tensor([3, 9])
    q3, r3, _, n3, _ = contract.npu_mla_prolog_v3(*args, *caches[0], cache_index=ci,
                                                  query_norm_flag=True)
    q2, r2, kv2, kr2, _ = contract.npu_mla_prolog_v2(*args, ci, *caches[1])
    assert torch.equal(q3, q2) and torch.equal(r3, r2) and n3.shape == (T, 1536)
    assert torch.equal(caches[0][0], kv2) and torch.equal(caches[0][1], kr2)
    assert (kv2.reshape(16, 512)[[3, 9]] != 0).any() and (kv2.reshape(16, 512)[0] == 0).all()
    _, _, _, n_off, _ = contract.npu_mla_prolog_v3(*args, *caches[0], cache_index=ci)
    assert n_off.numel() == 0  # query_norm only with query_norm_flag


def test_mla_prolog_supports_declines():
    sup = npu_ops.mla_prolog_supports

    def case(D, Rq, H, Dn, dtype=torch.bfloat16, absorb=True):
        e = lambda *s: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
        return (e(2, D), e(Rq, D), e(Rq), e(H * (Dn + 64), Rq), e(576, D), e(512),
                e(H, Dn, 512), e(2, 32), e(2, 32), 1e-5, e(4, 576),
                torch.zeros(2, dtype=I32), absorb)

    assert sup(*case(7168, 1536, 64, 128))
    assert not sup(*case(6144, 2048, 64, 192))  # GLM-5's sizes are not documented
    assert not sup(*case(7168, 1536, 64, 128, absorb=False))  # the op returns q_nope·W_UK only
    assert not sup(*case(7168, 1536, 64, 128, dtype=torch.float16))
    assert not sup(*case(7168, 1536, 48, 128))  # N a power of 2


def test_emulator_mla_prolog_rejects_contract_violations():
    vals = _prolog_case(4, 1, 1)
    args = [vals["x"], vals["w_qa"].t().contiguous(), vals["w_qb"].t().contiguous(),
            vals["w_uk"], vals["w_kva"].t().contiguous(), vals["g_qa"], vals["g_kva"],
            torch.cat((vals["sin"],) * 2, -1), torch.cat((vals["cos"],) * 2, -1),
            torch.zeros(1, 16, 1, 512, dtype=torch.bfloat16),
            torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)]
    ci = torch.tensor([0])
    with pytest.raises(ValueError, match="cache_mode"):
        contract.npu_mla_prolog_v3(*args, cache_index=ci, cache_mode="KV_BSND")
    with pytest.raises(NotImplementedError, match="PA_NZ"):
        contract.npu_mla_prolog_v3(*args, cache_index=ci, cache_mode="PA_NZ")
    with pytest.raises(ValueError, match="cache_index"):
        contract.npu_mla_prolog_v3(*args, cache_index=torch.tensor([16]))
    bad = list(args)
    bad[9] = torch.zeros(2, 8, 1, 512, dtype=torch.bfloat16)
    bad[10] = torch.zeros(2, 8, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        contract.npu_mla_prolog_v3(*bad, cache_index=ci)
    bad = list(args)
    bad[0] = vals["x"][:, :6144].contiguous()
    with pytest.raises(ValueError, match="He in"):
        contract.npu_mla_prolog_v3(*bad, cache_index=ci)
    with pytest.raises(NotImplementedError, match="non-quantized"):
        contract.npu_mla_prolog_v3(*args, cache_index=ci, weight_quant_mode=1)


# =========================================================================== quant_linear
@pytest.mark.parametrize("scheme", ["w8a16", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@given(data=st.data())
def test_quant_linear_binding_matches_reference(scheme, dtype, data):
    d = HypothesisDraw(data)
    m = Maker(d, dtype)
    M, N, K = d.int(1, 4), d.int(1, 8), d.choice((8, 64, 130, 200))
    w = torch.randn(N, K, generator=m.g) * K ** -0.5
    wp, ws = quantize_weight(w, scheme)
    x = m.randn(M, K, scale=d.choice((0.1, 1.0, 8.0)))
    if d.flag():
        x[d.int(0, M - 1)] = 0  # an all-zero row
    bias = m.randn(N, noncontig=False, dtype=d.choice((torch.float32, dtype))) \
        if d.flag() else None
    v = _judge("quant_linear", {"x": x, "w_packed": wp, "w_scale": ws, "scheme": scheme,
                                "bias": bias}, dtype)
    assert v.ok, v.message


def test_quant_linear_supports_declines_grouped_schemes():
    sup = npu_ops.quant_linear_supports
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    for scheme in ("w4a8", "w6a12"):
        wp, ws = quantize_weight(torch.randn(4, 256), scheme)
        assert not sup(x, wp, ws, scheme)
    wp, ws = quantize_weight(torch.randn(4, 256), "w8a8")
    assert sup(x, wp, ws, "w8a8") and not sup(x.float(), wp, ws, "w8a8")


def test_emulator_quant_ops_reject_contract_violations():
    x1 = torch.randint(-5, 5, (3, 16), dtype=torch.int8)
    x1[:, 3] = torch.tensor([127, -127, 127], dtype=torch.int8)  # each row's amax is 127
    x2 = torch.randint(-5, 5, (16, 4), dtype=torch.int8)
    sc, pt = torch.rand(4), torch.tensor([0.25, 2.0, 0.0078125])
    # x = x1 * pt is exact in bf16 (7-bit codes times powers of two) and npu_dynamic_quant gives
    # back (x1, pt) exactly: this call is the w8a8 binding's second step on x, i.e. glm5's
    # quant_linear(x, x2ᵀ, sc, "w8a8"), judged as that op.
    x = (x1.double() * pt.double()[:, None]).to(torch.bfloat16)
    xq, sx = contract.npu_dynamic_quant(x)
    assert torch.equal(xq, x1) and torch.equal(sx, pt)
    y = contract.npu_quant_matmul(x1, x2, sc, pertoken_scale=pt, output_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert_matches("quant_linear", y, {"x": x, "w_packed": x2.T.contiguous(), "w_scale": sc,
                                       "scheme": "w8a8", "bias": None}, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="output_dtype"):
        contract.npu_quant_matmul(x1, x2, sc, pertoken_scale=pt, output_dtype=torch.float32)
    with pytest.raises(ValueError, match="scale"):
        contract.npu_quant_matmul(x1, x2, torch.rand(3), pertoken_scale=pt,
                                  output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale"):  # fp16 output takes an fp32 scale only
        contract.npu_quant_matmul(x1, x2, sc.bfloat16(), pertoken_scale=pt,
                                  output_dtype=torch.float16)
    with pytest.raises(ValueError, match="transpose"):
        contract.npu_quant_matmul(x1, torch.randint(-5, 5, (16, 8), dtype=torch.int8)[:, ::2],
                                  sc, pertoken_scale=pt, output_dtype=torch.bfloat16)
    xh = torch.randn(3, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="antiquant_scale"):
        contract.npu_weight_quant_batchmatmul(xh, x2, torch.rand(4))  # fp32 scale, bf16 x
    with pytest.raises(ValueError, match="dtype"):
        contract.npu_dynamic_quant(torch.randn(3, 16))  # fp16 / bf16 only
    q, s = contract.npu_dynamic_quant(torch.tensor([[0.5, -1.0], [0.0, 0.0]],
                                                   dtype=torch.bfloat16))
    assert q.tolist() == [[64, -127], [0, 0]] and s[1] == 0  # round(63.5) half-to-even


# =========================================================================== moe_experts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@given(data=st.data())
def test_moe_experts_binding_matches_reference(dtype, data):
    values = GENERATORS["moe_experts"](HypothesisDraw(data, PROFILES["quick"]), dtype)
    v = _judge("moe_experts", values, dtype)
    assert v.ok, v.message


def test_moe_experts_all_padding_and_single_expert():
    fn = ROWS["moe_experts"][1]
    x = torch.randn(3, 8)
    w13, w2 = torch.randn(1, 8, 8), torch.randn(1, 8, 4)
    ids = torch.full((3, 2), -1, dtype=I32)
    assert (fn(x, ids, torch.ones(3, 2), w13, w2) == 0).all()
    ids[1, 0] = 0  # E = 1: group_list as a cumsum (type 1 may not have length 1)
    got = fn(x, ids, torch.ones(3, 2), w13, w2)
    assert_matches("moe_experts", got, {"x": x, "ids": ids, "weights": torch.ones(3, 2),
                                        "w13": w13, "w2": w2}, dtype=torch.float32)


def test_moe_experts_supports_declines():
    sup = npu_ops.moe_experts_supports
    e = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    ids = torch.zeros(2, 1, dtype=I32)
    assert sup(e(2, 4), ids, e(2, 1), e(1024, 8, 4), e(1024, 4, 4))
    assert not sup(e(2, 4), ids, e(2, 1), e(1025, 8, 4), e(1025, 4, 4))  # > 1024 groups
    assert not sup(e(2, 70000), ids, e(2, 1), e(2, 8, 70000), e(2, 70000, 4))


def test_emulator_grouped_matmul_contract():
    g = torch.Generator().manual_seed(6)
    # small integers: every product and every partial sum is exact in fp32, so any correct
    # grouped matmul returns the float64 result exactly, whatever its summation order
    x = torch.randint(-4, 5, (7, 5), generator=g).float()
    w = torch.randint(-4, 5, (3, 4, 5), generator=g).float()  # [E, N, K]; passed as [E, K, N]
    counts = torch.tensor([2, 0, 5])
    a = contract.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts,
                                    group_list_type=1, group_type=0, split_item=3)[0]
    b = contract.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts.cumsum(0),
                                    group_list_type=0, group_type=0, split_item=2)[0]
    want = torch.cat((x[:2].double() @ w[0].double().T, x[2:].double() @ w[2].double().T))
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(a.double(), want) and torch.equal(b.double(), want)
    call = dict(group_type=0, split_item=3)
    with pytest.raises(ValueError, match="length not 1"):
        contract.npu_grouped_matmul([x], [w[:1].transpose(1, 2)], group_list=torch.tensor([7]),
                                    group_list_type=1, **call)
    with pytest.raises(ValueError, match="ending at M=7"):
        contract.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=torch.tensor([2, 2, 6]),
                                    group_list_type=0, **call)
    with pytest.raises(ValueError, match="split_item"):
        contract.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts,
                                    group_list_type=1, group_type=0, split_item=0)
    with pytest.raises(ValueError, match="int64"):
        contract.npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=counts.int(),
                                    group_list_type=1, **call)
    with pytest.raises(ValueError, match="dtype"):
        contract.npu_grouped_matmul([x.half()], [w.transpose(1, 2)], group_list=counts,
                                    group_list_type=1, **call)
    # npu_swiglu (silu of the first half times the second) is glm5's silu_mul
    h = torch.randn(4, 6, generator=g)
    for hx in (h, h.bfloat16()):
        assert_matches("silu_mul", contract.npu_swiglu(hx), {"x": hx}, dtype=hx.dtype)


# =========================================================================== moe_route
@given(data=st.data())
def test_moe_route_binding_matches_reference(data):
    values = GENERATORS["moe_route"](HypothesisDraw(data, PROFILES["quick"]), torch.float32)
    assume(npu_ops.moe_route_supports(*_args("moe_route", values)))
    v = _judge("moe_route", values, torch.float32)
    assert v.ok, v.message


def test_moe_route_glm5_shape_and_exact_ties():
    # GLM-5: 256 experts, one group, top-8, normalised, scaled by 2.5; integer logits tie.
    g = torch.Generator().manual_seed(7)
    logits = torch.randint(-2, 3, (4, 256), generator=g).float()
    bias = torch.zeros(256)
    for norm in (True, False):
        w, ids = ROWS["moe_route"][1](logits, bias, 8, 1, 1, norm, 2.5)
        _, rids = OPS["moe_route"].reference(logits.double(), bias.double(), 8, 1, 1, norm, 2.5)
        assert torch.equal(ids, rids)  # ties to the smaller id
        assert_matches("moe_route", (w, ids), _route_vals(logits, bias, 8, 1, 1, norm, 2.5),
                       dtype=torch.float32)


def test_moe_route_supports_declines():
    sup = npu_ops.moe_route_supports
    b8, b4096 = torch.zeros(8), torch.zeros(4096)
    assert sup(torch.zeros(2, 8), b8, 2, 1, 1, True, 1.0)
    assert not sup(torch.zeros(2, 8), b8, 2, 4, 2, True, 1.0)  # groups of 2 experts
    assert not sup(torch.zeros(2, 4096), b4096, 2, 1, 1, True, 1.0)  # E <= 2048
    assert not sup(torch.zeros(2, 8, dtype=torch.float64), b8.double(), 2, 1, 1, True, 1.0)


def _softmax_as_attention(x: torch.Tensor) -> dict:
    """glm5 attention arguments whose out is softmax(x) over the last dim: one head per row t
    with q = x[t], keys e_j (scores x[t, j] at scale 1), values e_j, every key in range."""
    T, E = x.shape
    eye = torch.eye(E, dtype=x.dtype)[:, None, :]
    return {"q": x[:, None, :], "k": eye, "v": eye, "k_start": torch.zeros(T, dtype=I32),
            "k_end": torch.full((T,), E, dtype=I32), "scale": 1.0}


def test_emulator_moe_gating_contract():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 32, generator=g)
    b = torch.randn(32, generator=g) * 0.1
    y, idx, out = contract.npu_moe_gating_top_k(x, 4, bias=b, k_group=2, group_count=4,
                                                group_select_mode=1, norm_type=1,
                                                out_flag=True, routed_scaling_factor=2.5)
    # sigmoid, bias, groups by their top-2 sum, renormalised and scaled: the binding's call for
    # glm5's moe_route with norm_topk_prob (the eps 1e-20 is below an fp32 ulp of the sum)
    assert_matches("moe_route", (y, idx), _route_vals(x, b, 4, 4, 2, True, 2.5),
                   dtype=torch.float32)
    # norm_out is sigmoid(x) whatever k and the groups; read at the ids of a top-E call it is
    # moe_route's weights without norm_topk_prob (the binding's path for that setting)
    _, idx_all, out_all = contract.npu_moe_gating_top_k(x, 32, bias=b, norm_type=1,
                                                        out_flag=True)
    assert torch.equal(out_all, out)
    assert_matches("moe_route", (out_all.gather(1, idx_all.long()), idx_all),
                   _route_vals(x, b, 32, 1, 1, False, 1.0), dtype=torch.float32)
    # softmax (norm_type 0) is not renormalised: y0 is softmax(x) at idx0, judged by the bound
    # of attention's out for the same probabilities (scores x, keys and values e_j)
    y0, idx0, _ = contract.npu_moe_gating_top_k(x, 4, norm_type=0)
    p, bp = output_bound("attention", _softmax_as_attention(x), "out", torch.float32)
    sel = idx0.long()
    assert _within(y0, p[:, 0].gather(1, sel), bp[:, 0].gather(1, sel))
    for kw, match in ((dict(renorm=1), "renorm"), (dict(group_count=16, k_group=2), "more than 2"),
                      (dict(group_count=4, k_group=5), "k_group"), (dict(norm_type=2), "norm_type"),
                      (dict(group_count=3), "divisor")):
        with pytest.raises(ValueError, match=match):
            contract.npu_moe_gating_top_k(x, 4, **kw)
    with pytest.raises(ValueError, match="k"):
        contract.npu_moe_gating_top_k(x, 9, k_group=1, group_count=4)  # k <= 8 reachable
    with pytest.raises(ValueError, match="E <= 2048"):
        contract.npu_moe_gating_top_k(torch.zeros(1, 2050), 1)
