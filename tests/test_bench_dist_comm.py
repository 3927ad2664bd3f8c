"""bench/dist_comm.py's accounting at toy sizes: the collectives its wrapper sees in one forward
of a 2-rank FlashComm-int8 `tiny` model are the calls the layout makes, with the link bytes of
glm5.ir.ops_comm's formulas; the replay runs the same calls; the planner rows are the plan's;
the measured rows count every collective against `glm5.deploy.plan.layer_comm`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from glm5.testing.dist import DistPool, values

BENCH = Path(__file__).resolve().parents[1] / "bench" / "dist_comm.py"


def _bench():
    name = "glm5_bench_dist_comm"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    return sys.modules[name]


def _metered(ctx, tokens: int) -> dict:
    from glm5.parallel.layouts import ParallelConfig, parallelize

    b = _bench()
    cfg = ParallelConfig.from_context(ctx, tp=2, flashcomm=True, flashcomm_min_tokens=0,
                                      comm_quant="int8")
    model = parallelize(b._model("tiny"), cfg)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with b.CommMeter(keep_calls=True) as m:
            y = model(ids)
        again = b.replay(ctx, m.calls)
    from glm5.parallel import comm

    return {"totals": m.totals, "replayed": sorted(again), "restored":
            comm.all_gather.__name__ == "all_gather", "shape": list(y.shape)}


def test_comm_meter_counts_the_layouts_calls_and_their_link_bytes():
    with DistPool(2, comm_timeout_s=60) as pool:
        res = values(pool.run(_metered, 5, timeout_s=120))
    D, L, n, T = 64, 3, 2, 5  # tiny: hidden 64, 3 layers; 5 tokens pad to 6 over 2 ranks
    P = T + (-T % n)
    for r in res:
        t = r["totals"]
        assert set(t) == {"reduce_scatter", "all_gather_int8", "all_gather"}, t
        assert t["reduce_scatter"][0] == 2 * L  # after attention and after the MLP
        assert t["all_gather_int8"][0] == 2 * L  # before attention and before the MLP
        assert t["all_gather"][0] == 1  # the residual stream, once at the end
        # reduce-scatter of [P, D] fp32: (n-1)/n of its bytes
        assert t["reduce_scatter"][2] == 2 * L * (n - 1) / n * P * D * 4
        # int8 gather of a [P/n, D] shard: (n-1) x (codes + one fp32 scale per token)
        assert t["all_gather_int8"][2] == 2 * L * (n - 1) * (P // n * D + 4 * P // n)
        assert t["all_gather"][2] == (n - 1) * P // n * D * 4
        assert all(v[1] > 0 for v in t.values())  # timed
        assert r["replayed"] == sorted(t)
        assert r["restored"]  # the wrappers are gone after the block
        assert r["shape"] == [1, T, 128]


def test_plan_rows_are_the_planners():
    from glm5.core.config import preset
    from glm5.deploy.plan import plan

    rows = _bench().run_plan()
    assert {(r["chip"], r["tp"], r["ep"], r["phase"]) for r in rows} == {
        (c, tp, ep, ph) for c, lays in _bench().PLAN_LAYOUTS.items() for tp, ep in lays
        for ph in ("decode", "prefill")}
    r = next(r for r in rows if (r["chip"], r["tp"], r["ep"], r["phase"]) ==
             ("h200", 8, 8, "prefill"))
    p = plan(preset("glm-5"), "h200", "w4a8", 1, 8192, tp=8, ep=8)["prefill"]
    moe = next(k for k in p["comm"]["kinds"] if k["kind"] == "moe")
    assert r["per_moe_layer"]["flashcomm"]["total_us"] == moe["tp"]["flashcomm"]["total_us"]
    assert r["total_ms"] == p["total_ms"] and r["comm_option"] == p["comm_option"]


def _measured(ctx, preset_name: str, tokens: list[int]) -> dict:
    return _bench().measured_task(ctx, preset_name, tokens)


def test_measured_rows_are_counted_against_planned():
    """The measured part at toy size (tiny, 2 ranks, 5 tokens): a row per layout and layer,
    every one equal, and the report prints the table."""
    import argparse
    import contextlib
    import io

    from glm5.core.config import preset

    b = _bench()
    rows = b.run_measured(argparse.Namespace(preset="tiny", measured_procs=2,
                                             measured_tokens=[5]), _measured)
    L = preset("tiny").num_hidden_layers
    assert len(rows) == len(b.MEASURED_LAYOUTS) * L
    assert {r["layout"] for r in rows} == set(b.MEASURED_LAYOUTS)
    assert all(r["equal"] for r in rows), [r for r in rows if not r["equal"]]
    assert all(r["counted_per_rank"] == r["planned_per_rank"] for r in rows)
    fc = next(r for r in rows if r["layout"] == "tp+flashcomm" and r["layer"] == L - 1)
    # 5 tokens pad to 6: gathers of [3, 64] fp32 shards, reduce-scatters of [6, 64]; + the end
    assert fc["collectives"] == ["all_gather", "reduce_scatter"] * 2 + ["all_gather"]
    assert fc["counted_rank0"] == [3 * 64 * 4] * 5
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        b.report({"date": "d", "command": "c", "machine": {"cpu": "x", "cores": 2},
                  "preset": "tiny", "measured": rows})
    assert "measured vs planned link bytes per layer" in out.getvalue()
    assert out.getvalue().count("| yes |") == len(rows)
