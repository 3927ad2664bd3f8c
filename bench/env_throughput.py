"""Sandbox overhead per command and environments per second, on this CPU.

    python bench/env_throughput.py --out bench/results/env_throughput.json

1. Sandbox overhead: `glm5.rl.envs.sandbox.measure_overhead` — the median wall time of `true`
   run directly by subprocess, through a rlimits-mode sandbox and through a bwrap sandbox
   (where bwrap works), over ``--overhead-runs`` runs.
2. For every environment type registered in `glm5.rl.envs.base` (the built-in ones, imported
   first, and those of installed packages' `glm5.rl_envs` entry points): episodes/s of reset + one typical step + close, and steps/s of a typical step
   (the env reset, untimed, whenever an episode ends). The typical step is what an agent does
   most: a tool call in the GLM-5 markup (`<tool_call>NAME<arg_key>K</arg_key><arg_value>V
   </arg_value></tool_call>`) — terminal `shell` with `ls`, codefix `run_tests`, search
   `search`, data the `shell` command (awk) its demonstration starts with — or, for countdown,
   an answer. Environments with a sandbox run in each of ``--modes`` (default: auto, which is
   bwrap where it works).

Single process, torch imported with 1 thread (as in a rollout worker; a fork of a bigger
process costs more in rlimits mode, see docs/rl_envs.md "Overhead"). Rates are medians of
per-call times (1000 / median ms), from the quietest of ``--rounds`` rounds: the machine may
be shared; every round's medians, the means and the load averages are recorded too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import glm5  # noqa: F401,I001  (before torch: it sets OMP_WAIT_POLICY for torch's pool)

import torch

from glm5.rl.envs import base
from glm5.rl.envs.sandbox import SandboxConfig, measure_overhead, sandbox_report
from glm5.rl.envs.tools import tool_call
from glm5.perf.measure import cpu_model, rss_bytes

# env type -> the typical step after reset(seed) (the env is passed: some need its task)
TYPICAL: dict[str, tuple[str, Callable[[Any], str]]] = {
    "countdown": ("answer: the first two numbers added",
                  lambda env: f"{env.numbers[0]} + {env.numbers[1]}"),
    "search": ("search(query='capital river', k=3)",
               lambda env: tool_call("search", query="capital river", k=3)),
    "codefix": ("run_tests() (pytest in the sandbox)", lambda env: tool_call("run_tests")),
    "terminal": ("shell(command='ls')", lambda env: tool_call("shell", command="ls")),
    "data": ("shell(command=<its demonstration's awk command>)",
             lambda env: env.demonstration()[0]),
}


def _typical(name: str) -> tuple[str, Callable[[Any], str]]:
    if name in TYPICAL:
        return TYPICAL[name]
    # a type this script does not know: the first turn of its demonstration
    return "the first turn of its demonstration()", lambda env: env.demonstration()[0]


def _summary(ms: list[float]) -> dict[str, float]:
    med = statistics.median(ms)
    return {"median_ms": round(med, 3), "mean_ms": round(statistics.fmean(ms), 3),
            "p90_ms": round(sorted(ms)[int(0.9 * (len(ms) - 1))], 3),
            "per_s": round(1e3 / med, 2), "n": len(ms)}


def _check(name: str, observation: str) -> None:
    """The typical step did its work (a bench of error paths would measure the wrong thing):
    no tool error, shell commands exit 0, the tests ran, a countdown answer was parsed."""
    if observation.startswith("["):  # tool results
        for entry in json.loads(observation):
            res = entry.get("result")
            ok = "error" not in entry and not (
                entry["tool"] == "shell" and res["exit"] != 0) and not (
                entry["tool"] == "run_tests" and res["passed"] + res["failed"] == 0)
            if not ok:
                raise SystemExit(f"bench/env_throughput.py: {name}'s typical step failed: "
                                 f"{observation[:500]}")
    elif observation.startswith(("Invalid", "Error")):
        raise SystemExit(f"bench/env_throughput.py: {name}'s typical step failed: "
                         f"{observation[:500]}")


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if close is not None:
        close()


def measure_env(name: str, params: dict[str, Any], episodes: int, steps: int
                ) -> dict[str, Any]:
    """Episodes/s (reset + one typical step + close) and steps/s of the typical step."""
    what, action = _typical(name)
    env = base.make_env(name, **params)
    try:
        # warm-up: imports, the sandbox probes, caches
        env.reset(10_000)
        first = env.step(action(env))
        _check(name, first.observation)
        _close(env)
        ep_ms = []
        for i in range(episodes):
            t0 = time.perf_counter()
            env.reset(i)
            r = env.step(action(env))
            _close(env)
            ep_ms.append((time.perf_counter() - t0) * 1e3)
            _check(name, r.observation)
        step_ms = []
        env.reset(0)
        seed = 0
        while len(step_ms) < steps:
            a = action(env)
            t0 = time.perf_counter()
            r = env.step(a)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            _check(name, r.observation)
            if r.done:
                seed += 1
                env.reset(seed)
        _close(env)
    finally:
        _close(env)
    return {"env": name, "typical_step": what, "params": {k: repr(v) for k, v in params.items()},
            "step_observation_sample": first.observation[:160],
            "episode": _summary(ep_ms), "step": _summary(step_ms)}


def _uses_sandbox(name: str) -> bool:
    import inspect

    if name not in base.ENVS:  # an entry point's type: registered by its first make_env
        _close(base.make_env(name))
    return "sandbox_config" in inspect.signature(base.ENVS[name]).parameters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=30, help="timed episodes per env type")
    ap.add_argument("--steps", type=int, default=50, help="timed typical steps per env type")
    ap.add_argument("--overhead-runs", type=int, default=100,
                    help="runs of `true` per measure_overhead median")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each measurement; the "
                    "quietest is reported (every round's medians are recorded)")
    ap.add_argument("--modes", default="auto,rlimits",
                    help="sandbox modes for the envs that have a sandbox (auto, bwrap, rlimits)")
    ap.add_argument("--envs", default="", help="comma-separated env types (default: all "
                    "registered)")
    ap.add_argument("--out", default=None, help="JSON results file")
    a = ap.parse_args(argv)
    for k in ("episodes", "steps", "overhead_runs", "rounds"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} expected an int >= 1")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("auto", "bwrap", "rlimits")]
    if bad or not modes:
        ap.error(f"--modes expected auto, bwrap or rlimits, got {a.modes!r}")

    torch.set_num_threads(1)
    for module in sorted(set(base._BUILTIN.values())):
        importlib.import_module(module)
    from importlib.metadata import entry_points

    # types installed packages add (glm5.rl_envs entry points), registered by make_env
    plugged = {ep.name for ep in entry_points(group=base.ENTRY_POINT_GROUP)}
    known = sorted(set(base.ENVS) | plugged)
    names = [n.strip() for n in a.envs.split(",") if n.strip()] or known
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"--envs: unknown {unknown}; registered: {known}")

    load_before = os.getloadavg()
    t_start = time.time()
    report = sandbox_report()
    print(f"sandbox: default mode {report['mode']}; bwrap "
          f"{report['bwrap']['version'] or report['bwrap']['problem']}", flush=True)
    overhead_rounds = []
    for _ in range(a.rounds):
        overhead_rounds.append({k: round(v, 3) for k, v in
                                measure_overhead(a.overhead_runs).items()})
        print("overhead (ms, median of %d): %s" % (a.overhead_runs,
                                                   json.dumps(overhead_rounds[-1])), flush=True)
    # the quietest round: the least time through the sandbox, summed over the modes
    overhead = min(overhead_rounds, key=lambda o: sum(v for k, v in o.items()
                                                      if k.endswith("_ms")
                                                      and "overhead" not in k))

    rows = []
    for name in names:
        for mode in (modes if _uses_sandbox(name) else [None]):
            # rlimits mode as root runs only when asked to (the bench's commands are ours)
            params = {} if mode is None else {"sandbox_config": SandboxConfig(
                mode=mode, unsafe_rlimits_as_root=mode == "rlimits" and os.geteuid() == 0)}
            rounds = [measure_env(name, params, a.episodes, a.steps) for _ in range(a.rounds)]
            # the quietest round (the machine may be shared); every round's medians kept
            row = min(rounds, key=lambda r: r["episode"]["median_ms"] + r["step"]["median_ms"])
            row["rounds_median_ms"] = [{"episode": r["episode"]["median_ms"],
                                        "step": r["step"]["median_ms"]} for r in rounds]
            row["sandbox_mode"] = (None if mode is None else
                                   report["mode"] if mode == "auto" else mode)
            rows.append(row)
            e, s = row["episode"], row["step"]
            print(f"{name:10} {row['sandbox_mode'] or '-':8} episodes/s {e['per_s']:8.2f} "
                  f"({e['median_ms']:.2f} ms)  steps/s {s['per_s']:8.2f} ({s['median_ms']:.2f} "
                  f"ms)  {row['typical_step']}", flush=True)

    result = {
        "command": "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "usable_cores": len(os.sched_getaffinity(0)), "python":
                    platform.python_version(), "torch": torch.__version__, "torch_threads":
                    torch.get_num_threads(), "kernel": platform.release(),
                    "root": os.geteuid() == 0, "rss_mb": round(rss_bytes() / 2**20, 1),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "wall_s": round(time.time() - t_start, 1),
        "sandbox": {"default_mode": report["mode"], "bwrap": report["bwrap"]["version"],
                    "libseccomp": report["libseccomp"]["version"],
                    "pids_cgroup": report["pids_cgroup"]["version"],
                    "default_config": {k: v for k, v in dataclasses.asdict(SandboxConfig()).items()
                                       if k not in ("env", "ro_binds")}},
        "rounds": a.rounds, "overhead_runs": a.overhead_runs, "overhead_ms": overhead,
        "overhead_rounds_ms": overhead_rounds,
        "episodes_per_env": a.episodes, "steps_per_env": a.steps, "envs": rows,
        "notes": "the machine is shared: other jobs ran on its 2 cores during the run (see the "
                 "load averages); rates are 1000 / the median ms of single calls, from the "
                 "quietest of the rounds (all rounds' medians recorded)",
    }
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
