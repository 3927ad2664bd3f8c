"""plugins.toml: parsing, key-by-key merging of the user file (GLM5_PLUGINS), errors, and the
policy's effect on selection (allow/deny, global and per-op order)."""

from __future__ import annotations

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
    assert pol.order == ("ascend", "cuda", "hygon", "cambricon", "mthreads", "cpu")
    assert pol.allow == frozenset() and pol.deny == frozenset()
    assert pol.op_orders == {}
    assert pol.disabled_plugins == frozenset()
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


def test_user_file_without_selection_keeps_packaged_order(tmp_path, monkeypatch):
    _user(tmp_path, monkeypatch, '[plugins]\ndisabled = ["cuda"]\n')
    pol = load_policy()
    assert pol.order[0] == "ascend" and len(pol.order) == 6
    assert pol.disabled_plugins == frozenset({"cuda"})


def test_get_policy_rereads_when_glm5_plugins_changes(tmp_path, monkeypatch):
    assert get_policy().order[0] == "ascend"
    _user(tmp_path, monkeypatch, '[selection]\norder = ["cpu"]\n')
    assert get_policy().order == ("cpu",)
    monkeypatch.delenv("GLM5_PLUGINS")
    assert get_policy().order[0] == "ascend"


@pytest.mark.parametrize(
    ("doc", "names"),
    [
        ({"selection": {"order": "cpu"}}, "[selection] order"),
        ({"selection": {"allow": ["cpu", 3]}}, "[selection] allow"),
        ({"selection": {"deny": {"cpu": True}}}, "[selection] deny"),
        ({"plugins": {"disabled": "cuda"}}, "[plugins] disabled"),
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
