"""The generated parts of docs/ops.md (the op contract): each op's signature, argument and output
tables (shapes, dtypes, defaults, constraints), symbols and flags, and the catalog index, all
written from the OpDefs so that the page cannot drift from them. The prose around the generated
blocks (definitions, conventions, formats) is written by hand.

Regenerate after changing an OpDef: ``python -m glm5.ir.contract_doc docs/ops.md`` (rewrites the
blocks in place); ``--check`` exits 1 when the page is stale. ``tests/test_docs.py`` runs the
check and evaluates the shape expressions below against real calls.

Layering: this module imports only glm5.ir (the ir imports no glm5 layer).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from glm5.ir.catalog import OPS
from glm5.ir.opdef import OpDef
from glm5.ir.quant_formats import GROUP, SCHEMES
from glm5.ir.signature import OutArg, ScalarArg, TensorArg, dtype_name, evaluate

# --------------------------------------------------------------------------- hand-kept facts
# Shapes an OpDef computes with a function (outputs) or leaves to its `check` (scales): written
# as forms (condition, dims) over the op's symbols and scalar arguments. Conditions and dims are
# Python expressions; `ceil` is math.ceil. tests/test_docs.py evaluates them against real calls,
# and `op_block` refuses an op whose shape is computed but not written here.
_BY_SCHEME_8 = "scheme in ('w8a16', 'w8a8')"
_BY_SCHEME_G = "scheme in ('w4a8', 'w6a12')"
COMPUTED_SHAPES: dict[tuple[str, str], tuple[tuple[str, tuple[str, ...]], ...]] = {
    ("silu_mul", "y"): (("", ("...", "I")),),
    ("topk_indices", "idx"): (("", ("T", "k")),),
    ("indexer_topk", "idx"): (("", ("T", "topk")),),
    ("indexer_topk_fp8", "idx"): (("", ("T", "topk")),),
    ("paged_indexer_topk", "idx"): (("", ("T", "topk")),),
    ("paged_indexer_topk_fp8", "idx"): (("", ("T", "topk")),),
    ("mla_prolog", "q_main"): (("absorb", ("T", "H", "Rkv")), ("not absorb", ("T", "H", "Dn"))),
    ("moe_route", "weights"): (("", ("T", "top_k")),),
    ("moe_route", "ids"): (("", ("T", "top_k")),),
    ("quant_linear", "w_scale"): ((_BY_SCHEME_8, ("N",)),
                                  (_BY_SCHEME_G, ("N", f"ceil(K/{GROUP})"))),
    ("moe_experts_quant", "w13_scale"): ((_BY_SCHEME_8, ("E", "2*I")),
                                         (_BY_SCHEME_G, ("E", "2*I", f"ceil(D/{GROUP})"))),
    ("moe_experts_quant", "w2_scale"): ((_BY_SCHEME_8, ("E", "D")),
                                        (_BY_SCHEME_G, ("E", "D", f"ceil(I/{GROUP})"))),
}

# Dtypes an OpDef computes with a function: (condition, dtype name).
COMPUTED_DTYPES: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("quantize_per_token", "q"): (("bits == 8", "int8"), ("bits == 12", "int16")),
}


def _packed(n: str) -> tuple[tuple[str, str], ...]:
    """The packed width of ``n`` codes per scheme (int8: 1 byte each, int4: 2 per byte, int6:
    4 per 3 bytes, zero-padded to a whole unit): glm5.ir.quant_formats.Scheme.packed_k."""
    return ((_BY_SCHEME_8, n), ("scheme == 'w4a8'", f"ceil({n}/2)"),
            ("scheme == 'w6a12'", f"3*ceil({n}/4)"))


# Symbols an OpDef binds from a shape but whose value follows from others: (condition, value).
DERIVED_SYMBOLS: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("quant_linear", "P"): _packed("K"),
    ("moe_experts_quant", "I"): (("", "N13/2"),),
    ("moe_experts_quant", "P13"): _packed("D"),
    ("moe_experts_quant", "P2"): _packed("I"),
}

# What each shape symbol means; (op, symbol) overrides the global meaning.
SYMBOLS: dict[str, str] = {
    "T": "query tokens (all sequences of the batch flattened)",
    "S": "key rows (tokens in the cache)",
    "H": "attention heads",
    "Hk": "key/value heads (H a multiple of Hk; 1 = MQA)",
    "Dqk": "query/key head dim",
    "Dv": "value head dim",
    "K": "selected keys per query",
    "Hi": "indexer heads",
    "Di": "indexer head dim",
    "D": "hidden size (the normalised / last dim)",
    "R": "rotary dim (even)",
    "I": "intermediate size",
    "E": "experts",
    "k": "experts per token",
    "Rq": "query LoRA rank (q_lora_rank)",
    "Rkv": "latent KV rank (kv_lora_rank)",
    "Rkv2": "the cache's latent width (must equal Rkv)",
    "Dn": "no-rope query/key head dim (qk_nope_head_dim)",
    "Dr": "rope head dim (qk_rope_head_dim, even)",
    "N": "output features",
    "M": "rows (tokens)",
    "V": "vocabulary size",
    "P": "packed width of K codes",
    "N13": "rows of w13_packed (2*I, even)",
    "P13": "packed width of D codes",
    "P2": "packed width of I codes",
}
OP_SYMBOLS: dict[tuple[str, str], str] = {
    ("quantize_per_token", "K"): "features per row",
    ("quant_linear", "K"): "input features",
    ("moe_experts", "k"): "experts per token (ids columns)",
    ("moe_experts_quant", "k"): "experts per token (ids columns)",
    ("mla_prolog", "N"): "cache rows",
    ("mla_prolog", "D"): "hidden size",
    ("grpo_advantages", "N"): "rollouts (a multiple of group_size)",
    ("policy_loss", "T"): "tokens",
    ("token_logprobs", "D"): "hidden size",
    ("lightning_indexer", "S"): "key rows",
    ("topk_indices", "S"): "candidates per row",
    ("paged_indexer_topk", "S"): "rows of the key pool (pages * page_size)",
    ("paged_indexer_topk", "B"): "sequences (block_table rows)",
    ("paged_indexer_topk", "P"): "logical pages per sequence (block_table columns)",
    ("paged_indexer_topk_fp8", "S"): "rows of the key pool (pages * page_size)",
    ("paged_indexer_topk_fp8", "B"): "sequences (block_table rows)",
    ("paged_indexer_topk_fp8", "P"): "logical pages per sequence (block_table columns)",
}

# A display order for dtype sets.
_DTYPE_ORDER = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.bool,
                torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)

BEGIN_OP = "<!-- BEGIN GENERATED {name}: `python -m glm5.ir.contract_doc docs/ops.md`, do not edit -->"
END_OP = "<!-- END GENERATED {name} -->"
INDEX = "index"


# --------------------------------------------------------------------------- rendering
def dims_text(dims: Sequence[Any]) -> str:
    """``("T", "H", 3)`` -> ``[T, H, 3]``; ``()`` -> ``[]`` (a 0-dim tensor)."""
    return "[" + ", ".join(str(d) for d in dims) + "]"


def dtypes_text(dts: frozenset[torch.dtype] | None) -> str:
    if dts is None:
        return "any"
    ordered = [d for d in _DTYPE_ORDER if d in dts] + sorted(
        (d for d in dts if d not in _DTYPE_ORDER), key=dtype_name)
    return ", ".join(dtype_name(d) for d in ordered)


def _forms_text(forms: Sequence[tuple[str, Any]], value: Any = dims_text) -> str:
    parts = []
    for cond, v in forms:
        shown = value(v) if callable(value) else v
        parts.append(f"`{shown}`" + (f" if `{cond}`" if cond else ""))
    return "; ".join(parts)


def _computed(table: dict, op: OpDef, name: str, what: str) -> Any:
    try:
        return table[(op.name, name)]
    except KeyError:
        raise KeyError(
            f"glm5.ir.contract_doc: {op.name}.{name} has a computed {what}; write it in "
            f"{'COMPUTED_SHAPES' if what == 'shape' else 'COMPUTED_DTYPES'}") from None


def arg_shape_text(op: OpDef, p: TensorArg) -> str:
    if p.shape is None:
        return _forms_text(_computed(COMPUTED_SHAPES, op, p.name, "shape"))
    return f"`{dims_text(p.shape)}`"


def out_shape_text(op: OpDef, o: OutArg) -> str:
    if isinstance(o.shape, str) and o.shape.startswith("like:"):
        return f"as `{o.shape[5:]}`"
    if callable(o.shape):
        return _forms_text(_computed(COMPUTED_SHAPES, op, o.name, "shape"))
    return f"`{dims_text(o.shape)}`"


ACC_TEXT = "float32 (float64 when the op runs in float64)"


def out_dtype_text(op: OpDef, o: OutArg) -> str:
    d = o.dtype
    if isinstance(d, torch.dtype):
        return dtype_name(d)
    if d == "acc":
        return ACC_TEXT
    if isinstance(d, str) and d.startswith("like:"):
        return f"as `{d[5:]}`"
    return _forms_text(_computed(COMPUTED_DTYPES, op, o.name, "dtype"), value=None)


def scalar_constraints(p: ScalarArg) -> str:
    parts = []
    if p.has_default:
        parts.append(f"default `{p.default!r}`")
    if p.choices is not None:
        parts.append("one of " + ", ".join(f"`{c!r}`" for c in p.choices))
    if p.minimum is not None:
        parts.append(f"`{'>' if p.exclusive_minimum else '>='} {p.minimum:g}`")
    return "; ".join(parts)


def _symbols(op: OpDef) -> list[str]:
    """Shape symbols of the op in order of first appearance (args, then computed shapes)."""
    seen: list[str] = []
    specs: list[str] = []
    for p in op.tensor_params:
        if p.shape is not None:
            specs += [str(s) for s in p.shape]
        else:
            specs += [d for _, dims in COMPUTED_SHAPES.get((op.name, p.name), ()) for d in dims]
    for o in op.outputs:
        if isinstance(o.shape, tuple):
            specs += [str(s) for s in o.shape]
        elif callable(o.shape):
            specs += [d for _, dims in COMPUTED_SHAPES.get((op.name, o.name), ()) for d in dims]
    scalars = {p.name for p in op.params if isinstance(p, ScalarArg)}
    for spec in specs:
        for s in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", spec):
            if s not in seen and s not in scalars and s != "ceil":
                seen.append(s)
    for (name, sym) in DERIVED_SYMBOLS:
        if name == op.name and sym not in seen:
            seen.append(sym)
    return seen


def symbol_text(op: OpDef, sym: str) -> str:
    meaning = OP_SYMBOLS.get((op.name, sym), SYMBOLS.get(sym))
    if meaning is None:
        raise KeyError(f"glm5.ir.contract_doc: symbol {sym!r} of {op.name} has no meaning; "
                       f"add it to SYMBOLS or OP_SYMBOLS")
    derived = DERIVED_SYMBOLS.get((op.name, sym))
    if derived:
        meaning += ": " + _forms_text(derived, value=None)
    return f"`{sym}` {meaning}"


def call_text(op: OpDef) -> str:
    args = []
    for p in op.params:
        if isinstance(p, TensorArg) and p.optional:
            args.append(f"{p.name}=None")
        elif isinstance(p, ScalarArg) and p.has_default:
            args.append(f"{p.name}={p.default!r}")
        else:
            args.append(p.name)
    outs = ", ".join(o.name for o in op.outputs)
    if len(op.outputs) > 1:
        outs = f"({outs})"
    return f"glm5.ops.{op.name}({', '.join(args)}) -> {outs}"


def _flags(op: OpDef) -> list[str]:
    out = []
    if op.is_composite:
        out.append("composite: a backend may serve it whole; otherwise it is decomposed into "
                   "the ops named in its definition")
    if op.mutates:
        out.append("mutates " + ", ".join(f"`{m}`" for m in op.mutates) + " in place")
    if op.selection is not None:
        out.append(f"selection output `{op.selection.index_output}` judged {op.selection.doc}")
    if not op.differentiable:
        out.append("not differentiable")
    else:
        nd = [o.name for o in op.outputs if not o.differentiable]
        if nd:
            out.append("differentiable (vjp of the reference) except "
                       + ", ".join(f"`{n}`" for n in nd))
        else:
            out.append("differentiable (vjp of the reference)")
    return out


def op_block(op: OpDef) -> str:
    """The generated block of one op (markers included)."""
    lines = [BEGIN_OP.format(name=op.name), "", f"`{call_text(op)}`", "",
             f"torch op: `torch.ops.glm5.{op.name}{op.schema()}`", "",
             f"Summary: {op.summary}.", "",
             "| argument | kind | shape | dtypes | constraints, notes |", "|---|---|---|---|---|"]
    for p in op.params:
        if isinstance(p, TensorArg):
            kind = "tensor, optional" if p.optional else "tensor"
            if p.name in op.mutates:
                kind += ", mutated"
            notes = "; ".join(x for x in ("default `None`" if p.optional else "", p.doc) if x)
            lines.append(f"| `{p.name}` | {kind} | {arg_shape_text(op, p)} | "
                         f"{dtypes_text(p.dtypes)} | {notes} |")
        else:
            notes = "; ".join(x for x in (scalar_constraints(p), p.doc) if x)
            lines.append(f"| `{p.name}` | {p.type.__name__} | | | {notes} |")
    lines += ["", "| output | shape | dtype |", "|---|---|---|"]
    for o in op.outputs:
        lines.append(f"| `{o.name}` | {out_shape_text(op, o)} | {out_dtype_text(op, o)} |")
    lines.append("")
    syms = _symbols(op)
    if syms:
        lines += ["Symbols: " + "; ".join(symbol_text(op, s) for s in syms) + ".", ""]
    lines += ["- " + f for f in _flags(op)]
    lines += ["", END_OP.format(name=op.name)]
    return "\n".join(lines)


def index_block() -> str:
    """The catalog: every op, its category and summary, linked to its section."""
    lines = [BEGIN_OP.format(name=INDEX), "", "| op | category | what it computes |",
             "|---|---|---|"]
    for op in OPS.values():
        lines.append(f"| [`{op.name}`](#{op.name}) | {op.category} | {op.summary} |")
    lines += ["", END_OP.format(name=INDEX)]
    return "\n".join(lines)


def blocks() -> dict[str, str]:
    """Every generated block by name: ``index`` and each op's name."""
    out = {INDEX: index_block()}
    out.update({name: op_block(op) for name, op in OPS.items()})
    return out


