"""Accuracy and size of each quantization scheme against the fp32 model (docs/quantization.md).

    python bench/quant_accuracy.py [--presets tiny,small] [--seed 0]

Ops run on the reference backend (the scheme's own error, whatever kernels serve it here).
Random weights (tests/hf_oracle.randomize, std = the config's initializer_range, fixed seed),
the fixed token batch of glm5.deploy.quantize.accuracy_batch; each scheme is quantized with
`glm5 quantize`'s code path, loaded with glm5.load_model and compared on logits.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_oracle import randomize  # noqa: E402

from glm5.core.config import preset  # noqa: E402
from glm5.core.model import GLM5ForCausalLM  # noqa: E402
from glm5.deploy.quantize import BUDGETS, accuracy_batch, evaluate_scheme  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.getLogger("glm5").setLevel(logging.ERROR)
    import glm5

    glm5.use_backend("reference")  # the scheme's numerics, not a kernel's: the op references
    print("| preset | scheme | logit cosine | top-1 agree | bytes/param (quantized) | "
          "bytes/param (model) | budget (cos / top-1 / B/p) | within | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = 0
    for name in args.presets.split(","):
        cfg = preset(name)
        model = randomize(GLM5ForCausalLM(cfg, with_mtp=True), args.seed,
                          cfg.initializer_range).eval()
        ids = accuracy_batch(cfg.vocab_size, args.seed)
        with tempfile.TemporaryDirectory() as d:
            for scheme, b in BUDGETS[name].items():
                t = time.perf_counter()
                r = evaluate_scheme(model, d, scheme, ids)
                ok = (r["cosine"] >= b["cosine"] and r["top1"] >= b["top1"]
                      and r["bytes_per_param"] <= b["bytes_per_param"])
                failed += not ok
                print(f"| {name} | {scheme} | {r['cosine']:.5f} | {r['top1']:.3f} | "
                      f"{r['bytes_per_param']:.3f} | {r['model_bytes_per_param']:.3f} | "
                      f"{b['cosine']} / {b['top1']} / {b['bytes_per_param']} | "
                      f"{'yes' if ok else 'NO'} | "
                      f"{time.perf_counter() - t:.1f} |", flush=True)
    if failed:
        raise SystemExit(f"{failed} scheme(s) outside their budget")


if __name__ == "__main__":
    main()
