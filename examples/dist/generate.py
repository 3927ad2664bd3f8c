"""Greedy generation with a GLM-5 model split across processes (glm5.parallel), checked against the
single-process model.

    glm5 launch --nproc 2 examples/dist/generate.py --preset tiny --tp 2 [--flashcomm [--int8]]
    glm5 launch --nproc 2 examples/dist/generate.py --preset tiny --ep 2 [--dp-attention]
    glm5 launch --nproc 2 examples/dist/generate.py --model DIR --tp 2      # sharded loading
    torchrun --nproc-per-node 2 examples/dist/generate.py --preset tiny --tp 2   # the same

Every rank joins the world (`glm5.parallel.init_distributed`: torchrun's variables), takes its
groups (`ParallelConfig.from_context`), and gets its part of the model: with ``--model DIR``
`glm5.parallel.loading.load_parallel` reads only its slice of the checkpoint; with ``--preset``
every rank builds the whole preset from ``--seed`` (the same weights everywhere) and cuts it
(`glm5.parallel.layouts.parallelize`). Then greedy decoding of ``--new-tokens`` tokens from a
fixed prompt (``--batch`` sequences of ``--prompt-len`` random token ids, ``--prompt-seed``).
With ``--dp-attention`` each rank decodes its own ``batch / world`` sequences.

Rank 0 prints the tokens, then builds (or loads) the single-process model, when it fits in
memory, and checks: the greedy tokens equal and the prompt's logits agree within fp32
rounding; with ``--int8`` (FlashComm's all-gather in int8) the logits within the int8 budget
(tokens may then legitimately differ; how many agree is printed). Exit status 1 on a
mismatch, 2 on bad arguments.

Everything runs in float32 on each rank's device (``ctx.device``: CPU with gloo here).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

PROG = "examples/dist/generate.py"
# fp32: only the order of the partial sums differs from the single process
FP32_LOGIT_TOL = 2e-5  # x max(max |logit|, 1), as tests/test_dist_parallel.py
# max |logit error| / max |logit| allowed with int8 FlashComm gathers: the budget
# tests/test_dist_parallel.py holds them to (0.087 measured on tiny at 2 ranks)
INT8_LOGIT_BUDGET = 0.15


class UsageError(ValueError):
    """Arguments that cannot work (exit status 2)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help="build this preset from --seed (tiny)")
    src.add_argument("--model", default=None, metavar="DIR",
                     help="load this checkpoint sharded (load_parallel)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (1)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size with tp 1 (1)")
    ap.add_argument("--dp-attention", action="store_true",
                    help="with --ep: each rank runs attention on its own sequences")
    ap.add_argument("--flashcomm", action="store_true",
                    help="with --tp: reduce-scatter / all-gather instead of all-reduce")
    ap.add_argument("--flashcomm-min-tokens", type=int, default=0,
                    help="FlashComm from this many tokens per forward on (0: every forward, so "
                         "that decode steps use it too; `glm5 plan` gives a chip's threshold)")
    ap.add_argument("--int8", action="store_true",
                    help="with --flashcomm: int8 all-gather (per-token scales)")
    ap.add_argument("--seed", type=int, default=0, help="weights of --preset (0)")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences (default: the world size)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--prompt-seed", type=int, default=1)
    ap.add_argument("--no-check", action="store_true",
                    help="skip the single-process comparison")
    return ap.parse_args(argv)


