"""Plugin discovery, selection and the out-of-tree example plugin, end to end.

Discovery tests build throw-away distributions in ``tmp_path`` (a module plus a
``<name>-0.1.dist-info`` with an ``entry_points.txt``), put ``tmp_path`` on ``sys.path`` and
rediscover with ``glm5.reset_registry()``: the same path an installed vendor package takes.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import glm5
from conftest import PluginDir
from glm5 import cli
from glm5.backends import selection
from glm5.backends.registry import PluginLoadError
from glm5.ir.ops_dsa import topk_indices_ref
from glm5.ir.ops_norm import rms_norm_ref
from glm5.testing.compare import assert_matches

pytest_plugins = ["pytester"]  # runs the conformance kit in-process

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "glm5-example-plugin"
GLM5_ENV = ("GLM5_BACKEND", "GLM5_STRICT", "GLM5_PLUGINS")


# --------------------------------------------------------------------------- fixtures
def _clean_modules_under(root: Path, before: set[str]) -> None:
    for name in set(sys.modules) - before:
        f = getattr(sys.modules.get(name), "__file__", None) or ""
        if f.startswith(str(root)):
            sys.modules.pop(name, None)


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A sys.path entry for temporary plugin distributions, and a clean registry around it."""
    for var in GLM5_ENV:
        monkeypatch.delenv(var, raising=False)
    # glm5's built-ins but the accelerated ones, and the plugins the test adds (any plugin
    # installed in the environment stays out)
    pdir = PluginDir(tmp_path, policy=True)
    monkeypatch.setenv("GLM5_PLUGINS", pdir.policy_path)
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    glm5.reset_registry()
    yield pdir
    glm5.use_backend(None)  # a function-style override must not leak into the next test
    monkeypatch.undo()  # sys.path and environment
    _clean_modules_under(tmp_path, before)
    importlib.invalidate_caches()
    glm5.reset_registry()


GOOD = """
    import torch
    import glm5

    GLM5_API_VERSION = "1.0"

    b = glm5.Backend("tmpgood", vendor="Test Corp", device_type="cpu", priority=3,
                     description="good temp plugin")

    @b.availability
    def _avail():
        return True, "always"

    @b.kernel("rms_norm", dtypes=(torch.float32,))
    def rms_norm(x, weight, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)

    @glm5.hookimpl
    def glm5_register_backends(registry):
        registry.register(b)
"""


def _rms_inputs(dtype=torch.float32, d=32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype), 1e-6


def _rms_ok(x, w, eps):
    """glm5.ops.rms_norm on (x, w, eps), whoever serves it, judged by the kit (dtype: x's)."""
    assert_matches("rms_norm", glm5.ops.rms_norm(x, w, eps), {"x": x, "weight": w, "eps": eps},
                   dtype=x.dtype)


# --------------------------------------------------------------------------- (a) discovery
def test_good_plugin_is_loaded_with_its_distribution_as_source(plugin_dir):
    source = plugin_dir.add("tmpgood", GOOD)
    reg = glm5.get_registry()
    rec = reg.plugins["tmpgood"]
    assert rec.status == "loaded", rec.message
    assert rec.source == source == "glm5-tmp-tmpgood 0.1"
    assert rec.backends == ("tmpgood",)
    b = reg.backends["tmpgood"]
    assert (b.vendor, b.device_type, b.priority) == ("Test Corp", "cpu", 3)
    assert b.source == "glm5-tmp-tmpgood 0.1"
    assert b.is_available() == (True, "always")
    assert b.ops() == ["rms_norm"]
    # the built-in reference arrives through the same entry-point path
    assert reg.plugins["reference"].status == "loaded"
    assert "reference" in reg.backends
    assert reg.errors() == []


def test_plugin_whose_import_raises_is_recorded_and_glm5_still_works(plugin_dir):
    plugin_dir.add("tmpbroken", """
        raise RuntimeError("vendor runtime libfoo.so not found")
    """)
    plugin_dir.add("tmpgood", GOOD)
    reg = glm5.get_registry()
    rec = reg.plugins["tmpbroken"]
    assert rec.status == "failed"
    assert rec.message == "RuntimeError: vendor runtime libfoo.so not found"
    assert "Traceback" in rec.detail and "libfoo.so" in rec.detail
    assert reg.errors() == [rec]
    # the other plugin and the reference are unaffected, and ops run
    assert reg.plugins["tmpgood"].status == "loaded"
    x, w, eps = _rms_inputs()
    _rms_ok(x, w, eps)


