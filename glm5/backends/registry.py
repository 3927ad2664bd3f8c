"""Discovery: entry points of group ``glm5.backends`` -> pluggy -> the backend registry.

Every backend, built-in or third party, arrives through the same path. A plugin that fails to
import, declares another API major version, or raises while registering is recorded with its
reason and skipped; under ``GLM5_STRICT=1`` the error is re-raised. A plugin that declares no
API version is loaded (as built for this major version) with a warning on its record. Asking
for a backend that is not loaded (`Registry.get`) says why: the plugin of that name was
refused, failed or is disabled, or the name is unknown.
"""

from __future__ import annotations

import importlib.metadata as md
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from glm5.backends import reference
from glm5.backends.api import (
    API_VERSION,
    ENTRY_POINT_GROUP,
    PROJECT,
    REFERENCE,
    Backend,
    BackendError,
    HookSpecs,
    UnknownBackendError,
    strict_mode,
)
from glm5.backends.policy import get_policy, merge

BUILTIN_REFERENCE = "glm5.backends.reference"  # the module of glm5's own reference plugin
GLM5_DISTRIBUTION = "glm5"


@dataclass
class PluginRecord:
    name: str  # entry-point name
    source: str  # "<distribution> <version>" or a description
    status: str  # "loaded" | "failed" | "refused" | "disabled"
    message: str = ""
    detail: str = ""  # traceback for failures
    backends: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # a loaded plugin's problems (e.g. no GLM5_API_VERSION)


# How a record's status reads in a sentence: "plugin 'acme' (glm5-acme 0.1) was refused: ...".
_STATUS_PHRASE = {"failed": "failed to load", "refused": "was refused",
                  "disabled": "is disabled"}


class PluginLoadError(BackendError):
    """A plugin failed to load (raised only in strict mode)."""


def _major(v: str) -> str:
    return str(v).split(".")[0].strip()


