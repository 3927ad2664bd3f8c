"""`glm5 tune` and the per-device tuning cache: the search procedure (candidates, the verdict gate
that rejects a wrong kernel, the keep rule), the cache file, and the backend applying the cache
on a kernel's first call for the device of that call only (Triton interpreter, tiny shapes)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the Triton kernels on CPU tensors (interpreter)")

from glm5.backends import tuning_cache as tc  # noqa: E402
from glm5.cli import main as cli  # noqa: E402
from glm5.perf import device_shapes as ds  # noqa: E402
from glm5.perf import tune  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(tc.ENV, str(root))
    return root


def test_candidates():
    c = tune.candidates
    assert c("BLOCK_K", 64) == [64, 32, 128]
    assert c("BLOCK_K", 16) == [16, 32]
    assert c("BLOCK_K", 48) == [48]  # not a power of two: left alone
    assert c("num_warps", 8) == [8, 4, 16]
    assert c("num_warps", 1) == [1, 2]  # an S4000's 128-lane warp: a CUDA 4
    assert c("num_warps", 16) == [16, 8]
    assert c("MERGE", "auto") == ["auto"]
    assert c("TARGET_PROGRAMS", 264) == [264, 132, 528]
    assert c("SPLIT_MIN_KEYS", 128) == [128, 64, 256]
    assert c("TARGET_PROGRAMS_INTERPRETED", 0) == [0]  # never searched
    assert c("RESIDENT_Q", False) == [False, True]
    assert set(tune.searchable({"BLOCK_K": 32, "MAX_TOPK": 7})) == {
        "BLOCK_K", "num_warps", "num_stages"}
    # regime-prefixed keys are searched, and no plain launch option pins every regime
    assert c("MHA_BLOCK_N", 32) == [32, 16, 64]
    assert set(tune.searchable({"MHA_BLOCK_N": 32, "MHA_num_warps": 8,
                                "decode_num_stages": 2})) == {
        "MHA_BLOCK_N", "MHA_num_warps", "decode_num_stages"}
    # a backend pins parameters (Cambricon: num_warps must stay 1), regime-prefixed ones too
    assert set(tune.searchable({"BLOCK_K": 32, "decode_num_warps": 1, "num_stages": 1},
                               fixed=("num_warps", "num_stages"))) == {"BLOCK_K"}


def test_backend_tables_pin_what_must_not_move(tmp_path):
    from glm5.backends.cambricon import SPEC

    assert tune.fixed_keys(SPEC.tuning) == ("num_warps", "num_stages")
    assert tune.fixed_keys("") == ()
    bad = tmp_path / "t.json"
    bad.write_text('{"_tune": {"fixed": "num_warps"}}')
    with pytest.raises(ValueError, match="_tune.fixed expected a list"):
        tune.fixed_keys(bad)


def test_every_shape_fits_its_op():
    """Each op's timing shapes (on the meta device: no data) and check shapes bind to the op's
    signature and cost model; a check shape keeps its timing shape's head layout."""
    from glm5.ir.catalog import OPS

    for table in (*(tune.specs(tp) for tp in tune.TP_CHOICES), tune.TINY):
        for op, specs in table.items():
            o = OPS[op]
            for s in specs:
                with ds.on("meta"):
                    v = o.bind((), s.timed(torch.bfloat16))
                o.cost(v, o.symbols(v))
                with ds.on("cpu"):
                    c = o.validate((), s.check(torch.bfloat16))[0]
                for name in ("q", "k"):
                    if name in v and v[name].dim() == 3:
                        assert v[name].shape[1:] == c[name].shape[1:], (op, s.label, name)


class FakeClock:
    """Times from a table of launch parameters (the search's choice is then deterministic)."""

    def __init__(self, ms_of):
        self.ms_of, self.entry = ms_of, None

    def __call__(self, fn, budget_s):
        fn()
        return self.ms_of(self.entry) / 1e3


def _make_recording(clock):
    def make(op, entry):
        clock.entry = dict(entry)
        return tune.op_fn(op, entry)
    return make


def test_search_takes_the_fastest_correct_entry():
    p = tune.prepare("rms_norm", tune.TINY["rms_norm"], CPU)
    # num_warps 4 is fastest; num_stages 3 faster still
    clock = FakeClock(lambda e: 1.0 - 0.3 * (e.get("num_warps") == 4)
                      - 0.1 * (e.get("num_stages") == 3))
    start = {"BLOCK_D": 64, "num_warps": 8}
    r = tune.search(p, start, CPU, clock, deadline=float("inf"), per_measure_s=0.01,
                    make=_make_recording(clock))
    assert r["best"]["params"] == {"BLOCK_D": 64, "num_warps": 4, "num_stages": 3}
    assert r["best"]["ms"] == [pytest.approx(0.6)]
    assert tune.winner(r, start, 0.05) == {"num_warps": 4, "num_stages": 3}
    assert tune.winner(r, start, 0.9) is None  # not 90% faster
    # BLOCK_D 32 / 128 were tried, every trial ran or was rejected with its reason
    tried = {t["params"].get("BLOCK_D") for t in r["trials"]}
    assert {32, 64, 128} <= tried and all("ms" in t or "error" in t for t in r["trials"])