def test_broken_plugin_does_not_break_import_glm5_in_a_fresh_process(plugin_dir):
    plugin_dir.add("tmpbroken", """
        raise ImportError("no module named torch_acme")
    """)
    code = (
        "import glm5, torch\n"
        "y = glm5.ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
        "rec = glm5.get_registry().plugins['tmpbroken']\n"
        "print(rec.status, '|', rec.message, '|', tuple(y.shape))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in GLM5_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_dir.root),
                                                       env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "failed | ImportError: no module named torch_acme | (2, 8)"


def test_plugin_for_another_api_major_version_is_refused(plugin_dir):
    plugin_dir.add("tmpfuture", GOOD.replace('GLM5_API_VERSION = "1.0"',
                                             'GLM5_API_VERSION = "2.0"'))
    reg = glm5.get_registry()
    rec = reg.plugins["tmpfuture"]
    assert rec.status == "refused"
    assert "2.0" in rec.message and glm5.API_VERSION in rec.message
    assert "major" in rec.message
    assert "tmpgood" not in reg.backends  # not loaded half-way: its hook never ran


def test_plugin_with_another_minor_version_is_loaded(plugin_dir):
    plugin_dir.add("tmpminor", GOOD.replace('GLM5_API_VERSION = "1.0"',
                                            'GLM5_API_VERSION = "1.7"'))
    reg = glm5.get_registry()
    assert reg.plugins["tmpminor"].status == "loaded"
    assert "tmpgood" in reg.backends


def test_plugin_without_api_version_loads_with_a_warning_shown_by_diagnose(plugin_dir, capsys):
    plugin_dir.add("tmpnover", GOOD.replace('GLM5_API_VERSION = "1.0"', ""))
    reg = glm5.get_registry()
    rec = reg.plugins["tmpnover"]
    assert (rec.status, rec.backends) == ("loaded", ("tmpgood",))
    assert len(rec.warnings) == 1
    assert "declares no GLM5_API_VERSION" in rec.warnings[0]
    assert f'GLM5_API_VERSION = "{glm5.API_VERSION}"' in rec.warnings[0]  # what to add
    assert reg.errors() == []
    x, w, eps = _rms_inputs()
    assert _served("rms_norm", x, w, eps) == ("tmpgood", "native")
    _rms_ok(x, w, eps)
    assert cli.main(["backends", "--diagnose"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "warning:" in ln)
    assert "declares no GLM5_API_VERSION" in line
    assert cli.main(["backends"]) == 0  # the short listing points at --diagnose
    assert "1 plugin(s) loaded with warnings" in capsys.readouterr().out
    assert cli.main(["backends", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert plugins["tmpnover"]["warnings"] == list(rec.warnings)
    assert plugins["reference"]["warnings"] == []


REFUSED_WHY = ("was refused", "built for glm5 plugin API 2.0", "major versions differ")


def test_refused_plugin_is_explained_by_every_command_that_names_it(plugin_dir, capsys,
                                                                     monkeypatch):
    """The entry point and the backend share the name (as they usually do): parity, bench,
    ops, use_backend and GLM5_BACKEND all say the plugin was refused and why."""
    plugin_dir.add("tmpgood", GOOD.replace('"1.0"', '"2.0"'))
    for argv in (["parity", "--backend", "tmpgood"], ["bench", "--backend", "tmpgood"],
                 ["ops", "--backend", "tmpgood"]):
        assert cli.main(argv) != 0, argv
        err = capsys.readouterr().err
        assert "backend 'tmpgood' is not loaded: plugin 'tmpgood' (glm5-tmp-tmpgood 0.1)" in err
        for why in REFUSED_WHY:
            assert why in err, (argv, err)
    with pytest.raises(KeyError) as e:
        glm5.use_backend("tmpgood")
    assert str(e.value).startswith("glm5: backend 'tmpgood' is not loaded")  # no KeyError quotes
    assert all(why in str(e.value) for why in REFUSED_WHY)
    monkeypatch.setenv("GLM5_BACKEND", "tmpgood")
    x, w, eps = _rms_inputs()
    with pytest.raises(KeyError, match=r"GLM5_BACKEND='tmpgood': .*was refused"):
        glm5.ops.rms_norm(x, w, eps)


def test_refused_plugin_is_named_when_its_backend_name_differs(plugin_dir):
    """A refused plugin's hook never ran, so its backends' names are unknown: asking for any
    unknown backend lists the plugins that were not loaded, with their reasons."""
    plugin_dir.add("tmpfuture", GOOD.replace('"1.0"', '"3.1"'))
    with pytest.raises(KeyError) as e:
        glm5.use_backend("tmpgood")
    msg = str(e.value)
    assert msg.startswith("glm5: unknown backend 'tmpgood'; known backends: ")
    assert "plugins not loaded: tmpfuture (glm5-tmp-tmpfuture 0.1) was refused" in msg
    assert "API 3.1" in msg


def test_conformance_kit_says_why_a_backend_is_not_loaded(plugin_dir, pytester):
    """`pytest --pyargs glm5.testing --glm5-backend X` of a refused plugin stops at session
    start with one line saying why (not a collection error with a truncated KeyError)."""
    plugin_dir.add("tmpgood", GOOD.replace('"1.0"', '"2.0"'))
    res = pytester.runpytest_inprocess("--pyargs", "glm5.testing", "--glm5-backend", "tmpgood",
                                       "-p", "no:cacheprovider")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    err = res.stderr.str()
    assert ("ERROR: glm5 conformance kit: --glm5-backend tmpgood: backend 'tmpgood' is not "
            "loaded: plugin 'tmpgood' (glm5-tmp-tmpgood 0.1) was refused") in err
    assert all(why in err for why in REFUSED_WHY)
    assert "KeyError" not in err + res.stdout.str()
    res = pytester.runpytest_inprocess("--pyargs", "glm5.testing", "--glm5-backend",
                                       "reference", "--glm5-ops", "rms_norm,nosuch_op")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert "--glm5-ops: unknown op(s) nosuch_op; known ops: rms_norm" in res.stderr.str()


def test_enabled_list_loads_only_those_plugins(plugin_dir, tmp_path, monkeypatch):
    plugin_dir.add("tmpgood", GOOD)
    plugin_dir.add("tmpother", GOOD.replace('"tmpgood"', '"tmpother"'))
    user = tmp_path / "only.toml"
    user.write_text('[plugins]\nenabled = ["tmpother"]\n')
    monkeypatch.setenv("GLM5_PLUGINS", str(user))
    glm5.reset_registry()
    reg = glm5.get_registry()
    assert reg.plugins["tmpother"].status == "loaded"
    rec = reg.plugins["tmpgood"]
    assert rec.status == "disabled" and "[plugins] enabled" in rec.message
    assert "glm5_tmp_tmpgood" not in sys.modules  # not even imported
    assert set(reg.backends) == {"reference", "tmpother"}  # the oracle always loads
    with pytest.raises(KeyError, match=r"plugin 'tmpgood' .* is disabled: not in the "
                                       r"\[plugins\] enabled list"):
        reg.get("tmpgood")


def test_plugin_without_hook_is_refused(plugin_dir):
    plugin_dir.add("tmpnohook", """
        GLM5_API_VERSION = "1.0"

        def glm5_register_backends(registry):  # not marked with @glm5.hookimpl
            raise AssertionError("must not be called")
    """)
    rec = glm5.get_registry().plugins["tmpnohook"]
    assert rec.status == "refused"
    assert "glm5_register_backends" in rec.message


def test_plugin_whose_hook_raises_fails_and_registers_nothing(plugin_dir):
    plugin_dir.add("tmphalf", """
        import glm5

        GLM5_API_VERSION = "1.0"

        @glm5.hookimpl
        def glm5_register_backends(registry):
            registry.register(glm5.Backend("tmphalf_one", vendor="T", device_type="cpu"))
            raise ValueError("tuning table missing")
    """)
    reg = glm5.get_registry()
    rec = reg.plugins["tmphalf"]
    assert rec.status == "failed"
    assert rec.message == "ValueError: tuning table missing"
    assert rec.backends == ()
    assert "tmphalf_one" not in reg.backends  # the half-registered backend is rolled back


def test_duplicate_backend_name_fails_the_second_plugin(plugin_dir):
    twin = """
        import glm5

        GLM5_API_VERSION = "1.0"

        @glm5.hookimpl
        def glm5_register_backends(registry):
            registry.register(glm5.Backend("tmptwin", vendor="{v}", device_type="cpu"))
    """
    first = plugin_dir.add("tmpdup_a", twin.replace("{v}", "A"))
    plugin_dir.add("tmpdup_b", twin.replace("{v}", "B"))
    reg = glm5.get_registry()
    assert reg.plugins["tmpdup_a"].status == "loaded"  # entry points load in name order
    rec = reg.plugins["tmpdup_b"]
    assert rec.status == "failed"
    assert "'tmptwin' is already registered" in rec.message
    assert first in rec.message  # names where the first one came from
    assert reg.backends["tmptwin"].vendor == "A"
    assert reg.backends["tmptwin"].source == first


def test_disabled_plugin_is_not_imported(plugin_dir, tmp_path, monkeypatch):
    plugin_dir.add("tmpoff", """
        raise AssertionError("a disabled plugin must not be imported")
    """)
    user = tmp_path / "user-plugins.toml"
    user.write_text('[plugins]\ndisabled = ["tmpoff"]\n')
    monkeypatch.setenv("GLM5_PLUGINS", str(user))
    reg = glm5.get_registry()
    rec = reg.plugins["tmpoff"]
    assert rec.status == "disabled"
    assert "plugins.toml" in rec.message
    assert "glm5_tmp_tmpoff" not in sys.modules


def test_strict_mode_reraises_plugin_load_errors(plugin_dir, monkeypatch):
    plugin_dir.add("tmpbroken", """
        raise RuntimeError("boom at import")
    """)
    monkeypatch.setenv("GLM5_STRICT", "1")
    with pytest.raises(PluginLoadError, match=r"'tmpbroken'.*failed: RuntimeError: boom at import"):
        glm5.get_registry()


def test_strict_mode_reraises_refusals(plugin_dir, monkeypatch):
    plugin_dir.add("tmpfuture", GOOD.replace('"1.0"', '"2.0"'))
    monkeypatch.setenv("GLM5_STRICT", "1")
    with pytest.raises(PluginLoadError, match=r"'tmpfuture'.*refused.*2\.0"):
        glm5.get_registry()


# --------------------------------------------------------------------------- (b) selection
SELECT = """
    import torch
    import glm5

    GLM5_API_VERSION = "1.0"
    CALLS = []  # (backend, op) of every kernel call

    def _rms(name):
        def rms_norm(x, weight, eps):
            CALLS.append((name, "rms_norm"))
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
            return y.to(x.dtype)
        return rms_norm

    def _silu(name):
        def silu_mul(x):
            CALLS.append((name, "silu_mul"))
            a, b = x.float().chunk(2, dim=-1)
            return (torch.nn.functional.silu(a) * b).to(x.dtype)
        return silu_mul

    def _topk(name):
        def topk_indices(scores, k):
            CALLS.append((name, "topk_indices"))
            keyed = scores.masked_fill(~torch.isfinite(scores), float("-inf"))
            vals, idx = torch.topk(keyed, k, dim=-1)
            return idx.to(torch.int32).masked_fill(vals == float("-inf"), -1)
        return topk_indices

    # tmpa: preferred by priority; float32 only; silu_mul only up to 2*I = 64; topk_indices.
    a = glm5.Backend("tmpa", vendor="A", device_type="cpu", priority=5)
    a.kernel("rms_norm", dtypes=(torch.float32,))(_rms("tmpa"))
    a.kernel("silu_mul", supports=lambda x: x.shape[-1] <= 64)(_silu("tmpa"))
    a.kernel("topk_indices", dtypes=(torch.float32,),
             supports=lambda scores, k: k <= scores.shape[-1])(_topk("tmpa"))

    # tmpb: lower priority; float32 and bfloat16; silu_mul of any size.
    b = glm5.Backend("tmpb", vendor="B", device_type="cpu", priority=1)
    b.kernel("rms_norm", dtypes=(torch.float32, torch.bfloat16))(_rms("tmpb"))
    b.kernel("silu_mul")(_silu("tmpb"))

    # tmpgpu: highest priority but serves another device type.
    g = glm5.Backend("tmpgpu", vendor="G", device_type="cuda", priority=100)
    g.kernel("rms_norm")(_rms("tmpgpu"))

    # tmpoff: high priority but unavailable here.
    o = glm5.Backend("tmpoff", vendor="O", device_type="cpu", priority=50)
    o.kernel("rms_norm")(_rms("tmpoff"))

    @o.availability
    def _off():
        return False, "no Acme device found"

    @glm5.hookimpl
    def glm5_register_backends(registry):
        for backend in (a, b, g, o):
            registry.register(backend)
"""


@pytest.fixture
def sel(plugin_dir):
    """The SELECT plugin, discovered; returns its module (for CALLS)."""
    plugin_dir.add("tmpsel", SELECT)
    reg = glm5.get_registry()
    assert reg.plugins["tmpsel"].status == "loaded", reg.plugins["tmpsel"].message
    assert reg.plugins["tmpsel"].backends == ("tmpa", "tmpb", "tmpgpu", "tmpoff")
    mod = sys.modules["glm5_tmp_tmpsel"]
    mod.CALLS.clear()
    return mod


def _served(op: str, *args, **kwargs) -> tuple[str, str]:
    values, _ = glm5.get_op(op).validate(args, kwargs)
    return selection.kernel_for(glm5.get_op(op), values)


def test_priority_picks_the_available_backend_for_this_device(sel):
    x, w, eps = _rms_inputs()
    assert _served("rms_norm", x, w, eps) == ("tmpa", "native")
    _rms_ok(x, w, eps)
    assert sel.CALLS == [("tmpa", "rms_norm")]
    plan = selection.resolve(glm5.get_op("rms_norm"), "cpu", torch.float32)
    declined = dict(plan.declined)
    assert declined["tmpgpu"] == "serves cuda, not cpu"
    assert declined["tmpoff"] == "unavailable: no Acme device found"
    assert [k.backend.name for k in plan.candidates] == ["tmpa", "tmpb"]


def test_use_backend_as_context_manager_routes_and_restores(sel):
    x, w, eps = _rms_inputs()
    with glm5.use_backend("tmpb"):
        assert _served("rms_norm", x, w, eps) == ("tmpb", "native")
        glm5.ops.rms_norm(x, w, eps)
    assert _served("rms_norm", x, w, eps) == ("tmpa", "native")
    glm5.ops.rms_norm(x, w, eps)
    assert sel.CALLS == [("tmpb", "rms_norm"), ("tmpa", "rms_norm")]


def test_use_backend_as_function_routes_until_cleared(sel):
    x, w, eps = _rms_inputs()
    glm5.use_backend("tmpb")
    assert _served("rms_norm", x, w, eps) == ("tmpb", "native")
    glm5.ops.rms_norm(x, w, eps)
    glm5.use_backend(None)
    assert _served("rms_norm", x, w, eps) == ("tmpa", "native")
    glm5.ops.rms_norm(x, w, eps)
    assert sel.CALLS == [("tmpb", "rms_norm"), ("tmpa", "rms_norm")]


def test_use_backend_unknown_name_lists_known_backends(sel):
    with pytest.raises(KeyError, match=r"unknown backend 'nope'.*tmpa"):
        glm5.use_backend("nope")


def test_override_to_backend_that_cannot_serve_passes_on(sel):
    x, w, eps = _rms_inputs()
    with glm5.use_backend("tmpoff"):  # unavailable
        assert _served("rms_norm", x, w, eps) == ("tmpa", "native")
    with glm5.use_backend("tmpb"):  # has no topk_indices
        assert _served("topk_indices", torch.randn(2, 8), 3) == ("tmpa", "native")


def test_glm5_backend_env_routes_and_use_backend_beats_it(sel, monkeypatch):
    x, w, eps = _rms_inputs()
    monkeypatch.setenv("GLM5_BACKEND", "tmpb")
    assert _served("rms_norm", x, w, eps) == ("tmpb", "native")
    glm5.ops.rms_norm(x, w, eps)
    with glm5.use_backend("tmpa"):
        assert _served("rms_norm", x, w, eps) == ("tmpa", "native")
    assert sel.CALLS == [("tmpb", "rms_norm")]


def test_dtypes_decline_passes_to_next_then_to_reference(sel, caplog):
    caplog.set_level(logging.WARNING, logger="glm5")
    xb, wb, eps = _rms_inputs(torch.bfloat16)
    assert _served("rms_norm", xb, wb, eps) == ("tmpb", "native")  # tmpa is float32 only
    y = glm5.ops.rms_norm(xb, wb, eps)
    assert y.dtype == torch.bfloat16
    assert sel.CALLS == [("tmpb", "rms_norm")]

    xd, wd, eps = _rms_inputs(torch.float64)
    assert _served("rms_norm", xd, wd, eps) == ("reference", "fallback")
    # the fallback runs the reference itself: bit for bit
    assert torch.equal(glm5.ops.rms_norm(xd, wd, eps), rms_norm_ref(xd, wd, eps))
    assert sel.CALLS == [("tmpb", "rms_norm")]  # no plugin kernel saw the float64 call
    plan = selection.resolve(glm5.get_op("rms_norm"), "cpu", torch.float64)
    assert dict(plan.declined)["tmpa"] == "dtype float64 not in (float32)"


def test_supports_decline_passes_to_next_candidate(sel):
    small = torch.randn(3, 64)
    big = torch.randn(3, 128)
    assert _served("silu_mul", small) == ("tmpa", "native")
    assert _served("silu_mul", big) == ("tmpb", "native")
    assert_matches("silu_mul", glm5.ops.silu_mul(small), {"x": small}, dtype=small.dtype)
    assert_matches("silu_mul", glm5.ops.silu_mul(big), {"x": big}, dtype=big.dtype)
    assert sel.CALLS == [("tmpa", "silu_mul"), ("tmpb", "silu_mul")]


def test_supports_decline_of_last_candidate_falls_back_to_reference(sel):
    scores = torch.randn(2, 4)
    assert _served("topk_indices", scores, 6) == ("reference", "fallback")  # k > S
    idx = glm5.ops.topk_indices(scores, 6)
    assert torch.equal(idx, topk_indices_ref(scores, 6))
    assert sel.CALLS == []


def test_composite_op_decomposes_and_parts_use_the_plugin(sel):
    T, S, H, D = 3, 16, 2, 8
    q, k, w = torch.randn(T, H, D), torch.randn(S, D), torch.randn(T, H)
    ks = torch.zeros(T, dtype=torch.int32)
    ke = torch.full((T,), S, dtype=torch.int32)
    assert _served("indexer_topk", q, k, w, ks, ke, 4) == ("(parts)", "decomposed")
    idx = glm5.ops.indexer_topk(q, k, w, ks, ke, 4)
    assert idx.dtype == torch.int32 and idx.shape == (T, 4)
    assert sel.CALLS == [("tmpa", "topk_indices")]  # lightning_indexer came from the reference


def test_dispatch_records_what_served_each_call(sel):
    """Inside `recording_impls`, glm5.ops calls record their kernel's label (the backend's name
    for a plugin kernel given none), the reference fallback and decompositions."""
    from glm5.backends.api import recording_impls

    x, w, eps = _rms_inputs()
    xd, wd, _ = _rms_inputs(torch.float64)
    T, S, H, D = 3, 16, 2, 8
    q, k, wi = torch.randn(T, H, D), torch.randn(S, D), torch.randn(T, H)
    ks, ke = torch.zeros(T, dtype=torch.int32), torch.full((T,), S, dtype=torch.int32)
    glm5.ops.rms_norm(x, w, eps)  # outside a recorder: nothing to collect, nothing breaks
    with recording_impls() as labels:
        glm5.ops.rms_norm(x, w, eps)
    assert labels == ["tmpa"]
    with recording_impls() as labels:
        glm5.ops.rms_norm(xd, wd, eps)
    assert labels == ["fallback:reference"]
    with recording_impls() as labels:
        glm5.ops.indexer_topk(q, k, wi, ks, ke, 4)
    assert labels == ["decomposed", "fallback:reference", "tmpa"]
    with glm5.use_backend("reference"), recording_impls() as labels:
        glm5.ops.rms_norm(xd, wd, eps)  # named by an override: served, not a fallback
    assert labels == ["reference"]


def test_one_definition_of_the_plugin_api_names():
    from glm5.backends import api, policy, registry

    assert registry.strict_mode is api.strict_mode and selection.strict_mode is api.strict_mode
    assert registry.HookSpecs is api.HookSpecs and selection.REFERENCE is api.REFERENCE
    assert registry.REFERENCE is api.REFERENCE and policy.REFERENCE is api.REFERENCE
    assert not hasattr(registry, "RESERVED")


def test_strict_mode_fallback_is_an_error_naming_the_op(sel, monkeypatch):
    monkeypatch.setenv("GLM5_STRICT", "1")
    x, w, eps = _rms_inputs()
    glm5.ops.rms_norm(x, w, eps)  # served natively: fine under strict
    xd, wd, eps = _rms_inputs(torch.float64)
    with pytest.raises(glm5.FallbackError, match=r"glm5\.rms_norm: .*float64.*GLM5_STRICT=1"):
        glm5.ops.rms_norm(xd, wd, eps)
    assert sel.CALLS == [("tmpa", "rms_norm")]


def _glm5_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "glm5" and r.levelno == logging.WARNING]


def test_reference_fallback_outside_a_model_run_is_logged_once_per_op(sel, caplog):
    caplog.set_level(logging.WARNING, logger="glm5")
    xd, wd, eps = _rms_inputs(torch.float64)
    for _ in range(3):
        glm5.ops.rms_norm(xd, wd, eps)
    msgs = _glm5_warnings(caplog)
    assert len(msgs) == 1
    # the reasons of the backends for this device only: tmpgpu (cuda) is glm5 ops' business
    assert msgs[0].startswith("glm5: reference fallback on cpu/float64 for: rms_norm (")
    for why in ("tmpa: dtype float64 not in (float32)",
                "tmpb: dtype float64 not in (bfloat16, float32)",
                "tmpoff: unavailable: no Acme device found"):
        assert why in msgs[0]
    assert "tmpgpu" not in msgs[0] and "serves cuda" not in msgs[0]
    # another op falling back gets its own line
    glm5.ops.layer_norm(xd, wd, wd, eps)
    assert len(_glm5_warnings(caplog)) == 2


def test_fallbacks_of_a_model_run_are_logged_once_in_one_line(sel, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="glm5")
    xd, wd, eps = _rms_inputs(torch.float64)
    scores = torch.randn(2, 4)

    @glm5.ops.model_run
    def run():
        before = len(_glm5_warnings(caplog))
        for _ in range(2):
            with glm5.ops.model_run():  # nested: part of the outer run
                glm5.ops.rms_norm(xd, wd, eps)
                glm5.ops.layer_norm(xd, wd, wd, eps)
            glm5.ops.topk_indices(scores, 6)  # tmpa's supports() declines k > S
        assert len(_glm5_warnings(caplog)) == before  # nothing until the run ends

    run()
    msgs = _glm5_warnings(caplog)
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("glm5: reference fallback for: rms_norm on cpu/float64 (")
    assert "layer_norm on cpu/float64 (tmpoff: unavailable: no Acme device found; tmpa: no " \
           "kernel; tmpb: no kernel)" in msgs[0]
    assert "topk_indices on cpu/float32 (tmpoff: unavailable: no Acme device found; tmpb: no " \
           "kernel; tmpa: supports() declined the call)" in msgs[0]
    assert msgs[0].count("layer_norm") == 1 and "tmpgpu" not in msgs[0]
    run()  # the same fallbacks again: already said in this process
    assert len(_glm5_warnings(caplog)) == 1
    monkeypatch.setenv("GLM5_STRICT", "1")  # inside a run, strict mode still raises
    with pytest.raises(glm5.FallbackError, match=r"glm5\.rms_norm: .*GLM5_STRICT=1"):
        run()


def test_model_forward_and_generate_log_fallbacks_in_one_line(reference_only, caplog):
    """A tiny model on a registry of the reference alone: every op of the forward falls back,
    and the run says so in one line (not one warning per op listing every device backend)."""
    from glm5.core.config import preset

    caplog.set_level(logging.WARNING, logger="glm5")
    torch.manual_seed(0)
    model = glm5.GLM5ForCausalLM(preset("tiny"))
    ids = torch.tensor([[1, 2, 3]])
    model.generate(ids, 2)
    msgs = _glm5_warnings(caplog)
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("glm5: reference fallback on cpu/float32 for: rms_norm, rope, ")
    for op in ("attention", "silu_mul", "moe_route", "moe_experts"):
        assert op in msgs[0]
    assert msgs[0].count("(no backend for cpu is registered)") == 1
    with torch.no_grad():
        model(ids)  # a forward is a run too: nothing new to say
    assert len(_glm5_warnings(caplog)) == 1
    selection.clear_cache()  # forget what was said: a lone forward says it in one line
    with torch.no_grad():
        model(ids)
    msgs = _glm5_warnings(caplog)
    assert len(msgs) == 2 and msgs[1] == msgs[0]


def test_unknown_glm5_backend_is_an_error_naming_the_variable(sel, monkeypatch, capsys):
    x, w, eps = _rms_inputs()
    for value in ("nosuch", "tmpb, nosuch"):
        monkeypatch.setenv("GLM5_BACKEND", value)
        with pytest.raises(KeyError) as e:
            glm5.ops.rms_norm(x, w, eps)
        msg = str(e.value)
        assert msg.startswith(f"glm5: GLM5_BACKEND={value!r}: unknown backend 'nosuch'; "
                              f"known backends: ")
        assert "tmpa" in msg and "unset it" in msg
        assert isinstance(e.value, glm5.backends.api.UnknownBackendError)
    assert sel.CALLS == []
    assert cli.main(["ops"]) != 0
    assert "GLM5_BACKEND='tmpb, nosuch'" in capsys.readouterr().err
    assert cli.main(["backends", "--diagnose"]) == 0  # the place to find out still works
    assert "(error: unknown backend  nosuch)" in capsys.readouterr().out
    with glm5.use_backend("tmpb"):  # an explicit override does not read the variable
        assert _served("rms_norm", x, w, eps) == ("tmpb", "native")
    monkeypatch.setenv("GLM5_BACKEND", "tmpb")
    assert _served("rms_norm", x, w, eps) == ("tmpb", "native")


# --------------------------------------------------------------------------- (c) the example
@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    """glm5-example installed (as pip would for a user) into a private directory."""
    base = tmp_path_factory.mktemp("example")
    src = base / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                                 "__pycache__"))
    site = base / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (site / "glm5_example" / "__init__.py").is_file()
    return site


def _cli(site: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in GLM5_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "glm5.cli", *args], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout)


