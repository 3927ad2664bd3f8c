"""The `glm5` command line's errors and how `main` reports them (see `glm5.cli`'s docstring):
one line on stderr, ``glm5 <command>: what is wrong``, and the exit status of its kind."""

from __future__ import annotations

import os
import re
import sys


class UsageError(ValueError):
    """The command line is wrong (a bad value, a missing or conflicting option): exit 2."""


class CommandError(Exception):
    """A well-formed command could not do its job (an input unreadable or corrupt, a check
    that failed): exit 1."""


class ParseError(Exception):
    """argparse's error, raised to `main` by `glm5.cli.common.Parser` (one line, exit 2)."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


# The ValueError subclasses that say an input is broken, not that the command line is wrong
# (module, class): matched only once their module is loaded (an error of a module never
# imported cannot have been raised), so `main` imports nothing to classify an error.
_FAILURE_VALUE_ERRORS = (("glm5.core.checkpoint", "CheckpointError"),
                         ("glm5.deploy.quantize", "QuantizeError"),
                         ("glm5.backends.policy", "PolicyError"))
# Prefixes library messages carry (`glm5 quantize: `, `glm5 config: `, `glm5.load_model: `),
# dropped so the line starts with the command once: `glm5 <command>: what is wrong`.
_PREFIX = re.compile(r"^glm5(?: [\w-]+|\.(?:load_model|save_pretrained|plan))?: ")


def _loaded_class(module: str, name: str) -> type | None:
    m = sys.modules.get(module)
    return getattr(m, name, None) if m is not None else None


def classify(e: BaseException) -> tuple[int, str]:
    """(exit status, message) of an error raised by a command (see `glm5.cli`'s docstring)."""
    exists = _loaded_class("glm5.core.output", "OutputExistsError")
    if exists is not None and isinstance(e, exists):
        return 2, f"{e.path} {e.what}; pass --force to replace it"
    if isinstance(e, KeyError):  # an unknown name (backend, op)
        return 2, str(e.args[0]) if e.args else "unknown name"
    if isinstance(e, OSError) and e.strerror and e.filename:
        return 1, f"{e.strerror}: {e.filename}"
    failures = tuple(c for c in (_loaded_class(m, n) for m, n in _FAILURE_VALUE_ERRORS) if c)
    if isinstance(e, UsageError) or (isinstance(e, ValueError) and not isinstance(e, failures)):
        return 2, str(e)
    if isinstance(e, (CommandError, OSError, ValueError)):
        return 1, str(e)
    known = [(m, n) for m, n in (("glm5.backends.api", "BackendError"),
                                 ("glm5.backends.selection", "FallbackError"))
             if (c := _loaded_class(m, n)) is not None and isinstance(e, c)]
    if known:
        return 1, str(e)
    return 1, (f"unexpected {type(e).__name__}: {e} (a bug in glm5 or a plugin: rerun with "
               f"--debug for the traceback)")


def one_line(msg: str) -> str:
    return re.sub(r"\s*\n\s*", " ", _PREFIX.sub("", msg.strip())) or "failed"


def quiet_closed_stdout() -> None:
    """After EPIPE: point stdout at /dev/null, so that the interpreter's final flush of what is
    still buffered does not print a second BrokenPipeError."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


def err(line: str) -> None:
    try:
        print(line, file=sys.stderr)
    except (OSError, ValueError):  # stderr closed too: nothing more can be said
        pass
