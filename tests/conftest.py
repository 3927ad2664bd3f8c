"""Test-suite set-up: hypothesis profiles (`ci` under CI=true, else `dev`) come from the glm5
pytest plugin; every test starts from a fresh backend registry and selection cache; Triton runs
interpreted when there is no GPU."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run through the interpreter on a machine without a GPU. Triton reads this when
# a @triton.jit function is defined, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_registry():
    import glm5

    glm5.reset_registry()
    yield
    glm5.reset_registry()


BUILTIN_ACCELERATED = ("cpu", "cuda", "ascend", "cambricon", "mthreads", "hygon")


def accelerators_off_policy(directory) -> str:
    """A plugins.toml that disables glm5's built-in accelerated backends, for tests that reason
    about selection among the reference and their own test plugins only."""
    import pathlib

    p = pathlib.Path(directory) / "accelerators_off.toml"
    p.write_text("[plugins]\ndisabled = [" + ", ".join(f'"{n}"' for n in BUILTIN_ACCELERATED)
                 + "]\n")
    return str(p)


@pytest.fixture
def reference_only(tmp_path, monkeypatch):
    import glm5

    monkeypatch.setenv("GLM5_PLUGINS", accelerators_off_policy(tmp_path))
    glm5.reset_registry()


# The kit's mutation score (tests/test_mutations.py), printed in the terminal summary so that it
# shows with -q too.
MUTATION_SCORE = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    text = config.stash.get(MUTATION_SCORE, None)
    if text:
        terminalreporter.section("glm5 kit mutation score")
        terminalreporter.write_line(text)
