"""bench/gpu_suite.py without a GPU, so that a GPU session does not find the script's bugs: the
dry run checks every GPU shape against its op on the meta device, and ``--device cpu`` runs the
whole sequence (kit parity, ceilings, timings against the references and baselines, table,
JSON) with the cuda backend's kernels through the Triton interpreter at tiny shapes. And the
kit's copy of an example to a device keeps its views and aliasing
(`glm5.testing.compare.to_device`), which the suite's parity on a GPU relies on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glm5.testing.compare import to_device

ROOT = Path(__file__).resolve().parents[1]


def _suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "bench" / "gpu_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_checks_every_gpu_shape(capsys):
    gs = _suite()
    assert gs.dry_run() == 0
    n = sum(len(dts) for shapes in gs.SHAPES.values() for _, _, dts, _ in shapes)
    assert f"dry run: {n} GPU shapes checked against their op signatures" in capsys.readouterr().out
    assert gs.shp.DEV == "cuda"  # restored


def test_a_malformed_gpu_shape_fails_the_dry_run(monkeypatch):
    gs = _suite()
    bad = lambda dt: {"x": gs.rn(4, 8, dt=dt), "weight": gs.rn(16, dt=dt), "eps": 1e-5}  # noqa
    monkeypatch.setitem(gs.SHAPES, "rms_norm", [("D mismatch", bad, (gs.BF,), None)])
    assert gs.dry_run(["rms_norm"]) == 1


def test_cpu_smoke_runs_the_whole_sequence(tmp_path):
    pytest.importorskip("triton")
    gs = _suite()
    env = {**os.environ, "TRITON_INTERPRET": "1", "GLM5_TUNING_CACHE": "off"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--device", "cpu",
                        "--examples", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = tmp_path.glob("gpu_suite_*.json")
    res = json.loads(path.read_text())
    assert res["smoke"] is True and res["device"] == "cpu (Triton interpreter)"
    # parity: every smoke op, every dtype the kernel claims, through the kit
    assert {p["op"] for p in res["parity"]} == set(gs.SMOKE_SHAPES)
    assert all(p["status"] == "pass" for p in res["parity"]), res["parity"]
    assert res["measured"]["bf16_matmul_flops"] > 0 and res["measured"]["copy_bytes_per_s"] > 0
    # timings: one row per smoke shape and dtype, each timed against its reference and baseline
    want = [(op, label, dt, bl) for op, shapes in gs.SMOKE_SHAPES.items()
            for label, _, dts, bl in shapes for dt in dts]
    rows = {(t["op"], t["shape"], t["dtype"]): t for t in res["timings"]}
    assert len(rows) == len(want) == len(res["timings"])
    for op, label, dt, bl in want:
        t = rows[(op, label, str(dt).removeprefix("torch."))]
        assert t["ms"] > 0 and t["reference_ms"] > 0 and t["note"] == "", t
        assert t["tflops"] > 0 and t["gbps"] > 0
        assert (t["baseline_ms"] is not None and t["baseline_ms"] > 0) == (bl is not None), t
    n = len(res["parity"])
    assert f"parity: {n} passed, 0 failed, 0 skipped | {len(want)} timing rows" in r.stdout


def test_to_device_keeps_views_aliasing_and_layout():
    k = torch.randn(6, 1, 8)
    v = k[..., :4]  # MQA: v is k's first columns
    t = torch.randn(4, 6).T  # a transposed layout
    off = torch.arange(10, dtype=torch.int32)[3:7]  # an offset into its storage
    out = to_device({"k": k, "v": v, "t": t, "off": off, "scale": 0.5}, "cpu")
    for name, x in (("k", k), ("v", v), ("t", t), ("off", off)):
        y = out[name]
        assert torch.equal(y, x) and y.dtype == x.dtype
        assert y.stride() == x.stride() and y.storage_offset() == x.storage_offset()
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # a copy
    assert out["v"].untyped_storage().data_ptr() == out["k"].untyped_storage().data_ptr()
    assert out["scale"] == 0.5
    out["k"][0, 0, 0] = 42.0  # one storage on the device, as on the host; the host untouched
    assert out["v"][0, 0, 0] == 42.0 and k[0, 0, 0] != 42.0


def _gpu_run(tmp_path: Path, *budgets: str) -> tuple[Path, list[str]]:
    """Run ``GPU_RUN_SMOKE=1 bench/gpu_run.sh *budgets`` with ``$OUT`` set: ($OUT, the kinds of
    file in it). tuning_cache/ is left out: it is there only when the emulated search kept a
    winner, which interpreter times (noise) decide."""
    pytest.importorskip("triton")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "RESULTS"}
    env.update(OUT=str(out), GPU_RUN_SMOKE="1")
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), *budgets],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return out, sorted(p.name.split("_2")[0] for p in out.iterdir() if p.name != "tuning_cache")


def test_gpu_run_sh_smoke_brings_back_every_file(tmp_path):
    """bench/gpu_run.sh, what a GPU session runs, end to end on the CPU: suite, model run, tile
    search, every JSON file written into $OUT (which the device tool brings back)."""
    pytest.importorskip("transformers")
    out, got = _gpu_run(tmp_path, "60", "60", "30")
    assert got == ["cuda_tuning_candidate.json", "gpu_model", "gpu_suite", "gpu_tune"], got
    (suite,) = out.glob("gpu_suite_*.json")
    res_suite = json.loads(suite.read_text())
    assert res_suite["smoke"] and res_suite["parity"] and res_suite["timings"]
    (model,) = out.glob("gpu_model_*.json")
    assert json.loads(model.read_text())["decode"]
    (tune,) = out.glob("gpu_tune_*.json")
    assert json.loads(tune.read_text())["emulated"] is True


def test_the_suite_json_is_written_as_it_goes(tmp_path, monkeypatch):
    """The suite rewrites its JSON after each part and timing row: a run killed at the device
    tool's time limit still brings back what it measured."""
    pytest.importorskip("triton")
    gs = _suite()
    seen: list[int] = []
    real = gs.time_op

    def time_op(*a, **k):
        seen.append(len(json.loads(next(tmp_path.glob("gpu_suite_*.json")).read_text())[
            "timings"]))
        return real(*a, **k)

    monkeypatch.setattr(gs, "time_op", time_op)
    monkeypatch.setattr(gs.shp, "DEV", "cuda")  # main sets "cpu"; restored after the test
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gs.main(["--device", "cpu", "--examples", "1", "--ops", "rms_norm",
                    "--out", str(tmp_path)]) == 0
    assert seen == [0, 1]  # before each row: the parity rows and the rows timed so far on disk


def test_gpu_run_sh_budget_0_skips_a_step(tmp_path):
    """The tile search as its own command (the device tool allows 600 s a command): budgets of
    0 skip the suite and the model run."""
    _, got = _gpu_run(tmp_path, "0", "0", "30")
    assert got == ["cuda_tuning_candidate.json", "gpu_tune"], got
