"""Reads every import between glm5 modules (module level and inside functions) and checks them
against the layer table of docs/layers.md, the one definition of which package may import
which. Used by tests/test_layers.py; run it by hand to list what a change broke:

    python tests/layering.py            # all findings, one per line; exit 1 if any

A *unit* is a first-level package or module under glm5/ (`glm5.engine`, `glm5.ops`, ...);
the package `glm5` itself is the unit ``glm5``. Findings:

- ``edge``: a unit imports a unit its row of the table does not list;
- ``cycle``: modules that import each other, directly or around a loop (in-function imports
  count: they run too);
- ``private``: ``from M import _name`` where ``_name`` is not a private submodule of the
  importer's own package;
- ``lazy``: a glm5 import inside a function without a reason: a ``# lazy: why`` comment on its
  line or the line above, or a module-wide ``# lazy imports: why`` comment line in the module;
- ``table``: the table itself names an unknown unit or has a cycle.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_DOC = ROOT / "docs" / "layers.md"
LAZY_LINE = re.compile(r"#\s*lazy:\s*\S")
LAZY_MODULE = re.compile(r"^#\s*lazy imports:\s*\S", re.M)


@dataclass(frozen=True)
class Import:
    src: str          # importing module
    dst: str          # imported glm5 module (the longest existing module path)
    line: int
    in_function: bool
    names: tuple[str, ...]


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "glm5"


def modules(pkg_dir: Path) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is_package) for every .py file under ``pkg_dir``."""
    out = {}
    for p in sorted(pkg_dir.rglob("*.py")):
        parts = list(p.relative_to(pkg_dir.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, is_pkg)
    return out


def _resolve(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(mods: dict[str, tuple[Path, bool]],
            root: Path = ROOT) -> tuple[list[Import], list[str]]:
    """Every import of a glm5 module by a glm5 module, and the ``lazy`` findings (paths shown
    relative to ``root``, the folder holding the package)."""
    found: list[Import] = []
    lazy: list[str] = []
    for mod, (path, is_pkg) in mods.items():
        src = path.read_text()
        lines = src.splitlines()
        module_reason = bool(LAZY_MODULE.search(src))
        tree = ast.parse(src)
        for node, in_fn in _walk(tree, False):
            if isinstance(node, ast.Import):
                targets = [(a.name, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = []
                for a in node.names:
                    full = f"{target}.{a.name}"
                    targets.append((full, ()) if full in mods else (target, (a.name,)))
            else:
                continue
            hit = False
            for name, names in targets:
                if name.split(".")[0] != "glm5":
                    continue
                dst = _resolve(name, mods)
                if dst and dst != mod:
                    found.append(Import(mod, dst, node.lineno, in_fn, names))
                    hit = True
            if hit and in_fn and not module_reason:
                near = lines[node.lineno - 1] + "\n" + (lines[node.lineno - 2]
                                                       if node.lineno > 1 else "")
                end = getattr(node, "end_lineno", node.lineno)
                near += "\n" + lines[end - 1]
                if not LAZY_LINE.search(near):
                    lazy.append(f"lazy: {path.relative_to(root).as_posix()}:{node.lineno} imports "
                                f"{ast.unparse(node)!r} inside a function without a "
                                "'# lazy: why' comment")
    return found, lazy


def _walk(node: ast.AST, in_fn: bool):
    for child in ast.iter_child_nodes(node):
        child_in_fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                  ast.Lambda))
        yield child, in_fn
        yield from _walk(child, child_in_fn)


def read_table(doc: Path = TABLE_DOC) -> dict[str, set[str]]:
    """unit -> units it may import, from the first markdown table of ``doc`` whose header
    starts ``| unit | may import``."""
    rows: dict[str, set[str]] = {}
    in_table = False
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not in_table:
            in_table = len(cells) >= 2 and cells[0] == "unit" and cells[1] == "may import"
            continue
        if not line.strip().startswith("|"):
            break
        if set(cells[0]) <= set("-: "):
            continue
        name = cells[0].strip("`")
        allowed = {c.strip().strip("`") for c in cells[1].split(",")} - {"", "—", "-"}
        rows[name] = allowed
    if not rows:
        raise ValueError(f"{doc}: no '| unit | may import |' table")
    return rows


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def check(pkg_dir: Path = ROOT / "glm5", doc: Path = TABLE_DOC) -> list[str]:
    """All findings for the tree at ``pkg_dir`` against the table in ``doc``."""
    mods = modules(pkg_dir)
    table = read_table(doc)
    units = {unit(m) for m in mods}
    findings = []
    for name, allowed in sorted(table.items()):
        for u in sorted(({name} | allowed) - units):
            findings.append(f"table: {doc.name} names unit {u!r}, which is not in glm5/")
    for comp in _cycles(table):
        findings.append(f"table: the allowed imports cycle: {' <-> '.join(comp)}")
    for u in sorted(units - set(table)):
        findings.append(f"table: unit {u!r} has no row in {doc.name}")
    found, lazy = imports(mods, pkg_dir.parent)
    graph: dict[str, set[str]] = {}
    for imp in found:
        graph.setdefault(imp.src, set()).add(imp.dst)
        a, b = unit(imp.src), unit(imp.dst)
        if a != b and a in table and b not in table[a]:
            findings.append(f"edge: {imp.src}:{imp.line} imports {imp.dst} ({a} -> {b} is not "
                            f"in {doc.name})")
        for n in imp.names:
            if n.startswith("_") and not n.startswith("__"):
                findings.append(f"private: {imp.src}:{imp.line} imports {n} from {imp.dst}")
        leaf = imp.dst.rpartition(".")[2]
        home = imp.dst.rpartition(".")[0]
        if (leaf.startswith("_") and not leaf.startswith("__")
                and home not in (imp.src.rpartition(".")[0], imp.src)):
            findings.append(f"private: {imp.src}:{imp.line} imports the private module "
                            f"{imp.dst} of another package")
    for comp in _cycles(graph):
        findings.append(f"cycle: {' <-> '.join(comp)}")
    return findings + lazy


if __name__ == "__main__":
    only = sys.argv[1:]
    out = [f for f in check() if not only or any(o in f for o in only)]
    print("\n".join(out) if out else "no findings")
    sys.exit(1 if out else 0)
