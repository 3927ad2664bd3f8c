"""`glm5 plan`: memory and roofline time of a model on a chip, per device."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
import json

from glm5.cli.common import config_from, option_names, preset
from glm5.cli.errors import UsageError


def add_parser(sub) -> argparse.ArgumentParser:
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
    pl.set_defaults(func=run)
    return pl


def run(args: argparse.Namespace) -> int:
    from glm5.deploy.plan import format_plan, plan

    cfg = preset(args.preset) if args.preset else config_from(args.model, "--model")
    try:
        p = plan(cfg, args.chip, args.quant, args.batch, args.context, tp=args.tp, ep=args.ep,
                 kv_dtype=args.kv_dtype, reserve_gb=args.reserve_gb, mtp=args.mtp,
                 comm=args.comm, indexer_dtype=args.indexer_dtype)
    except ValueError as e:  # PlanError, ConfigError: name the command-line option
        msg = str(e).removeprefix("glm5.plan: ").removeprefix("glm5 config: ")
        raise UsageError(option_names(msg)) from None
    source = {"preset": args.preset} if args.preset else {"model": str(args.model)}
    if args.json:
        print(json.dumps({"source": source, **p}, indent=2))
    else:
        print(format_plan(p))
    return 0
