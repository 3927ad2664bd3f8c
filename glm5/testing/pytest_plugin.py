"""pytest plugin (entry point `pytest11: glm5`): adds `--glm5-backend NAME` and loads the
hypothesis profiles. The conformance tests live in glm5/testing/test_conformance.py:

    pytest --pyargs glm5.testing --glm5-backend NAME
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("glm5", "glm5 conformance kit")
    group.addoption("--glm5-backend", action="store", default="reference",
                    help="backend whose kernels the conformance suite checks (default: reference)")
    group.addoption("--glm5-ops", action="store", default="",
                    help="comma-separated ops to check (default: every op the backend claims)")
    group.addoption("--glm5-profile", action="store", default="default",
                    choices=("smoke", "quick", "default", "full"),
                    help="size tiers hypothesis draws from (glm5.testing.cases.PROFILES)")


def pytest_configure(config: pytest.Config) -> None:
    try:
        from glm5.testing.profiles import register_profiles
    except ImportError:  # pragma: no cover - hypothesis missing
        return
    try:
        register_profiles()
    except ImportError:
        pass


def pytest_report_header(config: pytest.Config) -> str:
    return f"glm5 conformance backend: {config.getoption('--glm5-backend')}"
