"""`glm5 quantize`: a transformers-format checkpoint quantized (or an msModelSlim one
converted) into glm5's canonical quantized format."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
from pathlib import Path

from glm5.cli.common import config_from, force_hint
from glm5.cli.errors import CommandError, UsageError


def add_parser(sub) -> argparse.ArgumentParser:
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
    qz.set_defaults(func=run)
    return qz


def run(args: argparse.Namespace) -> int:
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
    config_from(args.src, "SRC")
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
        raise force_hint(e) from e
    except ConfigError as e:
        raise CommandError(str(e).removeprefix("glm5 config: ")) from e
    print(f"wrote {args.dst}")
    return 0
