"""The conformance kit must catch broken kernels (and pass conforming ones that differ only in
ties or rounding)."""

from __future__ import annotations

import json

import pytest
import torch

import glm5
import glm5.backends.selection
from glm5 import cli
from glm5.ir.catalog import OPS
from glm5.testing.compare import assert_matches
from glm5.testing.parity import run_parity

F32 = (torch.float32,)


def _backend(name: str) -> glm5.Backend:
    b = glm5.Backend(name, vendor="test", device_type="cpu", priority=5)
    glm5.get_registry().register(b)
    return b


def _status(b, op, examples=12):
    rows = run_parity(b, [op], examples=examples, seed=3, profile="quick")
    assert rows, f"no parity row for {op}"
    return rows


def test_conforming_kernel_passes_and_off_by_one_percent_fails():
    b = _backend("t_norm")
    ref = OPS["rms_norm"].reference

    @b.kernel("rms_norm", dtypes=F32)
    def good(x, w, eps):
        xf = x.float()
        return (xf / xf.pow(2).mean(-1, keepdim=True).add(eps).sqrt() * w).to(x.dtype)

    assert [r.status for r in _status(b, "rms_norm")] == ["pass"]
    b2 = _backend("t_norm_bad")
    b2.kernel("rms_norm", dtypes=F32)(lambda x, w, eps: ref(x, w, eps) * 1.01)
    row = _status(b2, "rms_norm")[0]
    assert row.status == "fail" and "bound" in row.message


def test_topk_tie_order_is_exact_and_wrong_set_fails():
    """topk_indices compares its input scores: any correct kernel reproduces the order rule
    (ties to the smaller index), so breaking exact ties the other way fails."""
    b = _backend("t_topk")

    @b.kernel("topk_indices", dtypes=F32)
    def ties_to_larger_index(scores, k):
        # Reverse the columns, stable sort, map back: ties now go to the LARGER index.
        S = scores.shape[1]
        rev = scores.flip(-1)
        out = OPS["topk_indices"].reference(rev, k).long()
        return torch.where(out >= 0, S - 1 - out, out).to(torch.int32)

    row = _status(b, "topk_indices", 30)[0]
    assert row.status == "fail" and "ties to the smaller index" in row.message

    b2 = _backend("t_topk_bad")

    @b2.kernel("topk_indices", dtypes=F32)
    def smallest(scores, k):  # picks the k smallest: a wrong set
        return OPS["topk_indices"].reference(-scores, k)

    row = _status(b2, "topk_indices", 30)[0]
    assert row.status == "fail"


def test_kernel_exception_is_a_fail_row_not_a_crash():
    b = _backend("t_raise")

    @b.kernel("silu_mul", dtypes=F32)
    def boom(x):
        raise RuntimeError("device lost")

    row = _status(b, "silu_mul")[0]
    assert row.status == "fail" and "device lost" in row.message


def test_wrong_output_dtype_fails():
    b = _backend("t_dtype")
    b.kernel("silu_mul", dtypes=F32)(lambda x: OPS["silu_mul"].reference(x).double())
    row = _status(b, "silu_mul")[0]
    assert row.status == "fail" and "expected torch.float32" in row.message


def test_mla_prolog_that_skips_the_cache_write_fails():
    b = _backend("t_prolog")

    @b.kernel("mla_prolog", dtypes=F32)
    def no_cache(*args):
        args = list(args)
        args[10] = args[10].clone()  # writes a private copy: the caller's cache is untouched
        return OPS["mla_prolog"].reference(*args)

    row = _status(b, "mla_prolog")[0]
    assert row.status == "fail" and "kv_cache" in row.message


def test_sparse_attention_that_wraps_minus_one_fails():
    b = _backend("t_sparse")

    @b.kernel("sparse_attention", dtypes=F32)
    def wraps(q, k, v, idx, scale):
        S = k.shape[0]
        return OPS["sparse_attention"].reference(q, k, v, torch.where(idx < 0, idx + S, idx),
                                                 scale)

    assert _status(b, "sparse_attention", 20)[0].status == "fail"


