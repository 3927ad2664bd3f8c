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
from glm5.perf import tune_cpu  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def crossovers():
    yield
    quant.use_crossovers({})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tc.ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_chain_is_the_tables_paths_with_their_bounds(monkeypatch, crossovers):
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (True, "t"))
    quant.use_crossovers({})  # forget chains computed under other features
    assert quant.chain("w8a16", "vnni", F32) == (("vnni", 32), ("vgemm", None))
    assert quant.chain("w8a16", "vnni", BF16) == (("vnni", 16), ("vgemm", 128),
                                                  ("onednn", None))
    assert quant.chain("w8a8", "vnni", F32) == (("vnni", 16), ("vgemm", None))
    assert quant.chain("w8a8", "portable", F32) == (("tvm", 384), ("torch:gemm", None))
    assert quant.chain("w4a8", "portable", F32) == (("tvm", None),)  # one path for every M
    assert quant.chain("w6a12", "amx", BF16) == (("vnni", 2), ("amx", None))
    # without AVX-512 BF16 the VNNI tier's w8a16 on bf16 x has the GEMV only
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (False, "t"))
    quant.use_crossovers({})
    assert quant.chain("w8a16", "vnni", BF16) == (("vnni", None),)


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


def test_measured_switches_replace_the_tables(monkeypatch, crossovers):
    """w8a16 on bf16 x has three paths on the VNNI tier (GEMV, VNNI GEMM to 128 rows, oneDNN):
    one measured switch (an int) moves the first switch and the table keeps the second; a list
    moves both; a switch below the one before it is raised to it (the middle path is then
    skipped)."""
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (True, "t"))
    for rows, want in ((8, {8: "vnni", 9: "vgemm", 128: "vgemm", 129: "onednn"}),
                       (0, {1: "vgemm", 128: "vgemm", 129: "onednn"}),
                       (150, {150: "vnni", 151: "onednn"}),
                       ([8, 64], {8: "vnni", 9: "vgemm", 64: "vgemm", 65: "onednn"}),
                       ([12, 12], {12: "vnni", 13: "onednn"}),
                       ([0, 0], {1: "onednn"})):
        quant.use_crossovers({"vnni/w8a16/bfloat16": rows})
        assert {m: quant.path("w8a16", m, "vnni", BF16) for m in want} == want, rows


@pytest.mark.parametrize("bad", [{"vnni/w8a8": 4}, {"gpu/w8a8/float32": 4},
                                 {"vnni/w9a9/float32": 4}, {"vnni/w8a8/float16": 4},
                                 {"vnni/w8a8/float32": -1}, {"vnni/w8a8/float32": 4.5},
                                 {"vnni/w8a8/float32": True}, {"vnni/w8a8/float32": []},
                                 {"vnni/w8a8/float32": [8, 4]},
                                 {"vnni/w8a8/float32": [4, -1]},
                                 {"vnni/w8a8/float32": [4, True]}])
def test_bad_crossovers_are_refused(bad, crossovers):
    with pytest.raises(ValueError, match="glm5 quant_linear crossovers"):
        quant.use_crossovers(bad)


def test_switch_rule():
    """Two paths: the switch under which the rungs cost least in all (a rung: its path's time
    over the faster one's, 1 within 3%), ties to the larger switch."""
    t = lambda pairs: {m: {"g": a, "G": b} for m, (a, b) in pairs.items()}  # noqa: E731
    gG = ["g", "G"]
    assert tune_cpu.switches(t({1: (1, 5), 8: (2, 3), 16: (4, 3), 32: (8, 3)}), gG) == [8]
    # the GEMV wins again above a loss: the switch goes above it only if that gains more
    # (here 33% lost at 8 rows against 17% won at 16: no; 41% won: yes)
    assert tune_cpu.switches(t({1: (1, 5), 8: (4, 3), 16: (3, 3.5), 32: (8, 3)}), gG) == [1]
    assert tune_cpu.switches(t({1: (1, 5), 8: (4, 3), 16: (2, 3.5), 32: (8, 3)}), gG) == [16]
    assert tune_cpu.switches(t({1: (5, 1), 8: (6, 1)}), gG) == [0]
    assert tune_cpu.switches(t({1: (1, 5), 8: (2, 6)}), gG) == [8]
    # within 3% is a tie, which the GEMV keeps; 4% is not
    assert tune_cpu.switches(t({1: (1, 5), 8: (1.029, 1.0), 16: (2, 1)}), gG) == [8]
    assert tune_cpu.switches(t({1: (1, 5), 8: (1.04, 1.0), 16: (2, 1)}), gG) == [1]


