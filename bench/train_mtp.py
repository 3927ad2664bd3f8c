"""Train the MTP head of a preset (random weights) on the model's own greedy continuations, save
the checkpoint, then measure MTP speculative decoding with the serving engine.

    python bench/train_mtp.py [--preset small] [--out DIR] [--threads 1] [--seqs 64]
        [--prompt-len 16] [--gen-len 112] [--steps 300] [--max-seconds 150] [--batch 8]
        [--lr 3e-3] [--eval-prompts 8] [--eval-tokens 64] [--eval-concurrency 1,8]
        [--spec 1] [--rounds 2] [--json bench/results/mtp_small.json]

With random weights the MTP layer's drafts are almost never accepted; this trains it:

1. ``--seqs`` random prompts of ``--prompt-len`` tokens are continued greedily for
   ``--gen-len`` tokens by the engine (``ignore_eos``).
2. The main model (frozen) gives its final normed hidden states h once; only ``model.mtp``'s
   parameters train (AdamW, ``--batch`` sequences a step, at most ``--steps`` steps and
   ``--max-seconds``): loss = cross entropy of ``model.mtp_logits(h[:, i], ids[:, i + 1])``
   against ``ids[:, i + 2]``, the token two ahead, over the generated tokens (the prompt's
   random tokens are no continuation of anything).
3. The checkpoint (main model + trained MTP layer) is saved to ``--out`` and loaded back.
4. Two prompt sets of ``--eval-prompts`` prompts run through the engine with
   ``num_speculative_tokens`` = 0 and each of ``--spec``, greedy, in ``--rounds`` interleaved
   rounds, at each of ``--eval-concurrency`` c (closed loop, `bench/serving.py`; the first
   max(4, 2c) prompts of the set): ``held_out`` (fresh random prompts, a different seed: what
   the head learnt) and ``training_prompts`` (the first training prompts, whose continuations
   the head was trained on: how fast the engine goes when drafts are mostly accepted). For
   each: acceptance rate (accepted / drafted), tokens/s and its ratio to no MTP (total tokens /
   total wall time over the rounds), whether every request's tokens are identical with and
   without MTP, and the drafts' top-1 accuracy computed offline on the same continuations (a
   check on the engine's drafting: k = 1 acceptance should come close to it). The untrained
   head's acceptance (the model before step 2) is measured on the held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import (ROOT, closed_loop, make_engine, pages_for, random_prompts,  # noqa: E402
                     set_threads, summarize)


def greedy_continuations(model, prompts: list[list[int]], gen_len: int) -> torch.Tensor:
    """[len(prompts), P + gen_len] int64: each prompt followed by the engine's greedy
    continuation (every prompt the same length P)."""
    from glm5.engine.sampling import SamplingParams

    P = len(prompts[0])
    if any(len(p) != P for p in prompts):
        raise ValueError("bench/train_mtp.py greedy_continuations: prompts expected one length")
    eng = make_engine(model, num_pages=pages_for(len(prompts), P + gen_len, 64))
    sp = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, sp)
    done = {o.request_id: o for o in eng.run_to_completion()}
    return torch.tensor([prompts[i] + done[str(i)].token_ids for i in range(len(prompts))])


@torch.no_grad()
def hidden_states(model, ids: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """The main model's final normed hidden states [S, T, D] (what the MTP layer consumes)."""
    return torch.cat([model.forward_with_hidden(ids[i:i + batch])[1]
                      for i in range(0, len(ids), batch)])