def test_w8a8_without_activation_quantization_fails():
    b = _backend("t_quant")
    from glm5.ir.quant_formats import dequantize_weight

    @b.kernel("quant_linear", dtypes=F32)
    def float_path(x, wp, ws, scheme, bias=None):
        w = dequantize_weight(wp, ws, scheme, x.shape[1])
        y = x.float() @ w.T
        return (y + bias if bias is not None else y).to(x.dtype)

    row = _status(b, "quant_linear", 20)[0]
    assert row.status == "fail"


def test_moe_route_unnormalised_weights_fail():
    b = _backend("t_route")

    @b.kernel("moe_route", dtypes=F32)
    def unnormalised(logits, bias, top_k, n_group, topk_group, norm, scaling):
        return OPS["moe_route"].reference(logits, bias, top_k, n_group, topk_group, False,
                                          scaling)

    assert _status(b, "moe_route", 30)[0].status == "fail"


def test_supports_declining_everything_is_a_skip():
    b = _backend("t_skip")
    b.kernel("silu_mul", dtypes=F32, supports=lambda x: False)(OPS["silu_mul"].reference)
    row = _status(b, "silu_mul")[0]
    assert row.status == "skip" and "declined" in row.message


def test_unavailable_backend_rows_skip_but_cli_parity_of_it_fails(monkeypatch, capsys):
    """The runner marks what cannot run as skipped; `glm5 parity --backend X` of a backend
    that is unavailable here checked nothing, and says so with a non-zero exit (strict or
    not), unless --emulate runs its kernels."""
    b = _backend("t_absent")
    b.kernel("silu_mul", dtypes=F32)(OPS["silu_mul"].reference)
    b.availability(lambda: (False, "libfoo.so not found"))
    row = _status(b, "silu_mul")[0]
    assert row.status == "skip" and "libfoo.so" in row.message
    for strict in ("", "1"):
        monkeypatch.setenv("GLM5_STRICT", strict)
        assert cli.main(["parity", "--backend", "t_absent", "--json"]) == 1
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert [(r["op"], r["status"]) for r in rows] == [("*", "fail")]
        assert rows[0]["message"] == "backend unavailable here: libfoo.so not found"
    monkeypatch.delenv("GLM5_STRICT")
    assert cli.main(["parity", "--backend", "t_absent"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "libfoo.so not found" in out and "0 passed, 1 failed" in out
    assert cli.main(["parity", "--backend", "t_absent", "--emulate", "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["status"] == "fail" and rows[0]["message"].startswith(
        "backend cannot be emulated here: the backend declares no emulation mode")
    b.emulation(lambda: (True, "interpreter"))
    assert cli.main(["parity", "--backend", "t_absent", "--json"]) == 1
    assert "(--emulate runs its kernels on CPU through its emulator)" in \
        json.loads(capsys.readouterr().out)["rows"][0]["message"]
    assert cli.main(["parity", "--backend", "t_absent", "--emulate", "--examples", "2"]) == 0
    assert "1 passed, 0 failed" in capsys.readouterr().out


def test_cli_parity_json_and_exit_codes(capsys):
    assert cli.main(["parity", "--backend", "reference", "--ops", "rope,topk_indices",
                     "--examples", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["op"] for r in doc["rows"]} == {"rope", "topk_indices"}
    for r in doc["rows"]:
        assert set(r) >= {"op", "status", "dtype", "max_abs_err", "max_rel_err", "tolerance",
                          "examples"}
        assert r["status"] == "pass" and r["examples"] == 3
    b = _backend("t_cli_bad")
    b.kernel("silu_mul", dtypes=F32)(lambda x: OPS["silu_mul"].reference(x) + 1)
    assert cli.main(["parity", "--backend", "t_cli_bad"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "0 passed, 1 failed" in out
    assert cli.main(["parity", "--backend", "no_such_backend"]) == 2
    assert "unknown backend" in capsys.readouterr().err


@pytest.fixture(params=["clean", "third_party_installed"])
def environment(request):
    """Run a test as is and with a third-party plugin installed (conftest.HOSTILE: every
    kernel wrong, the highest priority): glm5's tests see glm5's own plugins only."""
    if request.param == "third_party_installed":
        request.getfixturevalue("third_party_installed")
    return request.param


def test_cli_backends_and_ops(capsys, reference_only, environment):
    assert cli.main(["backends", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ref = next(b for b in doc["backends"] if b["name"] == "reference")
    assert ref["available"] and len(ref["ops"]) == len(OPS)
    for key in ("vendor", "device_type", "reason", "priority", "source"):
        assert key in ref
    assert cli.main(["backends", "--diagnose"]) == 0
    assert "strict mode" in capsys.readouterr().out
    assert cli.main(["ops", "--json"]) == 0
    ops_doc = json.loads(capsys.readouterr().out)["ops"]
    by = {r["op"]: r for r in ops_doc}
    assert by["rms_norm"]["mode"] == "fallback" and by["rms_norm"]["served_by"] == "reference"
    assert by["indexer_topk"]["mode"] == "decomposed"
    b = _backend("t_ops")
    b.kernel("rms_norm")(OPS["rms_norm"].reference)
    glm5.backends.selection.clear_cache()
    assert cli.main(["ops", "--json"]) == 0
    by = {r["op"]: r for r in json.loads(capsys.readouterr().out)["ops"]}
    assert by["rms_norm"]["mode"] == "native" and by["rms_norm"]["served_by"] == "t_ops"


def test_an_installed_third_party_plugin_stays_out_of_glm5s_tests(third_party_installed,
                                                                 monkeypatch):
    """The plugin behind `environment` is really installed: a user's process (no test policy)
    loads it and it serves the cpu's rms_norm; glm5's tests' registry does not load it."""
    x, w = torch.randn(2, 8), torch.ones(8)
    reg = glm5.get_registry()  # the test suite's policy: glm5's own plugins only
    assert "hostile" not in reg.backends and reg.plugins["hostile"].status == "disabled"
    assert reg.plugins["cpu"].status == "loaded"
    assert_matches("rms_norm", glm5.ops.rms_norm(x, w, 1e-6), {"x": x, "weight": w, "eps": 1e-6},
                   dtype=x.dtype)
    monkeypatch.delenv("GLM5_PLUGINS")
    glm5.reset_registry()
    reg = glm5.get_registry()
    assert reg.plugins["hostile"].status == "loaded"
    values, _ = OPS["rms_norm"].validate((x, w, 1e-6), {})
    assert glm5.backends.selection.kernel_for(OPS["rms_norm"], values) == ("hostile", "native")


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_has_a_generator_that_validates(op):
    from glm5.testing.cases import GENERATORS, RandomDraw, case_dtypes

    opdef = OPS[op]
    for dt in case_dtypes(opdef, None):
        for s in range(5):
            values = GENERATORS[op](RandomDraw(s), dt)
            opdef.validate((), values)  # raises on a generator bug
            assert opdef.dispatch_dtype(values) == dt


def test_emulated_parity_rows(capsys):
    b = _backend("t_emul")
    b.kernel("silu_mul", dtypes=F32)(OPS["silu_mul"].reference)
    b.availability(lambda: (False, "no device"))
    rows = run_parity(b, ["silu_mul"], examples=3, emulate=True)
    assert rows[0].status == "skip" and "cannot emulate" in rows[0].message
    b.emulation(lambda: (True, "interpreter"))
    rows = run_parity(b, ["silu_mul"], examples=3, emulate=True)
    assert rows[0].status == "pass" and rows[0].emulated
    assert cli.main(["parity", "--backend", "t_emul", "--emulate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"][0]["emulated"] is True


def test_docs_carry_the_current_tolerance_table():
    """docs/conformance.md's generated section is the table the kit uses (regenerate it with
    `python -m glm5.testing.tolerances`)."""
    import pathlib

    from glm5.testing.tolerances import BEGIN, END, markdown

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "conformance.md").read_text()
    assert BEGIN in doc and END in doc
    section = doc[doc.index(BEGIN): doc.index(END) + len(END)]
    assert section == markdown(), "docs/conformance.md is stale: python -m glm5.testing.tolerances"


def test_every_op_has_an_error_model_or_a_selection_rule():
    for op in OPS.values():
        assert op.error is not None or op.selection is not None, op.name
        if op.error is not None:
            assert (op.error.__doc__ or "").strip(), f"{op.name}: the error model needs its derivation"
