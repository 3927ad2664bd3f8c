"""Cold start: in a fresh process on a warm kernel cache, the first forward of a model costs at
most 0.3 s more than the second (it paid ~1.8 s importing the `tvm` package to load the cached
kernels; see bench/cold_start.py and docs/performance.md, "Cold start")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tvm")  # the cpu backend's kernels are what a cold start loads

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cold_start.py"
BOUND_S = 0.3  # the goal: first forward - second forward, wall clock
# A loaded machine stretches every wall-clock interval (this one runs other jobs on 2 cores):
# then the extra CPU time of the first forward must meet the goal, and its wall-clock extra
# stay within this looser bound (before the fix both were ~1.5-2 s).
LOADED_WALL_S = 0.9


def _run(env: dict[str, str]) -> dict[str, float | bool]:
    out = subprocess.run([sys.executable, str(BENCH), "--child", "--preset", "tiny",
                          "--layers", "2", "--tokens", "64"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_first_forward_costs_at_most_0_3_s_more_than_the_second():
    env = dict(os.environ)
    # an installed package imports from .pyc files; an environment that forbids writing them
    # makes every module imported during the first forward compile from source each time
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # torch's OpenMP workers on an oversubscribed machine make forwards bimodal (0.15 vs 2.6 s
    # for the same call, measured); the cold-start work itself is single-threaded
    env["OMP_NUM_THREADS"] = "1"
    _run(env)  # warm-up: fills the kernel cache (builds what is missing) and the bytecode
    runs = []
    for _ in range(3):  # best of up to 3 fresh processes: noise only adds to the difference
        r = _run(env)
        runs.append(r)
        if r["first"] - r["second"] <= BOUND_S:
            return
    extra_cpu = min(r["first_cpu"] - r["second_cpu"] for r in runs)
    extra_wall = min(r["first"] - r["second"] for r in runs)
    assert extra_cpu <= BOUND_S and extra_wall <= LOADED_WALL_S, runs


def test_cached_kernels_load_without_importing_tvm():
    """The ~1.3 s `import tvm` was most of the cold start: a process whose kernels are all in
    the cache never imports the package (only tvm_ffi and TVM's C++ runtime)."""
    r = _run(dict(os.environ))
    if r["tvm_imported"]:  # a cold cache: this run built kernels, which needs tvm
        r = _run(dict(os.environ))
    assert not r["tvm_imported"]
