"""plugins.toml: selection order, per-op orders, allow/deny, per-backend settings, disabled
and enabled plugins. The packaged default is overridden key by key by the file named in
GLM5_PLUGINS. How the orders meet backend priorities is `glm5.backends.selection.ranked`."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from glm5.backends.api import REFERENCE


class PolicyError(ValueError):
    """plugins.toml is malformed."""


@dataclass(frozen=True)
class Policy:
    order: tuple[str, ...] = ()
    allow: frozenset[str] = frozenset()
    deny: frozenset[str] = frozenset()
    op_orders: dict[str, tuple[str, ...]] = field(default_factory=dict)
    disabled_plugins: frozenset[str] = frozenset()
    enabled_plugins: frozenset[str] = frozenset()  # non-empty: load only these (and reference)
    backend_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    def allowed(self, backend: str) -> bool:
        """The reference (the oracle and last resort) is always allowed."""
        if backend == REFERENCE:
            return True
        if backend in self.deny:
            return False
        return not self.allow or backend in self.allow

    def settings_for(self, backend: str) -> dict[str, Any]:
        return dict(self.backend_settings.get(backend, {}))


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Key-by-key override: tables merge recursively, everything else replaces."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def _str_list(doc: dict, where: str, key: str, what: str = "backend names") -> tuple[str, ...]:
    v = doc.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise PolicyError(f"plugins.toml: [{where}] {key} expected a list of {what}, got {v!r}")
    return tuple(v)


_EP_NAMES = "plugin (entry-point) names"


def parse(doc: dict[str, Any], sources: tuple[str, ...] = ()) -> Policy:
    sel = doc.get("selection", {})
    if not isinstance(sel, dict):
        raise PolicyError(f"plugins.toml: [selection] expected a table, got {sel!r}")
    ops = doc.get("ops", {})
    if not isinstance(ops, dict):
        raise PolicyError(f"plugins.toml: [ops] expected a table, got {ops!r}")
    op_orders = {}
    for name, table in ops.items():
        if not isinstance(table, dict):
            raise PolicyError(f"plugins.toml: [ops.{name}] expected a table with 'order'")
        op_orders[name] = _str_list(table, f"ops.{name}", "order")
    plugins = doc.get("plugins", {})
    if not isinstance(plugins, dict):
        raise PolicyError(f"plugins.toml: [plugins] expected a table, got {plugins!r}")
    backends = doc.get("backends", {})
    if not isinstance(backends, dict) or not all(isinstance(v, dict) for v in backends.values()):
        raise PolicyError("plugins.toml: [backends.<name>] entries expected tables of settings")
    return Policy(
        order=_str_list(sel, "selection", "order"),
        allow=frozenset(_str_list(sel, "selection", "allow")),
        deny=frozenset(_str_list(sel, "selection", "deny")),
        op_orders=op_orders,
        disabled_plugins=frozenset(_str_list(plugins, "plugins", "disabled", _EP_NAMES)),
        enabled_plugins=frozenset(_str_list(plugins, "plugins", "enabled", _EP_NAMES)),
        backend_settings={k: dict(v) for k, v in backends.items()},
        sources=sources,
    )


def load_policy() -> Policy:
    text = resources.files("glm5").joinpath("plugins.toml").read_text()
    doc = tomllib.loads(text)
    sources = ["glm5/plugins.toml (packaged)"]
    user = os.environ.get("GLM5_PLUGINS")
    if user:
        try:
            with open(user, "rb") as f:
                doc = merge(doc, tomllib.load(f))
        except FileNotFoundError:
            raise PolicyError(f"GLM5_PLUGINS={user}: no such file") from None
        except tomllib.TOMLDecodeError as e:
            raise PolicyError(f"GLM5_PLUGINS={user}: not valid TOML: {e}") from None
        sources.append(user)
    return parse(doc, tuple(sources))


_policy: Policy | None = None
_policy_key: str | None = None


def get_policy() -> Policy:
    """The policy in force (re-read when GLM5_PLUGINS changes)."""
    global _policy, _policy_key
    key = os.environ.get("GLM5_PLUGINS", "")
    if _policy is None or key != _policy_key:
        _policy, _policy_key = load_policy(), key
    return _policy
