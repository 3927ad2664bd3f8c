"""pytest plugin (entry point `pytest11: glm5`): adds `--glm5-backend NAME` and loads the
hypothesis profiles. The conformance tests live in glm5/testing/test_conformance.py:

    pytest --pyargs glm5.testing --glm5-backend NAME

A backend that is not loaded (unknown, or its plugin refused, failed or disabled) or an
unknown op in ``--glm5-ops`` stops the session at its start with one line saying why
(``ERROR: glm5 conformance kit: ...``, exit code 4), not a collection traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from glm5.testing.profiles import register_profiles

if TYPE_CHECKING:
    from glm5.backends.api import Backend

DEFAULT_BACKEND = "reference"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("glm5", "glm5 conformance kit")
    # default None (meaning the reference) tells an explicit choice apart: only then is the
    # registry loaded at session start, so other projects' pytest runs never pay for it.
    group.addoption("--glm5-backend", action="store", default=None,
                    help="backend whose kernels the conformance suite checks (default: "
                         f"{DEFAULT_BACKEND})")
    group.addoption("--glm5-ops", action="store", default="",
                    help="comma-separated ops to check (default: every op the backend claims)")
    group.addoption("--glm5-profile", action="store", default="default",
                    choices=("smoke", "quick", "default", "full"),
                    help="size tiers hypothesis draws from (glm5.testing.cases.PROFILES)")


def kit_backend(config: pytest.Config) -> "Backend":
    """The backend ``--glm5-backend`` names; `pytest.UsageError` saying why when it is not
    loaded (see `glm5.backends.registry.Registry.why_not_loaded`)."""
    # lazy: keeps this pytest11 plugin light (every pytest run of any project loads it)
    from glm5.backends.api import UnknownBackendError
    from glm5.backends.registry import PluginLoadError, get_registry  # lazy: as above

    name = config.getoption("--glm5-backend") or DEFAULT_BACKEND
    try:
        return get_registry().get(name)
    except (UnknownBackendError, PluginLoadError) as e:
        raise pytest.UsageError(
            f"glm5 conformance kit: --glm5-backend {name}: {str(e).removeprefix('glm5: ')}"
        ) from None


def kit_ops(config: pytest.Config) -> list[str]:
    """The ops ``--glm5-ops`` names ([] = every op the backend claims); `pytest.UsageError`
    naming an unknown one."""
    from glm5.ir.catalog import OPS  # lazy: keeps this pytest11 plugin light (as above)

    only = [o.strip() for o in config.getoption("--glm5-ops").split(",") if o.strip()]
    unknown = [o for o in only if o not in OPS]
    if unknown:
        raise pytest.UsageError(f"glm5 conformance kit: --glm5-ops: unknown op(s) "
                                f"{', '.join(unknown)}; known ops: {', '.join(OPS)}")
    return only


def pytest_configure(config: pytest.Config) -> None:
    try:
        register_profiles()
    except ImportError:
        pass


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if config.getoption("--glm5-backend") is not None or config.getoption("--glm5-ops"):
        kit_backend(config)
        kit_ops(config)


def pytest_report_header(config: pytest.Config) -> str:
    return f"glm5 conformance backend: {config.getoption('--glm5-backend') or DEFAULT_BACKEND}"
