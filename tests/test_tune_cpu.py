"""`glm5 tune --backend cpu`: quant_linear's crossovers measured on this CPU, kept in the tuning
cache and put in force by the cpu backend (`quant.use_crossovers`)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("tvm")

from glm5.backends import cpu as cpu_backend  # noqa: E402
from glm5.backends import tuning_cache as tc  # noqa: E402
from glm5.cli import main as cli  # noqa: E402
from glm5.kernels.tvm import quant, quant_vgemm  # noqa: E402
from glm5.testing import tune_cpu  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def crossovers():
    yield
    quant.use_crossovers({})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tc.ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_pair_is_the_tables_small_and_large_path(monkeypatch, crossovers):
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (True, "t"))
    quant.use_crossovers({})  # forget pairs computed under other features
    assert quant.pair("w8a16", "vnni", F32) == ("vnni", "vgemm", 32)
    assert quant.pair("w8a16", "vnni", BF16) == ("vnni", "vgemm", 16)
    assert quant.pair("w8a8", "vnni", F32) == ("vnni", "vgemm", 16)
    assert quant.pair("w8a8", "portable", F32) == ("tvm", "torch:gemm", 384)
    assert quant.pair("w4a8", "portable", F32) is None  # one path for every row count
    assert quant.pair("w6a12", "amx", BF16) == ("vnni", "amx", 2)
    # without AVX-512 BF16 the VNNI tier's w8a16 on bf16 x has the GEMV only
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (False, "t"))
    quant.use_crossovers({})
    assert quant.pair("w8a16", "vnni", BF16) is None


def test_crossovers_in_force_move_the_switch(monkeypatch, crossovers):
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (True, "t"))
    quant.use_crossovers({"vnni/w8a8/float32": 4, "vnni/w8a16/bfloat16": 0})
    assert quant.path("w8a8", 4, "vnni", F32) == "vnni"
    assert quant.path("w8a8", 5, "vnni", F32) == "vgemm"
    assert quant.path("w8a16", 1, "vnni", BF16) == "vgemm"  # 0: the GEMM from one row
    # other dtypes, schemes and tiers keep the table
    assert quant.path("w8a8", 16, "vnni", BF16) == "vnni"
    assert quant.path("w8a8", 17, "vnni", BF16) == "vgemm"
    assert quant.path("w8a8", 16, "amx", F32) == "amx"
    quant.use_crossovers({})
    assert quant.path("w8a8", 5, "vnni", F32) == "vnni"


def test_a_crossover_moves_only_the_first_switch(monkeypatch, crossovers):
    """w8a16 on bf16 x has three paths on the VNNI tier (GEMV, VNNI GEMM to 128 rows, oneDNN):
    a measured GEMV / GEMM crossover moves the first switch, the table's second one stays,
    and a crossover past it hands the GEMV's last row straight to oneDNN."""
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (True, "t"))
    for rows, want in ((8, {8: "vnni", 9: "vgemm", 128: "vgemm", 129: "onednn"}),
                       (0, {1: "vgemm", 128: "vgemm", 129: "onednn"}),
                       (150, {150: "vnni", 151: "onednn"})):
        quant.use_crossovers({"vnni/w8a16/bfloat16": rows})
        assert {m: quant.path("w8a16", m, "vnni", BF16) for m in want} == want, rows


@pytest.mark.parametrize("bad", [{"vnni/w8a8": 4}, {"gpu/w8a8/float32": 4},
                                 {"vnni/w9a9/float32": 4}, {"vnni/w8a8/float16": 4},
                                 {"vnni/w8a8/float32": -1}, {"vnni/w8a8/float32": 4.5},
                                 {"vnni/w8a8/float32": True}])
def test_bad_crossovers_are_refused(bad, crossovers):
    with pytest.raises(ValueError, match="glm5 quant_linear crossovers"):
        quant.use_crossovers(bad)


def test_crossover_rule():
    t = lambda pairs: {m: {"g": a, "G": b} for m, (a, b) in pairs.items()}  # noqa: E731
    assert tune_cpu.crossover(t({1: (1, 5), 8: (2, 3), 16: (4, 3), 32: (8, 3)}), "g", "G") == 8
    # a rung where the GEMV wins again above a loss: the switch is above it
    assert tune_cpu.crossover(t({1: (1, 5), 8: (4, 3), 16: (3, 3.5), 32: (8, 3)}),
                              "g", "G") == 16
    assert tune_cpu.crossover(t({1: (5, 1), 8: (6, 1)}), "g", "G") == 0
    assert tune_cpu.crossover(t({1: (1, 5), 8: (2, 6)}), "g", "G") == 8
    # within 3% is a tie, which the GEMV keeps; 4% is not
    assert tune_cpu.crossover(t({1: (1, 5), 8: (1.029, 1.0), 16: (2, 1)}), "g", "G") == 8
    assert tune_cpu.crossover(t({1: (1, 5), 8: (1.04, 1.0), 16: (2, 1)}), "g", "G") == 1


