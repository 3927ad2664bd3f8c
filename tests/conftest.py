"""Test-suite set-up: hypothesis profiles (`ci` under CI=true, else `dev`) come from the glm5
pytest plugin; every test starts from a fresh backend registry and selection cache."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_registry():
    import glm5

    glm5.reset_registry()
    yield
    glm5.reset_registry()
