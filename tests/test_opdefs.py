"""OpDef structure: shape functions agree with the references, costs are sane, schemas bind."""

from __future__ import annotations

import math

import pytest
import torch

import glm5
from glm5.ir.catalog import OPS
from glm5.testing.cases import GENERATORS, PROFILES, RandomDraw, case_dtypes
from glm5.testing.compare import assert_matches


def _cases(op, n=4):
    for dt in case_dtypes(op, None) + [torch.float64] * (torch.float64 not in case_dtypes(op, None)):
        for s in range(n):
            values = GENERATORS[op.name](RandomDraw(100 + s, tiers=PROFILES["smoke"]), dt)
            if op.dispatch_dtype(values) != dt:  # float64 only where the op allows it
                values = None
            if values is not None:
                yield dt, values


@pytest.mark.parametrize("name", list(OPS))
def test_meta_matches_reference_outputs(name):
    op = OPS[name]
    for dt, values in _cases(op):
        args = [values[n].clone() if isinstance(values[n], torch.Tensor) else values[n]
                for n in op.param_names]
        ref = op.reference(*args)
        ref = ref if isinstance(ref, tuple) else (ref,)
        meta = op.meta(*args)
        meta = meta if isinstance(meta, tuple) else (meta,)
        assert len(ref) == len(meta) == len(op.outputs)
        for r, m, spec in zip(ref, meta, op.outputs):
            assert r.shape == m.shape, (name, spec.name, dt)
            assert r.dtype == m.dtype, (name, spec.name, dt)


@pytest.mark.parametrize("name", list(OPS))
def test_cost_is_positive_and_finite(name):
    op = OPS[name]
    for _, values in _cases(op, 2):
        flops, nbytes = op.cost(values, op.symbols(values))
        assert math.isfinite(flops) and math.isfinite(nbytes)
        assert flops > 0 and nbytes > 0


def test_cost_golden_lightning_indexer_and_sparse_attention():
    T, S, H, D = 3, 7, 2, 8
    q, k, w = torch.randn(T, H, D), torch.randn(S, D), torch.randn(T, H)
    ks, ke = torch.zeros(T, dtype=torch.int32), torch.full((T,), S, dtype=torch.int32)
    flops, nbytes = glm5.get_op("lightning_indexer").flops_bytes(q, k, w, ks, ke)
    assert flops == 2 * T * S * H * D + 3 * T * S * H
    assert nbytes == 4 * (T * H * D + S * D + T * H) + 4 * T * S
    # GLM-5 decode MQA shape: 64 heads over 2048 selected latent rows, 576 / 512.
    q = torch.empty(1, 64, 576, dtype=torch.bfloat16)
    kv = torch.empty(4096, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 2048, dtype=torch.int32)
    flops, _ = glm5.get_op("sparse_attention").flops_bytes(q, kv, kv[..., :512], idx, 0.0625)
    assert flops == 2 * 64 * 2048 * (576 + 512)


def test_schema_of_every_op_is_bound_as_torch_op():
    from glm5 import ops  # noqa: F401  (binds torch.ops.glm5.*)

    for name, op in OPS.items():
        torch_op = getattr(torch.ops.glm5, name).default
        assert str(torch_op._schema).startswith(f"glm5::{name}(")
        assert len(torch_op._schema.arguments) == len(op.params)


def test_composites_decompose_to_the_reference():
    from glm5 import ops

    for name in ("indexer_topk", "paged_indexer_topk", "mla_prolog", "moe_experts_quant"):
        op = OPS[name]
        assert op.is_composite
        for _, values in _cases(op, 3):
            if values["x" if "x" in values else "q"].dtype != torch.float64:
                continue
            a = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
            got = getattr(ops, name)(**a)
            # what glm5.ops served against the float64 oracle (and the cache it wrote, for
            # mla_prolog)
            assert_matches(op, got, a, before=values, dtype=torch.float64)
