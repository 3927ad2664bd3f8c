"""bench/gpu_model.py runs its whole sequence (prefill against transformers, the fp8 indexer's
prefill, decode steps, profile) as a CPU smoke test on the tiny preset, and writes the JSON
the GPU run quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "gm.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_model.py"), "--device", "cpu",
                        "--preset", "tiny", "--prefill", "16,40", "--hf-max", "16",
                        "--decode-batches", "1,2", "--decode-prompt", "12", "--first-steps", "2",
                        "--decode-steps", "2", "--profile-len", "16", "--fp8-prefill", "40",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    pre = {row["tokens"]: row for row in res["prefill"]}
    assert set(pre) == {16, 40}
    assert pre[16]["glm5_s"] > 0 and pre[16]["hf_s"] > 0 and pre[16]["speedup"] > 0
    assert "hf_s" not in pre[40]  # above --hf-max
    (f8,) = res["prefill_fp8"]  # the fp8 indexer at 40 tokens, against the bf16 row
    assert f8["tokens"] == 40 and f8["glm5_s"] > 0 and f8["fp8_over_bf16"] > 0
    dec = {row["batch"]: row for row in res["decode"]}
    assert set(dec) == {1, 2}
    for row in dec.values():
        assert len(row["first_steps_ms"]) == 2 and row["steady_ms"] > 0
    assert res["profile"]["kernels"] and 0 < res["profile"]["kernels"][0]["share"] <= 1


def test_without_cuda_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_model.py")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "no CUDA device" in r.stdout


def _gpu_model():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_model", ROOT / "bench" / "gpu_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_failing_part_keeps_the_rest_and_the_json(tmp_path, monkeypatch, capsys):
    """One GPU session is all there is: a part that raises (here the decode rows; at one length
    the prefill) is recorded, the other parts still run, the JSON is written and the exit code
    says something failed; without transformers the prefill rows run glm5 alone."""
    gm = _gpu_model()

    def broken_decode(*a, **k):
        raise RuntimeError("planted decode failure")
        yield  # a generator, as decode_rows is

    real_build = gm.build_model

    def build(*a, **k):  # the model's forward fails at 24 tokens only
        m = real_build(*a, **k)
        fwd = m.forward

        def forward(ids, *x, **y):
            if ids.shape[-1] == 24:
                raise RuntimeError("planted prefill failure")
            return fwd(ids, *x, **y)

        m.forward = forward
        return m

    monkeypatch.setattr(gm, "build_model", build)
    monkeypatch.setattr(gm, "decode_rows", broken_decode)
    monkeypatch.setattr(gm, "load_hf", lambda *a: (_ for _ in ()).throw(
        ImportError("no GlmMoeDsaForCausalLM")))
    out = tmp_path / "gm.json"
    rc = gm.main(["--device", "cpu", "--preset", "tiny", "--prefill", "16,24", "--hf-max", "16",
                  "--decode-batches", "1", "--decode-prompt", "12", "--first-steps", "1",
                  "--decode-steps", "1", "--profile-len", "16", "--fp8-prefill", "",
                  "--out", str(out)])
    assert rc == 1
    res = json.loads(out.read_text())
    assert res["errors"] == {"decode": "RuntimeError: planted decode failure"}
    pre = {row["tokens"]: row for row in res["prefill"]}
    assert pre[16]["glm5_s"] > 0
    assert pre[24]["glm5_s"] is None and pre[24]["error"] == "RuntimeError: planted prefill failure"
    assert "hf_s" not in pre[16] and pre[16]["hf_note"].startswith("transformers unavailable")
    assert res["profile"]["kernels"]  # the part after the failing one ran
    assert "planted decode failure" in capsys.readouterr().out
