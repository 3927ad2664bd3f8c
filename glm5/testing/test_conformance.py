"""The conformance suite: every (op, dtype) the backend under test claims, judged against the
float64 oracle on hypothesis-generated inputs. Run with
`pytest --pyargs glm5.testing --glm5-backend NAME`."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from glm5.ir.catalog import OPS  # noqa: E402
from glm5.ir.signature import dtype_name  # noqa: E402
from glm5.testing.cases import PROFILES, GENERATORS, HypothesisDraw, case_dtypes  # noqa: E402
from glm5.testing.compare import check_example  # noqa: E402
from glm5.testing.pytest_plugin import kit_backend, kit_ops  # noqa: E402


def _params(config: pytest.Config) -> list:
    backend = kit_backend(config)  # checked at session start too (a one-line usage error)
    name = backend.name
    only = kit_ops(config)
    out = []
    for op_name, entry in backend.kernels.items():
        if only and op_name not in only:
            continue
        for dt in case_dtypes(OPS[op_name], entry.dtypes):
            out.append(pytest.param(entry, dt, id=f"{name}-{op_name}-{dtype_name(dt)}"))
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if {"entry", "dtype"} <= set(metafunc.fixturenames):
        metafunc.parametrize(("entry", "dtype"), _params(metafunc.config))


@pytest.fixture
def tiers(request: pytest.FixtureRequest) -> tuple[str, ...]:
    return PROFILES[request.config.getoption("--glm5-profile")]


@given(data=st.data())
def test_kernel_matches_float64_oracle(entry, dtype, tiers, data) -> None:
    ok, reason = entry.backend.is_available()
    if not ok:
        pytest.skip(f"backend {entry.backend.name} unavailable: {reason}")
    op = OPS[entry.op]
    values = GENERATORS[op.name](HypothesisDraw(data, tiers), dtype)
    values, _ = op.validate((), values)
    assume(entry.accepts(tuple(values[n] for n in op.param_names)))
    verdict = check_example(op, entry.fn, values, dtype)
    assert verdict.ok, f"{entry.backend.name}:{op.name}[{dtype_name(dtype)}] {verdict.message}"
