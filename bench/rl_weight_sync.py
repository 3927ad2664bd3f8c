"""Weight sync cost: bytes of a delta update vs the full state, and publish / apply time, after
one AdamW step (glm5/rl/weight_sync.py).

    python bench/rl_weight_sync.py [--preset tiny] [--lr 1e-4] [--runs 3]

For each of two cases — nothing frozen, and the DSA indexer + token embeddings frozen — and
each delta mode (xor, sub) it reports how many state_dict tensors the update carries, its
payload bytes against the full state's, the zlib level-1 size of its wire bytes (`to_bytes`),
and the best-of-``--runs`` time of `publish` and of `apply` into a fresh copy (CPU, float32;
apply includes checking every checksum). The result is checked bit-exact each run.
"""

from __future__ import annotations

import argparse
import copy
import time
import zlib

import glm5  # noqa: F401,I001  (before torch: it sets OMP_WAIT_POLICY for torch's pool)

import torch

from glm5.core.config import PRESETS, preset
from glm5.core.model import GLM5ForCausalLM
from glm5.rl.weight_sync import WeightPublisher, WeightReceiver, weights_equal


def one_step(model: GLM5ForCausalLM, lr: float, seed: int) -> None:
    """One AdamW step of next-token loss on random ids, on the parameters that require grad."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    ids = torch.randint(0, V, (2, 16), generator=g)
    loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].reshape(-1, V),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()


def measure(base: GLM5ForCausalLM, frozen: bool, mode: str, lr: float, runs: int) -> dict:
    best_pub = best_apply = float("inf")
    for r in range(runs):
        trainer = copy.deepcopy(base)
        if frozen:
            for n, p in trainer.named_parameters():
                p.requires_grad_(not (".indexer." in n or "embed_tokens" in n))
        pub = WeightPublisher(trainer, mode=mode)
        one_step(trainer, lr, seed=r)
        t0 = time.perf_counter()
        u = pub.publish()
        best_pub = min(best_pub, time.perf_counter() - t0)
        engine = copy.deepcopy(base)
        rec = WeightReceiver(engine)
        t0 = time.perf_counter()
        rec.apply(u)
        best_apply = min(best_apply, time.perf_counter() - t0)
        if not weights_equal(trainer, engine):
            raise SystemExit("bench/rl_weight_sync.py: the engine's weights differ after apply")
    full = pub.full_update()
    wire = u.to_bytes()
    return {"tensors": len(u.tensors), "of": len(full.tensors),
            "sub": sum(k == "sub" for k in u.modes.values()), "bytes": u.nbytes,
            "full_bytes": full.nbytes, "zlib": len(zlib.compress(wire, 1)) / len(wire),
            "publish_ms": 1e3 * best_pub, "apply_ms": 1e3 * best_apply}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    if a.runs < 1:
        ap.error("--runs expected an int >= 1")
    torch.manual_seed(0)
    base = GLM5ForCausalLM(preset(a.preset), with_mtp=False).float()
    print(f"preset {a.preset}, 1 AdamW step (lr {a.lr:g}), float32, best of {a.runs}")
    print("| frozen | mode | tensors sent | update MB | full MB | update / full | zlib-1 of wire "
          "| publish ms | apply ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for frozen in (False, True):
        for mode in ("xor", "sub"):
            m = measure(base, frozen, mode, a.lr, a.runs)
            sent = f"{m['tensors']}/{m['of']}" + (f" ({m['sub']} as sub)" if mode == "sub" else "")
            print(f"| {'indexer + embeddings' if frozen else 'nothing'} | {mode} | {sent} | "
                  f"{m['bytes'] / 1e6:.3f} | {m['full_bytes'] / 1e6:.3f} | "
                  f"{m['bytes'] / m['full_bytes']:.1%} | {m['zlib']:.0%} | "
                  f"{m['publish_ms']:.1f} | {m['apply_ms']:.1f} |")


if __name__ == "__main__":
    main()
