"""Host reads (synchronisations) per engine decode step, by mode, counted with
glm5.testing.syncs on the ``tiny`` model (3 layers).

    python bench/decode_syncs.py [--checks]

On a CUDA machine the model runs there on the default kernels (the cuda backend) and the reads
are the device's. Elsewhere the Triton kernel library runs on CPU tensors through the
interpreter (TRITON_INTERPRET=1 is set here) as a test backend, glm5's CPU backends off, and
value checks behave as on a device (`checks_as_on_device`); the count is what a GPU would do.
``--checks`` counts with the value checks on, as they run on CPU tensors and, on a device, under
GLM5_STRICT=1 (strict mode itself is not set: it would also refuse the reference fallbacks this
run makes for layer_norm and moe_route).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from collections import Counter

import torch


def _emulated_backend() -> str:
    """Register the Triton library as a CPU test backend (glm5's accelerated backends off)."""
    import glm5
    from glm5.backends import vendor
    from glm5.backends.api import Backend
    from glm5.backends.cuda import TUNING
    from glm5.backends.registry import get_registry

    policy = os.path.join(tempfile.mkdtemp(), "plugins.toml")
    with open(policy, "w") as f:
        f.write('[plugins]\ndisabled = ["cpu", "cuda", "ascend", "cambricon", "mthreads", '
                '"hygon"]\n')
    os.environ["GLM5_PLUGINS"] = policy
    glm5.reset_registry()
    b = Backend("triton_on_cpu", vendor="bench", device_type="cpu", priority=100,
                settings={"tuning_table": str(TUNING)})
    vendor.register_rows(b, vendor.triton_rows(b))
    get_registry().register(b)
    return b.name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checks", action="store_true",
                    help="value checks on (as on CPU tensors or under GLM5_STRICT=1)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    torch.set_num_threads(1)
    logging.getLogger("glm5").setLevel(logging.ERROR)
    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.engine.sampling import SamplingParams
    from glm5.testing.syncs import count_host_reads

    backend = None if cuda else _emulated_backend()
    warm = None if cuda else "reference"  # prefill on the fast path; the interpreter is slow
    torch.manual_seed(0)
    model = GLM5ForCausalLM(preset("tiny")).float().eval().to("cuda" if cuda else "cpu")
    modes = [("batch 1, dense path", [3], None, 0), ("batch 4, sparse path", [9, 12, 5, 17],
                                                      None, 0),
             ("batch 4, logprobs=0", [9, 12, 5, 17], 0, 0),
             ("batch 4, logprobs=3", [9, 12, 5, 17], 3, 0),
             ("batch 4, MTP k=1", [9, 12, 5, 17], None, 1),
             ("batch 4, MTP k=2", [9, 12, 5, 17], None, 2)]
    print(f"{'mode':24s} {'reads/step':>10s}  where")
    for label, lens, logprobs, k in modes:
        eng = LLMEngine(model, EngineConfig(page_size=4, num_pages=64, chunk_size=32,
                                            max_num_batched_tokens=64, cuda_graphs=False,
                                            num_speculative_tokens=k))
        for i, n in enumerate(lens):
            eng.add_request(f"r{i}", list(range(3 + 25 * i, 3 + 25 * i + n)),
                            SamplingParams(max_tokens=12, temperature=0.0 if i % 2 == 0 else 0.8,
                                           seed=i, ignore_eos=True, logprobs=logprobs))
        eng.backend = warm
        eng.step()  # prefill
        eng.step()  # first decode step
        eng.backend = backend
        counts, where = [], Counter()
        for _ in range(2):
            with count_host_reads(as_on_device=not a.checks) as reads:
                eng.step()
            counts.append(reads.count)
            where.update(r.where.split(" in ")[-1] for r in reads.reads)
        shown = ", ".join(f"{w} x{n}" for w, n in where.most_common())
        print(f"{label:24s} {'/'.join(map(str, counts)):>10s}  {shown}")


if __name__ == "__main__":
    main()
