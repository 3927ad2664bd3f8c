"""Cold start: the first forward of a model in a fresh process vs the second, on a warm kernel
cache (what a user pays once per process before any math, e.g. loading compiled kernels).

    python bench/cold_start.py [--preset small] [--layers 2] [--tokens 512] [--runs 3]

A warm-up process runs first (it builds any kernel missing from the disk cache); then each of
``--runs`` fresh processes builds the model, runs two identical forwards and reports both
times, and the time of `import glm5` and of building the model. The figure of merit is
first − second (best over the runs: noise only ever adds to it).

``--child`` runs one measurement in this process and prints it as JSON (what the parent and
tests/test_cold_start.py run in a subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(preset: str, layers: int, tokens: int, seed: int = 0) -> dict[str, float | bool]:
    """One fresh-process measurement: seconds for `import glm5`, building the model, the first
    and the second forward of ``tokens`` tokens (batch 1, no_grad), wall clock; and the
    process CPU time of the two forwards (all threads: a loaded machine delays, but does not
    add to, the CPU time)."""
    t0 = time.perf_counter()
    import torch

    import glm5  # noqa: F401
    from glm5.core.config import preset as get_preset
    from glm5.core.model import GLM5ForCausalLM

    t1 = time.perf_counter()
    cfg = get_preset(preset).replace(num_hidden_layers=layers)
    torch.manual_seed(seed)
    model = GLM5ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens))
    t2 = time.perf_counter()
    with torch.no_grad():
        c2 = time.process_time()
        t2 = time.perf_counter()
        model(ids)
        t3, c3 = time.perf_counter(), time.process_time()
        model(ids)
        t4, c4 = time.perf_counter(), time.process_time()
    return {"import": t1 - t0, "build": t2 - t1, "first": t3 - t2, "second": t4 - t3,
            "first_cpu": c3 - c2, "second_cpu": c4 - c3,
            # loading cached kernels needs only TVM's runtime, not the tvm package
            "tvm_imported": "tvm" in sys.modules}


def run_child(preset: str, layers: int, tokens: int, env: dict[str, str] | None = None
              ) -> dict[str, float | bool]:
    """`measure` in a fresh Python process (stderr passed through)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--preset", preset,
           "--layers", str(layers), "--tokens", str(tokens)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(measure(a.preset, a.layers, a.tokens)))
        return
    print(f"{a.preset} preset, {a.layers} layers, {a.tokens} tokens, batch 1, no_grad")
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("  note: PYTHONDONTWRITEBYTECODE is set: every module imported during the first "
              "forward is compiled from source (an installed package has its .pyc)")
    run_child(a.preset, a.layers, a.tokens)  # warm-up: fills the kernel cache
    rows = []
    for i in range(a.runs):
        r = run_child(a.preset, a.layers, a.tokens)
        rows.append(r)
        print(f"  run {i + 1}: import glm5 {r['import']:.3f} s  build {r['build']:.3f} s  "
              f"first {r['first']:.3f} s  second {r['second']:.3f} s  "
              f"first-second {r['first'] - r['second']:+.3f} s  (cpu {r['first_cpu']:.3f} / "
              f"{r['second_cpu']:.3f} s)")
    best = min(r["first"] - r["second"] for r in rows)
    print(f"best first-second over {a.runs} runs: {best:+.3f} s")


if __name__ == "__main__":
    main()