EXAMPLE_OPS = {"rms_norm", "silu_mul", "topk_indices"}


def test_example_plugin_in_process(example_site, plugin_dir, monkeypatch):
    plugin_dir.enable("example")
    monkeypatch.syspath_prepend(str(example_site))
    importlib.invalidate_caches()
    glm5.reset_registry()
    try:
        reg = glm5.get_registry()
        rec = reg.plugins["example"]
        assert (rec.status, rec.source, rec.backends) == ("loaded", "glm5-example 0.1.0",
                                                         ("example",))
        b = reg.backends["example"]
        assert (b.vendor, b.device_type, b.priority) == ("Example Corp", "cpu", 10)
        assert b.is_available() == (True, "cpu always present")
        assert EXAMPLE_OPS <= set(b.ops())

        for dt in (torch.float32, torch.bfloat16, torch.float16):
            x, w, eps = _rms_inputs(dt)
            assert _served("rms_norm", x, w, eps) == ("example", "native")
            y = glm5.ops.rms_norm(x, w, eps)
            assert y.dtype == dt
            assert_matches("rms_norm", y, {"x": x, "weight": w, "eps": eps}, dtype=dt)
            assert _served("silu_mul", x) == ("example", "native")
            z = glm5.ops.silu_mul(x)
            assert z.dtype == dt and z.shape == (4, 16)
            assert_matches("silu_mul", z, {"x": x}, dtype=dt)
        xd, wd, eps = _rms_inputs(torch.float64)
        assert _served("rms_norm", xd, wd, eps) == ("reference", "fallback")

        scores = torch.randn(3, 10)
        scores[0, 2] = float("nan")
        scores[1, :] = float("-inf")
        scores[1, 7] = 0.5
        assert _served("topk_indices", scores, 4) == ("example", "native")
        idx = glm5.ops.topk_indices(scores, 4)
        assert idx.dtype == torch.int32
        assert torch.equal(idx, topk_indices_ref(scores, 4))  # distinct scores: no ties
        assert idx[1].tolist() == [7, -1, -1, -1]
        # supports(): k > S is declined and passed on (here to the reference)
        assert _served("topk_indices", scores, 12) == ("reference", "fallback")
        assert torch.equal(glm5.ops.topk_indices(scores, 12), topk_indices_ref(scores, 12))
    finally:
        sys.modules.pop("glm5_example", None)


