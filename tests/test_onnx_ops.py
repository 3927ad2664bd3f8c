"""ONNX export of glm5 ops (glm5.ir.onnx_export): every covered op is exported with torch.onnx
(dynamo) and run with onnxruntime's CPU provider, and its outputs match the op's reference.

Two paths, each exported once per case (exports are slow, so one module holds several ops):
- "functions": glm5.ir.onnx_export.export keeps each op as a node of domain glm5 calling an
  ONNX function of that domain (body of standard ops) stored in the model;
- "inline": plain torch.onnx.export(..., custom_translation_table=translation_table()), which
  gives standard ops only (torch 2.13 inlines every local function while exporting).
"""

from __future__ import annotations

import math

import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import torch  # noqa: E402

import glm5  # noqa: E402
from glm5 import ops  # noqa: E402
from glm5.testing.compare import assert_matches  # noqa: E402

oe = pytest.importorskip("glm5.ir.onnx_export")

MODES = ("functions", "inline")
EPS = 1e-6


def ref(name):
    return glm5.get_op(name).reference


def _g(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- cases
class NormBlock(torch.nn.Module):
    def forward(self, x3, w, b, xq, xk, cos, sin, x2):
        return (
            ops.rms_norm(x3, w, 1e-5),
            ops.layer_norm(x2, w, b, 1e-5),
            ops.rope(xq, cos, sin, True),
            ops.rope(xq, cos, sin, False),
            ops.rope(xk, cos, sin, True),
            ops.rope(xk, cos, sin, False),
            ops.silu_mul(x2),
        )


def norm_case():
    g = _g(0)
    T, D, H, R = 5, 16, 3, 8
    ang = torch.rand(T, R // 2, generator=g) * 6
    args = (
        torch.randn(2, T, D, generator=g), torch.randn(D, generator=g),
        torch.randn(D, generator=g), torch.randn(T, H, R, generator=g),
        torch.randn(T, R, generator=g), ang.cos(), ang.sin(), torch.randn(T, D, generator=g),
    )

    def want(x3, w, b, xq, xk, cos, sin, x2):
        rope = ref("rope")
        return (
            ref("rms_norm")(x3, w, 1e-5), ref("layer_norm")(x2, w, b, 1e-5),
            rope(xq, cos, sin, True), rope(xq, cos, sin, False),
            rope(xk, cos, sin, True), rope(xk, cos, sin, False), ref("silu_mul")(x2),
        )

    names = ("rms_norm", "layer_norm", "rope[T,H,R] interleaved", "rope[T,H,R] neox",
             "rope[T,R] interleaved", "rope[T,R] neox", "silu_mul")

    def calls(got, x3, w, b, xq, xk, cos, sin, x2):
        return [
            ("rms_norm", dict(x=x3, weight=w, eps=1e-5)),
            ("layer_norm", dict(x=x2, weight=w, bias=b, eps=1e-5)),
            ("rope", dict(x=xq, cos=cos, sin=sin, interleaved=True)),
            ("rope", dict(x=xq, cos=cos, sin=sin, interleaved=False)),
            ("rope", dict(x=xk, cos=cos, sin=sin, interleaved=True)),
            ("rope", dict(x=xk, cos=cos, sin=sin, interleaved=False)),
            ("silu_mul", dict(x=x2)),
        ]

    return NormBlock(), args, names, want, calls


K_SEL = 5
SCALE = 0.3


class DsaBlock(torch.nn.Module):
    def forward(self, q, k, w, ks, ke, qa, ka, va, qm, km, ties):
        scores = ops.lightning_indexer(q, k, w, ks, ke)
        idx = ops.indexer_topk(q, k, w, ks, ke, K_SEL)
        sp_out, sp_lse = ops.sparse_attention(qa, ka, va, idx, SCALE)
        mqa_out, mqa_lse = ops.sparse_attention(qm, km, km[..., :4], idx, SCALE)
        at_out, at_lse = ops.attention(qa, ka, va, ks, ke, SCALE)
        return (
            scores, ops.topk_indices(scores, K_SEL), ops.topk_indices(scores, k.shape[0] + 3),
            idx, sp_out, sp_lse, mqa_out, mqa_lse, at_out, at_lse, ops.topk_indices(ties, 6),
        )


def dsa_case():
    g = _g(1)
    T, S, Hi, Di, H, Hk, D, Dv = 4, 10, 3, 8, 4, 2, 8, 6
    # row 1 has 3 valid keys (< K_SEL: -1 tail), row 2 none (all -1; attention gives 0, -inf)
    ks = torch.tensor([0, 0, 2, 5], dtype=torch.int32)
    ke = torch.tensor([10, 3, 2, 8], dtype=torch.int32)
    nan, inf = float("nan"), float("inf")
    ties = torch.tensor([
        [1.0, 3.0, 3.0, 2.0, 3.0, nan, inf, -inf, 2.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [5.0, -inf, 5.0, 1.0, 1.0, 1.0, 2.0, 2.0, nan],
        [-inf, nan, inf, -inf, 7.0, -inf, nan, 7.0, -inf],
    ])
    args = (
        torch.randn(T, Hi, Di, generator=g), torch.randn(S, Di, generator=g),
        torch.rand(T, Hi, generator=g), ks, ke,
        torch.randn(T, H, D, generator=g), torch.randn(S, Hk, D, generator=g),
        torch.randn(S, Hk, Dv, generator=g),
        torch.randn(T, H, D, generator=g), torch.randn(S, 1, D, generator=g), ties,
    )

    def want(q, k, w, ks, ke, qa, ka, va, qm, km, ties):
        scores = ref("lightning_indexer")(q, k, w, ks, ke)
        topk = ref("topk_indices")
        idx = ref("indexer_topk")(q, k, w, ks, ke, K_SEL)
        sp = ref("sparse_attention")
        return (
            scores, topk(scores, K_SEL), topk(scores, k.shape[0] + 3), idx,
            *sp(qa, ka, va, idx, SCALE), *sp(qm, km, km[..., :4], idx, SCALE),
            *ref("attention")(qa, ka, va, ks, ke, SCALE), topk(ties, 6),
        )

    names = ("lightning_indexer", "topk_indices", "topk_indices k > S", "indexer_topk",
             "sparse_attention out", "sparse_attention lse", "sparse_attention MQA out",
             "sparse_attention MQA lse", "attention out", "attention lse", "topk_indices ties")

    def calls(got, q, k, w, ks, ke, qa, ka, va, qm, km, ties):
        scores, idx = got[0], got[3]  # what the graph fed its later ops
        rng = dict(k_start=ks, k_end=ke)
        return [
            ("lightning_indexer", dict(q=q, k=k, w=w, **rng)),
            ("topk_indices", dict(scores=scores, k=K_SEL)),
            ("topk_indices", dict(scores=scores, k=k.shape[0] + 3)),
            ("indexer_topk", dict(q=q, k=k, w=w, **rng, topk=K_SEL)),
            ("sparse_attention", dict(q=qa, k=ka, v=va, idx=idx, scale=SCALE)),
            ("sparse_attention", dict(q=qm, k=km, v=km[..., :4], idx=idx, scale=SCALE)),
            ("attention", dict(q=qa, k=ka, v=va, **rng, scale=SCALE)),
            ("topk_indices", dict(scores=ties, k=6)),
        ]

    return DsaBlock(), args, names, want, calls


class MoeBlock(torch.nn.Module):
    def forward(self, logits, bias, tie_logits, x, ids, weights, w13, w2):
        w1, ids1 = ops.moe_route(logits, bias, 2, 1, 1, True, 2.5)
        wg, idsg = ops.moe_route(logits, bias, 3, 4, 2, False, 1.0)
        wt, idst = ops.moe_route(tie_logits, torch.zeros_like(bias), 3, 4, 2, True, 1.0)
        return (w1, ids1, wg, idsg, wt, idst, ops.moe_experts(x, ids, weights, w13, w2),
                ops.moe_experts(x, ids1, w1, w13, w2))


def moe_case():
    g = _g(2)
    T, E, D, I = 5, 8, 12, 6
    tie_logits = torch.tensor([[0.5] * E, [1.0, 2.0, 2.0, 1.0, 2.0, 2.0, 0.0, 0.0],
                               [0.0, 0.0, 3.0, 0.0, 0.0, 3.0, 1.0, 1.0]] + [[0.1] * E] * (T - 3))
    args = (
        torch.randn(T, E, generator=g), torch.randn(E, generator=g) * 0.1, tie_logits,
        torch.randn(T, D, generator=g),
        torch.tensor([[0, 3, -1], [7, -1, -1], [-1, -1, -1], [2, 5, 1], [4, 0, 6]],
                     dtype=torch.int32),
        torch.rand(T, 3, generator=g), torch.randn(E, 2 * I, D, generator=g) * 0.3,
        torch.randn(E, D, I, generator=g) * 0.3,
    )

    def want(logits, bias, tie_logits, x, ids, weights, w13, w2):
        route, experts = ref("moe_route"), ref("moe_experts")
        w1, ids1 = route(logits, bias, 2, 1, 1, True, 2.5)
        return (w1, ids1, *route(logits, bias, 3, 4, 2, False, 1.0),
                *route(tie_logits, torch.zeros_like(bias), 3, 4, 2, True, 1.0),
                experts(x, ids, weights, w13, w2), experts(x, ids1, w1, w13, w2))

    names = ("moe_route weights", "moe_route ids", "moe_route grouped weights",
             "moe_route grouped ids", "moe_route ties weights", "moe_route ties ids",
             "moe_experts (-1 ids)", "moe_experts (routed)")

    def calls(got, logits, bias, tie_logits, x, ids, weights, w13, w2):
        def route(lg, b, k, ng, tg, norm, scaling):
            return ("moe_route", dict(logits=lg, bias=b, top_k=k, n_group=ng, topk_group=tg,
                                      norm_topk_prob=norm, routed_scaling=scaling))

        return [
            route(logits, bias, 2, 1, 1, True, 2.5),
            route(logits, bias, 3, 4, 2, False, 1.0),
            route(tie_logits, torch.zeros_like(bias), 3, 4, 2, True, 1.0),
            ("moe_experts", dict(x=x, ids=ids, weights=weights, w13=w13, w2=w2)),
            # the routed call: the graph's own routing (got[0], got[1]) feeds the experts
            ("moe_experts", dict(x=x, ids=got[1], weights=got[0], w13=w13, w2=w2)),
        ]

    return MoeBlock(), args, names, want, calls


class MlaBlock(torch.nn.Module):
    """Both prolog variants; the (mutated) caches are returned, so they are graph outputs."""

    def forward(self, x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, cache_a, cache_b,
                slots):
        a = ops.mla_prolog(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, EPS, cache_a, slots,
                           True)
        b = ops.mla_prolog(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, EPS, cache_b, slots,
                           False)
        return (*a, cache_a, *b, cache_b)


def mla_case():
    g = _g(3)
    T, D, Rq, H, Dn, Dr, Rkv, N = 4, 16, 12, 2, 6, 4, 8, 7
    ang = torch.rand(T, Dr // 2, generator=g) * 6
    args = (
        torch.randn(T, D, generator=g), torch.randn(Rq, D, generator=g) * 0.3,
        torch.rand(Rq, generator=g) + 0.5, torch.randn(H * (Dn + Dr), Rq, generator=g) * 0.3,
        torch.randn(Rkv + Dr, D, generator=g) * 0.3, torch.rand(Rkv, generator=g) + 0.5,
        torch.randn(H, Dn, Rkv, generator=g) * 0.3, ang.cos(), ang.sin(),
        torch.randn(N, Rkv + Dr, generator=g), torch.randn(N, Rkv + Dr, generator=g),
        torch.tensor([5, -1, 0, 2], dtype=torch.int32),
    )

    def want(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, cache_a, cache_b, slots):
        prolog = ref("mla_prolog")
        ca, cb = cache_a.clone(), cache_b.clone()
        a = prolog(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, EPS, ca, slots, True)
        b = prolog(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, EPS, cb, slots, False)
        return (*a, ca, *b, cb)

    names = ("absorb q_main", "absorb q_pe", "absorb c_q", "absorb kv_cache", "q_main", "q_pe",
             "c_q", "kv_cache")

    def calls(got, x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, cache_a, cache_b, slots):
        common = dict(x=x, w_qa=w_qa, g_qa=g_qa, w_qb=w_qb, w_kva=w_kva, g_kva=g_kva, w_uk=w_uk,
                      cos=cos, sin=sin, eps=EPS, slots=slots)
        # the mutated cache is a graph output: judged as the op's in-place result
        return [
            ("mla_prolog", dict(common, kv_cache=cache_a, absorb=True)),
            ("mla_prolog", dict(common, kv_cache=cache_b, absorb=False)),
        ]

    return MlaBlock(), args, names, want, calls


class Fp8Block(torch.nn.Module):
    def forward(self, q, k, w, ks, ke):
        return (ops.indexer_topk_fp8(q, k, w, ks, ke, K_SEL),
                ops.indexer_topk_fp8(q.bfloat16(), k.bfloat16(), w, ks, ke, K_SEL))


def fp8_case():
    g = _g(4)
    T, S, Hi, Di = 4, 12, 2, 16
    ks = torch.tensor([0, 0, 3, 4], dtype=torch.int32)
    ke = torch.tensor([12, 4, 12, 4], dtype=torch.int32)  # row 3: no key (all -1)
    q = torch.randn(T, Hi, Di, generator=g) * torch.logspace(-5, 2, T)[:, None, None]
    k = torch.randn(S, Di, generator=g)
    k[1] = 0  # a zero row: the 1e-4 floor's scale
    k[2, 0] = 448 * 2.0 ** -3  # amax / 448 exactly a power of two
    q[0, 1, 3] = 448.0 * 4
    args = (q, k, torch.rand(T, Hi, generator=g), ks, ke)

    def want(q, k, w, ks, ke):
        f = ref("indexer_topk_fp8")
        return f(q, k, w, ks, ke, K_SEL), f(q.bfloat16(), k.bfloat16(), w, ks, ke, K_SEL)

    names = ("indexer_topk_fp8", "indexer_topk_fp8 bf16")

    def calls(got, q, k, w, ks, ke):
        return [("indexer_topk_fp8", dict(q=x, k=y, w=w, k_start=ks, k_end=ke, topk=K_SEL))
                for x, y in ((q, k), (q.bfloat16(), k.bfloat16()))]

    return Fp8Block(), args, names, want, calls


CASES = {"norm": norm_case, "dsa": dsa_case, "moe": moe_case, "mla": mla_case,
         "fp8": fp8_case}
GLM5_NODES = {
    "norm": {"rms_norm", "layer_norm", "rope", "silu_mul"},
    "dsa": {"lightning_indexer", "topk_indices", "indexer_topk", "sparse_attention",
            "attention"},
    "moe": {"moe_route", "moe_experts"},
    "mla": {"mla_prolog"},
    "fp8": {"indexer_topk_fp8"},
}


# --------------------------------------------------------------------------- export + run
def _export(module, args, mode):
    with oe.quiet_export():
        if mode == "functions":
            return oe.export(module, args).model_proto
        if isinstance(module, MlaBlock):
            # the in-place op must be functionalised first (see glm5.ir.onnx_export)
            module = oe.functionalize(torch.export.export(module, args))
        prog = torch.onnx.export(module, args, dynamo=True, verbose=False,
                                 custom_translation_table=oe.translation_table())
        return prog.model_proto


_cache: dict = {}


def exported(case, mode):
    key = (case, mode)
    if key not in _cache:
        module, args, names, want, calls = CASES[case]()
        model = _export(module, tuple(a.clone() for a in args), mode)
        sess = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        feed = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
        assert len(feed) == len(args)
        got = [torch.from_numpy(o) for o in sess.run(None, feed)]
        _cache[key] = (model, names, got, want(*args), calls(got, *args))
    return _cache[key]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_onnxruntime_matches_reference(case, mode):
    _, names, got, want, calls = exported(case, mode)
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if not w.is_floating_point():  # indices: exactly the reference's (as glm5 computes them)
            assert torch.equal(g, w), f"{name}:\n{g}\n!=\n{w}"
    # every op call of the graph, its outputs judged by the kit against the float64 oracle
    i = 0
    for op, values in calls:
        n = len(glm5.get_op(op).outputs)
        outs, what = tuple(got[i:i + n]), ", ".join(names[i:i + n])
        i += n
        if op == "mla_prolog":  # the cache the graph returns is the op's in-place result
            assert_matches(op, outs, {**values, "kv_cache": got[i]}, before=values, what=what)
            i += 1
        else:
            assert_matches(op, outs if n > 1 else outs[0], values, what=what)
    assert i == len(got)


@pytest.mark.parametrize("case", list(CASES))
def test_ops_are_functions_of_domain_glm5(case):
    model, *_ = exported(case, "functions")
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain: o.version for o in model.opset_import}[oe.DOMAIN] == oe.VERSION
    nodes = {n.op_type for n in model.graph.node if n.domain == oe.DOMAIN}
    assert nodes == GLM5_NODES[case]
    functions = {f.name: f for f in model.functions}
    assert set(functions) >= nodes
    assert all(f.domain == oe.DOMAIN for f in functions.values())
    for f in functions.values():
        for n in f.node:  # standard ops, or a call of another glm5 function of the model
            assert n.domain == "" or (n.domain == oe.DOMAIN and n.op_type in functions), n
    # the graph holds no standard op of the glm5 ops themselves: one node per glm5 call
    assert sum(n.domain == oe.DOMAIN for n in model.graph.node) >= len(GLM5_NODES[case])


@pytest.mark.parametrize("case", list(CASES))
def test_plain_torch_onnx_export_gives_standard_ops(case):
    model, *_ = exported(case, "inline")
    onnx.checker.check_model(model, full_check=True)
    assert all(n.domain == "" for n in model.graph.node)
    assert len(model.functions) == 0


def test_every_covered_op_is_exported():
    covered = set().union(*GLM5_NODES.values())
    assert covered == set(oe.COVERED)
    table = oe.translation_table()
    for name in covered - {"mla_prolog"}:
        assert getattr(torch.ops.glm5, name).default in table
    assert oe.functional_mla_prolog() in table


def test_functionalize_leaves_programs_without_mla_prolog_alone():
    ep = torch.export.export(NormBlock(), norm_case()[1])
    assert oe.functionalize(ep) is ep


def test_function_protos_include_dependencies():
    names = {f.name for f in oe.function_protos(["mla_prolog", "indexer_topk"])}
    assert names == {"mla_prolog", "rms_norm", "rope", "indexer_topk", "lightning_indexer",
                     "topk_indices"}
    assert math.isinf(oe.NEG_INF)


def test_e4m3_rows_function_is_the_quantizer():
    """The ONNX body of the fp8 row quantizer gives `glm5.ir.fp8`'s values bit for bit: every
    e4m3 grid value and every midpoint between neighbours (ties to even), +-1 fp32 ulp around
    them, subnormal codes, rows whose amax / 448 is a power of two, zero rows and rows below the
    1e-4 floor, magnitudes from 1e-9 to 1e6, fp32, bf16 and float64 inputs (run eagerly)."""
    import numpy as np

    from fp8_cases import e4m3_stress_rows
    from glm5.ir.fp8 import e4m3_rows

    x = e4m3_stress_rows()
    for xx, acc in ((x, 1), (x.bfloat16(), 1), (x.double(), 11)):
        got = oe.e4m3_rows(xx.float().numpy() if xx.dtype == torch.bfloat16 else xx.numpy(),
                           acc=acc)
        want = e4m3_rows(xx, torch.float64 if acc == 11 else torch.float32)
        assert np.array_equal(np.asarray(got), want.numpy()), xx.dtype
