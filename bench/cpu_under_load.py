"""A forward on a busy CPU: how much glm5 (cpu backend) and transformers eager slow down when
other processes keep every core busy, side by side in one run.

    python bench/cpu_under_load.py [--length 4096] [--load N] [--rounds 2] [--repeat 2]
                                   [--baseline DIR] [--out bench/results/cpu_under_load.json]

One 2-layer GLM-5-shaped model (the `small` preset cut to 2 layers: one dense, one MoE layer,
random weights) is saved by transformers and loaded by two long-lived child processes, glm5 and
transformers `GlmMoeDsaForCausalLM` (eager attention), each warmed up on 512 tokens. Then, for
`--rounds` rounds: an idle phase (both models run `--repeat` forward passes of `--length` tokens,
batch 1, one after the other) and a loaded phase (the same, while `--load` background processes,
started and stopped by this script, each multiply 512x512 float32 matrices with numpy on one
thread without pause). Idle and loaded phases alternate so that both see the same drift in the
machine's other work. The fastest pass of each (model, phase) is reported (medians in
brackets), with the CPU time the child's threads used per pass (spinning threads show there);
slowdown = loaded / idle for each model, and the speed-up of glm5 over transformers in
both phases. `--baseline DIR` adds a third child running glm5 from another source tree (e.g.
`git archive <commit> glm5 | tar -x -C DIR`), so that before / after figures come from one run.

Each child starts from the environment this script started with (the glm5 child sets its own
thread and wait settings when it imports glm5, as any glm5 process does; the transformers child
runs torch's defaults). The JSON also holds the settings in effect in each child and the CPU
time the load processes got during each loaded phase.
"""

from __future__ import annotations

import os

# The children start from this environment, not from this process's after `import glm5` (which
# sets glm5's OpenMP wait policy; the transformers child must run torch's defaults).
ENV0 = dict(os.environ)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")

CHILD = r"""
import json, logging, os, sys, time
which, path, L, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if which == "glm5":
    import glm5  # first: its OpenMP wait policy must be set before torch loads OpenMP
import torch
logging.getLogger("glm5").setLevel(logging.ERROR)
torch.manual_seed(0)
ids = torch.randint(0, 4096, (1, L))
if which == "glm5":
    try:
        from glm5 import cpu_threads
    except ImportError:  # a glm5 from before cpu_threads (for before/after figures)
        cpu_threads = None
    m = glm5.load_model(path).eval()
    run = lambda x: m(x)
else:
    from transformers import GlmMoeDsaForCausalLM
    m = GlmMoeDsaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    run = lambda x: m(x, use_cache=False).logits
with torch.inference_mode():
    run(ids[:, :512])  # warm-up: imports, kernel builds or loads (> index_topk: sparse path)
settings = {"torch_threads": torch.get_num_threads(),
            **{k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "TVM_NUM_THREADS",
                                              "TVM_BIND_THREADS", "TVM_THREAD_POOL_SPIN_COUNT")}}
if which == "glm5" and cpu_threads is not None:
    a = cpu_threads.applied()
    settings.update({"decision": a["decision"]._asdict(), "tvm_env": a["tvm_env"],
                     "torch_threads_how": a["torch_threads_how"],
                     "openmp": cpu_threads.openmp_state()})
print(json.dumps({"ready": True, "settings": settings}), flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    times, cpu = [], []
    with torch.inference_mode():
        for _ in range(repeat):
            t, c = time.perf_counter(), time.process_time()
            run(ids)
            times.append(time.perf_counter() - t); cpu.append(time.process_time() - c)
    print(json.dumps({"times": times, "cpu": cpu}), flush=True)
"""

# One busy core: numpy on one BLAS thread, multiplying without pause.
LOAD = r"""
import os
for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[k] = "1"
import numpy as np
a = np.random.default_rng(0).random((512, 512), dtype=np.float32)
while True:
    a = (a @ a) * (1.0 / 512)
"""