class Registry:
    """All known backends (available or not) and the record of every plugin."""

    def __init__(self) -> None:
        self.backends: dict[str, Backend] = {}
        self.plugins: dict[str, PluginRecord] = {}
        self._current_source = ""
        self._current_backends: list[str] = []
        self._builtin = False  # True only while glm5's own reference plugin registers

    # Called by plugins from their glm5_register_backends hook.
    def register(self, backend: Backend) -> None:
        if not isinstance(backend, Backend):
            raise BackendError(
                f"glm5 registry.register: expected a glm5.Backend, got {type(backend).__name__}"
            )
        if backend.name == REFERENCE and not self._builtin:
            raise BackendError(
                f"glm5 registry.register: the backend name {REFERENCE!r} is reserved for glm5's "
                f"float64 oracle"
            )
        if backend.name in self.backends:
            other = self.backends[backend.name].source
            raise BackendError(
                f"glm5 registry.register: a backend named {backend.name!r} is already "
                f"registered (from {other})"
            )
        backend.source = self._current_source or backend.source or "direct"
        backend.settings = merge(backend.settings, get_policy().settings_for(backend.name))
        self.backends[backend.name] = backend
        self._current_backends.append(backend.name)
        _changed()

    def get(self, name: str) -> Backend:
        """The backend ``name``; `UnknownBackendError` (a KeyError) saying why it is not
        loaded (see `why_not_loaded`) otherwise."""
        try:
            return self.backends[name]
        except KeyError:
            raise UnknownBackendError(f"glm5: {self.why_not_loaded(name)}") from None

    def why_not_loaded(self, name: str) -> str:
        """Why no backend ``name`` is registered, in one sentence: the plugin of that
        entry-point name was refused / failed / is disabled (with its reason), else the name is
        unknown, followed by the known backends and every plugin that is not loaded (its
        backends' names are unknown until its hook runs, so any of them may be the one)."""
        known = ", ".join(sorted(self.backends)) or "none"
        rec = self.plugins.get(name)
        if rec is not None and rec.status in _STATUS_PHRASE:
            return (f"backend {name!r} is not loaded: plugin {name!r} ({rec.source}) "
                    f"{_STATUS_PHRASE[rec.status]}: {rec.message}; known backends: {known}")
        msg = f"unknown backend {name!r}; known backends: {known}"
        others = [p for p in self.plugins.values() if p.status in ("failed", "refused")]
        if others:
            msg += "; plugins not loaded: " + "; ".join(
                f"{p.name} ({p.source}) {_STATUS_PHRASE[p.status]}: {p.message}" for p in others)
        return msg

    def errors(self) -> list[PluginRecord]:
        return [p for p in self.plugins.values() if p.status in ("failed", "refused")]

    # ------------------------------------------------------------------ discovery
    def load_plugin(self, name: str, obj: Any, source: str, pm: pluggy.PluginManager) -> None:
        """Check the API version of ``obj``, register it with pluggy and call its hook."""
        declared = getattr(obj, "GLM5_API_VERSION", None)
        warnings: list[str] = []
        if declared is None:
            # Loaded as built for this major version: refusing it would break every plugin
            # written before the declaration existed; the warning tells its author what to add.
            warnings.append(
                f"plugin declares no GLM5_API_VERSION; loaded as built for glm5 plugin API "
                f"{_major(API_VERSION)}.x (this glm5 speaks API {API_VERSION}): add "
                f"GLM5_API_VERSION = \"{API_VERSION}\" to the plugin object")
        elif _major(declared) != _major(API_VERSION):
            raise _Refused(
                f"plugin was built for glm5 plugin API {declared}, this glm5 speaks API "
                f"{API_VERSION} (major versions differ)"
            )
        pm.register(obj, name=name)
        impls = [
            i for i in pm.hook.glm5_register_backends.get_hookimpls() if i.plugin is obj
        ]
        if not impls:
            raise _Refused("plugin implements no glm5_register_backends hook")
        self._current_source, self._current_backends = source, []
        self._builtin = getattr(obj, "__name__", "") == BUILTIN_REFERENCE
        try:
            for impl in impls:
                impl.function(registry=self)
        except Exception:
            for b in self._current_backends:  # roll back a half-registered plugin
                self.backends.pop(b, None)
            raise
        finally:
            self._current_source = ""
            self._builtin = False
        self.plugins[name] = PluginRecord(
            name, source, "loaded", backends=tuple(self._current_backends),
            warnings=tuple(warnings),
        )

    def discover(self, disabled: set[str] | frozenset[str] = frozenset(),
                 enabled: set[str] | frozenset[str] = frozenset()) -> None:
        """Load every entry point of group ``glm5.backends``: ``disabled`` names are not
        imported; a non-empty ``enabled`` loads only the names it lists (glm5's reference
        plugin always loads: it is the oracle)."""
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(HookSpecs)
        # glm5's own oracle first, so no plugin can take its place; then by name.
        eps = sorted(md.entry_points(group=ENTRY_POINT_GROUP),
                     key=lambda e: (e.value != BUILTIN_REFERENCE, e.name))
        seen: dict[str, tuple[str, str]] = {}
        for ep in eps:
            dist = getattr(ep, "dist", None)
            source = f"{dist.name} {dist.version}" if dist is not None else ep.value
            ident = (ep.value, dist.name if dist is not None else "")
            if ep.name in seen:
                if seen[ep.name] != ident:  # two distributions claim one plugin name
                    self._record(f"{ep.name} ({source})", source, "failed",
                                 f"entry point name {ep.name!r} is already used by "
                                 f"{seen[ep.name][1] or seen[ep.name][0]}", "")
                continue  # else: the same distribution visible twice on sys.path
            seen[ep.name] = ident
            if ep.name in disabled:
                self.plugins[ep.name] = PluginRecord(ep.name, source, "disabled",
                                                     "disabled in plugins.toml")
                continue
            if enabled and ep.name not in enabled and ep.value != BUILTIN_REFERENCE:
                self.plugins[ep.name] = PluginRecord(
                    ep.name, source, "disabled",
                    "not in the [plugins] enabled list of plugins.toml")
                continue
            try:
                obj = ep.load()
                self.load_plugin(ep.name, obj, source, pm)
            except _Refused as e:
                self._record(ep.name, source, "refused", str(e), "")
            except Exception as e:
                self._record(ep.name, source, "failed", f"{type(e).__name__}: {e}",
                             traceback.format_exc())
        if REFERENCE not in self.backends:
            # glm5 itself is not installed (running from a source tree): the oracle must exist.
            self._current_source = "glm5 (source tree, no entry point)"
            self._builtin = True
            try:
                reference.glm5_register_backends(self)
            finally:
                self._current_source, self._builtin = "", False

    def _record(self, name: str, source: str, status: str, msg: str, detail: str) -> None:
        self.plugins[name] = PluginRecord(name, source, status, msg, detail)
        if strict_mode():
            raise PluginLoadError(f"glm5: plugin {name!r} ({source}) {status}: {msg}")


class _Refused(Exception):
    pass


def builtin_plugin_names() -> tuple[str, ...]:
    """The entry-point names glm5's own distribution declares (``reference``, ``cpu``,
    ``cuda``, ...), sorted: what ``[plugins] enabled`` lists to run with glm5's backends only
    (e.g. to check whether a third-party plugin causes a problem; glm5's own tests do)."""
    names = set()
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        ours = dist is None or (dist.name or "").lower() == GLM5_DISTRIBUTION
        if ours and ep.value.startswith("glm5.backends."):
            names.add(ep.name)
    return tuple(sorted(names))


_lock = threading.Lock()
_registry: Registry | None = None
# Called, without arguments, whenever the registered backends change (a backend registers, the
# registry is reset): what caches anything derived from them (selection's plans) subscribes
# with `on_change`.
_listeners: list[Callable[[], None]] = []


def on_change(fn: Callable[[], None]) -> Callable[[], None]:
    """Call ``fn()`` whenever the registered backends change (once per ``fn``)."""
    if fn not in _listeners:
        _listeners.append(fn)
    return fn


def _changed() -> None:
    for fn in _listeners:
        fn()


def get_registry() -> Registry:
    """The process-wide registry, discovered on first use."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                pol = get_policy()
                reg = Registry()
                reg.discover(pol.disabled_plugins, pol.enabled_plugins)
                _registry = reg
    return _registry


def reset_registry() -> None:
    """Forget the registry (tests, or after installing a plugin in-process)."""
    global _registry
    with _lock:
        _registry = None
    _changed()
