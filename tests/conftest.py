"""Test-suite set-up: hypothesis profiles (`ci` under CI=true, else `dev`) come from the glm5
pytest plugin; every test starts from a fresh backend registry and selection cache that load
glm5's own plugins only (a third-party plugin installed in the environment changes nothing:
`[plugins] enabled` of a test policy; tests/test_kit.py checks it with one installed); Triton
runs interpreted when there is no GPU; the per-device tuning cache is off."""

from __future__ import annotations

import importlib
import os
import textwrap
from pathlib import Path

import pytest
import torch

# Triton kernels run through the interpreter on a machine without a GPU. Triton reads this when
# a @triton.jit function is defined, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A tuning cache the developer filled (`glm5 tune`) must not change the tiles tests run with;
# tests of the cache point GLM5_TUNING_CACHE at a temporary directory.
os.environ["GLM5_TUNING_CACHE"] = "off"


def _toml_list(names) -> str:
    return "[" + ", ".join(f'"{n}"' for n in names) + "]"


def write_policy(path, *, disabled=(), enabled_extra=()) -> str:
    """Write a plugins.toml at ``path`` that loads glm5's own plugins and ``enabled_extra``
    only, without ``disabled``; returns the path (for GLM5_PLUGINS)."""
    from glm5.backends.registry import builtin_plugin_names

    # "reference" keeps the list non-empty (empty = everything) when glm5 runs from a source
    # tree without entry points.
    enabled = (*(builtin_plugin_names() or ("reference",)), *enabled_extra)
    Path(path).write_text(f"[plugins]\ndisabled = {_toml_list(disabled)}\n"
                          f"enabled = {_toml_list(enabled)}\n")
    return str(path)


@pytest.fixture(scope="session")
def _builtin_only_policy(tmp_path_factory) -> str:
    return write_policy(tmp_path_factory.mktemp("glm5-policy") / "builtin_only.toml")


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch, _builtin_only_policy):
    import glm5

    monkeypatch.setenv("GLM5_PLUGINS", _builtin_only_policy)
    glm5.reset_registry()
    yield
    glm5.reset_registry()


BUILTIN_ACCELERATED = ("cpu", "cuda", "ascend", "cambricon", "mthreads", "hygon")


def accelerators_off_policy(directory, enabled_extra=()) -> str:
    """A plugins.toml that disables glm5's built-in accelerated backends (and loads no
    third-party plugin but ``enabled_extra``), for tests that reason about selection among the
    reference and their own test plugins only."""
    return write_policy(Path(directory) / "accelerators_off.toml", disabled=BUILTIN_ACCELERATED,
                       enabled_extra=enabled_extra)


class PluginDir:
    """Writes temporary distributions exposing ``glm5.backends`` entry points into ``root``
    (put it on sys.path): the same path an installed vendor package takes. With ``policy``
    set, each added plugin is also enabled in that plugins.toml (an accelerators-off one)."""

    def __init__(self, root: Path, policy: bool = False) -> None:
        self.root = root
        self.policy = policy
        self.names: list[str] = []
        if policy:
            self.policy_path = accelerators_off_policy(root)

    def enable(self, ep_name: str) -> None:
        self.names.append(ep_name)
        if self.policy:
            accelerators_off_policy(self.root, enabled_extra=self.names)

    def add(self, ep_name: str, source: str, *, module: str | None = None,
            dist: str | None = None) -> str:
        module = module or f"glm5_tmp_{ep_name}"
        dist = dist or f"glm5-tmp-{ep_name.replace('_', '-')}"
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[glm5.backends]\n{ep_name} = {module}\n")
        importlib.invalidate_caches()
        self.enable(ep_name)
        return f"{dist} 0.1"


# A third-party plugin as a user may have installed it: a cpu backend of the highest priority
# whose kernels are all wrong (zeros), so any glm5 test it reached would fail loudly.
HOSTILE = """
    import torch
    import glm5

    GLM5_API_VERSION = "1.0"
    hostile = glm5.Backend("hostile", vendor="Elsewhere", device_type="cpu", priority=1000)
    for _op in ("rms_norm", "layer_norm", "silu_mul", "rope", "topk_indices", "moe_route"):
        hostile.kernel(_op)(lambda *args: torch.zeros(()))

    @glm5.hookimpl
    def glm5_register_backends(registry):
        registry.register(hostile)
"""


@pytest.fixture
def third_party_installed(tmp_path_factory, monkeypatch):
    """The HOSTILE plugin installed (a distribution with a ``glm5.backends`` entry point on
    sys.path); the test's registry policy is left as it is."""
    import sys

    import glm5

    site = tmp_path_factory.mktemp("site")
    PluginDir(site).add("hostile", HOSTILE, module="glm5_hostile", dist="glm5-hostile")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    glm5.reset_registry()
    yield site
    sys.modules.pop("glm5_hostile", None)


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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny-shape model runs: a step is hundreds of tiny ops
    (a few dozen rows of width 64), and thread hand-offs cost more than the work; on a loaded
    2-core machine they made such files 4-5x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
