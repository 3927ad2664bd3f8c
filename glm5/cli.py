"""`glm5` command line: backends | ops | parity | bench | info | plan | quantize | export |
serve | rl | doctor.

Errors (the framework in `main`): every error a user can cause prints one line on stderr,
``glm5 <command>: what is wrong, what was expected``, and no traceback unless ``--debug`` is
given (before or after the command). Exit status:

- 0: success;
- 1: the command ran and failed: an input file is unreadable, corrupt or inconsistent, a check
  failed, a backend is unavailable, an unexpected error (`CommandError`, and any error a command
  does not declare as a usage error);
- 2: the command line is wrong: an unknown option or name (backend, op, preset, chip, scheme), a
  bad value, a path argument that does not exist or is of the wrong kind, an output that exists
  without ``--force`` (`UsageError`, argparse's errors, ``KeyError``, ``ValueError``);
- 130: interrupted (Ctrl-C); 141: stdout was closed early (``glm5 ops | head``), which ends the
  command quietly, as a program ended by SIGPIPE.

Tables cut their last column (reasons, messages) to the terminal's width; ``--wide`` prints it
whole. Output to a pipe or file is never cut.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence


class UsageError(ValueError):
    """The command line is wrong (a bad value, a missing or conflicting option): exit 2."""


class CommandError(Exception):
    """A well-formed command could not do its job (an input unreadable or corrupt, a check
    that failed): exit 1."""


class _ParseError(Exception):
    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is raised to `main` (one line, exit 2) instead of printing the
    usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        raise _ParseError(self.prog, message)


def _config_from(path: str, option: str):
    """The GLM5Config of a checkpoint directory (or config file) named by ``option``: a path
    that does not exist or holds no config.json is a usage error, a config.json that is not
    valid a failure."""
    from glm5.core.config import ConfigError, GLM5Config

    p = Path(path)
    if not p.exists():
        raise UsageError(f"{option} {path}: no config.json there (no such file or directory); "
                         f"expected a checkpoint directory")
    if p.is_dir() and not (p / "config.json").is_file():
        raise UsageError(f"{option} {path}: no config.json in this directory; expected a "
                         f"checkpoint directory (config.json + safetensors)")
    try:
        return GLM5Config.from_pretrained(p)
    except ConfigError as e:
        raise CommandError(str(e).removeprefix("glm5 config: ")) from e


def _preset(name: str):
    """The preset ``name`` (case-insensitive: argparse lower-cases it); unknown is a usage
    error."""
    from glm5.core.config import ConfigError, preset

    try:
        return preset(name)
    except ConfigError as e:
        raise UsageError(str(e).removeprefix("glm5 config: ")) from None


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
        print(_fit(format_table(rows)))
    return 1 if any(r.status == "fail" for r in rows) else 0


# --------------------------------------------------------------------------- info
def _billions(n: int) -> str:
    return f"{n / 1e9:.1f} B"


def cmd_info(args: argparse.Namespace) -> int:
    from glm5.deploy.info import model_info

    cfg = _preset(args.preset) if args.preset else _config_from(args.model, "--model")
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
    if kv["indexer_dtype"] == "fp8":
        print(f"  (fp8 index cache: each indexer key row is {kv['indexer_key_per_layer']} e4m3 "
              f"codes + an fp32 scale = {kv['indexer_key_bytes']['bf16']} bytes in both)")
    pl = kv["bytes_per_layer"]
    print(f"  per layer: {kv['elements_per_layer']} elements = {pl['bf16']:,} bytes bf16, "
          f"{pl['fp8']:,} bytes fp8")
    return 0


# --------------------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    from glm5.backends.api import REFERENCE
    from glm5.perf.bench import SHAPES, format_rows, plot_rows, run_bench, write_csv

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
    if args.repeat < 1:
        raise UsageError(f"--repeat expected a count >= 1, got {args.repeat}")
    for opt, path, ext in (("--csv", args.csv, None), ("--plot", args.plot, ".png")):
        if path is None:
            continue
        if ext and Path(path).suffix.lower() != ext:
            raise UsageError(f"{opt} {path}: expected a {ext} file name")
        if not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{opt} {path}: no such directory {str(Path(path).parent)!r}")
    if args.plot:  # fail before the run, not after minutes of measuring
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    if not args.json:  # say what runs at once: the run takes minutes
        print(f"backend: {b.name}", flush=True)
    ceil, rows = run_bench(b, ops, with_reference=not args.no_reference, repeat=args.repeat,
                           quick=args.quick)
    if args.json:
        print(json.dumps({"backend": b.name, "ceilings": ceil,
                          "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        print(format_rows(ceil, rows))
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        plot_rows(args.plot, rows, title=f"glm5 bench: backend {b.name}")
    return 0


# --------------------------------------------------------------------------- tune
def _show_tuning_cache(backend: str | None) -> int:
    from glm5.backends import tuning_cache as tc

    got = tc.listing(backend)
    if got["dir"] is None:
        print(f"{tc.ENV}=off: no tuning cache is read or written")
        return 0
    print(f"tuning cache: {got['dir']}")
    if not got["files"]:
        print("  (empty: `glm5 tune --backend NAME` fills it)")
    for row in got["files"]:
        print(f"  {tc.describe(row)}")
    return 0


def _clear_tuning(path: Path | None, what: str) -> int:
    if path is not None and path.exists():
        path.unlink()
        print(f"removed {path}")
    else:
        print(f"no tuning cache for {what} ({path})")
    return 0


def _tune_cpu(args: argparse.Namespace, b: Any) -> int:
    """`glm5 tune --backend cpu`: where quant_linear's paths switch on this CPU."""
    import torch

    from glm5.backends import tuning_cache as tc
    from glm5.backends.cpu import context
    from glm5.perf.tune_cpu import OP, run

    for opt, given in (("--emulate", args.emulate), ("--table", args.table),
                       ("--fresh", args.fresh), ("--tp", args.tp != 1)):
        if given:
            raise UsageError(f"{opt} does not apply to the cpu backend (it tunes quant_linear's "
                             f"crossovers on this CPU, with no table)")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if any(o != OP for o in ops):
        raise UsageError(f"--ops: the cpu backend tunes {OP} only, got {args.ops!r}")
    ok, reason = b.is_available()
    if not ok:
        raise ValueError(f"backend 'cpu' cannot be tuned here: {reason}")
    context()  # the thread pools' sizes (the crossovers are measured and kept per thread count)
    from glm5.kernels.tvm.quant import cpu_tier

    if args.clear:
        return _clear_tuning(tc.path_for("cpu", tc.cpu_key(cpu_tier(), torch.get_num_threads())[0]),
                             "cpu on this CPU")
    report = run(context, budget_s=args.budget_s, write_cache=not args.no_cache)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    if args.show:
        return _show_tuning_cache(args.backend)
    if args.emulate:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch

    from glm5.backends import tuning_cache as tc
    from glm5.perf.tune import merge_table, run

    for opt in ("budget_s", "per_measure_s"):
        if getattr(args, opt) <= 0:
            raise UsageError(f"--{opt.replace('_', '-')} expected seconds > 0, got "
                             f"{getattr(args, opt)}")
    if args.min_gain < 0:
        raise UsageError(f"--min-gain expected a fraction >= 0, got {args.min_gain}")
    from glm5.perf.tune import TP_CHOICES

    if args.tp not in TP_CHOICES:
        raise UsageError(f"--tp expected one of {', '.join(map(str, TP_CHOICES))} (a divisor "
                         f"of GLM-5's 64 attention heads), got {args.tp}")
    if args.tp != 1 and args.emulate:
        raise UsageError("--tp applies to the device shapes; --emulate runs tiny ones")
    from glm5.backends.vendor import DeviceTuned

    b = _registry().get(args.backend or "cuda")
    if b.name == "cpu":
        return _tune_cpu(args, b)
    if not any(isinstance(e.fn, DeviceTuned) for e in b.kernels.values()):
        raise ValueError(f"backend {b.name!r} runs no kernel of the Triton library: glm5 tune "
                         f"searches Triton launch parameters (cuda, hygon, ascend, cambricon, "
                         f"mthreads, or a plugin built on glm5.backends.vendor)")
    ok, reason = b.can_emulate() if args.emulate else b.is_available()
    if not ok:
        hint = "" if args.emulate or not b.can_emulate()[0] else \
            " (--emulate checks the procedure on CPU through its emulator)"
        raise ValueError(f"backend {b.name!r} cannot be "
                         f"{'emulated' if args.emulate else 'tuned'} here: {reason}{hint}")
    device = torch.device("cpu" if args.emulate else b.device_type)
    if args.clear:
        return _clear_tuning(tc.path_for(b.name, tc.device_key(device)[0]),
                             f"{b.name} on this device")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    report = run(b, ops, device, emulate=args.emulate, budget_s=args.budget_s, tp=args.tp,
                 per_measure_s=args.per_measure_s, min_gain=args.min_gain, fresh=args.fresh,
                 write_cache=not args.no_cache)
    if args.table:
        path = Path(args.table)
        table = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps(merge_table(table, report["kept"]), indent=1) + "\n")
        print(f"merged {', '.join(sorted(report['kept'])) or 'nothing'} into {path}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


# --------------------------------------------------------------------------- export
def _force_hint(e: Exception) -> UsageError:
    """An `OutputExistsError` said as the command line says it (--force, not overwrite=True)."""
    return UsageError(f"{e.path} {e.what}; pass --force to replace it")


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from glm5.deploy.export import export_onnx
    from glm5.core.model import GLM5ForCausalLM
    from glm5.core.output import OutputExistsError

    if args.format != "onnx":
        raise UsageError(f"--format expected 'onnx', got {args.format!r}")
    if args.preset:
        cfg = _preset(args.preset)
        if args.preset == "glm-5":
            raise UsageError("exporting the 744 B glm-5 preset with random weights is not "
                             "useful; export a checkpoint with --model")
        torch.manual_seed(args.seed)
        model = GLM5ForCausalLM(cfg)  # random initialisation
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, cfg.initializer_range)
    else:
        from glm5.core.checkpoint import load_model

        _config_from(args.model, "--model")
        model = load_model(args.model)
    try:
        out = export_onnx(model, args.out, seq_len=args.seq_len, batch=args.batch,
                          overwrite=args.force)
    except OutputExistsError as e:
        raise _force_hint(e) from e
    print(f"wrote {out} (input_ids [{args.batch}, {args.seq_len}] int64 -> logits; glm5 ops "
          f"as ONNX functions in domain 'glm5')")
    return 0