def check_args(a: argparse.Namespace, world_size: int) -> None:
    """Raise UsageError naming the option when the arguments cannot work for ``world_size``."""
    from glm5.core.config import PRESETS

    if a.preset is None and a.model is None:
        a.preset = "tiny"
    if a.preset is not None and a.preset not in PRESETS:
        raise UsageError(f"--preset expected one of {', '.join(PRESETS)}, got {a.preset!r}")
    for name in ("tp", "ep", "prompt_len", "new_tokens"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} expected a positive integer, got "
                             f"{getattr(a, name)}")
    if a.flashcomm_min_tokens < 0:
        raise UsageError(f"--flashcomm-min-tokens expected >= 0, got {a.flashcomm_min_tokens}")
    if a.tp > 1 and a.ep > 1:
        raise UsageError("--tp and --ep expected one at a time (with --tp the experts are "
                         "split over the TP group)")
    for name in ("tp", "ep"):
        v = getattr(a, name)
        if world_size % v:
            hint = (" (launch it with `glm5 launch --nproc N` or `torchrun --nproc-per-node "
                    "N`)" if world_size == 1 else "")
            raise UsageError(f"--{name} expected a divisor of the world size {world_size}, got "
                             f"{v}{hint}")
    if a.dp_attention and a.ep == 1:
        raise UsageError("--dp-attention expected with --ep > 1")
    if a.flashcomm and a.tp == 1:
        raise UsageError("--flashcomm expected with --tp > 1")
    if a.int8 and not a.flashcomm:
        raise UsageError("--int8 expected with --flashcomm (it quantizes FlashComm's "
                         "all-gather)")
    if a.batch is None:
        a.batch = world_size
    if a.batch < 1:
        raise UsageError(f"--batch expected a positive integer, got {a.batch}")
    if a.dp_attention and a.batch % world_size:
        raise UsageError(f"--batch expected a multiple of the world size {world_size} with "
                         f"--dp-attention (each rank decodes batch / world sequences), got "
                         f"{a.batch}")


# ---------------------------------------------------------------------------- the recipe
def preset_model(name: str, seed: int) -> torch.nn.Module:
    """The preset ``name`` in float32 with weights from ``seed`` (the same on every rank)."""
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM

    torch.manual_seed(seed)
    return GLM5ForCausalLM(preset(name)).eval()


