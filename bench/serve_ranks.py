"""Tokens/s of `glm5 serve` on one process against the same checkpoint served across ranks
(``--tp 2``, ``--ep 2 --dp-attention``, ...), through the OpenAI API, side by side in one run.

    python bench/serve_ranks.py [--preset small] [--concurrency 8] [--max-tokens 32]
        [--layouts "1" "--tp 2" "--ep 2 --dp-attention"] [--json out.json]

Each layout: the command is started as a user starts it (`python -m glm5.cli serve DIR ...
--port 0`, torchrun underneath for more than one rank), ``--warmup`` requests are sent, then
``--requests`` requests (random token-id prompts of ``--prompt-len``, greedy, ``ignore_eos``,
``--max-tokens`` each) at ``--concurrency`` at a time; generated tokens / wall seconds is the
rate. The server is then stopped (SIGTERM) before the next layout starts, so layouts never
share the machine's cores. The report says the machine's core count: on CPU the ranks share
those cores, so the numbers say what the ranks' communication and lockstep cost, not what more
devices would give.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import tempfile
import time

import httpx
import torch

from glm5.testing.serve_process import ServeProcess


def _checkpoint(preset: str, root: str) -> str:
    from glm5.core.config import preset as get_preset
    from glm5.core.model import GLM5ForCausalLM

    path = os.path.join(root, preset)
    torch.manual_seed(0)
    GLM5ForCausalLM(get_preset(preset).replace(num_nextn_predict_layers=0)).eval() \
        .save_pretrained(path)
    return path


async def _load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int
                ) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(client: httpx.AsyncClient, p: list[int]) -> None:
        nonlocal tokens
        async with sem:
            r = await client.post(url + "/v1/completions", json={
                "model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}, timeout=600)
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*[one(c, p) for p in prompts])
        return tokens, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, help="a checkpoint directory instead of --preset")
    ap.add_argument("--layouts", nargs="+", default=["1", "--tp 2", "--ep 2 --dp-attention"],
                    help="'1' (one process) or glm5 serve options")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default=None, help="write the report here too")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="glm5-bench-ranks-") as tmp:
        model_dir = a.model or _checkpoint(a.preset, tmp)
        from glm5.core.config import GLM5Config

        V = GLM5Config.from_pretrained(model_dir).vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, V, (a.requests + a.warmup, a.prompt_len), generator=g).tolist()
        engine = ["--served-model-name", "m", "--num-pages", "256"]
        rows = []
        for lay in a.layouts:
            extra = [] if lay.strip() == "1" else shlex.split(lay)
            srv = ServeProcess([model_dir, *engine, *extra], start_timeout=600)
            try:
                asyncio.run(_load(srv.url, prompts[:a.warmup], a.max_tokens, a.concurrency))
                n, s = asyncio.run(_load(srv.url, prompts[a.warmup:], a.max_tokens,
                                         a.concurrency))
            finally:
                rc = srv.stop()
            rows.append({"layout": lay if extra else "one process", "tokens": n,
                         "seconds": round(s, 3), "tokens_per_s": round(n / s, 2),
                         "exit_status": rc})
            print(f"{rows[-1]['layout']:>28}: {n} tokens in {s:.2f} s = {n / s:.1f} tok/s",
                  flush=True)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_first"] = round(r["tokens_per_s"] / base, 3)
    report = {"preset": a.model or a.preset, "cpu_cores": os.cpu_count(),
              "concurrency": a.concurrency, "requests": a.requests,
              "prompt_len": a.prompt_len, "max_tokens": a.max_tokens, "rows": rows}
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
