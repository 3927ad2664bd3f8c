"""`glm5` command line: backends | ops | parity | info."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence


def _registry():
    import glm5

    return glm5.get_registry()


# --------------------------------------------------------------------------- backends
def backend_rows() -> list[dict[str, Any]]:
    rows = []
    for b in sorted(_registry().backends.values(), key=lambda b: (-b.priority, b.name)):
        ok, reason = b.is_available()
        rows.append({
            "name": b.name, "vendor": b.vendor, "device_type": b.device_type, "available": ok,
            "reason": reason, "priority": b.priority, "source": b.source, "ops": b.ops(),
            "description": b.description, "settings": b.settings,
        })
    return rows


def plugin_rows(detail: bool) -> list[dict[str, Any]]:
    out = []
    for p in _registry().plugins.values():
        row = {"name": p.name, "source": p.source, "status": p.status, "message": p.message,
               "backends": list(p.backends), "warnings": list(p.warnings)}
        if detail:
            row["detail"] = p.detail
        out.append(row)
    return out


def cmd_backends(args: argparse.Namespace) -> int:
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
    print(_fmt(table))
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
        import torch

        print("\nplugins:")
        for p in plugins:
            print(f"  {p['name']:<14} {p['status']:<9} {p['source']}  {p['message']}")
            for w in p["warnings"]:
                print(f"    warning: {w}")
            if p.get("detail"):
                print("    " + p["detail"].rstrip().replace("\n", "\n    "))
        print(f"\npolicy: {' + '.join(get_policy().sources)}")
        print(f"strict mode (GLM5_STRICT): {'on' if strict_mode() else 'off'}")
        env_backend = os.environ.get("GLM5_BACKEND") or "-"
        unknown = [n for n in env_backend.split(",") if n.strip() and env_backend != "-"
                   and n.strip() not in _registry().backends]
        print(f"override (GLM5_BACKEND): {env_backend}"
              + (f"  (error: unknown backend {', '.join(unknown)})" if unknown else ""))
        print(f"device override (GLM5_DEVICE): {os.environ.get('GLM5_DEVICE') or '-'}")
        print(f"torch {torch.__version__}; cuda available: {torch.cuda.is_available()}; "
              f"hip: {getattr(torch.version, 'hip', None)}")
    return 0


# --------------------------------------------------------------------------- ops
def op_rows(backend: str | None, device: str, dtype_name: str) -> list[dict[str, Any]]:
    import torch

    from glm5.backends import selection
    from glm5.ir.catalog import OPS

    want = getattr(torch, dtype_name)
    rows = []
    ctx = selection.use_backend(backend) if backend else selection.use_backend(None)
    with ctx:
        for op in OPS.values():
            arg = next((p for p in op.tensor_params if p.name == op.dispatch_arg), None)
            allowed = arg.dtypes if arg is not None and arg.dtypes else None
            dt = want if allowed is None or want in allowed else sorted(allowed, key=str)[0]
            plan = selection.resolve(op, device, dt)
            rows.append({
                "op": op.name, "category": op.category,
                "kind": "composite" if op.is_composite else "primitive",
                "check": "selection" if op.selection is not None else "error model", "dtype": str(dt).replace("torch.", ""),
                "served_by": plan.served_by, "mode": plan.mode,
                "candidates": [c.backend.name for c in plan.candidates],
                "declined": {n: r for n, r in plan.declined},
                "summary": op.summary,
            })
    return rows


def cmd_ops(args: argparse.Namespace) -> int:
    if args.backend:
        _registry().get(args.backend)
    rows = op_rows(args.backend, args.device, args.dtype)
    if args.json:
        print(json.dumps({"device": args.device, "backend": args.backend, "ops": rows}, indent=2))
        return 0
    table = [("op", "kind", "checked by", "dtype", "served by", "mode", "candidates")]
    for r in rows:
        table.append((r["op"], r["kind"], r["check"], r["dtype"], r["served_by"],
                      r["mode"], ",".join(r["candidates"]) or "-"))
    print(_fmt(table))
    fb = [r["op"] for r in rows if r["mode"] == "fallback"]
    if fb:
        print(f"\n{len(fb)} op(s) fall back to the reference on {args.device}: {', '.join(fb)}")
    return 0


# --------------------------------------------------------------------------- parity
def cmd_parity(args: argparse.Namespace) -> int:
    from glm5.backends.api import REFERENCE
    from glm5.testing.cases import PROFILE_EXAMPLES, PROFILES
    from glm5.testing.parity import Row, format_table, run_parity
    from glm5.testing.tolerances import bound_form

    examples = args.examples if args.examples is not None else PROFILE_EXAMPLES[args.profile]

    if args.emulate:
        # Triton reads this when a kernel module is imported: before any of them is.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    reg = _registry()
    names = sorted(reg.backends) if args.backend == "all" else [args.backend]
    for n in names:
        reg.get(n)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    rows: list[Row] = []
    for n in names:
        b = reg.backends[n]
        emulate = args.emulate and n != REFERENCE
        ok, reason = b.can_emulate() if emulate else b.is_available()
        if not ok and args.backend != "all":
            # A backend named alone that cannot run checked nothing: that is a failure, not a
            # table of skips that exits 0. (`--backend all` skips what cannot run here.)
            if emulate:
                msg = f"backend cannot be emulated here: {reason}"
            else:
                msg = f"backend unavailable here: {reason}"
                if b.can_emulate()[0]:
                    msg += " (--emulate runs its kernels on CPU through its emulator)"
            rows.append(Row(n, "*", "fail", "-", 0.0, 0.0, "", 0, msg, emulate))
            continue
        rows.extend(run_parity(b, ops, examples, args.seed, emulate=emulate,
                               profile=args.profile))
    if args.json:
        print(json.dumps({"backend": args.backend, "seed": args.seed, "examples": examples,
                          "profile": args.profile, "tiers": list(PROFILES[args.profile]),
                          "bound": bound_form(), "rows": [r.as_dict() for r in rows]},
                         indent=2))
    else:
        print(format_table(rows))
    return 1 if any(r.status == "fail" for r in rows) else 0


# --------------------------------------------------------------------------- info
def _billions(n: int) -> str:
    return f"{n / 1e9:.1f} B"


def cmd_info(args: argparse.Namespace) -> int:
    from glm5.core.config import ConfigError, GLM5Config, preset
    from glm5.core.info import model_info

    try:
        cfg = preset(args.preset) if args.preset else GLM5Config.from_pretrained(args.model)
    except ConfigError as e:
        raise ValueError(str(e).removeprefix("glm5 config: ")) from None
    info = model_info(cfg)
    source = {"preset": args.preset} if args.preset else {"model": str(args.model)}
    if args.json:
        print(json.dumps({"source": source, **info}, indent=2))
        return 0
    p, kv = info["params"], info["kv_cache_per_token"]
    lay = p["layers"]
    what = f"preset {args.preset}" if args.preset else f"model {args.model}"
    print(f"GLM-5 model info: {what}")
    print(f"  {lay['total']} layers ({lay['dense']} dense, {lay['sparse']} MoE; indexer "
          f"{lay['indexer_full']} full, {lay['indexer_shared']} shared), hidden "
          f"{cfg.hidden_size}, {cfg.n_routed_experts} routed experts "
          f"({cfg.num_experts_per_tok} active) + {cfg.n_shared_experts} shared, "
          f"{lay['mtp']} MTP layer(s)\n")
    rows = [("parameters", "billions", "exact")]
    rows.append(("total (without MTP)", _billions(p["total_params"]), f"{p['total_params']:,}"))
    rows.append(("active per token", _billions(p["active_params"]), f"{p['active_params']:,}"))
    rows.append(("MTP", _billions(p["mtp_params"]), f"{p['mtp_params']:,}"))
    rows.append(("MTP active per token", _billions(p["mtp_active_params"]),
                 f"{p['mtp_active_params']:,}"))
    print(_fmt(rows))
    print()
    rows = [("component", "billions", "exact")]
    for name, n in p["components"].items():
        rows.append((name, _billions(n), f"{n:,}"))
    for name, n in p["mtp"].items():
        rows.append((f"mtp.{name}", _billions(n), f"{n:,}"))
    print(_fmt(rows))
    print(f"\n(total includes {p['buffer_params']:,} e_score_correction_bias buffer elements; "
          "active = total with routed experts at num_experts_per_tok/n_routed_experts, "
          "embeddings and lm_head included; MTP shares the embedding and lm_head)\n")
    b = kv["bytes"]
    print(f"KV cache per token: {kv['layers']} layers x {kv['latent_per_layer']} latent + "
          f"{kv['indexer_layers']} indexer layers x {kv['indexer_key_per_layer']} key = "
          f"{kv['elements']:,} elements")
    print(f"  bf16: {b['bf16']:,} bytes/token ({b['bf16'] / 2**10:.1f} KiB); "
          f"fp8: {b['fp8']:,} bytes/token ({b['fp8'] / 2**10:.1f} KiB)")
    pl = kv["bytes_per_layer"]
    print(f"  per layer: {kv['elements_per_layer']} elements = {pl['bf16']:,} bytes bf16, "
          f"{pl['fp8']:,} bytes fp8")
    return 0


# --------------------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    from glm5.backends.api import REFERENCE
    from glm5.testing.bench import SHAPES, format_rows, run_bench

    from glm5.backends.selection import preferred_backend

    reg = _registry()
    if args.backend:
        b = reg.get(args.backend)
    else:  # what the selection rule offers CPU calls first (the model's choice too)
        b = preferred_backend("cpu") or reg.get(REFERENCE)
    ok, reason = b.is_available()
    if not ok:
        raise ValueError(f"backend {b.name!r} is unavailable: {reason}")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    unknown = [o for o in ops or [] if o not in SHAPES]
    if unknown:
        raise ValueError(f"no benchmark shapes for {unknown}; ops with shapes: "
                         f"{', '.join(SHAPES)}")
    ceil, rows = run_bench(b, ops, with_reference=not args.no_reference, repeat=args.repeat,
                           quick=args.quick)
    if args.json:
        print(json.dumps({"backend": b.name, "ceilings": ceil,
                          "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        print(f"backend: {b.name}")
        print(format_rows(ceil, rows))
    return 0


# --------------------------------------------------------------------------- export
def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from glm5.core.config import ConfigError, preset
    from glm5.core.export import export_onnx
    from glm5.core.model import GLM5ForCausalLM

    if args.format != "onnx":
        raise ValueError(f"--format expected 'onnx', got {args.format!r}")
    try:
        if args.preset:
            if args.preset == "glm-5":
                raise ValueError("exporting the 744 B glm-5 preset with random weights is not "
                                 "useful; export a checkpoint with --model")
            torch.manual_seed(args.seed)
            model = GLM5ForCausalLM(preset(args.preset))  # random initialisation
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() > 1:
                        p.normal_(0.0, preset(args.preset).initializer_range)
        else:
            from glm5.core.checkpoint import load_model

            model = load_model(args.model)
    except ConfigError as e:
        raise ValueError(str(e).removeprefix("glm5 config: ")) from None
    out = export_onnx(model, args.out, seq_len=args.seq_len, batch=args.batch)
    print(f"wrote {out} (input_ids [{args.batch}, {args.seq_len}] int64 -> logits; glm5 ops "
          f"as ONNX functions in domain 'glm5')")
    return 0


# --------------------------------------------------------------------------- plan
def cmd_plan(args: argparse.Namespace) -> int:
    import re

    from glm5.core.config import GLM5Config, preset
    from glm5.core.plan import format_plan, plan

    try:
        cfg = preset(args.preset) if args.preset else GLM5Config.from_pretrained(args.model)
        p = plan(cfg, args.chip, args.quant, args.batch, args.context, tp=args.tp, ep=args.ep,
                 kv_dtype=args.kv_dtype, reserve_gb=args.reserve_gb, mtp=args.mtp)
    except ValueError as e:  # PlanError, ConfigError: name the command-line option
        msg = str(e).removeprefix("glm5.plan: ").removeprefix("glm5 config: ")
        raise ValueError(re.sub(r"argument '(\w+)'",
                                lambda m: "--" + m[1].replace("_", "-"), msg)) from None
    source = {"preset": args.preset} if args.preset else {"model": str(args.model)}
    if args.json:
        print(json.dumps({"source": source, **p}, indent=2))
    else:
        print(format_plan(p))
    return 0


# --------------------------------------------------------------------------- quantize
def cmd_quantize(args: argparse.Namespace) -> int:
    from glm5.core.config import ConfigError
    from glm5.core.quantize import DEFAULT_SHARD_BYTES, import_msmodelslim, quantize_checkpoint

    shard = int(args.max_shard_gb * 2**30) if args.max_shard_gb else DEFAULT_SHARD_BYTES
    try:
        if args.from_format == "msmodelslim":
            if args.scheme:
                raise ValueError("--scheme does not apply to --from msmodelslim (each tensor's "
                                 "scheme follows its msModelSlim type)")
            import_msmodelslim(args.src, args.dst, shard, args.clamp_int8, log=print)
        else:
            if not args.scheme:
                raise ValueError("--scheme is required (w8a16, w8a8, w4a8, w6a12)")
            if args.clamp_int8:
                raise ValueError("--clamp-int8 applies only to --from msmodelslim")
            quantize_checkpoint(args.src, args.dst, args.scheme, shard, log=print)
    except ConfigError as e:
        raise ValueError(str(e).removeprefix("glm5 config: ")) from None
    print(f"wrote {args.dst}")
    return 0


# --------------------------------------------------------------------------- main
def _fmt(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm5", description="GLM-5 on an op IR with pluggable "
                                "hardware backends")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("backends", help="list discovered backends and plugins")
    b.add_argument("--json", action="store_true")
    b.add_argument("--diagnose", action="store_true",
                   help="show every plugin's load status with tracebacks, the policy and env")
    b.set_defaults(func=cmd_backends)

    o = sub.add_parser("ops", help="the op catalog and which backend serves each op")
    o.add_argument("--backend", help="show what serves each op with this backend preferred")
    o.add_argument("--device", default="cpu", help="torch device type (default cpu)")
    o.add_argument("--dtype", default="bfloat16", help="dispatch dtype (default bfloat16)")
    o.add_argument("--json", action="store_true")
    o.set_defaults(func=cmd_ops)

    q = sub.add_parser("parity", help="check a backend's kernels against the float64 oracle")
    q.add_argument("--backend", required=True, help="backend name, or 'all'")
    q.add_argument("--ops", default="", help="comma-separated ops (default: all it claims)")
    q.add_argument("--examples", type=int, default=None,
                   help="examples per (op, dtype) (default: 10 for the default profile, 6 "
                        "quick, 4 smoke, 100 full)")
    q.add_argument("--profile", choices=("smoke", "quick", "default", "full"), default="default",
                   help="size tiers the examples cycle through: smoke = edge, tile; quick = "
                        "edge, tile, model "
                        "(interpreters); default adds large and huge (thousands of keys, past "
                        "every kernel's tiles); full = the same tiers, 100 examples")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--emulate", action="store_true",
                   help="run device kernels on CPU tensors through the backend's emulator "
                        "(Triton interpreter, contract emulators); rows are marked emulated")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_parity)

    i = sub.add_parser("info", help="parameter counts and KV-cache size of a model config")
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="a built-in config: glm-5, tiny, small")
    src.add_argument("--model", help="a directory (or file) with a transformers config.json")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    bn = sub.add_parser("bench", help="time a backend's kernels vs the reference and roofline")
    bn.add_argument("--backend", help="backend (default: the one serving the CPU)")
    bn.add_argument("--ops", default="", help="comma-separated ops (default: all with shapes)")
    bn.add_argument("--repeat", type=int, default=3)
    bn.add_argument("--quick", action="store_true", help="smaller ceiling measurements")
    bn.add_argument("--no-reference", action="store_true", help="skip timing the reference")
    bn.add_argument("--json", action="store_true")
    bn.set_defaults(func=cmd_bench)

    e = sub.add_parser("export", help="export the model's prefill forward to ONNX")
    e.add_argument("--format", default="onnx", help="onnx (the only format)")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="a built-in config with random weights (tiny, small)")
    src.add_argument("--model", help="a transformers-format checkpoint directory")
    e.add_argument("--seq-len", type=int, default=16, help="tokens per sequence in the graph")
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--seed", type=int, default=0, help="weights seed for --preset")
    e.add_argument("out", help="output .onnx path")
    e.set_defaults(func=cmd_export)

    qz = sub.add_parser("quantize", help="quantize a transformers-format checkpoint (or convert "
                        "an msModelSlim one) into glm5's canonical quantized format")
    qz.add_argument("--scheme", choices=("w8a16", "w8a8", "w4a8", "w6a12"),
                    help="quantization scheme (docs/ops.md); required unless --from msmodelslim")
    qz.add_argument("--from", dest="from_format", choices=("transformers", "msmodelslim"),
                    default="transformers", help="SRC format (default transformers)")
    qz.add_argument("--clamp-int8", action="store_true",
                    help="msmodelslim: clamp int8 code -128 to -127 instead of failing")
    qz.add_argument("--max-shard-gb", type=float, default=0.0,
                    help="largest output shard in GiB (default 5)")
    qz.add_argument("src", help="source checkpoint directory")
    qz.add_argument("dst", help="output directory (new or empty)")
    qz.set_defaults(func=cmd_quantize)

    pl = sub.add_parser("plan", help="memory and roofline time of a model on a chip, per device")
    src = pl.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="a built-in config: glm-5, tiny, small")
    src.add_argument("--model", help="a directory (or file) with a transformers config.json")
    pl.add_argument("--chip", required=True, help="ascend-910b, mlu590, mtt-s4000, hygon-k100, "
                    "h100-sxm, h200")
    pl.add_argument("--quant", default="bf16", help="bf16 (none), w8a16, w8a8, w4a8, w6a12")
    pl.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    pl.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    pl.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    pl.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    pl.add_argument("--kv-dtype", default="bf16", help="KV-cache element: bf16 or fp8")
    pl.add_argument("--reserve-gb", type=float, default=None,
                    help="activation/workspace reserve per device (default 10%% of memory)")
    pl.add_argument("--mtp", action="store_true", help="add the MTP layer to each decode step")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "examples", None) is not None and args.examples < 1:
        print("glm5 parity: --examples expected a positive integer", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        msg = msg.removeprefix("glm5: ")
        print(f"glm5 {args.command}: {msg}", file=sys.stderr)
        return 2
    except Exception as e:
        from glm5.backends.registry import PluginLoadError

        if isinstance(e, PluginLoadError):
            print(f"glm5 {args.command}: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