def prompt(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """The fixed prompt: [batch, length] int64 token ids drawn from ``seed``."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def whole_model_bytes(cfg: Any) -> int:
    """Bytes of the whole model (with one MTP block) in float32."""
    from glm5.deploy.info import count_params

    p = count_params(cfg)
    return 4 * (p["total_params"] + p["mtp_params"])


def fits(nbytes: int, copies: int = 1) -> tuple[bool, str]:
    """Whether ``copies`` models of ``nbytes`` fit in this machine's available memory (with a
    quarter spare for activations)."""
    from glm5.perf.measure import mem_available

    avail = mem_available()
    if avail and copies * nbytes > 0.75 * avail:
        return False, (f"{copies} x {nbytes / 1e9:.2f} GB needed, {avail / 1e9:.2f} GB "
                       f"available")
    return True, ""


def compare(tokens: torch.Tensor, ref_tokens: torch.Tensor, logits: torch.Tensor,
            ref_logits: torch.Tensor, int8: bool) -> tuple[bool, str]:
    """(ok, one-line verdict) of the parallel run's greedy ``tokens`` [B, T + n] and prompt
    ``logits`` [B, T, V] against the single process's. fp32 communication: tokens equal and
    max |logit error| <= FP32_LOGIT_TOL x max(max |logit|, 1). int8: max |logit error| /
    max |logit| <= INT8_LOGIT_BUDGET (tokens are reported, not required to agree)."""
    if tokens.shape != ref_tokens.shape or logits.shape != ref_logits.shape:
        return False, (f"shapes differ: tokens {list(tokens.shape)} vs "
                       f"{list(ref_tokens.shape)}, logits {list(logits.shape)} vs "
                       f"{list(ref_logits.shape)}")
    err = float((logits - ref_logits).abs().max())
    scale = float(ref_logits.abs().max())
    same = int((tokens == ref_tokens).all(1).sum())
    what = (f"{same}/{tokens.shape[0]} sequences' tokens equal, max |logit error| {err:.3g} "
            f"(max |logit| {scale:.3g}, relative {err / max(scale, 1e-30):.3g})")
    if int8:
        ok = err <= INT8_LOGIT_BUDGET * scale
        return ok, f"{what}; int8 budget {INT8_LOGIT_BUDGET}: {'within' if ok else 'EXCEEDED'}"
    ok = same == tokens.shape[0] and err <= FP32_LOGIT_TOL * max(scale, 1.0)
    return ok, what


# ---------------------------------------------------------------------------- the run
def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import glm5.parallel as gd

    ctx = gd.init_distributed()
    try:
        try:
            check_args(a, ctx.world_size)
        except UsageError as e:
            if ctx.rank == 0:
                print(f"{PROG}: {e}", file=sys.stderr)
            return 2
        try:
            return run(a, ctx)
        except UsageError as e:
            if ctx.rank == 0:
                print(f"{PROG}: {e}", file=sys.stderr)
            return 2
    finally:
        gd.destroy()


def run(a: argparse.Namespace, ctx: Any) -> int:
    """The parallel generation and (rank 0) the check; the exit status."""
    import glm5.parallel as gd
    from glm5.parallel.layouts import ParallelConfig, parallelize

    say = print if ctx.rank == 0 else (lambda *x, **k: None)
    cfg = ParallelConfig.from_context(ctx, tp=a.tp, ep=a.ep, dp_attention=a.dp_attention,
                                      flashcomm=a.flashcomm,
                                      flashcomm_min_tokens=a.flashcomm_min_tokens,
                                      comm_quant="int8" if a.int8 else None)
    t0 = time.perf_counter()
    if a.model is not None:
        from glm5.parallel.loading import load_parallel

        model = load_parallel(a.model, cfg, dtype=torch.float32, device=ctx.device).eval()
        source = (f"{a.model}: read {model.load_stats['bytes_read'] / 1e6:.2f} of "
                  f"{model.load_stats['checkpoint_bytes'] / 1e6:.2f} MB on rank 0")
    else:
        from glm5.core.config import preset

        ok, why = fits(whole_model_bytes(preset(a.preset)),
                       int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)))
        # every rank takes the same decision (free memory differs a little between ranks)
        ok = bool(gd.all_reduce(torch.tensor([int(not ok)]), ctx.world).item() == 0)
        if not ok:
            raise UsageError(f"--preset {a.preset}: every rank builds the whole model before "
                             f"cutting it and that does not fit ({why or 'on another rank'}); "
                             f"save a checkpoint and use --model DIR (each rank then reads only "
                             f"its slice)")
        model = parallelize(preset_model(a.preset, a.seed).to(ctx.device), cfg)
        source = f"preset {a.preset}, seed {a.seed}"
    mode = (f"tp {a.tp}" + (" + FlashComm" if a.flashcomm else "") + (" int8" if a.int8 else "")
            if a.tp > 1 else f"ep {a.ep}" + (" + DP attention" if a.dp_attention else "")
            if a.ep > 1 else "one rank")
    say(f"world {ctx.world_size} ({ctx.backend or 'no process group'}), {mode}; {source}; "
        f"model ready in {time.perf_counter() - t0:.2f} s", flush=True)

    ids = prompt(model.config.vocab_size, a.batch, a.prompt_len, a.prompt_seed)
    rows = slice(None)
    if a.dp_attention:  # each rank its own sequences
        per = a.batch // ctx.world_size
        rows = slice(ctx.rank * per, (ctx.rank + 1) * per)
    mine = ids[rows].to(ctx.device)
    with torch.no_grad():
        logits = model(mine)
        t0 = time.perf_counter()
        out = model.generate(mine, a.new_tokens)
        dt = time.perf_counter() - t0
    if a.dp_attention:  # rank 0 prints (and checks) every rank's sequences
        out = gd.all_gather(out, ctx.world)
        logits = gd.all_gather(logits, ctx.world)
    out, logits = out.cpu(), logits.cpu()
    del model
    if ctx.rank != 0:
        return 0
    for b in range(a.batch):
        print(f"sequence {b}: prompt {ids[b].tolist()} -> {out[b, a.prompt_len:].tolist()}")
    print(f"generated {a.new_tokens} tokens x {a.batch} sequences in {dt:.2f} s", flush=True)
    if a.no_check:
        return 0
    from glm5.core.config import GLM5Config, preset

    whole = (GLM5Config.from_pretrained(a.model) if a.model is not None else preset(a.preset))
    ok, why = fits(whole_model_bytes(whole))
    if not ok:
        print(f"check skipped: the single-process model does not fit here ({why})")
        return 0
    if a.model is not None:
        from glm5.core.checkpoint import load_model

        ref = load_model(a.model, dtype=torch.float32).eval()
    else:
        ref = preset_model(a.preset, a.seed)
    with torch.no_grad():
        ref_logits = ref(ids)
        ref_out = ref.generate(ids, a.new_tokens)
    ok, why = compare(out, ref_out, logits, ref_logits, a.int8)
    print(f"check against the single-process model: {'OK' if ok else 'MISMATCH'}: {why}")
    if not ok:
        for b in range(a.batch):
            print(f"  single process, sequence {b}: {ref_out[b, a.prompt_len:].tolist()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