# --------------------------------------------------------------------------- plan
def cmd_plan(args: argparse.Namespace) -> int:
    from glm5.deploy.plan import format_plan, plan

    cfg = _preset(args.preset) if args.preset else _config_from(args.model, "--model")
    try:
        p = plan(cfg, args.chip, args.quant, args.batch, args.context, tp=args.tp, ep=args.ep,
                 kv_dtype=args.kv_dtype, reserve_gb=args.reserve_gb, mtp=args.mtp,
                 comm=args.comm, indexer_dtype=args.indexer_dtype)
    except ValueError as e:  # PlanError, ConfigError: name the command-line option
        msg = str(e).removeprefix("glm5.plan: ").removeprefix("glm5 config: ")
        raise UsageError(re.sub(r"argument '(\w+)'",
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
    from glm5.core.output import OutputExistsError
    from glm5.deploy.quantize import DEFAULT_SHARD_BYTES, import_msmodelslim, quantize_checkpoint

    if args.max_shard_gb < 0:
        raise UsageError(f"--max-shard-gb expected a positive number of GiB, got "
                         f"{args.max_shard_gb}")
    shard = int(args.max_shard_gb * 2**30) if args.max_shard_gb else DEFAULT_SHARD_BYTES
    if args.from_format == "msmodelslim":
        if args.scheme:
            raise UsageError("--scheme does not apply to --from msmodelslim (each tensor's "
                             "scheme follows its msModelSlim type)")
    else:
        if not args.scheme:
            raise UsageError("--scheme is required (w8a16, w8a8, w4a8, w6a12)")
        if args.clamp_int8:
            raise UsageError("--clamp-int8 applies only to --from msmodelslim")
    _config_from(args.src, "SRC")
    if Path(args.dst).resolve() == Path(args.src).resolve():
        raise UsageError("DST must differ from SRC")
    try:
        if args.from_format == "msmodelslim":
            import_msmodelslim(args.src, args.dst, shard, args.clamp_int8, log=print,
                               overwrite=args.force)
        else:
            quantize_checkpoint(args.src, args.dst, args.scheme, shard, log=print,
                                overwrite=args.force)
    except OutputExistsError as e:
        raise _force_hint(e) from e
    except ConfigError as e:
        raise CommandError(str(e).removeprefix("glm5 config: ")) from e
    print(f"wrote {args.dst}")
    return 0


# --------------------------------------------------------------------------- serve
_SERVE_ENGINE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "page_size",
                         "num_pages", "max_model_len", "num_speculative_tokens",
                         "long_prompt_tokens", "long_prompt_qps")
_SERVE_DTYPES = ("float32", "bfloat16", "float16")


def _listen_socket(host: str, port: int):
    """A socket bound to host:port (port 0: a free one), before the model loads: a port in use
    fails in a second, not after the load."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        # listening from now on: a client that connects once the "at http://..." line is out
        # waits in the backlog until the server accepts, instead of being refused while
        # uvicorn starts (a race seen in CI)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise CommandError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


# `glm5 serve`'s client-limit flags: (ServeLimits field, type, help); defaults in the help are
# ServeLimits' (README "Serving" has the same table, with vLLM's).
_SERVE_LIMIT_FLAGS = (
    ("max_body_bytes", int, "request body size; over it: 413 before it is read (8388608)"),
    ("header_timeout", float, "s for a request's line and headers to arrive (10)"),
    ("body_timeout", float, "s for a request's body to arrive; then 408 (30)"),
    ("timeout_keep_alive", float, "s an idle keep-alive connection stays open (5)"),
    ("max_header_bytes", int, "request line + headers size; over it: 400 (65536)"),
    ("max_connections", int, "open connections; over it: 503 and closed (default: the "
                             "descriptor limit, raised to its hard limit, less 256)"),
    ("stream_backlog", int, "outputs per choice a client may leave unread before its request "
                            "is aborted (256)"),
    ("stall_timeout", float, "s a client may leave its socket unwritable (not reading) before "
                             "it is dropped (30)"),
    ("graceful_timeout", float, "s after SIGTERM before open streams get a final error event "
                                "and the server exits (30)"),
    ("send_buffer_bytes", int, "each connection's kernel send buffer (SO_SNDBUF; default: the "
                               "kernel's autotuning)"),
)
_SERVE_LIMIT_OPTIONS = tuple(name for name, _, _ in _SERVE_LIMIT_FLAGS)


def _serve_limits(args: argparse.Namespace):
    """The `ServeLimits` of the command line (an error names the option)."""
    from glm5.serve.limits import ServeLimits

    given = {k: getattr(args, k) for k in _SERVE_LIMIT_OPTIONS if getattr(args, k) is not None}
    try:
        return ServeLimits(**given)
    except ValueError as e:
        msg = str(e).removeprefix("glm5 ServeLimits: ")
        raise UsageError(re.sub(r"argument '(\w+)'", lambda m: "--" + m[1].replace("_", "-"),
                                msg)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CommandError(f"needs the serve extra ({e.name} is not installed): "
                           f"pip install 'glm5[serve]'") from None
    import torch

    from glm5.engine.engine import EngineConfig

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port expected 0..65535, got {args.port}")
    settings = {k: getattr(args, k) for k in _SERVE_ENGINE_OPTIONS if getattr(args, k) is not None}
    if args.no_prefix_cache:
        settings["enable_prefix_cache"] = False
    try:
        engine_config = EngineConfig(**settings)
    except ValueError as e:  # name the option, not the EngineConfig field
        msg = str(e).removeprefix("glm5 EngineConfig: ")
        raise UsageError(re.sub(r"argument '(\w+)'", lambda m: "--" + m[1].replace("_", "-"),
                                msg)) from None
    limits = _serve_limits(args)
    _config_from(args.model_dir, "MODEL_DIR")
    if args.backend:
        b = _registry().get(args.backend)
        ok, reason = b.is_available()
        if not ok:
            raise UsageError(f"--backend {b.name} is unavailable here: {reason}")
    name = args.served_model_name or Path(args.model_dir).resolve().name
    from glm5.serve.limits import raise_descriptor_limit

    raise_descriptor_limit()  # before the connection cap is derived from it
    sock = _listen_socket(args.host, args.port)
    try:
        from glm5.core.checkpoint import load_model
        from glm5.engine.async_engine import AsyncEngine
        from glm5.engine.engine import LLMEngine
        from glm5.engine.llm import load_tokenizer
        from glm5.serve.app import build_app
        from glm5.serve.http import make_server

        print(f"glm5 serve: loading {args.model_dir}", flush=True)
        model = load_model(args.model_dir, getattr(torch, args.dtype) if args.dtype else None,
                           indexer_dtype=args.indexer_dtype,
                           indexer_hadamard=True if args.indexer_hadamard else None)
        try:
            tokenizer = load_tokenizer(Path(args.model_dir))
        except (OSError, ValueError) as e:  # a broken tokenizer file is a bad input, not usage
            raise CommandError(str(e)) from None
        if tokenizer is None:
            _err(f"glm5 serve: {args.model_dir} has no tokenizer.json: only token-id prompts "
                 f"are served (no text, no chat)")
        try:
            engine = LLMEngine(model, engine_config, tokenizer, args.backend)
        except ValueError as e:
            raise UsageError(str(e).removeprefix("glm5 engine: ")) from None
        app = build_app(AsyncEngine(engine), name, tokenizer,
                        allow_weight_updates=args.allow_weight_updates, limits=limits)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"glm5 serve: {name} at http://{shown}:{port}/v1 ({engine.allocator.num_pages} "
              f"pages of {engine_config.page_size} tokens, backend "
              f"{args.backend or 'auto'}; Ctrl-C or SIGTERM drains and stops)", flush=True)
        # uvicorn handles SIGINT / SIGTERM: it stops accepting connections, lets the open ones
        # finish (for up to --graceful-timeout s: then what is left gets a final error), then
        # the app's lifespan drains the engine (a second Ctrl-C forces the exit).
        make_server(app, log_level=args.log_level).run(sockets=[sock])
    finally:
        sock.close()
    return 0


# --------------------------------------------------------------------------- rl
def _rl_config(args: argparse.Namespace):
    """The RLConfig of ``args.config`` with the command line's overrides (a config error is a
    usage error naming the file and the key)."""
    try:
        import yaml
    except ImportError:
        raise CommandError("needs the rl extra (pyyaml is not installed): pip install "
                           "'glm5[rl]'") from None
    from glm5.rl.config import RLConfig, RLConfigError

    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps expected a positive integer, got {args.steps}")
    if args.seed is not None and args.seed < 0:
        raise UsageError(f"--seed expected an integer >= 0, got {args.seed}")
    try:
        cfg = RLConfig.from_yaml(args.config)
        d = cfg.to_dict()
        run = d["run"]
        for key, value in (("steps", args.steps), ("mode", args.mode), ("seed", args.seed),
                           ("out_dir", args.out)):
            if value is not None:
                run[key] = value
        if args.ray:
            run["ray"] = True
        return RLConfig.from_dict(d)
    except RLConfigError as e:
        raise UsageError(f"{args.config}: {str(e).removeprefix('glm5 rl config: ')}") from None
    except yaml.YAMLError as e:
        raise CommandError(f"{args.config} is not valid YAML: {e}") from None


def _rl_status(row: dict) -> str:
    return (f"step {int(row['step'])}: reward {row['reward']:.3f}, exact {row['exact']:.3f}, "
            f"trainer idle {row['trainer_idle_frac']:.0%}")


def cmd_rl_train(args: argparse.Namespace) -> int:
    from glm5 import progress
    from glm5.rl.metrics import MetricsLogger

    cfg = _rl_config(args)
    if cfg.run.ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise CommandError("--ray needs the rl extra (ray is not installed): pip install "
                               "'glm5[rl]'") from None
    from glm5.rl.loop import CHECKPOINT, RLRun

    import yaml

    out = Path(cfg.run.out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"run directory {out} (--out or run.out_dir) exists and is not a "
                         f"directory")
    out.mkdir(parents=True, exist_ok=True)
    # The resolved config (file + overrides) beside the run: what produced these metrics.
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    metrics = MetricsLogger(out, tensorboard=cfg.run.tensorboard)
    ws = cfg.warm_start
    if ws.demos and (args.no_resume or not (out / CHECKPOINT).exists()):
        print(f"glm5 rl train: warm start on {ws.demos} demonstration(s) per environment type, "
              f"{ws.steps} step(s) of batch {ws.batch_size} ...", flush=True)
    run = RLRun(cfg, out_dir=out, resume=not args.no_resume, metrics=metrics)
    if run.warm_start:
        w = run.warm_start
        print(f"glm5 rl train: warm start done: {w['warm_start_demos']:.0f} demonstrations, "
              f"loss {w['warm_start_loss_first']:.3f} -> {w['warm_start_loss_last']:.3f} in "
              f"{w['warm_start_seconds']:.1f} s", flush=True)
    try:
        metrics.truncate(run.step)  # rows past the checkpoint are recomputed
        target = cfg.run.steps
        start = run.step
        todo = f"steps {start + 1}..{target}" if start < target else \
            f"nothing to train: run.steps is {target}"
        print(f"glm5 rl train: {args.config} -> {out} ({cfg.run.mode}"
              f"{', ray' if cfg.run.ray else ''}, {f'resumed at step {start}, ' if start else ''}"
              f"{todo})", flush=True)
        drawn = progress.enabled()
        every = max(cfg.run.log_every, 1)
        with progress.progress_bar(max(target - start, 0), "rl train", unit="step",
                                   delay=0.0) as bar:
            def on_step(row: dict) -> None:
                if drawn:
                    # update first: setting the description redraws the bar, so each step
                    # shows even when it took less than tqdm's minimum redraw interval
                    bar.update(1)
                    bar.set_description_str(f"rl train: reward {row['reward']:.3f} exact "
                                            f"{row['exact']:.3f} idle "
                                            f"{row['trainer_idle_frac']:.0%}")
                elif int(row["step"]) % every == 0 or int(row["step"]) == target:
                    print(_rl_status(row), flush=True)  # a log line where no bar is drawn

            summary = run.train(target, progress=on_step)
    finally:
        run.close()
        metrics.close()
    done = summary.steps - start
    print(f"glm5 rl train: {done} step(s) in {summary.wall_s:.1f} s (now at step "
          f"{summary.steps}); final reward {summary.final_reward:.3f} (mean of the last 10% of "
          f"steps); trainer idle {summary.idle_fraction:.1%} of wall time")
    tb = f", TensorBoard {out / 'tb'}" if (out / "tb").is_dir() else ""
    print(f"metrics: {metrics.path}{tb}")
    ckpt = out / CHECKPOINT
    print(f"checkpoint: {ckpt}" if ckpt.exists() else
          f"checkpoint: none written (run.checkpoint_every = {cfg.run.checkpoint_every})")
    return 0


def cmd_rl_plot(args: argparse.Namespace) -> int:
    from glm5.rl.plot import plot_runs

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CommandError("needs matplotlib: pip install 'glm5[rl]'") from None
    if not Path(args.output).resolve().parent.is_dir():
        raise UsageError(f"-o {args.output}: no such directory "
                         f"{str(Path(args.output).parent)!r}")
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    if Path(args.output).suffix.lstrip(".").lower() not in kinds:
        raise UsageError(f"-o {args.output}: expected a file name ending in one of "
                         f"{', '.join('.' + k for k in sorted(kinds))}")
    try:
        out = plot_runs(args.run_dirs, args.output, x=args.x)
    except FileNotFoundError as e:  # a RUN_DIR that is not one: the command line is wrong
        raise UsageError(f"RUN_DIR {e.filename}: {e.strerror}") from None
    except ValueError as e:  # a metrics.csv that holds no usable rows: a bad input
        raise CommandError(str(e).removeprefix("glm5 rl plot: ")) from None
    print(f"wrote {out} ({len(args.run_dirs)} run(s), x = {args.x})")
    return 0


# --------------------------------------------------------------------------- launch
def launch_argv(args: argparse.Namespace) -> list[str]:
    """The torchrun (torch.distributed.run) command line of ``glm5 launch``: one node with a
    free port found by torchrun's standalone rendezvous, or, with ``--nnodes``, torchrun's own
    c10d rendezvous at ``--rdzv-endpoint``. ``python script.py ...`` and ``script.py ...`` run
    the script with this interpreter; ``python -m module ...`` runs a module; anything else is
    an executable run as is."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("expected the program to run: glm5 launch --nproc N [--] script.py "
                         "[args] (or python script.py, python -m module)")
    if args.nproc < 1:
        raise UsageError(f"--nproc expected a positive integer, got {args.nproc}")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout expected a positive number of seconds, got {args.timeout}")
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
    if args.nnodes is None:
        run.append("--standalone")
    else:
        if not args.rdzv_endpoint:
            raise UsageError("--nnodes expected with --rdzv-endpoint HOST:PORT (the rendezvous "
                             "every node joins)")
        run += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id}"]
    if Path(cmd[0]).name.startswith("python") and len(cmd) > 1:
        cmd = cmd[1:]  # torchrun runs scripts and modules with this very interpreter
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise UsageError("expected a module name after -m")
        return run + ["--module", *cmd[1:]]
    if cmd[0].endswith(".py"):
        if not Path(cmd[0]).is_file():
            raise UsageError(f"{cmd[0]}: no such script")
        return run + cmd
    return run + ["--no-python", *cmd]


