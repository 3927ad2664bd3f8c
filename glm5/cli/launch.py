"""`glm5 launch`: a script run on N processes by torchrun (torch.distributed.run)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from glm5.cli.errors import UsageError


def add_parser(sub) -> argparse.ArgumentParser:
    la = sub.add_parser("launch", help="run a script on N processes (torchrun): glm5 launch "
                        "--nproc N [--] script.py [args]")
    la.add_argument("--nproc", type=int, required=True, help="processes on this node")
    la.add_argument("--timeout", type=float, default=None,
                    help="seconds a collective may take before the ranks fail with an error "
                         "naming it (GLM5_DIST_TIMEOUT; default 60)")
    la.add_argument("--nnodes", default=None, help="nodes (multi-node: torchrun's rendezvous)")
    la.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT every node joins")
    la.add_argument("--rdzv-id", default="glm5", help="the job's rendezvous id (default glm5)")
    la.add_argument("cmd", nargs=argparse.REMAINDER,
                    help="script.py [args], python script.py [args], python -m module [args]")
    la.set_defaults(func=run)
    return la


def launch_argv(args: argparse.Namespace) -> list[str]:
    """The torchrun (torch.distributed.run) command line of ``glm5 launch``: one node with a
    free port found by torchrun's standalone rendezvous, or, with ``--nnodes``, torchrun's own
    c10d rendezvous at ``--rdzv-endpoint``. ``python script.py ...`` and ``script.py ...`` run
    the script with this interpreter; ``python -m module ...`` runs a module; anything else is
    an executable run as is."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("expected the program to run: glm5 launch --nproc N [--] script.py "
                         "[args] (or python script.py, python -m module)")
    if args.nproc < 1:
        raise UsageError(f"--nproc expected a positive integer, got {args.nproc}")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout expected a positive number of seconds, got {args.timeout}")
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
    if args.nnodes is None:
        run.append("--standalone")
    else:
        if not args.rdzv_endpoint:
            raise UsageError("--nnodes expected with --rdzv-endpoint HOST:PORT (the rendezvous "
                             "every node joins)")
        run += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id}"]
    if Path(cmd[0]).name.startswith("python") and len(cmd) > 1:
        cmd = cmd[1:]  # torchrun runs scripts and modules with this very interpreter
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise UsageError("expected a module name after -m")
        return run + ["--module", *cmd[1:]]
    if cmd[0].endswith(".py"):
        if not Path(cmd[0]).is_file():
            raise UsageError(f"{cmd[0]}: no such script")
        return run + cmd
    return run + ["--no-python", *cmd]


def run(args: argparse.Namespace) -> int:
    argv = launch_argv(args)
    env = dict(os.environ)
    if args.timeout is not None:  # glm5.parallel.init_distributed reads it as its default timeout
        env["GLM5_DIST_TIMEOUT"] = str(args.timeout)
    return subprocess.call(argv, env=env)