def test_example_plugin_listed_by_cli_backends(example_site):
    out = _cli(example_site, "backends", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    by_name = {b["name"]: b for b in data["backends"]}
    ex = by_name["example"]
    assert ex["available"] is True
    assert ex["reason"] == "cpu always present"
    assert (ex["vendor"], ex["device_type"], ex["priority"]) == ("Example Corp", "cpu", 10)
    assert "glm5-example" in ex["source"]
    assert EXAMPLE_OPS <= set(ex["ops"])
    assert "reference" in by_name
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["example"]["status"] == "loaded"
    assert "example" in plugins["example"]["backends"]


def test_example_plugin_passes_cli_parity(example_site):
    out = _cli(example_site, "parity", "--backend", "example", "--json", "--examples", "5")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    data = json.loads(out.stdout)
    assert data["backend"] == "example"
    rows = data["rows"]
    assert rows, "parity reported no rows"
    bad = [r for r in rows if r["status"] not in ("pass", "skip")]
    assert not bad, bad
    assert {r["backend"] for r in rows} == {"example"}
    assert EXAMPLE_OPS <= {r["op"] for r in rows}
    passed = {r["op"] for r in rows if r["status"] == "pass"}
    assert EXAMPLE_OPS <= passed


# --------------------------------------------------------------------------- registry hardening
IMPOSTOR = """
    import glm5

    GLM5_API_VERSION = "1.0"

    @glm5.hookimpl
    def glm5_register_backends(registry):
        registry.register(glm5.Backend("reference", vendor="Evil", device_type="cpu"))
"""


def test_no_plugin_can_take_the_reference_name(plugin_dir):
    plugin_dir.add("aaa", IMPOSTOR)  # sorts before "reference"
    reg = glm5.get_registry()
    assert reg.plugins["aaa"].status == "failed"
    assert "reserved" in reg.plugins["aaa"].message
    assert reg.backends["reference"].vendor == "glm5"
    x, w, eps = _rms_inputs()
    _rms_ok(x, w, eps)


def test_two_distributions_with_one_entry_point_name_are_reported(plugin_dir):
    plugin_dir.add("clash", GOOD, module="glm5_tmp_clash_a", dist="glm5-tmp-clash-a")
    plugin_dir.add("clash", GOOD.replace('"tmpgood"', '"tmpgood2"'), module="glm5_tmp_clash_b",
                   dist="glm5-tmp-clash-b")
    reg = glm5.get_registry()
    loaded = [p for p in reg.plugins.values() if p.status == "loaded" and p.name == "clash"]
    failed = [p for p in reg.plugins.values() if p.status == "failed"]
    assert len(loaded) == 1
    assert len(failed) == 1 and "already used by" in failed[0].message


def test_plugins_toml_settings_are_merged_over_backend_defaults(plugin_dir, tmp_path,
                                                               monkeypatch):
    src = GOOD.replace('description="good temp plugin")',
                       'description="good temp plugin", settings={"quant_scheme": "w8a16", '
                       '"collective": "gloo"})')
    plugin_dir.add("tmpgood", src)
    user = tmp_path / "user.toml"
    user.write_text('[backends.tmpgood]\nquant_scheme = "w4a8"\n')
    monkeypatch.setenv("GLM5_PLUGINS", str(user))
    glm5.reset_registry()
    b = glm5.get_registry().get("tmpgood")
    assert b.settings == {"quant_scheme": "w4a8", "collective": "gloo"}