def test_a_wrong_candidate_is_rejected_by_the_verdict():
    p = tune.prepare("rms_norm", tune.TINY["rms_norm"], CPU)
    clock = tune.Clock(CPU)
    base = {"BLOCK_D": 64}
    assert "ms" in tune.trial(p, base, CPU, clock, 0.01)

    def off_by_one_percent(op, entry):
        fn = tune.op_fn(op, entry)
        return lambda *a: fn(*a) * 1.01 if entry.get("num_warps") == 4 else fn(*a)

    t = tune.trial(p, {**base, "num_warps": 4}, CPU, clock, 0.01, make=off_by_one_percent)
    assert "ms" not in t and t["error"].startswith("verdict")
    # ... and the search never picks it, however fast it would be
    fast = FakeClock(lambda e: 0.1 if e.get("num_warps") == 4 else 1.0)

    def make(op, entry):
        fast.entry = dict(entry)
        return off_by_one_percent(op, entry)

    r = tune.search(p, {**base, "num_warps": 8}, CPU, fast, float("inf"), 0.01, make=make)
    assert r["best"]["params"].get("num_warps") == 8


def test_keep_rule_over_several_shapes():
    s = {"ms": [1.0, 1.0], "params": {"A": 1}}
    assert tune.winner({"start": s, "best": {"ms": [0.5, 1.0], "params": {"A": 2}}},
                       {"A": 1}, 0.05) == {"A": 2}
    # faster overall but one shape 10% slower: not kept
    assert tune.winner({"start": s, "best": {"ms": [0.5, 1.1], "params": {"A": 2}}},
                       {"A": 1}, 0.05) is None
    # within noise overall: not kept
    assert tune.winner({"start": s, "best": {"ms": [0.97, 0.99], "params": {"A": 2}}},
                       {"A": 1}, 0.05) is None
    # the kept entry is the difference from the backend's table, not from the start
    assert tune.winner({"start": s, "best": {"ms": [0.5, 0.5], "params": {"A": 1, "B": 3}}},
                       {"A": 1, "B": 2}, 0.05) == {"B": 3}


def test_cache_file_round_trip(cache):
    path = tc.path_for("cuda", "NVIDIA-H200-sm90")
    assert path == cache / "cuda" / "NVIDIA-H200-sm90.json"
    meta = {"kernels": tc.kernels_hash(), "date": "d", "results": {"a": 1}}
    tc.write(path, {"rms_norm": {"num_warps": 4}}, meta)
    tc.write(path, {"attention": {"BLOCK_N": 32}}, {**meta, "results": {"b": 2}})
    ops, why = tc.entries("cuda", "NVIDIA-H200-sm90")
    assert ops == {"rms_norm": {"num_warps": 4}, "attention": {"BLOCK_N": 32}}
    assert str(path) in why
    assert tc.read(path)[tc.META]["results"] == {"a": 1, "b": 2}
    # written for other kernel sources: not applied, and said
    tc.write(path, {"rms_norm": {"num_warps": 4}}, {**meta, "kernels": "0" * 16})
    ops, why = tc.entries("cuda", "NVIDIA-H200-sm90")
    assert ops == {} and "other triton kernel sources" in why
    # another device has nothing; a broken file is said, not applied
    assert tc.entries("cuda", "NVIDIA-H100-sm90")[0] == {}
    path.write_text("[1, 2]")
    ops, why = tc.entries("cuda", "NVIDIA-H200-sm90")
    assert ops == {} and "expected an object" in why


def test_cache_off(monkeypatch):
    monkeypatch.setenv(tc.ENV, "off")
    assert tc.cache_dir() is None and tc.path_for("cuda", "x") is None
    assert tc.entries("cuda", "x") == ({}, f"{tc.ENV}=off")


def test_device_key():
    assert tc.device_key("cpu") == ("interpreter", "Triton interpreter")
    assert tc._slug("NVIDIA H200 (141GB)") == "NVIDIA-H200-141GB"


def _rms_entries(monkeypatch):
    """Record the rms_norm entries the Triton library builds kernels with."""
    from glm5.kernels.triton import norm

    seen, real = [], norm.make_rms_norm
    monkeypatch.setattr(norm, "make_rms_norm", lambda p: seen.append(dict(p)) or real(p))
    return seen


def _fresh_cuda_rows():
    from glm5.backends import vendor
    from glm5.backends.cuda import BACKEND

    return {r[0]: r[1] for r in vendor.triton_rows(BACKEND)}


