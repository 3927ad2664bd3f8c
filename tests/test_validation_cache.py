"""Validation once per signature (`OpDef.validate_cached`, used by `glm5.ops` and the
`torch.ops.glm5` binding): a call whose signature passed without reading values skips the
checks; checks that read values (index ranges) still run on every call where they run at all,
so a bad call after a good one with the same shapes gets the same error."""

from __future__ import annotations

import pytest
import torch

import glm5
from glm5 import ops
from glm5.ir import opdef
from glm5.ir.opdef import checks_as_on_device
from glm5.ir.signature import OpInputError, OpTypeError
from glm5.testing.cases import example

# (op, argument, a bad value for it built from the good example): checks that read values
VALUE_CHECKED = [
    ("sparse_attention", "idx", lambda a: a["idx"].clone().fill_(a["k"].shape[0])),
    ("moe_experts", "ids", lambda a: a["ids"].clone().fill_(a["w13"].shape[0])),
    ("token_logprobs", "targets", lambda a: a["targets"].clone().fill_(a["w_vocab"].shape[0])),
]


def _good(name: str) -> dict:
    op = glm5.get_op(name)
    ex = example(name, torch.float32, 3, 0)
    return {k: v for k, v in ex.items() if k in op.param_names}


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises((OpInputError, OpTypeError)) as e:
        fn(*args, **kwargs)
    return str(e.value)


@pytest.fixture(autouse=True)
def _fresh_caches():
    for op in glm5.ir.catalog.OPS.values():
        op._validated.clear()
        op._bound.clear()
    yield


@pytest.mark.parametrize("name,arg,bad", VALUE_CHECKED, ids=[v[0] for v in VALUE_CHECKED])
def test_a_bad_value_after_a_good_call_of_the_same_shapes_gets_the_same_error(name, arg, bad):
    op = glm5.get_op(name)
    good = _good(name)
    with torch.inference_mode():
        getattr(ops, name)(**good)
        getattr(ops, name)(**good)
        wrong = {**good, arg: bad(good)}
        assert op.signature((), wrong) == op.signature((), good)
        expected = _error(op.validate, (), wrong)
        assert arg in expected
        assert _error(getattr(ops, name), **wrong) == expected
        assert _error(getattr(torch.ops.glm5, name), *(wrong[n] for n in op.param_names)) \
            == expected


def test_a_signature_that_read_values_is_not_remembered():
    op = glm5.get_op("sparse_attention")
    good = _good("sparse_attention")
    op.validate_cached((), good)
    assert op.signature((), good) not in op._validated
    # ... only its shape binding is: the op's checks (which read the values) run again
    assert op.signature((), good) in op._bound
    calls = []
    check = op.check
    object.__setattr__(op, "check", lambda v, s: (calls.append(s), check(v, s)))
    try:
        values = op.validate_cached((), good)
    finally:
        object.__setattr__(op, "check", check)
    assert len(calls) == 1 and calls[0] == op.validate((), good)[1]
    assert values == op.validate((), good)[0]


def test_shape_only_signatures_skip_the_checks_and_anything_else_revalidates(monkeypatch):
    op = glm5.get_op("sparse_attention")
    good = _good("sparse_attention")
    calls = []
    check = op.check
    monkeypatch.setattr(op, "check", lambda v, s: (calls.append(1), check(v, s)))
    with checks_as_on_device():  # as on a device: index ranges are not read
        op.validate_cached((), good)
        op.validate_cached((), good)
        assert len(calls) == 1
        # another dtype, shape, scalar value or device setting is a new signature
        op.validate_cached((), {**good, "scale": 0.5})
        assert len(calls) == 2
        with pytest.raises((OpInputError, OpTypeError), match="dtype"):
            op.validate_cached((), {**good, "q": good["q"].double()})
        with pytest.raises(OpInputError, match="'k'"):
            op.validate_cached((), {**good, "k": good["k"][..., :-1]})
    monkeypatch.setenv("GLM5_STRICT", "1")
    with checks_as_on_device():  # strict: value checks run on devices too
        wrong = {**good, "idx": good["idx"].clone().fill_(good["k"].shape[0])}
        with pytest.raises(OpInputError, match="'idx'"):
            op.validate_cached((), wrong)


