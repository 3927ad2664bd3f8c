"""`glm5 export`: the model's prefill forward exported to ONNX."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse

from glm5.cli.common import config_from, force_hint, preset
from glm5.cli.errors import UsageError


def add_parser(sub) -> argparse.ArgumentParser:
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
    e.set_defaults(func=run)
    return e


def run(args: argparse.Namespace) -> int:
    import torch

    from glm5.deploy.export import export_onnx
    from glm5.core.model import GLM5ForCausalLM
    from glm5.core.output import OutputExistsError

    if args.format != "onnx":
        raise UsageError(f"--format expected 'onnx', got {args.format!r}")
    if args.preset:
        cfg = preset(args.preset)
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

        config_from(args.model, "--model")
        model = load_model(args.model)
    try:
        out = export_onnx(model, args.out, seq_len=args.seq_len, batch=args.batch,
                          overwrite=args.force)
    except OutputExistsError as e:
        raise force_hint(e) from e
    print(f"wrote {out} (input_ids [{args.batch}, {args.seq_len}] int64 -> logits; glm5 ops "
          f"as ONNX functions in domain 'glm5')")
    return 0