def test_backend_applies_this_devices_cache_on_first_call(cache, monkeypatch):
    seen = _rms_entries(monkeypatch)
    meta = {"kernels": tc.kernels_hash(), "date": "d"}
    tc.write(tc.path_for("cuda", tc.INTERPRETER), {"rms_norm": {"BLOCK_D": 32}}, meta)
    tc.write(tc.path_for("cuda", "NVIDIA-H200-sm90"), {"rms_norm": {"BLOCK_D": 16}}, meta)
    rows = _fresh_cuda_rows()
    assert seen[-1]["BLOCK_D"] == 8192  # registration: the table, no device asked yet
    fn = rows["rms_norm"]
    x, w = torch.randn(4, 64), torch.randn(64)
    y = fn(x, w, 1e-5)
    assert seen[-1]["BLOCK_D"] == 32 and fn.device_key == tc.INTERPRETER  # not the H200's
    from glm5.testing.compare import assert_matches

    assert_matches("rms_norm", y, {"x": x, "weight": w, "eps": 1e-5})
    n = len(seen)
    fn(x, w, 1e-5)
    assert len(seen) == n  # resolved once
    # an op the cache does not tune keeps the plain kernel
    silu = rows["silu_mul"]
    silu(torch.randn(4, 64))
    assert silu.fn is silu.plain
    # the implementation label is the Triton library's
    from glm5.backends.api import default_impl

    assert default_impl(fn, "cuda") == "triton"


@pytest.mark.parametrize("case", ["off", "stale", "other device"])
def test_backend_ignores_a_cache_that_does_not_apply(case, cache, monkeypatch):
    seen = _rms_entries(monkeypatch)
    meta = {"kernels": tc.kernels_hash(), "date": "d"}
    if case == "off":
        tc.write(tc.path_for("cuda", tc.INTERPRETER), {"rms_norm": {"BLOCK_D": 32}}, meta)
        monkeypatch.setenv(tc.ENV, "off")
    elif case == "stale":
        tc.write(tc.path_for("cuda", tc.INTERPRETER), {"rms_norm": {"BLOCK_D": 32}},
                 {**meta, "kernels": "0" * 16})
    else:
        tc.write(tc.path_for("cuda", "NVIDIA-H200-sm90"), {"rms_norm": {"BLOCK_D": 32}}, meta)
    fn = _fresh_cuda_rows()["rms_norm"]
    fn(torch.randn(4, 64), torch.randn(64), 1e-5)
    assert fn.fn is fn.plain and all(e["BLOCK_D"] == 8192 for e in seen)