def test_positional_and_keyword_calls_and_scalar_types_are_different_signatures():
    op = glm5.get_op("rms_norm")
    x, w = torch.randn(2, 8), torch.ones(8)
    keys = {op.signature((x, w, 1e-6)), op.signature((x, w), {"eps": 1e-6}),
            op.signature((x, w, 1)), op.signature((x, w, True)),
            op.signature((x.t().contiguous().t(), w, 1e-6))}
    assert len(keys) == 5
    assert op.signature(([1.0], w, 1e-6)) is None
    assert op.signature((x.to("meta"), w, 1e-6)) is None
    ops.rms_norm(x, w, 1e-6)
    with pytest.raises(OpTypeError, match="'eps'"):
        ops.rms_norm(x, w, True)  # a bool where a float is expected, same shapes
    with pytest.raises(OpInputError, match="'eps'"):
        ops.rms_norm(x, w, -1.0)


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(opdef, "VALIDATED_LIMIT", 4)
    op = glm5.get_op("rms_norm")
    w = torch.ones(8)
    for n in range(1, 11):
        ops.rms_norm(torch.randn(n, 8), w, 1e-6)
        assert len(op._validated) <= 4


def test_a_served_signature_goes_straight_to_its_kernel_until_the_dispatch_state_changes(
        monkeypatch):
    from glm5.backends import selection

    x, w = torch.randn(2, 8), torch.ones(8)
    with torch.inference_mode():
        want = ops.rms_norm(x, w, 1e-6)
        slow = []
        call = selection.call
        monkeypatch.setattr(selection, "call", lambda *a: (slow.append(1), call(*a))[1])
        assert torch.equal(ops.rms_norm(x, w, 1e-6), want)
        assert slow == []  # served from the signature's kernel, no validation, no selection
        with glm5.use_backend("reference"):  # another dispatch state: selected again
            ops.rms_norm(x, w, 1e-6)
        assert len(slow) == 1
        glm5.reset_registry()  # plans went stale
        ops.rms_norm(x, w, 1e-6)
        assert len(slow) == 2
        ops.rms_norm(x, w, 1e-6)
        assert len(slow) == 2


def test_calls_that_need_autograd_or_read_values_never_take_the_shortcut(monkeypatch):
    from glm5.backends import selection

    x, w = torch.randn(2, 8), torch.ones(8, requires_grad=True)
    ops.rms_norm(x, w.detach(), 1e-6)
    y = ops.rms_norm(x, w, 1e-6)  # same shapes, but w requires grad: a new signature
    y.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    good = _good("sparse_attention")
    slow = []
    call = selection.call
    monkeypatch.setattr(selection, "call", lambda *a: (slow.append(1), call(*a))[1])
    with torch.inference_mode():
        for _ in range(3):
            ops.sparse_attention(**good)
    assert len(slow) == 3  # its index range is read on every call (CPU), so no shortcut


def test_frozen_dispatch_reads_the_environment_once(monkeypatch):
    from glm5.backends import selection

    monkeypatch.setenv("GLM5_BACKEND", "reference")
    monkeypatch.delenv("GLM5_STRICT", raising=False)
    with ops.frozen_dispatch():
        monkeypatch.setenv("GLM5_BACKEND", "cpu")
        monkeypatch.setenv("GLM5_STRICT", "1")
        assert selection.dispatch_state()[0] == ("reference",)  # as on entry
        assert opdef.strict_mode() is False
        with glm5.use_backend("cpu"):  # a context variable, not the environment: it applies
            assert selection.dispatch_state()[0] == ("cpu",)
        assert selection.dispatch_state()[0] == ("reference",)
    assert selection.dispatch_state()[0] == ("cpu",)  # read again after the scope
    assert opdef.strict_mode() is True


def test_frozen_dispatch_does_not_reuse_a_kernel_across_backends():
    from glm5.backends import selection

    x, w = torch.randn(2, 16), torch.randn(16)
    served: list[str] = []

    def wrap(entry):
        def fn(*args):
            served.append(entry.backend.name)
            return entry.fn(*args)
        return fn

    with selection.wrapped_kernels(wrap), ops.frozen_dispatch():
        for name in ("reference", "cpu", "reference"):
            with glm5.use_backend(name):
                ops.rms_norm(x, w, 1e-5)
                ops.rms_norm(x, w, 1e-5)  # the second call of a signature: the fast path
    assert served == ["reference"] * 2 + ["cpu"] * 2 + ["reference"] * 2


