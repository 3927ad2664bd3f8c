"""glm5.parallel collectives and process groups: every collective against its float64 reference
(glm5.ir.ops_comm) at 2 and 4 processes (gloo) — sums, rank order, uneven all_to_all counts
with zeros, dims other than 0, sub-groups (tp=2 inside a world of 4), a raw ProcessGroup, int8
all_gather within its stated bound — and planted bugs (a chunk to the wrong rank, a reversed
all_to_all, an int8 scale 1% off) that the same checks must catch. Single-process: the
identity of a group of one, init and layout errors, the collective backend from the device
backends' settings, link-byte costs by hand, docs/ops.md's communication section.

One world of 2 and one of 4 (module-scoped pools) serve every multi-process check."""

from __future__ import annotations

import re
import time
import weakref
from pathlib import Path

import pytest
import torch

import glm5.parallel as gd
from glm5.parallel import comm
from glm5.ir import ops_comm
from glm5.ir.ops_comm import COMM_OPS, int8_gather_bound, sum_bound
from glm5.testing.dist import DistPool, RankError, values

ROOT = Path(__file__).resolve().parent.parent
HARNESS_S = 60.0


# --------------------------------------------------------------------------- inputs (both sides)
def send_matrix(n: int) -> list[list[int]]:
    """Rows rank s sends rank r: uneven, with zeros, and a rank that receives from two ranks or
    more (else a wrong order of the received blocks could not show)."""
    return [[(1 + s + 2 * r) % 3 for r in range(n)] for s in range(n)]


