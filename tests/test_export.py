"""Graph capture: torch.export sees one node per glm5 op; autograd through the vjp of the
reference; composite ops decompose when no backend serves them whole."""

from __future__ import annotations

import torch

import glm5
from glm5 import ops


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(16))

    def forward(self, x, q, k, w, ks, ke):
        h = ops.rms_norm(x, self.w, 1e-5)
        h = ops.silu_mul(h)
        idx = ops.indexer_topk(q, k, w, ks, ke, 4)
        return h, idx


def _inputs():
    T, S = 3, 6
    return (
        torch.randn(T, 16),
        torch.randn(T, 2, 8),
        torch.randn(S, 8),
        torch.randn(T, 2),
        torch.zeros(T, dtype=torch.int32),
        torch.tensor([4, 5, 6], dtype=torch.int32),
    )


def test_export_has_one_node_per_op():
    ep = torch.export.export(Block(), _inputs())
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    glm5_nodes = [str(t) for t in targets if str(t).startswith("glm5.")]
    assert glm5_nodes == ["glm5.rms_norm.default", "glm5.silu_mul.default",
                          "glm5.indexer_topk.default"]
    # The exported program runs and matches eager.
    args = _inputs()
    got = ep.module()(*args)
    want = Block()(*args)
    assert torch.equal(got[0], want[0])  # the same kernels through the graph
    assert torch.equal(got[1], want[1])


def test_fake_tensor_shapes_come_from_the_opdef():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q = torch.empty(5, 3, 7)
        k = torch.empty(9, 1, 7)
        v = torch.empty(9, 1, 4)
        idx = torch.empty(5, 6, dtype=torch.int32)
        out, lse = torch.ops.glm5.sparse_attention(q, k, v, idx, 0.5)
    assert out.shape == (5, 3, 4) and out.dtype == torch.float32
    assert lse.shape == (5, 3) and lse.dtype == torch.float32
    del mode


def test_backward_is_the_vjp_of_the_reference():
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(16, dtype=torch.float64, requires_grad=True)
    y = ops.rms_norm(x, wt, 1e-6)
    assert y.grad_fn is not None
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, wt), g)
    ref = glm5.get_op("rms_norm").reference
    x2, w2 = x.detach().requires_grad_(), wt.detach().requires_grad_()
    rx, rw = torch.autograd.grad(ref(x2, w2, 1e-6), (x2, w2), g)
    assert torch.equal(gx, rx) and torch.equal(gw, rw)  # the reference's vjp, bit for bit


def test_gradcheck_sparse_attention_through_custom_op():
    T, S, H = 2, 5, 2
    q = torch.randn(T, H, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(S, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(S, 1, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 2, -1], [4, 1, 3]], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda q, k, v: ops.sparse_attention(q, k, v, idx, 0.5)[0], (q, k, v)
    )


def test_compile_graph_contains_glm5_op():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    f = torch.compile(lambda x, w: ops.rms_norm(x, w, 1e-5) * 2, backend=backend, fullgraph=True)
    x, w = torch.randn(2, 8), torch.randn(8)
    assert torch.equal(f(x, w), ops.rms_norm(x, w, 1e-5) * 2)  # the same kernel, compiled
    assert any("glm5.rms_norm" in s for s in seen)