def test_tuner_measures_every_pair_and_caches(cache, monkeypatch, crossovers):
    """On this CPU's tier, at tiny sizes, with a scripted clock that makes the GEMM win from 4
    rows: every pair the tier has is judged and measured, and the crossovers are cached under
    this CPU's key; a new start of the backend puts them in force."""
    tier = quant.cpu_tier()
    ctx = cpu_backend.context
    ctx()
    ran = []
    real_run = quant._run

    def run(p, context, x, wp, ws, scheme):
        ran.append((p, x.shape[0]))
        return real_run(p, context, x, wp, ws, scheme)

    def scripted(fn, reps):
        fn()
        p, m = ran[-1]
        small = p in ("vnni", "tvm")
        return (1.0 if small else 2.0) if m < 4 else (2.0 if small else 1.0)

    monkeypatch.setattr(quant, "_run", run)
    report = tune_cpu.run(ctx, K=256, N=64, reps=1, ladder=(1, 2, 4, 8), clock=scripted,
                          say=lambda s: None)
    pairs = [(s, d) for s in quant.SCHEMES for d in (F32, BF16)
             if quant.pair(s, tier, d) is not None]
    assert len(report["results"]) == len(pairs)
    key, _ = tc.cpu_key(tier, torch.get_num_threads())
    assert report["device_key"] == key and report["tier"] == tier
    for r in report["results"]:
        assert "error" not in r, r
        assert r["crossover"] == 2 and set(r["times"]) == {1, 2, 4, 8}
    kept = report["kept"].get("quant_linear", {})
    assert kept == {quant.crossover_key(tier, s, d): 2 for s, d in pairs}
    if not kept:
        return  # a tier with one path per scheme: nothing to cache
    data = tc.read(tc.path_for("cpu", key))
    assert data["quant_linear"] == kept
    assert data[tc.META]["kernels"] == tc.kernels_hash("tvm")
    quant.use_crossovers({})
    monkeypatch.setattr(cpu_backend, "_ctx", None)
    cpu_backend.context()  # the backend starting: the cache in force
    assert quant._crossovers == kept and "quant_linear" in cpu_backend.tuning_state
    s, d = pairs[0]
    small, large, _ = quant.pair(s, tier, d)
    assert quant.path(s, 2, dtype=d) == small and quant.path(s, 3, dtype=d) == large


def test_a_wrong_path_is_caught_before_timing(cache, monkeypatch, crossovers):
    tier = quant.cpu_tier()
    pairs = [(s, d) for s in quant.SCHEMES for d in (F32,) if quant.pair(s, tier, d)]
    if not pairs:
        pytest.skip(f"tier {tier} has one path per scheme")
    s, d = pairs[0]
    small, large, _ = quant.pair(s, tier, d)
    real_run = quant._run
    monkeypatch.setattr(quant, "_run", lambda p, *a: real_run(p, *a) * (1.01 if p == large
                                                                           else 1.0))
    m = tune_cpu.measure(cpu_backend.context, s, d, small, large, (1, 2), 256, 64, 1,
                         float("inf"))
    assert m["error"].startswith(f"{large}: verdict")


@pytest.mark.parametrize("case", ["stale", "other CPU", "bad entry", "off"])
def test_backend_ignores_a_cache_that_does_not_apply(case, cache, monkeypatch, crossovers):
    key, _ = tc.cpu_key(quant.cpu_tier(), torch.get_num_threads())
    entry = {"quant_linear": {quant.crossover_key(quant.cpu_tier(), "w8a8", F32): 0}}
    meta = {"kernels": tc.kernels_hash("tvm")}
    if case == "stale":
        tc.write(tc.path_for("cpu", key), entry, {"kernels": "0" * 16})
    elif case == "other CPU":
        tc.write(tc.path_for("cpu", key + "-other"), entry, meta)
    elif case == "bad entry":
        tc.write(tc.path_for("cpu", key), {"quant_linear": {"x/y/z": 1}}, meta)
    else:
        tc.write(tc.path_for("cpu", key), entry, meta)
        monkeypatch.setenv(tc.ENV, "off")
    why = cpu_backend.apply_tuning_cache()
    assert quant._crossovers == {}, why
    if case == "bad entry":
        assert why.startswith("ignored: glm5 quant_linear crossovers")


def test_cpu_key_names_model_tier_and_threads(monkeypatch):
    from glm5 import host_cpu

    monkeypatch.setattr(host_cpu, "_model", ["AMD EPYC 9B45 96-Core Processor"])
    assert tc.cpu_key("vnni", 2) == ("AMD-EPYC-9B45-96-Core-Processor-vnni-2t",
                                     "AMD EPYC 9B45 96-Core Processor (vnni, 2 threads)")
    assert tc.cpu_key("amx", 1)[1].endswith("(amx, 1 thread)")


def test_cli(cache, tmp_path, monkeypatch, capsys, crossovers):
    monkeypatch.setattr(tune_cpu, "LADDER", (1, 2))
    monkeypatch.setattr(tune_cpu, "PORTABLE_LADDER", (1, 2))
    real = tune_cpu.run
    monkeypatch.setattr(tune_cpu, "run", lambda ctx, **kw: real(ctx, K=256, N=64, reps=1, **kw))
    out = tmp_path / "r.json"
    assert cli(["tune", "--backend", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "cpu" and report["ladder"] == [1, 2]
    assert report["cache"] == (str(tc.path_for("cpu", report["device_key"]))
                               if report["kept"] else None)
    capsys.readouterr()
    assert cli(["tune", "--show"]) == 0
    shown = capsys.readouterr().out
    if report["kept"]:
        assert f"cpu/{report['device_key']}: quant_linear" in shown and "applied" in shown
        assert cli(["tune", "--backend", "cpu", "--clear"]) == 0
        assert not tc.path_for("cpu", report["device_key"]).exists()
    for argv, msg in ((["--emulate"], "--emulate does not apply to the cpu backend"),
                      (["--table", "t.json"], "--table does not apply"),
                      (["--ops", "rms_norm"], "tunes quant_linear only")):
        assert cli(["tune", "--backend", "cpu", *argv]) != 0
        assert msg in capsys.readouterr().err