def make_inputs(rank: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    rows = sum(send_matrix(n)[rank])
    return {
        "ints": torch.randint(-50, 50, (8, 8), generator=g).to(torch.float32),  # exact sums
        "rnd": torch.randn(8, 4, generator=g) * 10 ** torch.randint(-3, 3, (8, 1),
                                                                     generator=g),
        "bf16": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "a2a": torch.randn(rows, 3, 2, generator=g),
        # tokens over the last dim, of very different sizes per token and per rank
        "tok": torch.randn(3, 2, 16, generator=g) * (rank + 1)
               * 10 ** torch.randint(-2, 3, (3, 2, 1), generator=g),
    }


# --------------------------------------------------------------------------- run on every rank
def collectives(ctx, seed: int) -> dict:
    """Every collective on the world and on sub-groups; returns the outputs."""
    n, r = ctx.world_size, ctx.rank
    lay = ctx.new_groups(tp=2, ep=n)
    x = make_inputs(r, n, seed)
    before = {k: v.clone() for k, v in x.items()}
    S = send_matrix(n)
    out = {
        "ar_int": gd.all_reduce(x["ints"], ctx.world),
        "ar_rnd": gd.all_reduce(x["rnd"], ctx.world),
        "ar_bf16": gd.all_reduce(x["bf16"], ctx.world),
        "rs0": gd.reduce_scatter(x["ints"], ctx.world),
        "rs1": gd.reduce_scatter(x["ints"], ctx.world, dim=1),
        "ag0": gd.all_gather(x["rnd"], ctx.world),
        "ag_1": gd.all_gather(x["rnd"], ctx.world, dim=-1),
        "a2a": gd.all_to_all(x["a2a"], S[r], [S[s][r] for s in range(n)], ctx.world),
        "int8": gd.all_gather(x["tok"], ctx.world, dim=1, quant="int8"),
        "int8_bf16": gd.all_gather(x["tok"].to(torch.bfloat16), ctx.world, quant="int8"),
        "tp_ar": gd.all_reduce(x["ints"], lay.tp),
        "tp_rs": gd.reduce_scatter(x["ints"], lay.tp, dim=1),
        "dp_ag": gd.all_gather(x["rnd"], lay.dp),
        "ep_ar": gd.all_reduce(x["ints"], lay.ep),
        "raw_pg": gd.all_reduce(x["ints"], lay.tp.pg),
    }
    out["unchanged"] = all(torch.equal(x[k], before[k]) for k in x)
    out["groups"] = (lay.tp.ranks, lay.tp.rank, lay.dp.ranks, lay.dp.rank, lay.ep.ranks)
    # A group of one inside a distributed world is the identity: no torch.distributed call.
    one = ctx.new_groups(tp=1, ep=1, dp=n).tp
    import torch.distributed as dist

    saved = {k: getattr(dist, k) for k in ("all_reduce", "all_to_all_single",
                                            "reduce_scatter_single", "all_gather_single")}

    def forbidden(*a, **k):
        raise AssertionError("torch.distributed called for a group of one")

    for k in saved:
        setattr(dist, k, forbidden)
    try:
        t = x["ints"]
        out["identity"] = [gd.all_reduce(t, one) is t, gd.reduce_scatter(t, one, 1) is t,
                           gd.all_gather(t, one, quant="int8") is t,
                           gd.all_to_all(t, [8], [8], one) is t, gd.all_reduce(t, None) is t]
    finally:
        for k, v in saved.items():
            setattr(dist, k, v)
    # Bad input is refused on every rank before anything is sent (no rank is left waiting).
    try:
        gd.reduce_scatter(torch.zeros(n + 1, 2), ctx.world)
        out["bad_rs"] = ""
    except gd.CommArgumentError as e:
        out["bad_rs"] = str(e)
    out["after_bad"] = gd.all_reduce(torch.ones(2), ctx.world)  # the world still works
    out["impl"] = gd.collective_impl("all_reduce", "cpu")[0]
    return out


def planted(ctx, seed: int) -> dict:
    """The same calls served by a registered backend for cpu whose collectives and quantizer
    carry planted bugs: reduce_scatter hands rank i chunk i+1, all_to_all returns the received
    blocks in reverse rank order, quantize_per_token (used by the default int8 all_gather)
    reports scales 1% too large."""
    import glm5
    from glm5.backends import selection
    from glm5.backends.registry import get_registry
    from glm5.ir.quant_formats import quantize_per_token_ref

    n, r = ctx.world_size, ctx.rank
    bug = glm5.Backend("commbug", "test", "cpu", priority=1000)

    @bug.kernel("quantize_per_token")
    def scale_off(x, bits):
        q, s = quantize_per_token_ref(x, bits)
        return q, s * 1.01

    def rs_wrong_chunk(x, g, dim=0):
        full = comm._torch_all_reduce(x, g)
        return full.chunk(g.size, dim=dim)[(g.rank + 1) % g.size].clone()

    def a2a_reversed(x, send, recv, g):
        y = comm._torch_all_to_all(x, send, recv, g)
        return torch.cat(list(reversed(y.split(recv))), 0)

    reg = get_registry()
    reg.register(bug)
    gd.register_collective("reduce_scatter", rs_wrong_chunk, backend="commbug")
    gd.register_collective("all_to_all", a2a_reversed, backend="commbug")
    try:
        x = make_inputs(r, n, seed)
        S = send_matrix(n)
        return {
            "impl": [gd.collective_impl(k, "cpu")[0] for k in ("reduce_scatter", "all_to_all",
                                                                "all_gather", "all_reduce")],
            "rs0": gd.reduce_scatter(x["ints"], ctx.world),
            "a2a": gd.all_to_all(x["a2a"], S[r], [S[s][r] for s in range(n)], ctx.world),
            "int8": gd.all_gather(x["tok"], ctx.world, dim=1, quant="int8"),
        }
    finally:  # the pool's world serves later checks: leave it as it was
        gd.unregister_collective("reduce_scatter", "commbug")
        gd.unregister_collective("all_to_all", "commbug")
        reg.backends.pop("commbug", None)
        selection.clear_cache()


# --------------------------------------------------------------------------- the checks (parent)
def problems(outs: list[dict], n: int, seed: int) -> list[str]:
    """Every output against the float64 reference of glm5.ir.ops_comm; the problems found."""
    xs = [make_inputs(r, n, seed) for r in range(n)]
    S = send_matrix(n)
    bad: list[str] = []

    def exact(key: str, refs: list[torch.Tensor], ranks: list[int]) -> None:
        for i, r in enumerate(ranks):
            if key in outs[r] and not torch.equal(outs[r][key].double(), refs[i]):
                bad.append(f"{key}: rank {r} differs from the reference")

    def within(key: str, refs: list[torch.Tensor], bounds: list[torch.Tensor]) -> None:
        for r in range(n):
            if key in outs[r]:
                err = (outs[r][key].double() - refs[r]).abs()
                if not bool((err <= bounds[r]).all()):
                    bad.append(f"{key}: rank {r} exceeds its bound by "
                               f"{float((err - bounds[r]).max()):.3g}")

    col = lambda k, ranks: [xs[r][k] for r in ranks]  # noqa: E731
    world = list(range(n))
    exact("ar_int", ops_comm.all_reduce_ref(col("ints", world)), world)
    exact("rs0", ops_comm.reduce_scatter_ref(col("ints", world)), world)
    exact("rs1", ops_comm.reduce_scatter_ref(col("ints", world), dim=1), world)
    exact("ag0", ops_comm.all_gather_ref(col("rnd", world)), world)
    exact("ag_1", ops_comm.all_gather_ref(col("rnd", world), dim=-1), world)
    exact("a2a", ops_comm.all_to_all_ref(col("a2a", world), S), world)
    for key, k in (("ar_rnd", "rnd"), ("ar_bf16", "bf16")):
        ref = ops_comm.all_reduce_ref(col(k, world))
        within(key, ref, [sum_bound(col(k, world), xs[0][k].dtype)] * n)
    for key, dt, dim in (("int8", torch.float32, 1), ("int8_bf16", torch.bfloat16, 0)):
        parts = [xs[r]["tok"].to(dt) for r in world]
        ref = ops_comm.all_gather_ref(parts, dim=dim)
        bound = torch.cat([int8_gather_bound(p) for p in parts], dim=dim)
        within(key, ref, [bound] * n)
    if n == 4:
        groups = {"tp_ar": [[0, 1], [2, 3]], "tp_rs": [[0, 1], [2, 3]], "dp_ag": [[0, 2], [1, 3]],
                  "ep_ar": [world], "raw_pg": [[0, 1], [2, 3]]}
    else:
        groups = {k: [world] for k in ("tp_ar", "tp_rs", "ep_ar", "raw_pg")}
        groups["dp_ag"] = [[0], [1]]
    refs = {"tp_ar": ops_comm.all_reduce_ref, "ep_ar": ops_comm.all_reduce_ref,
            "raw_pg": ops_comm.all_reduce_ref,
            "tp_rs": lambda v: ops_comm.reduce_scatter_ref(v, dim=1),
            "dp_ag": ops_comm.all_gather_ref}
    inp = {"tp_ar": "ints", "ep_ar": "ints", "raw_pg": "ints", "tp_rs": "ints", "dp_ag": "rnd"}
    for key, gs in groups.items():
        for ranks in gs:
            exact(key, refs[key](col(inp[key], ranks)), ranks)
    return bad


# --------------------------------------------------------------------------- pools
_pools: dict[int, DistPool] = {}


def pool(n: int) -> DistPool:
    p = _pools.get(n)
    if p is None or p.broken:
        p = _pools[n] = DistPool(n, comm_timeout_s=20.0)
    return p


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    for p in _pools.values():
        p.close()
    _pools.clear()


# --------------------------------------------------------------------------- multi-process tests
@pytest.mark.parametrize("n", [2, 4])
def test_collectives_match_the_float64_reference(n):
    outs = values(pool(n).run(collectives, 7, timeout_s=HARNESS_S))
    assert problems(outs, n, 7) == []
    for r, o in enumerate(outs):
        assert o["unchanged"], f"rank {r}: an input was modified"
        assert o["identity"] == [True] * 5
        assert o["impl"] == "torch.distributed"
        assert o["after_bad"].tolist() == [float(n)] * 2
        assert re.search(rf"argument 'x' expected x.shape\[0\] to be a multiple of the group "
                         rf"size {n}, got {n + 1}", o["bad_rs"]), o["bad_rs"]
        assert o["ag0"].shape == (8 * n, 4) and o["ag_1"].shape == (8, 4 * n)
        assert o["rs1"].shape == (8, 8 // n)
        assert o["a2a"].shape == (sum(send_matrix(n)[s][r] for s in range(n)), 3, 2)
    if n == 4:
        assert [o["groups"] for o in outs] == [
            ((0, 1), 0, (0, 2), 0, (0, 1, 2, 3)), ((0, 1), 1, (1, 3), 0, (0, 1, 2, 3)),
            ((2, 3), 0, (0, 2), 1, (0, 1, 2, 3)), ((2, 3), 1, (1, 3), 1, (0, 1, 2, 3))]


@pytest.mark.parametrize("n", [2, 4])
def test_the_all_to_all_counts_are_uneven_with_zeros(n):
    S = send_matrix(n)
    assert any(0 in row for row in S) and len({sum(row) for row in S}) > 1
    assert any(sum(1 for s in range(n) if S[s][r]) >= 2 for r in range(n))


def test_planted_bugs_are_caught():
    """A backend's registered collectives serve the calls (the selection rule), and the checks
    above catch each planted bug."""
    n = 2
    outs = values(pool(n).run(planted, 7, timeout_s=HARNESS_S))
    assert outs[0]["impl"] == ["commbug", "commbug", "torch.distributed", "torch.distributed"]
    found = problems(outs, n, 7)
    assert any(p.startswith("rs0: rank") for p in found), found
    assert any(p.startswith("a2a: rank") for p in found), found
    assert any(p.startswith("int8: rank") and "exceeds its bound" in p for p in found), found


# --------------------------------------------------------------------------- single process
def test_world_of_one_needs_no_process_group(monkeypatch):
    for v in gd.groups.ENV_VARS:
        monkeypatch.delenv(v, raising=False)
    import torch.distributed as dist

    ctx = gd.init_distributed(device="cpu")
    try:
        assert (ctx.rank, ctx.world_size, ctx.backend, ctx.distributed) == (0, 1, None, False)
        assert not dist.is_initialized()
        lay = ctx.new_groups(tp=1, ep=1)
        x = torch.randn(3, 4)
        for g in (None, ctx.world, lay.tp, lay.ep, lay.dp):
            assert gd.all_reduce(x, g) is x and gd.all_gather(x, g, 1) is x
            assert gd.reduce_scatter(x, g, 1) is x and gd.all_to_all(x, [3], [3], g) is x
        assert gd.get_context() is ctx
        with pytest.raises(RuntimeError, match="already initialized"):
            gd.init_distributed()
    finally:
        gd.destroy()
    assert gd.get_context() is None


def test_init_errors_name_the_variable_or_argument(monkeypatch):
    for v in gd.groups.ENV_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(gd.DistConfigError, match="WORLD_SIZE expected with RANK"):
        gd.init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(gd.DistConfigError, match="WORLD_SIZE expected an integer, got 'two'"):
        gd.init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(gd.DistConfigError, match="MASTER_ADDR expected"):
        gd.init_distributed(device="cpu")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(gd.DistConfigError, match=r"rank expected in \[0, 2\), got 2"):
        gd.init_distributed()
    with pytest.raises(gd.DistConfigError, match="'world_size' expected with rank"):
        gd.init_distributed(rank=0)
    with pytest.raises(gd.DistConfigError, match="'timeout_s' expected a positive number"):
        gd.init_distributed(timeout_s=0)
    monkeypatch.setenv("GLM5_DIST_TIMEOUT", "soon")
    with pytest.raises(gd.DistConfigError, match="GLM5_DIST_TIMEOUT expected a number"):
        gd.init_distributed()
    assert gd.get_context() is None


def test_default_timeout_comes_from_glm5_launch(monkeypatch):
    for v in gd.groups.ENV_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("GLM5_DIST_TIMEOUT", "7.5")
    ctx = gd.init_distributed(device="cpu")
    gd.destroy()
    assert ctx.timeout_s == 7.5


def test_layout_ranks_and_errors():
    assert gd.layout_ranks(4, tp=2, ep=4) == {
        "tp": [(0, 1), (2, 3)], "dp": [(0, 2), (1, 3)], "ep": [(0, 1, 2, 3)]}
    assert gd.layout_ranks(8, tp=2, ep=4) == {
        "tp": [(0, 1), (2, 3), (4, 5), (6, 7)], "dp": [(0, 2, 4, 6), (1, 3, 5, 7)],
        "ep": [(0, 1, 2, 3), (4, 5, 6, 7)]}
    assert gd.layout_ranks(4, tp=1, ep=2)["dp"] == [(0, 1, 2, 3)]
    with pytest.raises(gd.DistConfigError, match="argument 'tp' expected a divisor of the world "
                                                 "size 4, got 3"):
        gd.layout_ranks(4, tp=3, ep=1)
    with pytest.raises(gd.DistConfigError, match="argument 'ep' expected a positive int"):
        gd.layout_ranks(4, tp=1, ep=0)
    with pytest.raises(gd.DistConfigError, match=r"'tp' \* 'dp' expected to equal the world "
                                                 r"size 4, got 2 \* 1 = 2"):
        gd.layout_ranks(4, tp=2, ep=1, dp=1)


def test_collective_backend_comes_from_the_device_backends_settings(tmp_path, monkeypatch):
    import glm5
    from glm5.backends.registry import builtin_plugin_names

    assert [gd.collective_backend(d) for d in ("cpu", "cuda", "npu", "mlu", "musa")] == [
        "gloo", "nccl", "hccl", "cncl", "mccl"]
    assert gd.collective_backend(torch.device("cpu")) == "gloo"
    with pytest.raises(gd.DistConfigError, match="no backend for device type 'xla'"):
        gd.collective_backend("xla")
    names = ", ".join(f'"{n}"' for n in (builtin_plugin_names() or ("reference",)))
    policy = tmp_path / "p.toml"
    policy.write_text(f'[plugins]\nenabled = [{names}]\n[backends.cpu]\ncollective = "mpi"\n'
                      f'[backends.ascend]\ncollective = "hccl2"\n')
    monkeypatch.setenv("GLM5_PLUGINS", str(policy))
    glm5.reset_registry()
    assert gd.collective_backend("cpu") == "mpi"
    assert gd.collective_backend("npu") == "hccl2"


def test_argument_errors_name_the_function_and_argument():
    g = gd.Group("tp", (0, 1), 0, pg=object())  # never reached: input is checked first
    with pytest.raises(TypeError, match=r"glm5.parallel.all_reduce: argument 'x' expected a "
                                        r"torch.Tensor, got list"):
        gd.all_reduce([1.0], g)
    with pytest.raises(gd.CommArgumentError, match=r"reduce_scatter: argument 'dim' expected "
                                                   r"in \[-2, 2\)"):
        gd.reduce_scatter(torch.zeros(4, 2), g, dim=2)
    with pytest.raises(gd.CommArgumentError, match="all_gather: argument 'quant' expected None "
                                                   "or 'int8', got 'fp8'"):
        gd.all_gather(torch.zeros(4, 2), g, quant="fp8")
    with pytest.raises(gd.CommArgumentError, match="all_gather: argument 'x' expected a "
                                                   "floating dtype"):
        gd.all_gather(torch.zeros(4, 2, dtype=torch.int32), g, quant="int8")
    with pytest.raises(gd.CommArgumentError, match="'send_counts' expected 2 entries"):
        gd.all_to_all(torch.zeros(4, 2), [4], [2, 2], g)
    with pytest.raises(gd.CommArgumentError, match="'send_counts' expected to sum to "
                                                   r"x.shape\[0\] = 4, got sum 3"):
        gd.all_to_all(torch.zeros(4, 2), [1, 2], [2, 2], g)
    with pytest.raises(gd.CommArgumentError, match="'recv_counts' expected a list of 2 "
                                                   "non-negative ints"):
        gd.all_to_all(torch.zeros(4, 2), [2, 2], [2, -1], g)
    with pytest.raises(gd.CommArgumentError, match=r"'recv_counts' expected \[4\] for a group "
                                                   "of one rank"):
        gd.all_to_all(torch.zeros(4, 2), [4], [3], None)
    with pytest.raises(TypeError, match="argument 'group' expected a glm5.parallel Group"):
        gd.all_reduce(torch.zeros(2), "world")
    with pytest.raises(KeyError, match="argument 'name' expected one of all_reduce"):
        gd.register_collective("broadcast", lambda x, g: x, backend="cpu")


def test_link_bytes_by_hand():
    f32 = torch.float32
    # [8, 16] fp32: B = 512 bytes; n = 4.
    assert COMM_OPS["all_reduce"].link_bytes((8, 16), f32, 4) == 768.0  # 2 * 3/4 * 512
    assert COMM_OPS["reduce_scatter"].link_bytes((8, 16), f32, 4) == 384.0  # 3/4 * 512
    assert COMM_OPS["all_gather"].link_bytes((8, 16), f32, 4) == 1536.0  # 3 * 512
    # int8: 3 * (128 codes + 8 tokens * 4 scale bytes)
    assert COMM_OPS["all_gather"].link_bytes((8, 16), f32, 4, quant="int8") == 480.0
    assert COMM_OPS["all_gather"].link_bytes((2, 4, 16), torch.bfloat16, 2, dim=1,
                                             quant="int8") == 128.0 + 32.0
    # all_to_all of [10, 16] fp32 rows (64 bytes each), rank 1 sends [1, 2, 3, 4]: 1 + 3 + 4
    assert COMM_OPS["all_to_all"].link_bytes((10, 16), f32, 4, send_counts=[1, 2, 3, 4],
                                             rank=1) == 512.0
    assert COMM_OPS["all_reduce"].link_bytes((8, 16), torch.bfloat16, 2) == 256.0
    # Through glm5.parallel: the group's size and rank; a group of one moves nothing.
    g = gd.Group("ep", (0, 1, 2, 3), 1, pg=object())
    x = torch.zeros(10, 16)
    assert gd.link_bytes("all_to_all", x, g, send_counts=[1, 2, 3, 4]) == 512.0
    assert gd.link_bytes("all_reduce", x, g) == 2 * 3 / 4 * 640
    assert gd.link_bytes("all_reduce", x, None) == 0.0


def test_shape_functions():
    assert COMM_OPS["reduce_scatter"].out_shape((8, 6), 2, dim=0) == (4, 6)
    assert COMM_OPS["all_gather"].out_shape((8, 6), 4, dim=-1) == (8, 24)
    assert COMM_OPS["all_to_all"].out_shape((5, 3), 2, recv_counts=[0, 7]) == (7, 3)
    with pytest.raises(ValueError, match="not a multiple of the group size 4"):
        COMM_OPS["reduce_scatter"].out_shape((6, 2), 4)


def test_references_by_hand():
    a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    assert ops_comm.reduce_scatter_ref([a, b])[1].tolist() == [[33.0, 44.0]]
    assert ops_comm.all_gather_ref([a, b], dim=1)[0].tolist() == [[1, 2, 10, 20], [3, 4, 30, 40]]
    x0, x1 = torch.arange(3.0)[:, None], 10 + torch.arange(2.0)[:, None]
    # rank 0 sends row 0 to itself, rows 1-2 to rank 1; rank 1 sends nothing to 0, both to 1
    out = ops_comm.all_to_all_ref([x0, x1], [[1, 2], [0, 2]])
    assert out[0].flatten().tolist() == [0.0]
    assert out[1].flatten().tolist() == [1.0, 2.0, 10.0, 11.0]


def test_int8_bound_is_the_rounding_budget_and_catches_a_scale_1pct_off():
    from glm5.ir.quant_formats import quantize_per_token_ref

    x = torch.randn(64, 32) * torch.logspace(-3, 3, 64)[:, None]
    q, s = quantize_per_token_ref(x, 8)
    bound = int8_gather_bound(x)
    ok = q.float() * s[:, None]
    assert bool(((ok.double() - x.double()).abs() <= bound).all())
    off = q.float() * (s * 1.01)[:, None]
    assert not bool(((off.double() - x.double()).abs() <= bound).all())
    # the budget: half a code step, amax / 254 per token, and no looser than 1% over it
    amax = x.double().abs().amax(-1, keepdim=True)
    assert bool((bound <= amax / 254 * 1.01).all()) and bool((bound >= amax / 254).all())
    assert bool((int8_gather_bound(torch.zeros(2, 4)) == 0).all())


def test_docs_list_every_collective_with_its_call_and_cost():
    text = (ROOT / "docs" / "ops.md").read_text()
    m = re.search(r"\n## Communication.*?(?=\n## )", text, re.S)
    assert m, "docs/ops.md has no '## Communication' section"
    sec = m.group(0)
    for name, op in COMM_OPS.items():
        assert f"\n### `glm5.parallel.{name}`\n" in sec, name
        assert f"`{op.call_text()}`" in sec, op.call_text()
        assert f"`{op.cost_text}`" in sec, (name, op.cost_text)
    assert "glm5.ir.catalog.OPS" in sec  # says why the catalog is separate


def _doc_blocks() -> list[str]:
    text = (ROOT / "docs" / "distributed.md").read_text()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_distributed_md_world_of_one_example_runs_as_written(monkeypatch, capsys):
    for v in gd.groups.ENV_VARS:
        monkeypatch.delenv(v, raising=False)
    code = next(b for b in _doc_blocks() if "init_distributed()" in b)
    exec(compile(code, "distributed.md", "exec"), {"__name__": "__doc__"})
    assert capsys.readouterr().out.startswith("0 1 None tensor([1., 1., 1.])")
    assert gd.get_context() is None


def test_distributed_md_harness_example_runs_as_written(tmp_path):
    import os
    import subprocess
    import sys

    code = next(b for b in _doc_blocks() if "run_multiprocess(check" in b)
    script = tmp_path / "harness_example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    want = [ln.split("# ")[1] for ln in code.splitlines() if "print(values(run" in ln]
    assert p.stdout.splitlines() == [want[0], str([[6.0, 6.0]] * 4)], p.stdout


def _explicit_and_adopted(directory: str) -> dict:
    """Without the harness's init: an explicit file:// init, then a process group made by the
    caller and adopted."""
    import os

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    ctx = gd.init_distributed(backend="gloo", rank=rank, world_size=2, device="cpu",
                              init_method=f"file://{directory}/explicit", timeout_s=20)
    out = {"explicit": (ctx.rank, ctx.world_size, ctx.backend, ctx.timeout_s),
           "sum1": gd.all_reduce(torch.tensor([rank + 1.0]), ctx.world).item()}
    lay = ctx.new_groups(tp=2)
    pg = weakref.ref(ctx.world.pg)
    gd.destroy()
    out["destroyed"] = not dist.is_initialized()
    # destroy lets go of the group at once (one kept until interpreter exit can abort a clean
    # run), and a collective on the destroyed context still raises instead of being the identity
    out["released"] = (pg() is None, lay.tp.pg is None, ctx.distributed)
    try:
        gd.all_reduce(torch.ones(1), lay.tp)
        out["after"] = "no error"
    except RuntimeError as e:
        out["after"] = str(e)
    dist.init_process_group("gloo", init_method=f"file://{directory}/own", rank=rank,
                            world_size=2)
    ctx = gd.init_distributed(timeout_s=20)
    out["adopted"] = (ctx.rank, ctx.world_size, ctx.backend)
    out["sum2"] = gd.all_reduce(torch.tensor([rank + 1.0]), ctx.world).item()
    ctx.destroy()
    out["kept"] = dist.is_initialized()  # the caller's group is the caller's to destroy
    dist.destroy_process_group()
    return out


def test_explicit_init_and_an_adopted_process_group(tmp_path):
    from glm5.testing.dist import run_multiprocess

    outs = values(run_multiprocess(_explicit_and_adopted, 2, HARNESS_S, str(tmp_path),
                                   init=False))
    for r, o in enumerate(outs):
        assert o == {"explicit": (r, 2, "gloo", 20.0), "sum1": 3.0, "destroyed": True,
                     "released": (True, True, False),
                     "after": "glm5.parallel.DistContext.all_reduce: the context was destroyed",
                     "adopted": (r, 2, "gloo"), "sum2": 3.0, "kept": True}
