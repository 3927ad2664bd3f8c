"""plugins.toml: parsing, key-by-key merging of the user file (GLM5_PLUGINS), errors, and the
policy's effect on selection (allow/deny, global and per-op order)."""

from __future__ import annotations

import json

import pytest
import torch

import glm5
from glm5.backends import selection
from glm5.backends.policy import Policy, PolicyError, get_policy, load_policy, merge, parse
from glm5.ir.ops_norm import rms_norm_ref, silu_mul_ref

PACKAGED = "glm5/plugins.toml (packaged)"


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in ("GLM5_BACKEND", "GLM5_STRICT", "GLM5_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    glm5.reset_registry()
    yield
    glm5.use_backend(None)
    monkeypatch.undo()
    glm5.reset_registry()


def _user(tmp_path, monkeypatch, text: str):
    p = tmp_path / "plugins.toml"
    p.write_text(text)
    monkeypatch.setenv("GLM5_PLUGINS", str(p))
    return p


# --------------------------------------------------------------------------- parse / merge
def test_packaged_default():
    pol = load_policy()
    assert pol.sources == (PACKAGED,)
    # The packaged file names no backend: priority alone ranks built-ins and plugins alike
    # (see `selection.ranked`); only a user's file orders them otherwise.
    assert pol.order == ()
    assert pol.allow == frozenset() and pol.deny == frozenset()
    assert pol.op_orders == {}
    assert pol.disabled_plugins == frozenset() and pol.enabled_plugins == frozenset()
    assert pol.settings_for("reference") == {"quant_scheme": "none", "collective": "gloo"}
    assert pol.settings_for("nosuch") == {}


def test_merge_tables_merge_and_lists_and_values_replace():
    base = {"selection": {"order": ["a", "b"], "deny": ["x"]},
            "backends": {"cpu": {"quant_scheme": "w8a16", "collective": "gloo"}}}
    over = {"selection": {"order": ["c"]},
            "backends": {"cpu": {"collective": "mpi"}, "acme": {"quant_scheme": "w4a8"}},
            "ops": {"rms_norm": {"order": ["c"]}}}
    out = merge(base, over)
    assert out == {
        "selection": {"order": ["c"], "deny": ["x"]},
        "backends": {"cpu": {"quant_scheme": "w8a16", "collective": "mpi"},
                     "acme": {"quant_scheme": "w4a8"}},
        "ops": {"rms_norm": {"order": ["c"]}},
    }
    assert base["selection"]["order"] == ["a", "b"]  # inputs are not mutated
    assert base["backends"]["cpu"]["collective"] == "gloo"


def test_user_file_overrides_key_by_key(tmp_path, monkeypatch):
    p = _user(tmp_path, monkeypatch, """
[selection]
order = ["cpu"]

[ops.indexer_topk]
order = ["ascend", "cuda"]

[backends.reference]
collective = "mpi"

[backends.acme]
quant_scheme = "w4a8"
compile_cache = "/tmp/acme-cache"
""")
    pol = load_policy()
    assert pol.sources == (PACKAGED, str(p))
    assert pol.order == ("cpu",)  # a list replaces, it is not appended to
    assert pol.allow == frozenset() and pol.deny == frozenset()  # untouched keys keep defaults
    assert pol.op_orders == {"indexer_topk": ("ascend", "cuda")}
    # a table merges: the packaged quant_scheme stays, collective is overridden
    assert pol.settings_for("reference") == {"quant_scheme": "none", "collective": "mpi"}
    assert pol.settings_for("acme") == {"quant_scheme": "w4a8", "compile_cache": "/tmp/acme-cache"}


def test_user_file_without_selection_keeps_packaged_selection(tmp_path, monkeypatch):
    _user(tmp_path, monkeypatch, '[plugins]\ndisabled = ["cuda"]\nenabled = ["cpu", "acme"]\n')
    pol = load_policy()
    assert pol.order == () and pol.allow == frozenset()
    assert pol.disabled_plugins == frozenset({"cuda"})
    assert pol.enabled_plugins == frozenset({"cpu", "acme"})


def test_get_policy_rereads_when_glm5_plugins_changes(tmp_path, monkeypatch):
    assert get_policy().order == ()
    _user(tmp_path, monkeypatch, '[selection]\norder = ["cpu"]\n')
    assert get_policy().order == ("cpu",)
    monkeypatch.delenv("GLM5_PLUGINS")
    assert get_policy().order == ()


def test_packaged_file_and_docs_state_the_builtin_priorities():
    """plugins.toml's comment and docs/plugins.md's table tell users how built-ins rank (a
    plugin picks its priority by them): they must say what the backends say."""
    from importlib import resources
    from pathlib import Path

    text = resources.files("glm5").joinpath("plugins.toml").read_text()
    reg = glm5.get_registry()
    builtin = sorted((b for b in reg.backends.values() if b.name != "reference"),
                     key=lambda b: -b.priority)
    stated = ", ".join(f"{b.name} {b.priority}" for b in builtin)
    comments = " ".join(ln.lstrip("# ") for ln in text.splitlines() if ln.startswith("#"))
    assert f"built-ins rank {stated}," in comments
    docs = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    assert ("| backend | " + " | ".join(b.name for b in builtin) + " | reference |\n") in docs
    assert ("| priority | " + " | ".join(str(b.priority) for b in builtin)
            + " | last resort only |\n") in docs

@pytest.mark.parametrize(
    ("doc", "names"),
    [
        ({"selection": {"order": "cpu"}}, "[selection] order"),
        ({"selection": {"allow": ["cpu", 3]}}, "[selection] allow"),
        ({"selection": {"deny": {"cpu": True}}}, "[selection] deny"),
        ({"plugins": {"disabled": "cuda"}}, "[plugins] disabled"),
        ({"plugins": {"enabled": [1]}}, "[plugins] enabled"),
        ({"plugins": ["cuda"]}, "[plugins]"),
        ({"selection": ["cpu"]}, "[selection]"),
        ({"ops": {"rms_norm": {"order": "cpu"}}}, "[ops.rms_norm] order"),
        ({"ops": {"rms_norm": ["cpu"]}}, "[ops.rms_norm]"),
        ({"ops": ["rms_norm"]}, "[ops]"),
        ({"backends": {"cpu": "w8a16"}}, "[backends.<name>]"),
    ],
)
def test_malformed_values_raise_policy_error_naming_the_key(doc, names):
    with pytest.raises(PolicyError) as e:
        parse(doc)
    assert names in str(e.value)
    assert str(e.value).startswith("plugins.toml:")


def test_malformed_user_file_raises_through_load_policy(tmp_path, monkeypatch):
    _user(tmp_path, monkeypatch, '[selection]\ndeny = "cuda"\n')
    with pytest.raises(PolicyError, match=r"\[selection\] deny expected a list of backend names"):
        load_policy()


def test_invalid_toml_raises_policy_error(tmp_path, monkeypatch):
    p = _user(tmp_path, monkeypatch, "[selection\norder = [\n")
    with pytest.raises(PolicyError, match="not valid TOML") as e:
        load_policy()
    assert str(p) in str(e.value)


def test_missing_user_file_raises_policy_error(tmp_path, monkeypatch):
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("GLM5_PLUGINS", str(missing))
    with pytest.raises(PolicyError, match="no such file") as e:
        load_policy()
    assert str(missing) in str(e.value)


def test_allow_and_deny_semantics():
    pol = Policy(allow=frozenset({"cuda"}), deny=frozenset({"ascend"}))
    assert pol.allowed("cuda")
    assert not pol.allowed("cpu")  # not in a non-empty allow list
    assert not pol.allowed("ascend")  # denied
    assert pol.allowed("reference")  # the reference is always allowed
    open_pol = Policy(deny=frozenset({"ascend"}))
    assert open_pol.allowed("cpu") and open_pol.allowed("reference")
    assert not open_pol.allowed("ascend")
    both = Policy(allow=frozenset({"cuda"}), deny=frozenset({"cuda"}))
    assert not both.allowed("cuda")  # deny wins over allow


# --------------------------------------------------------------------------- effect on selection
def _backend(name: str, priority: int, ops=("rms_norm", "silu_mul")) -> glm5.Backend:
    b = glm5.Backend(name, vendor="Test", device_type="cpu", priority=priority)
    refs = {"rms_norm": rms_norm_ref, "silu_mul": silu_mul_ref}
    for op in ops:
        b.kernel(op)(refs[op])
    return b


@pytest.fixture
def two_backends(reference_only):
    """pa (priority 5) and pb (priority 1) both serve rms_norm and silu_mul; pa alone serves
    nothing else; registered directly into the live registry (glm5's accelerated built-ins
    are disabled, so only these compete)."""
    reg = glm5.get_registry()
    reg.register(_backend("pa", 5))
    reg.register(_backend("pb", 1))
    reg.register(_backend("pc", 0, ops=("silu_mul",)))
    assert reg.backends["pa"].source == "direct"
    return reg


def _served(op: str, *args) -> tuple[str, str]:
    values, _ = glm5.get_op(op).validate(args, {})
    return selection.kernel_for(glm5.get_op(op), values)


X, W = torch.randn(2, 16), torch.ones(16)


def test_without_policy_priority_decides(two_backends):
    assert _served("rms_norm", X, W, 1e-6) == ("pa", "native")
    assert _served("silu_mul", X) == ("pa", "native")


def test_global_order_beats_priority(two_backends, tmp_path, monkeypatch):
    _user(tmp_path, monkeypatch, '[selection]\norder = ["pb", "not-installed"]\n')
    assert _served("rms_norm", X, W, 1e-6) == ("pb", "native")
    assert _served("silu_mul", X) == ("pb", "native")


def test_per_op_order_applies_to_that_op_only(two_backends, tmp_path, monkeypatch):
    _user(tmp_path, monkeypatch, '[ops.rms_norm]\norder = ["pb"]\n')
    assert _served("rms_norm", X, W, 1e-6) == ("pb", "native")
    assert _served("silu_mul", X) == ("pa", "native")  # by priority, as before


def test_per_op_order_beats_global_order(two_backends, tmp_path, monkeypatch):
    _user(tmp_path, monkeypatch,
          '[selection]\norder = ["pb"]\n[ops.silu_mul]\norder = ["pc"]\n')
    assert _served("silu_mul", X) == ("pc", "native")
    assert _served("rms_norm", X, W, 1e-6) == ("pb", "native")


def test_per_op_order_can_name_the_reference_explicitly(two_backends, tmp_path, monkeypatch):
    _user(tmp_path, monkeypatch, '[ops.rms_norm]\norder = ["reference"]\n')
    assert _served("rms_norm", X, W, 1e-6) == ("reference", "native")  # chosen, not a fallback
    assert _served("silu_mul", X) == ("pa", "native")


def test_override_beats_policy(two_backends, tmp_path, monkeypatch):
    _user(tmp_path, monkeypatch, '[selection]\norder = ["pb"]\n')
    with glm5.use_backend("pa"):
        assert _served("rms_norm", X, W, 1e-6) == ("pa", "native")
    monkeypatch.setenv("GLM5_BACKEND", "pa")
    assert _served("rms_norm", X, W, 1e-6) == ("pa", "native")


def test_deny_removes_a_backend_even_when_explicitly_requested(two_backends, tmp_path,
                                                                monkeypatch):
    _user(tmp_path, monkeypatch, '[selection]\ndeny = ["pa"]\n')
    assert _served("rms_norm", X, W, 1e-6) == ("pb", "native")
    with glm5.use_backend("pa"):
        assert _served("rms_norm", X, W, 1e-6) == ("pb", "native")
    plan = selection.resolve(glm5.get_op("rms_norm"), "cpu", torch.float32)
    assert dict(plan.declined)["pa"] == "denied by plugins.toml"


def test_allow_restricts_backends_and_reference_stays_the_fallback(two_backends, tmp_path,
                                                                    monkeypatch):
    _user(tmp_path, monkeypatch, '[selection]\nallow = ["pc"]\n')
    assert _served("silu_mul", X) == ("pc", "native")
    assert _served("rms_norm", X, W, 1e-6) == ("reference", "fallback")
    assert torch.equal(glm5.ops.rms_norm(X, W, 1e-6), rms_norm_ref(X, W, 1e-6))  # it is the ref
    monkeypatch.setenv("GLM5_STRICT", "1")
    with pytest.raises(glm5.FallbackError, match=r"glm5\.rms_norm.*pa: denied by plugins\.toml"):
        glm5.ops.rms_norm(X, W, 1e-6)


# --------------------------------------------------------------------------- one rule, four users
def _third_party(name: str, priority: int, ops) -> glm5.Backend:
    from glm5.ir.catalog import OPS

    b = glm5.Backend(name, vendor="Third Party", device_type="cpu", priority=priority)
    for op in ops:
        b.kernel(op)(OPS[op].reference)
    glm5.get_registry().register(b)
    return b


def _bench_pick(monkeypatch, capsys) -> str:
    """The backend `glm5 bench` (no --backend) would time (the timing itself is stubbed)."""
    from glm5 import cli

    picked = []

    def fake_run_bench(backend, *args, **kwargs):
        picked.append(backend.name)
        return {}, []

    monkeypatch.setattr("glm5.perf.bench.run_bench", fake_run_bench)
    assert cli.main(["bench", "--json"]) == 0
    capsys.readouterr()
    return picked[0]


def _ops_served(capsys) -> dict[str, dict]:
    from glm5 import cli

    assert cli.main(["ops", "--json"]) == 0
    return {r["op"]: r for r in json.loads(capsys.readouterr().out)["ops"]}


def test_one_rule_ranks_plugins_among_builtins_for_model_ops_and_bench(tmp_path, monkeypatch,
                                                                       capsys):
    """glm5's built-ins and third-party plugins rank by priority alike: a plugin of priority
    50 serves rms_norm ahead of glm5's cpu backend (10) in the model's dispatch, in `glm5 ops`
    and as `glm5 bench`'s choice; one of priority 5 serves only what the cpu backend does not.
    A user's plugins.toml order, or GLM5_BACKEND, decides otherwise, for all of them."""
    from glm5.ir.catalog import OPS

    reg = glm5.get_registry()
    cpu = reg.get("cpu")
    prims = [op.name for op in OPS.values() if not op.is_composite]
    _third_party("hi", 50, ["rms_norm"])
    _third_party("lo", 5, prims)

    def cpu_serves(op: str, dtype_name: str) -> bool:
        k = cpu.kernels.get(op)
        return cpu.is_available()[0] and k is not None and k.accepts_dtype(
            getattr(torch, dtype_name))

    rows = _ops_served(capsys)
    for op in prims:
        r = rows[op]
        want = "hi" if op == "rms_norm" else "cpu" if cpu_serves(op, r["dtype"]) else "lo"
        assert r["served_by"] == want, (op, r)
        plan = selection.resolve(OPS[op], "cpu", getattr(torch, r["dtype"]))
        assert plan.served_by == want  # what the model's calls get
    assert _served("rms_norm", X, W, 1e-6) == ("hi", "native")
    assert _bench_pick(monkeypatch, capsys) == "hi"

    _user(tmp_path, monkeypatch, '[selection]\norder = ["cpu"]\n')  # the user's word
    rows = _ops_served(capsys)
    want = "cpu" if cpu_serves("rms_norm", rows["rms_norm"]["dtype"]) else "hi"
    assert rows["rms_norm"]["served_by"] == want
    assert _bench_pick(monkeypatch, capsys) == ("cpu" if cpu.is_available()[0] else "hi")

    monkeypatch.setenv("GLM5_BACKEND", "lo")
    assert _ops_served(capsys)["rms_norm"]["served_by"] == "lo"
    assert _served("rms_norm", X, W, 1e-6) == ("lo", "native")
    assert _bench_pick(monkeypatch, capsys) == "lo"
