"""bench/gpu_tune.py: the tile search's procedure on CPU (interpreted kernels, tiny shapes):
candidates, the verdict gate that rejects a wrong kernel, and the table merge."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the Triton kernels on CPU tensors (interpreter)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_tune  # noqa: E402


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(gpu_tune.gs, "DEV", "cpu")


def test_candidates():
    assert gpu_tune.candidates("BLOCK_K", 64) == [64, 32, 128]
    assert gpu_tune.candidates("BLOCK_K", 16) == [16, 32]
    assert gpu_tune.candidates("BLOCK_K", 48) == [48]  # not a power of two: left alone
    assert gpu_tune.candidates("num_warps", 8) == [8, 4]
    assert gpu_tune.candidates("MERGE", "auto") == ["auto"]
    assert gpu_tune.candidates("TARGET_PROGRAMS", 264) == [264, 132, 528]
    assert gpu_tune.candidates("SPLIT_MIN_KEYS", 128) == [128, 64, 256]
    assert gpu_tune.candidates("TARGET_PROGRAMS_INTERPRETED", 0) == [0]  # never searched
    assert gpu_tune.candidates("RESIDENT_Q", False) == [False, True]
    assert set(gpu_tune.searchable({"BLOCK_K": 32, "MAX_TOPK": 7})) == {
        "BLOCK_K", "num_warps", "num_stages"}
    # regime-prefixed keys are searched, and no plain launch option pins every regime
    assert gpu_tune.candidates("MHA_BLOCK_N", 32) == [32, 16, 64]
    assert set(gpu_tune.searchable({"MHA_BLOCK_N": 32, "MHA_num_warps": 8,
                                    "decode_num_stages": 2})) == {
        "MHA_BLOCK_N", "MHA_num_warps", "decode_num_stages"}


def test_search_and_write(cpu, tmp_path):
    table = tmp_path / "tuning.json"
    table.write_text(json.dumps({"attention": {"BLOCK_K": 32}}))
    out = tmp_path / "r.json"
    assert gpu_tune.main(["--device", "cpu", "--ops", "rms_norm", "--budget-s", "60",
                          "--out", str(out), "--write", str(table), "--min-gain", "-1"]) == 0
    res = json.loads(out.read_text())["results"]
    assert res[0]["op"] == "rms_norm" and res[0]["default"]["ms"] > 0
    assert len(res[0]["trials"]) > 1 and all("ms" in t or "error" in t for t in res[0]["trials"])
    merged = json.loads(table.read_text())
    assert merged["attention"] == {"BLOCK_K": 32}  # other ops' entries are kept
    if res[0]["best"]["params"] != res[0]["default"]["params"]:
        assert merged["rms_norm"]


def test_a_wrong_candidate_is_rejected(cpu, monkeypatch):
    real = gpu_tune._op_fn

    def off_by_one_percent(op, entry):
        fn = real(op, entry)
        return lambda *a: fn(*a) * 1.01

    build = gpu_tune.TINY["rms_norm"][0][1]()
    call = gpu_tune._call("rms_norm", build, torch.bfloat16)
    clock = gpu_tune.Clock("cpu")
    base = {"BLOCK_D": 1024}
    assert "ms" in gpu_tune.trial("rms_norm", base, call, call, clock, 0.01)
    monkeypatch.setattr(gpu_tune, "_op_fn", off_by_one_percent)
    t = gpu_tune.trial("rms_norm", base, call, call, clock, 0.01)
    assert "ms" not in t and t["error"].startswith("verdict")


def test_merge_keeps_only_real_gains(tmp_path):
    path = tmp_path / "t.json"
    base = {"x": {"BLOCK": 32, "num_warps": 4}}
    res = [{"op": "x", "default": {"ms": 1.0, "params": base["x"]},
            "best": {"ms": 0.97, "params": {"BLOCK": 64, "num_warps": 4}}}]
    assert gpu_tune.merge_into(path, res, base, 0.05) == {}
    res[0]["best"]["ms"] = 0.5
    assert gpu_tune.merge_into(path, res, base, 0.05) == {"x": {"BLOCK": 64}}
