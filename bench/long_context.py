"""Long-context forward: glm5 (default backend) vs transformers eager, same checkpoint, side by
side in one run.

    python bench/long_context.py [--contexts 2048,8192,16384,32768] [--json out.json]

The `small` preset (index_topk 256) with random weights is saved once by transformers and loaded
by both. For each context, after a 256-token warm-up pass (imports, kernel loading), one forward
pass (batch 1): wall time, peak RSS growth during the pass
(measured in a fresh subprocess per run, so one run's memory does not hide another's), time per
token, and glm5's time inside `sparse_attention` per token (the DSA attention proper, which
should stay flat as the context grows; the indexer is O(L) per token by design). transformers is
skipped where its [H, L, L] attention weights would not fit in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from glm5.testing.measure import mem_available

CHILD = r"""
import json, logging, sys, time
import torch
logging.getLogger("glm5").setLevel(logging.ERROR)
which, path, L = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
ids = torch.randint(0, 4096, (1, L))

from glm5.testing.measure import PeakRSS

op_time = {}
if which == "glm5":
    import glm5
    from glm5.backends import selection
    m = glm5.load_model(path).eval()
    orig = selection.call
    def timed(op, values):
        t = time.perf_counter(); r = orig(op, values)
        op_time[op.name] = op_time.get(op.name, 0.0) + time.perf_counter() - t
        return r
    selection.call = timed
    run = lambda: m(ids)
else:
    from transformers import GlmMoeDsaForCausalLM
    m = GlmMoeDsaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    run = lambda: m(ids, use_cache=False).logits
with torch.inference_mode():  # warm-up on 256 tokens: imports, kernel loads, allocator
    warm = ids
    ids = ids[:, :256]
    run()
    ids = warm
op_time.clear()
with torch.inference_mode(), PeakRSS() as pk:
    t = time.perf_counter(); out = run(); dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "peak_bytes": pk.peak, "op_seconds": op_time,
                  "logit0": float(out[0, -1, 0])}))
"""


def run_child(which: str, path: str, L: int, timeout: int) -> dict:
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, which, path, str(L)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout}s"}
    if out.returncode != 0:
        tail = (out.stderr or "").strip().splitlines()[-1:] or ["?"]
        return {"error": f"exit {out.returncode}: {tail[0][:200]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="2048,8192,16384,32768")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from hf_oracle import random_hf_model

    from glm5.core.config import preset

    cfg = preset("small")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        random_hf_model(cfg, 0, std=0.05).save_pretrained(d)
        for L in [int(x) for x in a.contexts.split(",")]:
            g = run_child("glm5", d, L, a.timeout)
            # eager attention holds [H, L, L] fp32 weights and scores, plus the indexer's
            # [L, Hi, L]: skip transformers where that cannot fit.
            need = 4 * L * L * (3 * cfg.num_attention_heads + 2 * cfg.index_n_heads)
            if need > 0.8 * mem_available():
                h = {"error": f"skipped: needs ~{need / 2**30:.0f} GiB"}
            else:
                h = run_child("transformers", d, L, a.timeout)
            row = {"context": L, "glm5": g, "transformers": h}
            if "seconds" in g and "seconds" in h:
                row["speedup"] = h["seconds"] / g["seconds"]
                row["memory_ratio"] = g["peak_bytes"] / max(h["peak_bytes"], 1)
            rows.append(row)
            print(fmt_row(row), flush=True)
    print("\n" + table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": "small (index_topk 256)", "rows": rows,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=2)


def fmt_row(r: dict) -> str:
    return json.dumps(r)


def table(rows: list[dict]) -> str:
    out = ["| context | glm5 s | glm5 peak MiB | glm5 ms/token | sparse_attention µs/token | "
           "transformers s | transformers peak MiB | speed-up | memory ratio |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, h, L = r["glm5"], r["transformers"], r["context"]
        if "seconds" in g:
            sa = g["op_seconds"].get("sparse_attention", 0.0)
            gs = (f"{g['seconds']:.1f} | {g['peak_bytes'] / 2**20:.0f} | "
                  f"{g['seconds'] / L * 1e3:.2f} | {sa / L * 1e6:.1f}")
        else:
            gs = f"{g['error']} | | |"
        hs = (f"{h['seconds']:.1f} | {h['peak_bytes'] / 2**20:.0f}" if "seconds" in h
              else f"{h['error']} |")
        sp = f"{r['speedup']:.1f}x" if "speedup" in r else "-"
        mr = f"{r['memory_ratio']:.2f}" if "memory_ratio" in r else "-"
        out.append(f"| {L} | {gs} | {hs} | {sp} | {mr} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