def _span(text: str, name: str) -> tuple[int, int] | None:
    b, e = BEGIN_OP.format(name=name), END_OP.format(name=name)
    i = text.find(b)
    if i < 0:
        return None
    j = text.find(e, i)
    return None if j < 0 else (i, j + len(e))


def problems(text: str) -> list[str]:
    """What is wrong with the page ``text`` against the OpDefs: missing sections or blocks,
    stale blocks, sections for ops that do not exist."""
    out = []
    for name, block in blocks().items():
        if name != INDEX and not re.search(rf"^### `{re.escape(name)}`$", text, re.M):
            out.append(f"no section '### `{name}`'")
        sp = _span(text, name)
        if sp is None:
            out.append(f"no generated block for {name}")
        elif text[sp[0]:sp[1]] != block:
            out.append(f"the generated block of {name} is stale")
    for name in re.findall(r"^### `([A-Za-z_0-9]+)`$", text, re.M):
        if name not in OPS:
            out.append(f"a section for {name!r}, which is not an op")
    for name in re.findall(r"<!-- BEGIN GENERATED ([A-Za-z_0-9]+):", text):
        if name != INDEX and name not in OPS:
            out.append(f"a generated block for {name!r}, which is not an op")
    return out


def render(text: str) -> str:
    """``text`` with every generated block rewritten; a missing block is inserted right after
    its op's ``### `name` `` heading (the heading itself must be written by hand, in place)."""
    for name, block in blocks().items():
        sp = _span(text, name)
        if sp is not None:
            text = text[:sp[0]] + block + text[sp[1]:]
            continue
        if name == INDEX:
            raise ValueError("glm5.ir.contract_doc: the page has no index block; add the "
                             f"line {BEGIN_OP.format(name=INDEX)!r} and its END line")
        m = re.search(rf"^### `{re.escape(name)}`\n", text, re.M)
        if m is None:
            raise ValueError(f"glm5.ir.contract_doc: the page has no section '### `{name}`' "
                             f"for the op {name}; add the heading where it belongs")
        text = text[:m.end()] + "\n" + block + "\n" + text[m.end():]
    return text