def test_switch_rule_over_three_paths():
    """Three paths (GEMV, VNNI GEMM, oneDNN; ms by rows): two-thread Zen 5 times keep the
    GEMM for 17-128 rows; one-thread times, where oneDNN leads from 12 rows and trails the
    GEMM by 5% at 64 only, give the GEMM no rows (equal switches); a middle path that never
    wins gets none either."""
    t = lambda rows: {m: dict(zip("abc", v)) for m, v in rows.items()}  # noqa: E731
    two = {16: (3.21, 3.71, 3.17), 24: (4.48, 3.79, 3.73), 32: (5.13, 3.35, 3.45),
           64: (10.5, 3.67, 4.53), 128: (20.9, 6.75, 7.44), 256: (42.2, 12.7, 12.3)}
    assert tune_cpu.switches(t(two), list("abc")) == [16, 128]
    one = {8: (3.18, 6.91, 3.27), 12: (4.59, 6.72, 3.40), 16: (6.30, 6.93, 3.90),
           64: (20.4, 7.05, 7.40), 128: (41.4, 12.6, 11.7), 256: (83.4, 24.8, 21.3)}
    assert tune_cpu.switches(t(one), list("abc")) == [8, 8]
    never = {1: (1, 9, 5), 8: (4, 9, 3), 64: (40, 9, 8)}
    assert tune_cpu.switches(t(never), list("abc")) == [1, 1]
    assert tune_cpu.rungs_for((("a", 16), ("b", 128), ("c", None)), (1, 128)) == (
        1, 128, 192, 256)
    assert tune_cpu.rungs_for((("a", 16), ("c", None)), (1, 16)) == (1, 16)


def test_tuner_measures_every_chain_and_caches(cache, monkeypatch, crossovers):
    """On this CPU's tier, at tiny sizes, with a scripted clock under which a chain's first
    path is fastest below 4 rows and its last from 4 rows on (the middle ones between): every
    chain the tier has is judged and measured path by path, and the switches are cached under
    this CPU's key; a new start of the backend puts them in force."""
    tier = quant.cpu_tier()
    ctx = cpu_backend.context
    ctx()
    ran = []
    real_run = quant.run_path

    def run(p, context, x, wp, ws, scheme):
        ran.append((p, x.shape[0], scheme, x.dtype))
        return real_run(p, context, x, wp, ws, scheme)

    def scripted(fn, reps):
        fn()
        p, m, scheme, dtype = ran[-1]
        paths = [q for q, _ in quant.chain(scheme, tier, dtype)]
        i, n = paths.index(p), len(paths)
        return 1.0 + (i if m < 4 else n - 1 - i)

    monkeypatch.setattr(quant, "run_path", run)
    report = tune_cpu.run(ctx, K=256, N=64, reps=1, ladder=(1, 2, 4, 8), clock=scripted,
                          say=lambda s: None)
    pairs = [(s, d) for s in quant.SCHEMES for d in (F32, BF16)
             if len(quant.chain(s, tier, d)) > 1]
    assert len(report["results"]) == len(pairs)
    key, _ = tc.cpu_key(tier, torch.get_num_threads())
    assert report["device_key"] == key and report["tier"] == tier
    for r in report["results"]:
        assert "error" not in r, r
        # the GEMV (vnni / tvm) wins below 4 rows; every later path ties it above
        assert r["switches"] == [2] * (len(r["paths"]) - 1) and set(r["times"]) == {1, 2, 4, 8}
        assert all(set(v) == set(r["paths"]) for v in r["times"].values())
    kept = report["kept"].get("quant_linear", {})
    assert kept == {quant.crossover_key(tier, s, d): 2 if len(quant.chain(s, tier, d)) == 2
                    else [2] * (len(quant.chain(s, tier, d)) - 1) for s, d in pairs}
    if not kept:
        return  # a tier with one path per scheme: nothing to cache
    data = tc.read(tc.path_for("cpu", key))
    assert data["quant_linear"] == kept
    assert data[tc.META]["kernels"] == tc.kernels_hash("tvm")
    quant.use_crossovers({})
    monkeypatch.setattr(cpu_backend, "_ctx", None)
    cpu_backend.context()  # the backend starting: the cache in force
    assert quant._crossovers == kept and "quant_linear" in cpu_backend.tuning_state
    for s, d in pairs:
        ch = quant.chain(s, tier, d)
        assert quant.path(s, 2, dtype=d) == ch[0][0] and quant.path(s, 3, dtype=d) == ch[-1][0]


def test_a_wrong_path_is_caught_before_timing(cache, monkeypatch, crossovers):
    tier = quant.cpu_tier()
    pairs = [(s, d) for s in quant.SCHEMES for d in (F32,) if len(quant.chain(s, tier, d)) > 1]
    if not pairs:
        pytest.skip(f"tier {tier} has one path per scheme")
    s, d = pairs[0]
    paths = [p for p, _ in quant.chain(s, tier, d)]
    real_run = quant.run_path
    monkeypatch.setattr(quant, "run_path", lambda p, *a: real_run(p, *a) * (1.01 if p == paths[-1]
                                                                           else 1.0))
    m = tune_cpu.measure(cpu_backend.context, s, d, paths, (1, 2), 256, 64, 1, float("inf"))
    assert m["error"].startswith(f"{paths[-1]}: verdict")


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