class Child:
    """A model in its own process, answering "run" with the seconds of `repeat` passes.
    ``name``: its row; ``which``: "glm5" or "transformers"; ``source``: a glm5 source tree to
    import instead of this one."""

    def __init__(self, name: str, which: str, path: str, length: int, repeat: int, log: str,
                 source: str | None = None) -> None:
        self.which = name
        self.log_path = log
        self.log = open(log, "w")
        env = dict(ENV0)
        if source:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, which, path, str(length),
                                   str(repeat)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, env=env,
                                  cwd=os.path.dirname(log))  # not a source tree: `-c` imports
                                                             # from the working directory first
        self.settings = self._reply()["settings"]

    def _reply(self) -> dict[str, Any]:
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            self.log.flush()
            with open(self.log_path) as f:
                tail = f.read().strip().splitlines()[-3:]
            raise RuntimeError(f"cpu_under_load: the {self.which} child exited "
                               f"({self.p.returncode}): {' / '.join(tail)}")
        return json.loads(line)

    def run(self) -> tuple[list[float], list[float]]:
        """Wall seconds and CPU seconds (all the child's threads) of each pass."""
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        r = self._reply()
        return r["times"], r["cpu"]

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write("quit\n")
                self.p.stdin.close()
                self.p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()
        self.log.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Load:
    """`n` busy background processes while the block runs; `cores_busy`: the CPU-seconds they
    got per second of the block (how much of the machine the load really took)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cores_busy = 0.0

    def __enter__(self) -> "Load":
        env = {**ENV0, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen([sys.executable, "-c", LOAD], env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for _ in range(self.n)]
        if self.n:
            time.sleep(1.0)  # imports done, every process multiplying
        self.t0 = time.perf_counter()
        self.c0 = sum(cpu_seconds(p.pid) for p in self.procs)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            dt = time.perf_counter() - self.t0
            self.cores_busy = (sum(cpu_seconds(p.pid) for p in self.procs) - self.c0) / dt
        finally:
            for p in self.procs:
                p.kill()
            for p in self.procs:
                p.wait()


def summary(times: list[float]) -> dict[str, Any]:
    return {"best": min(times), "median": statistics.median(times), "runs": times}


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=4096, help="tokens per forward (batch 1)")
    ap.add_argument("--load", type=int, default=usable_cpus(),
                    help="busy background processes in the loaded phase (default: one per CPU "
                         "this process may use)")
    ap.add_argument("--rounds", type=int, default=2, help="idle + loaded phase pairs")
    ap.add_argument("--repeat", type=int, default=2, help="forward passes per model per phase")
    ap.add_argument("--baseline", default="",
                    help="also run glm5 from this source tree (before / after in one run)")
    ap.add_argument("--out", default="", help="write the results as JSON here "
                                             "(e.g. bench/results/cpu_under_load.json)")
    a = ap.parse_args()
    for name in ("length", "load", "rounds", "repeat"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} expected a positive integer, got {getattr(a, name)}")

    sys.path.insert(0, TESTS)
    from hf_oracle import random_hf_model

    from glm5.core.config import preset

    cfg = dataclasses.replace(preset("small"), num_hidden_layers=2, mlp_layer_types=None,
                              indexer_types=None)
    started = time.perf_counter()
    import glm5

    # the glm5 child imports the glm5 this script imports
    kids = [("glm5", "glm5", os.path.dirname(os.path.dirname(os.path.abspath(glm5.__file__))))]
    if a.baseline:
        if not os.path.isdir(os.path.join(a.baseline, "glm5")):
            ap.error(f"--baseline expected a source tree holding glm5/, got {a.baseline!r}")
        kids.append(("glm5 baseline", "glm5", os.path.abspath(a.baseline)))
    kids.append(("transformers", "transformers", None))
    samples: dict[str, dict[str, list[float]]] = {k[0]: {"idle": [], "loaded": []}
                                                  for k in kids}
    cpu_s: dict[str, dict[str, list[float]]] = {k[0]: {"idle": [], "loaded": []} for k in kids}
    busy: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        random_hf_model(cfg, 0, std=0.05).save_pretrained(d)
        children: list[Child] = []
        try:
            for i, (name, which, source) in enumerate(kids):
                children.append(Child(name, which, d, a.length, a.repeat,
                                      os.path.join(d, f"child{i}.log"), source))
            for r in range(a.rounds):
                for phase in ("idle", "loaded"):
                    with Load(a.load if phase == "loaded" else 0) as load:
                        for c in children:
                            wall, cpu = c.run()
                            samples[c.which][phase] += wall
                            cpu_s[c.which][phase] += cpu
                busy.append(load.cores_busy)
                print(f"round {r + 1}/{a.rounds}: " + "; ".join(
                    f"{w} idle {min(s['idle']):.2f} s, loaded {min(s['loaded']):.2f} s"
                    for w, s in samples.items()) + f"; load got {load.cores_busy:.2f} CPUs",
                      flush=True)
            settings = {c.which: c.settings for c in children}
        finally:
            for c in children:
                c.close()
    rows = {}
    for w, s in samples.items():
        idle, loaded = summary(s["idle"]), summary(s["loaded"])
        rows[w] = {"idle": idle, "loaded": loaded,
                   "cpu_seconds": {ph: summary(v) for ph, v in cpu_s[w].items()},
                   "slowdown": loaded["best"] / idle["best"],
                   "slowdown_median": loaded["median"] / idle["median"]}
    g, h = rows["glm5"], rows["transformers"]
    res = {"length": a.length, "layers": 2, "config": "small preset, 2 layers (dense + MoE)",
           "baseline": os.path.abspath(a.baseline) if a.baseline else None,
           "load_processes": a.load, "rounds": a.rounds, "repeat": a.repeat,
           "cpus": usable_cpus(), "load_cpus_busy": busy, "models": rows,
           "speedup_idle": h["idle"]["best"] / g["idle"]["best"],
           "speedup_loaded": h["loaded"]["best"] / g["loaded"]["best"],
           "target_met": g["slowdown"] <= h["slowdown"], "settings": settings,
           "seconds": time.perf_counter() - started, "date": time.strftime("%Y-%m-%d %H:%M")}
    print()
    print(table(res))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def table(res: dict[str, Any]) -> str:
    out = [f"{res['length']} tokens, {res['layers']} layers, batch 1; load: "
           f"{res['load_processes']} busy processes on {res['cpus']} CPUs (they got "
           f"{', '.join(f'{b:.2f}' for b in res['load_cpus_busy'])} CPUs); best of "
           f"{res['rounds'] * res['repeat']} passes per cell (median in brackets)", "",
           "| model | idle s | loaded s | slowdown | CPU s per pass, idle / loaded (median) |",
           "|---|---|---|---|---|"]
    for w, r in res["models"].items():
        c = r["cpu_seconds"]
        out.append(f"| {w} | {r['idle']['best']:.2f} ({r['idle']['median']:.2f}) | "
                   f"{r['loaded']['best']:.2f} ({r['loaded']['median']:.2f}) | "
                   f"{r['slowdown']:.1f}x ({r['slowdown_median']:.1f}x) | "
                   f"{c['idle']['median']:.2f} / {c['loaded']['median']:.2f} |")
    out += ["", f"glm5 speed-up over transformers: {res['speedup_idle']:.1f}x idle, "
                f"{res['speedup_loaded']:.1f}x loaded; target (glm5 slows no more than "
                f"transformers): {'met' if res['target_met'] else 'NOT met'}"]
    return "\n".join(out)


if __name__ == "__main__":
    main()
