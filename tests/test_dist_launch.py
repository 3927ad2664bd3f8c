"""`glm5 launch`: a 2-process script run through torchrun (a free port, torchrun's variables,
the collective timeout passed on), the command lines it builds for scripts, modules,
executables and multi-node rendezvous, and its usage errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from glm5.cli import build_parser, launch_argv, main

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, torch, glm5.parallel as gd
ctx = gd.init_distributed()
y = gd.all_reduce(torch.tensor([float(ctx.rank + 1)]), ctx.world)
print(f"rank={ctx.rank} world={ctx.world_size} backend={ctx.backend} timeout={ctx.timeout_s:g} "
      f"sum={y.item():g} args={sys.argv[1:]}", flush=True)
gd.destroy()
"""


def _launch(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "glm5.cli", "launch", "--nproc", "2",
                           "--timeout", "9", "--", "python", str(script), *extra],
                          capture_output=True, text=True, timeout=120, env=env)


def test_launch_runs_a_two_process_script(tmp_path):
    p = _launch(tmp_path, "--x", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    # the ranks share one stdout pipe: a line's text and its newline may be two writes, so
    # lines of two ranks can run together; take the records, not the lines
    lines = sorted(re.findall(r"rank=\d+ world=.*?args=\[[^\]]*\]", p.stdout))
    assert lines == [f"rank={r} world=2 backend=gloo timeout=9 sum=3 args=['--x', '1']"
                     for r in (0, 1)], p.stdout


def _args(*argv: str):
    return build_parser().parse_args(["launch", *argv])


def test_launch_command_lines():
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4"]
    here = str(Path(__file__))
    assert launch_argv(_args("--nproc", "4", here, "-v")) == run + ["--standalone", here, "-v"]
    assert launch_argv(_args("--nproc", "4", "--", "python3", here)) == run + ["--standalone",
                                                                              here]
    assert launch_argv(_args("--nproc", "4", "--", "python", "-m", "pkg.mod", "--a")) == (
        run + ["--standalone", "--module", "pkg.mod", "--a"])
    assert launch_argv(_args("--nproc", "4", "--", "nvidia-smi", "-L")) == (
        run + ["--standalone", "--no-python", "nvidia-smi", "-L"])
    assert launch_argv(_args("--nproc", "4", "--nnodes", "2", "--rdzv-endpoint", "node0:29400",
                             here)) == run + ["--nnodes=2", "--rdzv-backend=c10d",
                                              "--rdzv-endpoint=node0:29400",
                                              "--rdzv-id=glm5", here]


@pytest.mark.parametrize("argv, msg", [
    (["--nproc", "2"], "expected the program to run"),
    (["--nproc", "0", "x.py"], "--nproc expected a positive integer, got 0"),
    (["--nproc", "2", "--timeout", "0", "x.py"], "--timeout expected a positive number"),
    (["--nproc", "2", "--nnodes", "2", "x.py"], "--nnodes expected with --rdzv-endpoint"),
    (["--nproc", "2", "no_such_script.py"], "no_such_script.py: no such script"),
])
def test_launch_usage_errors(argv, msg, capsys):
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm5 launch: ") and msg in err, err