def test_cli_tunes_caches_and_the_backend_uses_it(cache, tmp_path, monkeypatch, capsys):
    """`glm5 tune --emulate` end to end with a clock that makes BLOCK_D 32 the winner: the
    cache file names it, `--show` lists it, `--table` merges it, and a new backend runs it."""
    clock = FakeClock(lambda e: 0.5 if e.get("BLOCK_D") == 4096 else 1.0)
    monkeypatch.setattr(tune, "Clock", lambda device: clock)
    real = tune.op_fn

    def op_fn(op, entry):
        clock.entry = dict(entry)
        return real(op, entry)

    monkeypatch.setattr(tune, "op_fn", op_fn)
    table = tmp_path / "tuning.json"
    table.write_text(json.dumps({"attention": {"BLOCK_N": 32}}))
    out = tmp_path / "r.json"
    assert cli(["tune", "--emulate", "--ops", "rms_norm", "--budget-s", "60",
                "--table", str(table), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kept"] == {"rms_norm": {"BLOCK_D": 4096}}
    assert report["device_key"] == tc.INTERPRETER and report["emulated"] is True
    path = tc.path_for("cuda", tc.INTERPRETER)
    assert report["cache"] == str(path)
    data = tc.read(path)
    assert data["rms_norm"] == {"BLOCK_D": 4096}
    assert data[tc.META]["results"]["rms_norm"]["best_ms"] == [0.5]
    assert json.loads(table.read_text()) == {"attention": {"BLOCK_N": 32},
                                             "rms_norm": {"BLOCK_D": 4096}}
    capsys.readouterr()
    assert cli(["tune", "--show"]) == 0
    assert "cuda/interpreter: rms_norm" in capsys.readouterr().out
    seen = _rms_entries(monkeypatch)
    fn = _fresh_cuda_rows()["rms_norm"]
    fn(torch.randn(4, 64), torch.randn(64), 1e-5)
    assert seen[-1]["BLOCK_D"] == 4096
    # a second run starts from the cache: nothing beats it, the file keeps its entry
    assert cli(["tune", "--emulate", "--ops", "rms_norm", "--budget-s", "60"]) == 0
    assert tc.read(path)["rms_norm"] == {"BLOCK_D": 4096}
    assert cli(["tune", "--emulate", "--clear"]) == 0
    assert not path.exists()


def test_cli_refuses_bad_input(cache, capsys):
    assert cli(["tune", "--emulate", "--ops", "no_such_op"]) != 0
    assert "no emulation shapes for ['no_such_op']" in capsys.readouterr().err
    assert cli(["tune", "--emulate", "--budget-s", "0"]) != 0
    assert "--budget-s expected seconds > 0" in capsys.readouterr().err
    assert cli(["tune", "--emulate", "--min-gain", "-1"]) != 0
    assert "--min-gain expected a fraction >= 0" in capsys.readouterr().err
    assert cli(["tune", "--backend", "reference"]) != 0
    assert "runs no kernel of the Triton library" in capsys.readouterr().err
    # no CUDA device here: not tunable, and the message points at --emulate
    assert cli(["tune", "--backend", "cuda"]) != 0
    err = capsys.readouterr().err
    assert "cannot be tuned here" in err and "--emulate" in err


def test_a_cached_entry_that_fails_here_is_dropped(cache, tmp_path, monkeypatch):
    """A cached entry that no longer passes the verdict (e.g. under another Triton): the
    search starts over from the table and the cache forgets the entry."""
    path = tc.path_for("cuda", tc.INTERPRETER)
    tc.write(path, {"rms_norm": {"BLOCK_D": 32}, "attention": {"BLOCK_N": 16}},
             {"kernels": tc.kernels_hash(), "date": "d"})
    clock = FakeClock(lambda e: 1.0)
    monkeypatch.setattr(tune, "Clock", lambda device: clock)
    real = tune.op_fn

    def op_fn(op, entry):
        clock.entry = dict(entry)
        fn = real(op, entry)
        return (lambda *a: fn(*a) * 1.01) if entry.get("BLOCK_D") == 32 else fn

    monkeypatch.setattr(tune, "op_fn", op_fn)
    out = tmp_path / "r.json"
    assert cli(["tune", "--emulate", "--ops", "rms_norm", "--budget-s", "60",
                "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dropped"] == ["rms_norm"] and report["kept"] == {}
    r = report["results"][0]
    assert r["start"]["params"]["BLOCK_D"] == 8192 and "ms" in r["start"]
    data = tc.read(path)
    assert "rms_norm" not in data and data["attention"] == {"BLOCK_N": 16}


def test_tensor_parallel_shapes():
    """--tp N: the shapes one of N ranks runs (glm5 plan's layout): heads, column-parallel
    outputs and the vocabulary split, the indexer and the experts as at tp 1."""
    one, eight = tune.specs(1), tune.specs(8)
    assert tune.SPECS.keys() == one.keys() == eight.keys()
    with ds.on("meta"):
        q1 = one["sparse_attention"][0].timed(torch.bfloat16)["q"]
        q8 = eight["sparse_attention"][0].timed(torch.bfloat16)["q"]
        assert q1.shape[1] == 64 and q8.shape[1] == 8
        assert eight["attention"][0].timed(torch.bfloat16)["k"].shape[1] == 8
        assert eight["quant_linear"][0].timed(torch.bfloat16)["w_packed"].shape[0] == 768
        assert eight["token_logprobs"][0].timed(torch.bfloat16)["w_vocab"].shape[0] == 19360
        for op in ("indexer_topk", "moe_experts", "rms_norm"):
            a1, a8 = one[op][0].timed(torch.bfloat16), eight[op][0].timed(torch.bfloat16)
            assert all(a1[n].shape == a8[n].shape for n in a1 if isinstance(a1[n], torch.Tensor))
    with ds.on("cpu"):
        assert eight["sparse_attention"][1].check(torch.bfloat16)["q"].shape[1] == 8
    with pytest.raises(ValueError, match="tp expected one of"):
        tune.specs(3)


def test_cli_tp(cache, capsys):
    assert cli(["tune", "--emulate", "--tp", "2"]) == 2
    assert "--tp applies to the device shapes" in capsys.readouterr().err
    assert cli(["tune", "--backend", "cuda", "--tp", "3"]) == 2
    assert "--tp expected one of 1, 2, 4, 8, 16" in capsys.readouterr().err
    assert cli(["tune", "--backend", "cpu", "--tp", "2"]) == 2
    assert "--tp does not apply to the cpu backend" in capsys.readouterr().err
    tc.write(tc.path_for("cuda", "NVIDIA-H200-sm90"), {"attention": {"BLOCK_N": 32}},
             {"kernels": tc.kernels_hash(), "device": "NVIDIA H200", "date": "d", "tp": 8})
    assert cli(["tune", "--show"]) == 0
    assert "NVIDIA H200, tuned at tp 8, d: applied" in capsys.readouterr().out
