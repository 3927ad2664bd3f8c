"""`glm5 backends`: the discovered backends and plugins (``--diagnose``: each plugin's load
status, the policy and the environment overrides)."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from glm5.cli.common import fmt, registry


def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("backends", help="list discovered backends and plugins")
    b.add_argument("--json", action="store_true")
    b.add_argument("--diagnose", action="store_true",
                   help="show every plugin's load status with tracebacks, the policy and env")
    b.set_defaults(func=run)
    return b


def backend_rows() -> list[dict[str, Any]]:
    rows = []
    for b in sorted(registry().backends.values(), key=lambda b: (-b.priority, b.name)):
        ok, reason = b.is_available()
        rows.append({
            "name": b.name, "vendor": b.vendor, "device_type": b.device_type, "available": ok,
            "reason": reason, "priority": b.priority, "source": b.source, "ops": b.ops(),
            "description": b.description, "settings": b.settings,
        })
    return rows


def plugin_rows(detail: bool) -> list[dict[str, Any]]:
    out = []
    for p in registry().plugins.values():
        row = {"name": p.name, "source": p.source, "status": p.status, "message": p.message,
               "backends": list(p.backends), "warnings": list(p.warnings)}
        if detail:
            row["detail"] = p.detail
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    from glm5.backends.policy import get_policy
    from glm5.backends.api import strict_mode

    rows, plugins = backend_rows(), plugin_rows(args.diagnose)
    if args.json:
        doc: dict[str, Any] = {"backends": rows, "plugins": plugins}
        if args.diagnose:
            doc["policy_sources"] = list(get_policy().sources)
            doc["strict"] = strict_mode()
        print(json.dumps(doc, indent=2))
        return 0
    table = [("backend", "vendor", "device", "available", "priority", "ops", "source", "reason")]
    for r in rows:
        table.append((r["name"], r["vendor"], r["device_type"], "yes" if r["available"] else "no",
                      str(r["priority"]), str(len(r["ops"])), r["source"], r["reason"]))
    print(fmt(table))
    bad = [p for p in plugins if p["status"] in ("failed", "refused")]
    if bad:
        print(f"\n{len(bad)} plugin(s) not loaded (see `glm5 backends --diagnose`):")
        for p in bad:
            print(f"  {p['name']} ({p['source']}): {p['status']}: {p['message']}")
    warned = [p for p in plugins if p["warnings"]]
    if warned and not args.diagnose:
        print(f"\n{len(warned)} plugin(s) loaded with warnings (see `glm5 backends "
              f"--diagnose`): {', '.join(p['name'] for p in warned)}")
    if args.diagnose:
        _diagnose(plugins, get_policy().sources, strict_mode())
    return 0


def _diagnose(plugins: list[dict[str, Any]], policy_sources, strict: bool) -> None:
    import torch

    print("\nplugins:")
    for p in plugins:
        print(f"  {p['name']:<14} {p['status']:<9} {p['source']}  {p['message']}")
        for w in p["warnings"]:
            print(f"    warning: {w}")
        if p.get("detail"):
            print("    " + p["detail"].rstrip().replace("\n", "\n    "))
    print(f"\npolicy: {' + '.join(policy_sources)}")
    print(f"strict mode (GLM5_STRICT): {'on' if strict else 'off'}")
    env_backend = os.environ.get("GLM5_BACKEND") or "-"
    unknown = [n for n in env_backend.split(",") if n.strip() and env_backend != "-"
               and n.strip() not in registry().backends]
    print(f"override (GLM5_BACKEND): {env_backend}"
          + (f"  (error: unknown backend {', '.join(unknown)})" if unknown else ""))
    print(f"device override (GLM5_DEVICE): {os.environ.get('GLM5_DEVICE') or '-'}")
    print(f"torch {torch.__version__}; cuda available: {torch.cuda.is_available()}; "
          f"hip: {getattr(torch.version, 'hip', None)}")