# --------------------------------------------------------------------------- evaluation
def _env(values: dict[str, Any], syms: dict[str, int]) -> dict[str, Any]:
    env: dict[str, Any] = {"ceil": math.ceil}
    env.update({k: v for k, v in values.items() if not isinstance(v, torch.Tensor)})
    env.update(syms)
    return env


def select_form(forms: Sequence[tuple[str, Any]], values: dict[str, Any],
                syms: dict[str, int]) -> Any:
    """The value of the one form whose condition holds for this call (a call's scalar
    arguments and shape symbols are the names). Raises ValueError when none or several hold."""
    env = _env(values, syms)
    hits = [v for cond, v in forms if not cond or evaluate(cond, env)]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} forms hold for this call: {forms}")
    return hits[0]


def evaluate_shape(forms: Sequence[tuple[str, tuple[str, ...]]], values: dict[str, Any],
                   syms: dict[str, int]) -> tuple[Any, ...]:
    """The dims of the shape form that holds for this call, as ints (``...`` kept as is)."""
    env = _env(values, syms)
    return tuple(d if d == "..." else int(evaluate(d, env))
                 for d in select_form(forms, values, syms))


def symbol_value(op: OpDef, sym: str, values: dict[str, Any], syms: dict[str, int]) -> int:
    """The value DERIVED_SYMBOLS gives ``sym`` of ``op`` for this call."""
    expr = select_form(DERIVED_SYMBOLS[(op.name, sym)], values, syms)
    return int(evaluate(expr, _env(values, syms)))