@pytest.mark.parametrize("name,arg,bad", VALUE_CHECKED[:1], ids=[VALUE_CHECKED[0][0]])
def test_compiled_calls_skip_python_validation_but_bad_input_still_gets_its_error(name, arg, bad):
    # Under dynamo `glm5.ops.<name>` goes straight to `torch.ops.glm5.<name>` (no graph
    # breaks): the fake kernel checks shapes at trace time, the real kernel validates values
    # at run time (glm5/ir/library.py `_impl`), with the eager message.
    op = glm5.get_op(name)
    good = _good(name)
    f = getattr(ops, name)

    def call(kw):
        return f(**kw)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            ex = torch._dynamo.explain(call)(good)
            assert ex.graph_break_count == 0, [b.reason for b in ex.break_reasons]
            torch._dynamo.reset()
            compiled = torch.compile(call, backend="eager")
            want = f(**good)
            got = compiled(good)
            for w, g in zip(want if isinstance(want, tuple) else (want,),
                            got if isinstance(got, tuple) else (got,)):
                torch.testing.assert_close(g, w)
            # a bad index value, same shapes (no retrace): the run-time check, same message
            wrong = {**good, arg: bad(good)}
            expected = _error(f, **wrong)
            assert arg in expected
            assert _error(compiled, wrong) == expected
            # a bad shape (a retrace): the fake kernel's check, naming the op and argument
            q = good["q"]
            short = {**good, "q": q[..., :-1]}
            eager_msg = _error(f, **short)
            with pytest.raises(Exception) as e:
                compiled(short)
            msg = str(e.value)
            # (q's last dim binds Dqk, so k is the one named; on the retrace q is dynamic:
            # Dqk=s.., hence the comparison up to the shape)
            head = f"glm5.{name}: argument 'k' expected shape [S, Hk, Dqk]"
            assert eager_msg.startswith(head), eager_msg
            assert head in msg, msg
    finally:
        torch._dynamo.reset()


def test_the_binding_serves_repeated_signatures_without_validation_and_keeps_autograd():
    """`torch.ops.glm5.<op>` remembers the kernel of a validated signature (no validation, no
    selection the next time), in a table of its own: its kernel runs below autograd, so an
    eager `glm5.ops` call that needs autograd must not go straight to the kernel."""
    from glm5 import ops as ops_mod

    x = torch.randn(3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    y = torch.ops.glm5.rms_norm(x, w, 1e-5)
    y.sum().backward()
    served = ops_mod._served_binding["rms_norm"]
    assert any(k[0] == glm5.get_op("rms_norm").signature((x, w, 1e-5)) for k in served.table)
    calls = []
    op = glm5.get_op("rms_norm")
    validate = op.validate_cached
    object.__setattr__(op, "validate_cached", lambda *a: (calls.append(1), validate(*a))[1])
    try:
        torch.ops.glm5.rms_norm(x, w, 1e-5)  # served: not even the cached validation runs
    finally:
        object.__delattr__(op, "validate_cached")
    assert calls == []
    out = ops.rms_norm(x, w, 1e-5)  # the same signature, eagerly, with grad enabled
    assert out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None


def test_getenv_follows_every_change_made_through_os_environ(monkeypatch):
    import os

    from glm5.ir.env import getenv

    monkeypatch.delenv("GLM5_TEST_ENV_READ", raising=False)
    assert getenv("GLM5_TEST_ENV_READ") is None
    monkeypatch.setenv("GLM5_TEST_ENV_READ", "a,b")
    assert getenv("GLM5_TEST_ENV_READ") == "a,b"
    os.environ["GLM5_TEST_ENV_READ"] = "é"  # non-ASCII: decoded as os.environ decodes it
    assert getenv("GLM5_TEST_ENV_READ") == os.environ["GLM5_TEST_ENV_READ"] == "é"
    del os.environ["GLM5_TEST_ENV_READ"]
    assert getenv("GLM5_TEST_ENV_READ") is None
    monkeypatch.setenv("GLM5_STRICT", "yes")
    assert opdef.strict_mode() is True
    monkeypatch.setenv("GLM5_STRICT", "0")
    assert opdef.strict_mode() is False
