"""Long-context forward: glm5 (default backend) vs transformers eager, same checkpoint, side by
side in one run.

    python bench/long_context.py [--contexts 2048,8192,16384,32768] [--json out.json]

The `small` preset (index_topk 256) with random weights is saved once by transformers and loaded
by both. For each context, after a 512-token warm-up pass (imports, kernel builds or loads:
longer than index_topk, so the sparse path is warmed too), `--repeat` forward passes (batch 1;
the fastest is reported for both, all are kept in the JSON — this VM's timings swing by ~20%
between passes): wall time, peak RSS growth during the passes (measured in a fresh subprocess
per run, so one run's memory does not hide another's), time per token, and glm5's time inside
`sparse_attention` per token (the DSA attention proper, which should stay flat as the context
grows; the indexer is O(L) per token by design) — the least of the passes' sparse_attention
totals (`op_seconds_min`; `op_seconds` is the fastest pass's). transformers is skipped where
its [H, L, L] attention weights would not fit in memory. Logits: after its timed passes,
transformers runs once more with its indexer's top-k ties broken to the smaller index
(docs/ops.md's rule; `tests/hf_oracle.install_deterministic_indexer_topk`) — random weights produce
exact score ties, which torch.topk orders arbitrarily — and glm5's logits are compared with
those, position by position.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from glm5.perf.measure import mem_available

CHILD = r"""
import json, logging, sys, time
import torch
logging.getLogger("glm5").setLevel(logging.ERROR)
which, path, L = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
ids = torch.randint(0, 4096, (1, L))

from glm5.perf.measure import PeakRSS

op_time = {}
if which == "glm5":
    import glm5
    from glm5.backends import selection
    m = glm5.load_model(path).eval()
    orig = selection.call
    def timed(op, values, ops):
        t = time.perf_counter(); r = orig(op, values, ops)
        op_time[op.name] = op_time.get(op.name, 0.0) + time.perf_counter() - t
        return r
    selection.call = timed
    run = lambda: m(ids)
else:
    from transformers import GlmMoeDsaForCausalLM
    m = GlmMoeDsaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    run = lambda: m(ids, use_cache=False).logits
with torch.inference_mode():  # warm-up on 512 tokens (> index_topk: sparse path too)
    warm = ids
    ids = ids[:, :512]
    run()
    ids = warm
runs, per_run_ops = [], []
for i in range(int(sys.argv[4])):
    op_time.clear()
    with torch.inference_mode(), PeakRSS() as pk:
        t = time.perf_counter(); out = run(); runs.append(time.perf_counter() - t)
    per_run_ops.append(dict(op_time))
    peak = pk.peak if i == 0 else max(peak, pk.peak)
best = min(range(len(runs)), key=runs.__getitem__)
if which == "transformers":
    # One more (untimed) pass with the indexer's top-k ties broken to the smaller index, as
    # glm5 does (docs/ops.md), so the logits can be compared: torch.topk leaves tie order open.
    sys.path.insert(0, sys.argv[6])
    from hf_oracle import install_deterministic_indexer_topk
    install_deterministic_indexer_topk()
    with torch.inference_mode():
        out = run()
torch.save(out[0].float(), sys.argv[5])
print(json.dumps({"seconds": runs[best], "runs": runs, "peak_bytes": peak,
                  "op_seconds": per_run_ops[best],
                  "op_seconds_min": {k: min(r.get(k, float("inf")) for r in per_run_ops)
                                     for k in per_run_ops[best]},
                  "logit0": float(out[0, -1, 0])}))
"""

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")


def run_child(which: str, path: str, L: int, timeout: int, repeat: int, logits: str) -> dict:
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, which, path, str(L), str(repeat),
                              logits, TESTS],
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
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed passes per run (after the warm-up); the fastest is reported, "
                         "for glm5 and transformers alike")
    ap.add_argument("--json", default="")
    ap.add_argument("--glm5-only", action="store_true",
                    help="skip transformers (glm5's time and per-token costs only)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from hf_oracle import random_hf_model

    from glm5.core.config import preset

    cfg = preset("small")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        random_hf_model(cfg, 0, std=0.05).save_pretrained(d)
        for L in [int(x) for x in a.contexts.split(",")]:
            g = run_child("glm5", d, L, a.timeout, a.repeat, os.path.join(d, "glm5.pt"))
            # eager attention holds [H, L, L] fp32 weights and scores, plus the indexer's
            # [L, Hi, L]: skip transformers where that cannot fit.
            need = 4 * L * L * (3 * cfg.num_attention_heads + 2 * cfg.index_n_heads)
            if a.glm5_only:
                h = {"error": "skipped (--glm5-only)"}
            elif need > 0.8 * mem_available():
                h = {"error": f"skipped: needs ~{need / 2**30:.0f} GiB"}
            else:
                h = run_child("transformers", d, L, a.timeout, a.repeat, os.path.join(d, "hf.pt"))
            row = {"context": L, "glm5": g, "transformers": h}
            if "seconds" in g and "seconds" in h:
                row["speedup"] = h["seconds"] / g["seconds"]
                row["memory_ratio"] = g["peak_bytes"] / max(h["peak_bytes"], 1)
                row["logits"] = compare_logits(os.path.join(d, "glm5.pt"),
                                               os.path.join(d, "hf.pt"))
            rows.append(row)
            print(fmt_row(row), flush=True)
    print("\n" + table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": "small (index_topk 256)", "repeat": a.repeat, "rows": rows,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=2)


def compare_logits(a_path: str, b_path: str) -> dict:
    """glm5's logits [L, V] against transformers' (deterministic top-k ties): the largest error
    relative to the largest |logit| of the same position, and top-1 agreement."""
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    rel = (a - b).abs().amax(-1) / b.abs().amax(-1)
    return {"max_rel_err": float(rel.max()), "median_rel_err": float(rel.median()),
            "positions_over_1e-3": int((rel > 1e-3).sum()),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


def fmt_row(r: dict) -> str:
    return json.dumps(r)


def table(rows: list[dict]) -> str:
    out = ["| context | glm5 s | glm5 peak MiB | glm5 ms/token | sparse_attention µs/token | "
           "transformers s | transformers peak MiB | speed-up | memory ratio | logits max rel err "
           "(median) | top-1 agree |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g, h, L = r["glm5"], r["transformers"], r["context"]
        if "seconds" in g:
            sa = g.get("op_seconds_min", g["op_seconds"]).get("sparse_attention", 0.0)
            gs = (f"{g['seconds']:.1f} | {g['peak_bytes'] / 2**20:.0f} | "
                  f"{g['seconds'] / L * 1e3:.2f} | {sa / L * 1e6:.1f}")
        else:
            gs = f"{g['error']} | | |"
        hs = (f"{h['seconds']:.1f} | {h['peak_bytes'] / 2**20:.0f}" if "seconds" in h
              else f"{h['error']} |")
        sp = f"{r['speedup']:.1f}x" if "speedup" in r else "-"
        mr = f"{r['memory_ratio']:.2f}" if "memory_ratio" in r else "-"
        lg = r.get("logits")
        lc = (f"{lg['max_rel_err']:.1e} ({lg['median_rel_err']:.1e}) | {lg['top1_agree']:.4f}"
              if lg else "- | -")
        out.append(f"| {L} | {gs} | {hs} | {sp} | {mr} | {lc} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
