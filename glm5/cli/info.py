"""`glm5 info`: parameter counts and KV-cache size of a model config."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
import json

from glm5.cli.common import config_from, fmt, preset


def add_parser(sub) -> argparse.ArgumentParser:
    i = sub.add_parser("info", help="parameter counts and KV-cache size of a model config")
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", type=str.lower, help="a built-in config: glm-5, tiny, small")
    src.add_argument("--model", help="a directory (or file) with a transformers config.json")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=run)
    return i


def _billions(n: int) -> str:
    return f"{n / 1e9:.1f} B"


def run(args: argparse.Namespace) -> int:
    from glm5.deploy.info import model_info

    cfg = preset(args.preset) if args.preset else config_from(args.model, "--model")
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
    print(fmt(rows))
    print()
    rows = [("component", "billions", "exact")]
    for name, n in p["components"].items():
        rows.append((name, _billions(n), f"{n:,}"))
    for name, n in p["mtp"].items():
        rows.append((f"mtp.{name}", _billions(n), f"{n:,}"))
    print(fmt(rows))
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