def mtp_loss(model, h: torch.Tensor, ids: torch.Tensor, first_target: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross entropy, top-1 accuracy) of the MTP logits at positions i (hidden h[:, i],
    token ids[:, i + 1]) against ids[:, i + 2], for targets at positions >= first_target.
    h [B, T, D], ids [B, T] int64."""
    T = ids.shape[1]
    if not 2 <= first_target < T:
        raise ValueError(f"bench/train_mtp.py mtp_loss: first_target expected in [2, {T}), got "
                         f"{first_target}")
    logits = model.mtp_logits(h[:, :T - 2], ids[:, 1:T - 1])[:, first_target - 2:]
    target = ids[:, first_target:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
    acc = (logits.argmax(-1) == target).float().mean()
    return loss, acc


def train_mtp(model, ids: torch.Tensor, first_target: int, steps: int, batch: int, lr: float,
              max_seconds: float, seed: int, log_every: int = 10) -> dict[str, Any]:
    """Train ``model.mtp`` only (everything else frozen) on ``ids`` [S, T]; the loss curve."""
    if model.mtp is None:
        raise ValueError("bench/train_mtp.py: the model has no MTP layer "
                         "(num_nextn_predict_layers = 0)")
    h = hidden_states(model.eval(), ids)
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    curve, t0, cpu0, done = [], time.perf_counter(), time.process_time(), 0
    for step in range(steps):
        sel = torch.randperm(len(ids), generator=g)[:batch]
        loss, acc = mtp_loss(model, h[sel], ids[sel], first_target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done = step + 1
        if step % log_every == 0 or step + 1 == steps:
            lv, av = float(loss.detach()), float(acc)
            curve.append({"step": step, "loss": lv, "accuracy": av})
            print(f"  step {step}: loss {lv:.3f}, draft accuracy {av:.3f}", flush=True)
        if time.perf_counter() - t0 > max_seconds:
            break
    for p in params:
        p.requires_grad_(False)
    with torch.no_grad():
        loss, acc = mtp_loss(model, h, ids, first_target)
    return {"steps": done, "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - cpu0, "curve": curve,
            "final_loss_all": float(loss), "final_accuracy_all": float(acc)}


def measure_spec(model, prompts: list[list[int]], concurrency: int, max_tokens: int,
                 spec: list[int], rounds: int) -> dict[str, Any]:
    """Engine runs with num_speculative_tokens 0 and each of ``spec``, interleaved over
    ``rounds``: throughput per round, totals, acceptance, identical outputs."""
    runs: dict[int, list[dict]] = {k: [] for k in [0, *spec]}
    tokens: dict[int, list[list[int]]] = {}
    longest = max(len(p) for p in prompts) + max_tokens
    for _ in range(rounds):
        for k in runs:
            eng = make_engine(model, num_speculative_tokens=k,
                              num_pages=pages_for(concurrency, longest + 2 * k, 64))
            traces, wall, cpu = closed_loop(eng, prompts, concurrency, len(prompts), max_tokens,
                                            tag=f"k{k}-")
            row = summarize(traces, wall, cpu)
            row.update(drafted=eng.stats.drafted, accepted=eng.stats.accepted,
                       steps=eng.stats.steps)
            runs[k].append(row)
            out = [t.token_ids for t in traces]
            if k not in tokens:
                tokens[k] = out
            elif tokens[k] != out:
                raise RuntimeError(f"bench/train_mtp.py: greedy outputs with "
                                   f"num_speculative_tokens={k} changed between rounds")
    res: dict[str, Any] = {"concurrency": concurrency, "requests": len(prompts),
                           "max_tokens": max_tokens, "rounds": rounds, "by_k": {}}
    # The drafts' top-1 accuracy offline on these continuations (targets from the second
    # generated token on: the first draft follows the prefill): what k = 1 acceptance should
    # come close to, a check on the engine's drafting.
    P = len(prompts[0])
    if all(len(p) == P for p in prompts) and max_tokens >= 2:
        ids = torch.tensor([list(p) + t for p, t in zip(prompts, tokens[0])])
        with torch.no_grad():
            res["offline_draft_accuracy"] = float(mtp_loss(model, hidden_states(model, ids), ids,
                                                           P + 1)[1])

    def total(k: int) -> float:
        return sum(r["tokens"] for r in runs[k]) / sum(r["wall_s"] for r in runs[k])

    for k, rows in runs.items():
        drafted = sum(r["drafted"] for r in rows)
        res["by_k"][k] = {
            "throughput": total(k), "throughput_rounds": [r["throughput"] for r in rows],
            "itl_mean_ms": sum(r["itl_mean_ms"] for r in rows) / len(rows),
            "steps": rows[0]["steps"],
            "acceptance": (sum(r["accepted"] for r in rows) / drafted) if drafted else None,
            "speedup": total(k) / total(0), "identical_to_k0": tokens[k] == tokens[0]}
    return res


def acceptance(model, prompts: list[list[int]], max_tokens: int, k: int = 1) -> float:
    """accepted / drafted MTP tokens of one engine run (greedy, every prompt at once)."""
    eng = make_engine(model, num_speculative_tokens=k,
                      num_pages=pages_for(len(prompts), max(map(len, prompts)) + max_tokens
                                          + 2 * k, 64))
    closed_loop(eng, prompts, len(prompts), len(prompts), max_tokens, tag="acc")
    return eng.stats.accepted / max(eng.stats.drafted, 1)


def _ints(s: str, name: str, lo: int) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        v = []
    if not v or any(x < lo for x in v):
        raise SystemExit(f"bench/train_mtp.py: {name} expected comma-separated ints >= {lo}, "
                         f"got {s!r}")
    return v


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None,
                    help="checkpoint directory (default: a temporary one, removed at the end)")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=112)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--max-seconds", type=float, default=150.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--eval-concurrency", default="1,8")
    ap.add_argument("--spec", default="1", help="num_speculative_tokens values to measure")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None,
                    help="result file (default bench/results/mtp_<preset>.json)")
    a = ap.parse_args(argv)
    for k in ("seqs", "prompt_len", "gen_len", "steps", "batch", "eval_prompts",
              "eval_tokens", "rounds"):
        if getattr(a, k) < 1:
            raise SystemExit(f"bench/train_mtp.py: --{k.replace('_', '-')} expected >= 1, got "
                             f"{getattr(a, k)}")
    if a.gen_len < 3 or not (a.lr > 0 and math.isfinite(a.lr)):
        raise SystemExit("bench/train_mtp.py: --gen-len expected >= 3 and --lr a finite "
                         "number > 0")
    conc = _ints(a.eval_concurrency, "--eval-concurrency", 1)
    spec = _ints(a.spec, "--spec", 1)
    set_threads(a.threads)
    logging.getLogger("glm5").setLevel(logging.ERROR)
    import glm5
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    cfg = preset(a.preset)
    torch.manual_seed(a.seed)
    model = GLM5ForCausalLM(cfg).eval()
    V = cfg.vocab_size
    res: dict[str, Any] = {"preset": a.preset, "seed": a.seed, "threads": torch.get_num_threads(),
                           "dtype": str(model.dtype).replace("torch.", ""), "argv": argv if argv is not None else sys.argv[1:]}
    t_all = time.perf_counter()
    if a.eval_tokens > a.gen_len:
        raise SystemExit(f"bench/train_mtp.py: --eval-tokens expected <= --gen-len "
                         f"({a.gen_len}: the training prompts are evaluated too), got "
                         f"{a.eval_tokens}")
    train_prompts = random_prompts(a.seqs, a.prompt_len, a.prompt_len, V, a.seed)
    sets = {"held_out": random_prompts(a.eval_prompts, a.prompt_len, a.prompt_len, V,
                                       a.seed + 1000),
            "training_prompts": train_prompts[:a.eval_prompts]}
    res["acceptance_untrained"] = acceptance(model, sets["held_out"], a.eval_tokens)
    print(f"untrained MTP head: acceptance {res['acceptance_untrained']:.3f}", flush=True)
    t = time.perf_counter()
    ids = greedy_continuations(model, train_prompts, a.gen_len)
    res["data"] = {"sequences": a.seqs, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                   "seconds": time.perf_counter() - t}
    print(f"data: {a.seqs} x {a.prompt_len}+{a.gen_len} tokens in "
          f"{res['data']['seconds']:.0f} s", flush=True)
    res["train"] = train_mtp(model, ids, a.prompt_len, a.steps, a.batch, a.lr, a.max_seconds,
                             a.seed)
    res["train"].update(batch=a.batch, lr=a.lr)
    tmp = None
    out = a.out
    if out is None:
        tmp = tempfile.TemporaryDirectory()
        out = tmp.name
    model.save_pretrained(out, overwrite=True)
    res["checkpoint"] = a.out
    trained = glm5.load_model(out).eval()  # what was saved is what is measured
    res["eval"] = {name: [measure_spec(trained, p[:max(4, 2 * c)], c, a.eval_tokens, spec,
                                       a.rounds) for c in conc] for name, p in sets.items()}
    if tmp is not None:
        tmp.cleanup()
    res["seconds"] = time.perf_counter() - t_all
    print(report(res))
    path = Path(a.json) if a.json else ROOT / "bench" / "results" / f"mtp_{a.preset}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")
    return res


def report(res: dict[str, Any]) -> str:
    tr = res["train"]
    lines = [f"MTP head trained {tr['steps']} steps ({tr['seconds']:.0f} s): loss "
             f"{tr['curve'][0]['loss']:.2f} -> {tr['final_loss_all']:.2f}, draft accuracy on the "
             f"training continuations {tr['final_accuracy_all']:.3f}; untrained acceptance "
             f"{res['acceptance_untrained']:.3f}",
             "", "| prompts | concurrency | requests | num_speculative_tokens | acceptance | "
             "offline draft accuracy | tokens/s | speed-up | mean ITL ms | identical to no MTP |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, evals in res["eval"].items():
        for e in evals:
            for k, r in e["by_k"].items():
                acc = "—" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
                off = e.get("offline_draft_accuracy")
                lines.append(f"| {name} | {e['concurrency']} | {e['requests']} | {k} | {acc} | "
                             f"{'—' if off is None or not int(k) else f'{off:.3f}'} | "
                             f"{r['throughput']:.1f} | {r['speedup']:.2f}x | "
                             f"{r['itl_mean_ms']:.1f} | "
                             f"{'yes' if r['identical_to_k0'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
