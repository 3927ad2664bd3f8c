"""`glm5` command line: backends | ops | parity | bench | info | plan | quantize | export |
serve | rl | doctor.

One module per command (`glm5.cli.backends`, `glm5.cli.serve`, ...), each owning its options
(``add_parser``) and running them (``run``); this package only collects the parsers and
dispatches. Shared helpers: `glm5.cli.common` (parser, config look-ups, tables) and
`glm5.cli.errors` (the error kinds and their report).

Errors (the framework in `main`): every error a user can cause prints one line on stderr,
``glm5 <command>: what is wrong, what was expected``, and no traceback unless ``--debug`` is
given (before or after the command). Exit status:

- 0: success;
- 1: the command ran and failed: an input file is unreadable, corrupt or inconsistent, a check
  failed, a backend is unavailable, an unexpected error (`CommandError`, and any error a command
  does not declare as a usage error);
- 2: the command line is wrong: an unknown option or name (backend, op, preset, chip, scheme), a
  bad value, a path argument that does not exist or is of the wrong kind, an output that exists
  without ``--force`` (`UsageError`, argparse's errors, ``KeyError``, ``ValueError``);
- 130: interrupted (Ctrl-C); 141: stdout was closed early (``glm5 ops | head``), which ends the
  command quietly, as a program ended by SIGPIPE.

Tables cut their last column (reasons, messages) to the terminal's width; ``--wide`` prints it
whole. Output to a pipe or file is never cut.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from glm5 import __version__
from glm5.cli import (backends, bench, doctor, export, info, launch, ops, parity, plan,
                      quantize, rl, serve, tune)
from glm5.cli.backends import backend_rows, plugin_rows
from glm5.cli.common import Parser, add_global_options, set_wide
from glm5.cli.errors import (CommandError, ParseError, UsageError, classify, err, one_line,
                             quiet_closed_stdout)
from glm5.cli.launch import launch_argv
from glm5.cli.rl import rl_config as _rl_config  # noqa: F401 - its name before the split

__all__ = ["main", "build_parser", "launch_argv", "backend_rows", "plugin_rows",
           "UsageError", "CommandError", "COMMANDS"]

# The commands, in the order `glm5 --help` lists them.
COMMANDS = (backends, ops, parity, info, bench, tune, export, quantize, plan, serve, rl, doctor,
            launch)


def __getattr__(name: str) -> Any:
    if name == "_listen_socket":  # its old name here; the server's loads the engine
        from glm5.serve.server import listen_socket  # lazy: it loads torch and the engine

        return listen_socket
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="glm5", description="GLM-5 on an op IR with pluggable hardware backends")
    p.add_argument("--version", action="version", version=f"glm5 {__version__}")
    add_global_options(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    for command in sub.choices.values():  # every command takes the global options after it too
        add_global_options(command, suppress=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `glm5` command line ``argv`` (default: sys.argv[1:]); returns the exit status
    (0 success, 1 failure, 2 usage error, 130 interrupted, 141 stdout closed)."""
    try:
        rc = _run(argv)
        sys.stdout.flush()  # here, so that a closed pipe is seen while it can end quietly
        return rc
    except BrokenPipeError:  # `glm5 ops | head`: the reader has all it wanted
        quiet_closed_stdout()
        return 141


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ParseError as e:
        msg = e.args[0]
        if msg.startswith("the following arguments are required: COMMAND"):
            msg = "a command is required"
        err(f"{e.prog}: {msg} (see `{e.prog} --help`)")
        return 2
    except SystemExit as e:  # --help, --version: argparse printed and exits 0
        return int(e.code or 0)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # as given (glm5 serve
    # --tp N runs its command line again on each rank)
    command = f"glm5 {args.command}"
    set_wide(bool(getattr(args, "wide", False)))
    try:
        if getattr(args, "examples", None) is not None and args.examples < 1:
            raise UsageError("--examples expected a positive integer")
        return args.func(args)
    except BrokenPipeError:
        raise
    except KeyboardInterrupt:
        if getattr(args, "debug", False):
            raise
        err(f"{command}: interrupted")
        return 130
    except Exception as e:
        code, msg = classify(e)
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exc()
        err(f"{command}: {one_line(msg)}")
        return code