def cmd_launch(args: argparse.Namespace) -> int:
    import subprocess

    argv = launch_argv(args)
    env = dict(os.environ)
    if args.timeout is not None:  # glm5.parallel.init_distributed reads it as its default timeout
        env["GLM5_DIST_TIMEOUT"] = str(args.timeout)
    return subprocess.call(argv, env=env)


# --------------------------------------------------------------------------- doctor
def cmd_doctor(args: argparse.Namespace) -> int:
    from glm5.doctor import doctor_report, format_report

    report = doctor_report(backend_rows(), plugin_rows(False))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report, _fmt))
    return 1 if args.strict and report["warnings"] else 0


# --------------------------------------------------------------------------- main
_WIDE = False  # --wide: tables print their last column whole (set by `main`)
_MIN_LAST = 24  # the last column is never cut narrower than this
_CUT_NOTE = "(… = cut to the terminal's width; --wide prints it whole)"


def _table_width() -> int | None:
    """Columns a table may use: None (unlimited) with --wide or when stdout is not a terminal
    (pipes and files get whole lines), else $COLUMNS or the terminal's width."""
    import shutil

    if _WIDE:
        return None
    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    try:
        if not sys.stdout.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size().columns


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _fmt(rows: Sequence[Sequence[str]]) -> str:
    """An aligned table (first row = header). The last column (reasons, candidates) is cut to
    the terminal's width (`_table_width`), with a note saying so."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    limit = _table_width()
    cut = False
    if limit is not None:
        room = max(limit - sum(widths[:-1]) - 2 * (len(widths) - 1), _MIN_LAST)
        if widths[-1] > room:
            widths[-1], cut = room, True
            rows = [(*r[:-1], _cut(r[-1], room)) for r in rows]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if cut:
        lines.append(_CUT_NOTE)
    return "\n".join(lines)


def _fit(table: str) -> str:
    """A table formatted elsewhere (the parity table), its long lines cut to the terminal's
    width (its last column is the message), with a note when any was cut."""
    limit = _table_width()
    if limit is None:
        return table
    lines = table.split("\n")
    out = [_cut(ln, max(limit, _MIN_LAST)) for ln in lines]
    return "\n".join(out + ([_CUT_NOTE] if out != lines else []))


def _add_global_options(p: argparse.ArgumentParser, suppress: bool) -> None:
    """--debug and --wide, accepted before the command (``suppress`` False: they default to
    False there) and after it (``suppress`` True: no default, so the value given before the
    command is not reset)."""
    d = argparse.SUPPRESS if suppress else False
    if "--debug" not in p._option_string_actions:
        p.add_argument("--debug", action="store_true", default=d,
                       help="show the traceback of an error")
    if "--wide" not in p._option_string_actions:
        p.add_argument("--wide", action="store_true", default=d,
                       help="print tables' long columns (reasons, messages) whole")


def build_parser() -> argparse.ArgumentParser:
    from glm5 import __version__

    p = _Parser(prog="glm5", description="GLM-5 on an op IR with pluggable hardware backends")
    p.add_argument("--version", action="version", version=f"glm5 {__version__}")
    _add_global_options(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    src.add_argument("--preset", type=str.lower, help="a built-in config: glm-5, tiny, small")
    src.add_argument("--model", help="a directory (or file) with a transformers config.json")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    bn = sub.add_parser("bench", help="time a backend's kernels vs the reference and roofline")
    bn.add_argument("--backend", help="backend (default: the one serving the CPU)")
    bn.add_argument("--ops", default="", help="comma-separated ops (default: all with shapes)")
    bn.add_argument("--repeat", type=int, default=3, help="timed rounds per row (median)")
    bn.add_argument("--quick", action="store_true", help="faster ceiling measurements")
    bn.add_argument("--no-reference", action="store_true", help="skip timing the reference")
    bn.add_argument("--json", action="store_true")
    bn.add_argument("--csv", metavar="FILE", help="also write the rows to a CSV file")
    bn.add_argument("--plot", metavar="FILE.png",
                    help="also draw %% of roofline per op and dtype (needs matplotlib)")
    bn.set_defaults(func=cmd_bench)

    tu = sub.add_parser("tune", help="search a backend's Triton tiles on this device, each "
                        "candidate checked against the float64 oracle; winners are cached per "
                        "device and used from then on")
    tu.add_argument("--backend",
                    help="a Triton-library backend (default cuda), or cpu: where "
                         "quant_linear's paths (GEMV, GEMM, oneDNN) switch on this CPU "
                         "(--show: every backend's files unless given)")
    tu.add_argument("--ops", default="", help="comma-separated ops (default: all with shapes)")
    tu.add_argument("--budget-s", type=float, default=600.0, help="time for the whole search")
    tu.add_argument("--per-measure-s", type=float, default=0.15,
                    help="time spent timing one candidate at one shape")
    tu.add_argument("--min-gain", type=float, default=0.05,
                    help="keep a winner only when this much faster (0.05: 5%%)")
    tu.add_argument("--tp", type=int, default=1,
                    help="tune at the shapes one of N tensor-parallel ranks runs (attention "
                         "heads, column-parallel linears and the vocabulary split N ways)")
    tu.add_argument("--fresh", action="store_true",
                    help="start from the backend's table, not from this device's cache")
    tu.add_argument("--no-cache", action="store_true", help="report only; write no cache")
    tu.add_argument("--table", metavar="TUNING.JSON",
                    help="also merge the winners into this tuning table (backend maintainers)")
    tu.add_argument("--out", metavar="FILE", help="write every trial as JSON")
    tu.add_argument("--emulate", action="store_true",
                    help="tiny shapes through the Triton interpreter on CPU: checks the "
                         "procedure only (CPU times say nothing about a device)")
    tu.add_argument("--show", action="store_true",
                    help="list the tuning cache's files and whether they apply; tune nothing")
    tu.add_argument("--clear", action="store_true",
                    help="remove this device's cache file for the backend; tune nothing")
    tu.set_defaults(func=cmd_tune)

    e = sub.add_parser("export", help="export the model's prefill forward to ONNX")
    e.add_argument("--format", default="onnx", help="onnx (the only format)")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", type=str.lower,
                     help="a built-in config with random weights (tiny, small)")
    src.add_argument("--model", help="a transformers-format checkpoint directory")
    e.add_argument("--seq-len", type=int, default=16, help="tokens per sequence in the graph")
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--seed", type=int, default=0, help="weights seed for --preset")
    e.add_argument("--force", action="store_true", help="replace OUT if it exists")
    e.add_argument("out", help="output .onnx path (written atomically; refused if it exists "
                   "unless --force)")
    e.set_defaults(func=cmd_export)

    qz = sub.add_parser("quantize", help="quantize a transformers-format checkpoint (or convert "
                        "an msModelSlim one) into glm5's canonical quantized format")
    qz.add_argument("--scheme", type=str.lower, choices=("w8a16", "w8a8", "w4a8", "w6a12"),
                    help="quantization scheme (docs/ops.md); required unless --from msmodelslim")
    qz.add_argument("--from", dest="from_format", choices=("transformers", "msmodelslim"),
                    default="transformers", help="SRC format (default transformers)")
    qz.add_argument("--clamp-int8", action="store_true",
                    help="msmodelslim: clamp int8 code -128 to -127 instead of failing")
    qz.add_argument("--max-shard-gb", type=float, default=0.0,
                    help="largest output shard in GiB (default 5)")
    qz.add_argument("src", help="source checkpoint directory")
    qz.add_argument("--force", action="store_true",
                    help="replace DST if it holds a checkpoint")
    qz.add_argument("dst", help="output directory (written atomically: it appears complete or "
                    "not at all; refused if it holds a checkpoint unless --force)")
    qz.set_defaults(func=cmd_quantize)

    pl = sub.add_parser("plan", help="memory and roofline time of a model on a chip, per device")
    src = pl.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", type=str.lower, help="a built-in config: glm-5, tiny, small")
    src.add_argument("--model", help="a directory (or file) with a transformers config.json")
    pl.add_argument("--chip", required=True, type=str.lower, help="ascend-910b, mlu590, "
                    "mtt-s4000, hygon-k100, h100-sxm, h200 (any case)")
    pl.add_argument("--quant", default="bf16", type=str.lower,
                    help="bf16 (none), w8a16, w8a8, w4a8, w6a12")
    pl.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    pl.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    pl.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    pl.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    pl.add_argument("--kv-dtype", default="bf16", type=str.lower,
                    help="KV-cache element: bf16 or fp8")
    pl.add_argument("--indexer-dtype", default=None, type=str.lower,
                    help="the indexer's key cache and selection: bf16 or fp8 (e4m3 codes + a "
                         "scale per key, DeepSeek-V3.2's form) (default: the model's "
                         "dsa_indexer_dtype)")
    pl.add_argument("--reserve-gb", type=float, default=None,
                    help="activation/workspace reserve per device (default 10%% of memory)")
    pl.add_argument("--mtp", action="store_true", help="add the MTP layer to each decode step")
    pl.add_argument("--comm", default="auto", type=str.lower,
                    help="how TP groups sum partial outputs in the step times: allreduce, "
                         "flashcomm, flashcomm-int8, or auto (FlashComm from the computed token "
                         "threshold on) (default auto)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (FastAPI + uvicorn) "
                        "over the serving engine")
    sv.add_argument("model_dir", metavar="MODEL_DIR",
                    help="checkpoint directory (config.json + safetensors; tokenizer.json for "
                         "text and chat)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                    "127.0.0.1; 0.0.0.0 for every interface)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one)")
    sv.add_argument("--backend", help="ops backend (default: the usual selection)")
    sv.add_argument("--dtype", choices=_SERVE_DTYPES, type=str.lower,
                    help="weights dtype (default: the checkpoint's)")
    sv.add_argument("--indexer-dtype", choices=("bf16", "fp8"), type=str.lower,
                    help="the DSA indexer's precision (default: the checkpoint's config, "
                         "dsa_indexer_dtype); fp8: DeepSeek-V3.2's fp8 indexer, its keys "
                         "cached in fp8")
    sv.add_argument("--indexer-hadamard", action="store_true",
                    help="with the fp8 indexer: rotate its q and k by the Hadamard matrix before "
                         "quantizing (DeepSeek-V3.2's official code, SGLang) (default: the "
                         "checkpoint's config, dsa_indexer_hadamard)")
    sv.add_argument("--served-model-name", help="the model name clients send (default: the "
                    "directory's name)")
    sv.add_argument("--max-num-seqs", type=int, help="sequences in the running batch (256)")
    sv.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (8192)")
    sv.add_argument("--chunk-size", type=int, help="prefill tokens per request and step (512)")
    sv.add_argument("--page-size", type=int, help="tokens per cache page (64)")
    sv.add_argument("--num-pages", type=int, help="cache pages (default: as many as 2 GiB hold)")
    sv.add_argument("--max-model-len", type=int,
                    help="context length (default: the model's max_position_embeddings)")
    sv.add_argument("--num-speculative-tokens", type=int, help="MTP drafts per step (0: off)")
    sv.add_argument("--no-prefix-cache", action="store_true", help="disable prefix reuse")
    sv.add_argument("--long-prompt-tokens", type=int,
                    help="prompts longer than this get their own rate limit (32768)")
    sv.add_argument("--long-prompt-qps", type=float,
                    help="long prompts admitted per second; over it: 429 + Retry-After (0.5)")
    sv.add_argument("--allow-weight-updates", action="store_true",
                    help="accept RL weight updates at POST /glm5/v1/weights (an RL rollout "
                         "engine; never on a public server)")
    lim = sv.add_argument_group("client limits", "what one client may cost the server (see "
                                "README, Serving: limits; vLLM sets none of these but keep-alive)")
    for name, kind, what in _SERVE_LIMIT_FLAGS:
        lim.add_argument("--" + name.replace("_", "-"), type=kind, help=what)
    sv.add_argument("--log-level", default="info", type=str.lower,
                    choices=("critical", "error", "warning", "info", "debug"),
                    help="uvicorn's log level (default info: one line per request)")
    sv.set_defaults(func=cmd_serve)

    rl = sub.add_parser("rl", help="reinforcement learning: train a policy with the async RL "
                        "loop, plot runs (docs/rl.md)")
    rl_sub = rl.add_subparsers(dest="rl_command", required=True, metavar="SUBCOMMAND")
    rt = rl_sub.add_parser("train", help="run (or resume) an RL run from a YAML config")
    rt.add_argument("config", metavar="CONFIG.yaml",
                    help="the run's config (examples/rl/*.yaml; keys in glm5/rl/config.py)")
    rt.add_argument("--out", metavar="DIR", help="run directory: metrics.csv, tb/, checkpoint, "
                    "journal (default: the config's run.out_dir)")
    rt.add_argument("--steps", type=int, help="train until this many trainer steps in total "
                    "(default: run.steps)")
    rt.add_argument("--mode", choices=("sync", "async"), type=str.lower,
                    help="sync: rollouts and training alternate; async: they overlap "
                         "(default: run.mode)")
    rt.add_argument("--ray", action="store_true", help="run rollout workers, pool and trainer "
                    "as Ray actors on a local ray.init (needs the rl extra)")
    rt.add_argument("--no-resume", action="store_true", help="start from step 0 even if DIR "
                    "holds a checkpoint (its metrics.csv is started over)")
    rt.add_argument("--seed", type=int, help="run.seed: prompts and sampling (the model's "
                    "initialisation keeps model.init_seed)")
    rt.set_defaults(func=cmd_rl_train)
    rp = rl_sub.add_parser("plot", help="reward, exact match, rollout throughput and trainer "
                           "idle fraction of one or more runs, one line per run")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                    help="run directories written by `glm5 rl train`")
    rp.add_argument("-o", "--output", required=True, metavar="OUT.png",
                    help="the figure (.png, .pdf, .svg; replaced if it exists)")
    rp.add_argument("--x", choices=("step", "time"), default="step",
                    help="x axis: trainer step (default) or wall time")
    rp.set_defaults(func=cmd_rl_plot)
    for command in rl_sub.choices.values():  # --debug / --wide after the subcommand too
        _add_global_options(command, suppress=True)

    dr = sub.add_parser("doctor", help="what this machine can do for glm5: Python, torch, CPU "
                        "features, backends, optional dependencies, the RL sandbox; warnings")
    dr.add_argument("--json", action="store_true", help="one JSON object instead of text")
    dr.add_argument("--strict", action="store_true", help="exit 1 when there is any warning")
    dr.set_defaults(func=cmd_doctor)

    la = sub.add_parser("launch", help="run a script on N processes (torchrun): glm5 launch "
                        "--nproc N [--] script.py [args]")
    la.add_argument("--nproc", type=int, required=True, help="processes on this node")
    la.add_argument("--timeout", type=float, default=None,
                    help="seconds a collective may take before the ranks fail with an error "
                         "naming it (GLM5_DIST_TIMEOUT; default 60)")
    la.add_argument("--nnodes", default=None, help="nodes (multi-node: torchrun's rendezvous)")
    la.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT every node joins")
    la.add_argument("--rdzv-id", default="glm5", help="the job's rendezvous id (default glm5)")
    la.add_argument("cmd", nargs=argparse.REMAINDER,
                    help="script.py [args], python script.py [args], python -m module [args]")
    la.set_defaults(func=cmd_launch)

    for command in sub.choices.values():  # every command takes the global options after it too
        _add_global_options(command, suppress=True)
    return p


# The ValueError subclasses that say an input is broken, not that the command line is wrong
# (module, class): matched only once their module is loaded (an error of a module never
# imported cannot have been raised), so `main` imports nothing to classify an error.
_FAILURE_VALUE_ERRORS = (("glm5.core.checkpoint", "CheckpointError"),
                         ("glm5.deploy.quantize", "QuantizeError"),
                         ("glm5.backends.policy", "PolicyError"))
# Prefixes library messages carry (`glm5 quantize: `, `glm5 config: `, `glm5.load_model: `),
# dropped so the line starts with the command once: `glm5 <command>: what is wrong`.
_PREFIX = re.compile(r"^glm5(?: [\w-]+|\.(?:load_model|save_pretrained|plan))?: ")


def _loaded_class(module: str, name: str) -> type | None:
    m = sys.modules.get(module)
    return getattr(m, name, None) if m is not None else None


def _classify(e: BaseException) -> tuple[int, str]:
    """(exit status, message) of an error raised by a command (see the module docstring)."""
    exists = _loaded_class("glm5.core.output", "OutputExistsError")
    if exists is not None and isinstance(e, exists):
        return 2, f"{e.path} {e.what}; pass --force to replace it"
    if isinstance(e, KeyError):  # an unknown name (backend, op)
        return 2, str(e.args[0]) if e.args else "unknown name"
    if isinstance(e, OSError) and e.strerror and e.filename:
        return 1, f"{e.strerror}: {e.filename}"
    failures = tuple(c for c in (_loaded_class(m, n) for m, n in _FAILURE_VALUE_ERRORS) if c)
    if isinstance(e, UsageError) or (isinstance(e, ValueError) and not isinstance(e, failures)):
        return 2, str(e)
    if isinstance(e, (CommandError, OSError, ValueError)):
        return 1, str(e)
    known = [(m, n) for m, n in (("glm5.backends.api", "BackendError"),
                                 ("glm5.backends.selection", "FallbackError"))
             if (c := _loaded_class(m, n)) is not None and isinstance(e, c)]
    if known:
        return 1, str(e)
    return 1, (f"unexpected {type(e).__name__}: {e} (a bug in glm5 or a plugin: rerun with "
               f"--debug for the traceback)")


def _one_line(msg: str) -> str:
    return re.sub(r"\s*\n\s*", " ", _PREFIX.sub("", msg.strip())) or "failed"


def _quiet_closed_stdout() -> None:
    """After EPIPE: point stdout at /dev/null, so that the interpreter's final flush of what is
    still buffered does not print a second BrokenPipeError."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