def derived_symbols(op: OpDef, values: dict[str, Any], syms: dict[str, int]) -> dict[str, int]:
    """``syms`` plus the symbols DERIVED_SYMBOLS defines only from others (e.g. I = N13/2)."""
    out = dict(syms)
    for (name, sym) in DERIVED_SYMBOLS:
        if name == op.name and sym not in out:
            out[sym] = symbol_value(op, sym, values, out)
    return out


# --------------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5.ir.contract_doc",
                                 description="rewrite (or --check) the generated blocks of "
                                             "docs/ops.md from the OpDefs")
    ap.add_argument("path", nargs="?", default="docs/ops.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    a = ap.parse_args(argv)
    path = Path(a.path)
    if not path.is_file():
        print(f"python -m glm5.ir.contract_doc: {path} is not a file (expected docs/ops.md)",
              file=sys.stderr)
        return 2
    text = path.read_text()
    if a.check:
        found = problems(text)
        for p in found:
            print(f"{path}: {p}", file=sys.stderr)
        return 1 if found else 0
    try:
        new = render(text)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    if new != text:
        path.write_text(new)
        print(f"{path}: generated blocks rewritten")
    left = problems(new)
    for p in left:
        print(f"{path}: {p}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":  # pragma: no cover - docs generator
    sys.exit(main())


__all__ = ["COMPUTED_DTYPES", "COMPUTED_SHAPES", "DERIVED_SYMBOLS", "SYMBOLS", "blocks",
           "derived_symbols", "evaluate_shape", "index_block", "op_block", "problems",
           "render", "select_form", "symbol_value"]