def _err(line: str) -> None:
    try:
        print(line, file=sys.stderr)
    except (OSError, ValueError):  # stderr closed too: nothing more can be said
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `glm5` command line ``argv`` (default: sys.argv[1:]); returns the exit status
    (0 success, 1 failure, 2 usage error, 130 interrupted, 141 stdout closed)."""
    try:
        rc = _run(argv)
        sys.stdout.flush()  # here, so that a closed pipe is seen while it can end quietly
        return rc
    except BrokenPipeError:  # `glm5 ops | head`: the reader has all it wanted
        _quiet_closed_stdout()
        return 141


def _run(argv: Sequence[str] | None) -> int:
    global _WIDE
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ParseError as e:
        msg = e.args[0]
        if msg.startswith("the following arguments are required: COMMAND"):
            msg = "a command is required"
        _err(f"{e.prog}: {msg} (see `{e.prog} --help`)")
        return 2
    except SystemExit as e:  # --help, --version: argparse printed and exits 0
        return int(e.code or 0)
    command = f"glm5 {args.command}"
    _WIDE = bool(getattr(args, "wide", False))
    try:
        if getattr(args, "examples", None) is not None and args.examples < 1:
            raise UsageError("--examples expected a positive integer")
        return args.func(args)
    except BrokenPipeError:
        raise
    except KeyboardInterrupt:
        if getattr(args, "debug", False):
            raise
        _err(f"{command}: interrupted")
        return 130
    except Exception as e:
        code, msg = _classify(e)
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exc()
        _err(f"{command}: {_one_line(msg)}")
        return code


if __name__ == "__main__":
    sys.exit(main())
