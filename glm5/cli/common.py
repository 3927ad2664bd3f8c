"""What the command modules share: the parser class, the global options, the config and
registry look-ups, tables cut to the terminal, and option names in library messages."""

# lazy imports: `glm5 --help` must not load torch: a config or the registry loads on first use

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from glm5.cli.errors import CommandError, ParseError, UsageError


class Parser(argparse.ArgumentParser):
    """argparse, but an error is raised to `main` (one line, exit 2) instead of printing the
    usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ParseError(self.prog, message)


def add_global_options(p: argparse.ArgumentParser, suppress: bool) -> None:
    """--debug and --wide, accepted before the command (``suppress`` False: they default to
    False there) and after it (``suppress`` True: no default, so the value given before the
    command is not reset)."""
    d = argparse.SUPPRESS if suppress else False
    if "--debug" not in p._option_string_actions:
        p.add_argument("--debug", action="store_true", default=d,
                       help="show the traceback of an error")
    if "--wide" not in p._option_string_actions:
        p.add_argument("--wide", action="store_true", default=d,
                       help="print tables' long columns (reasons, messages) whole")


_ARGUMENT = re.compile(r"argument '(\w+)'")


def option_names(msg: str, positional: dict[str, str] | None = None) -> str:
    """A library message naming Python arguments (``argument 'max_num_seqs'``) said with the
    command line's names (``--max-num-seqs``; ``positional`` maps an argument to its METAVAR)."""
    names = positional or {}
    return _ARGUMENT.sub(lambda m: names.get(m[1]) or "--" + m[1].replace("_", "-"), msg)


def config_from(path: str, option: str):
    """The GLM5Config of a checkpoint directory (or config file) named by ``option``: a path
    that does not exist or holds no config.json is a usage error, a config.json that is not
    valid a failure."""
    from glm5.core.config import ConfigError, GLM5Config, missing_config

    why = missing_config(path)
    if why:
        raise UsageError(f"{option} {path}: {why}")
    try:
        return GLM5Config.from_pretrained(Path(path))
    except ConfigError as e:
        raise CommandError(str(e).removeprefix("glm5 config: ")) from e


def preset(name: str):
    """The preset ``name`` (case-insensitive: argparse lower-cases it); unknown is a usage
    error."""
    from glm5.core.config import ConfigError, preset as get

    try:
        return get(name)
    except ConfigError as e:
        raise UsageError(str(e).removeprefix("glm5 config: ")) from None


def registry():
    import glm5

    return glm5.get_registry()


def force_hint(e: Exception) -> UsageError:
    """An `OutputExistsError` said as the command line says it (--force, not overwrite=True)."""
    return UsageError(f"{e.path} {e.what}; pass --force to replace it")


def split_ops(text: str | None) -> list[str] | None:
    """``--ops a,b``: the names, or None when none is given (every op)."""
    return [o.strip() for o in text.split(",") if o.strip()] if text else None


# --------------------------------------------------------------------------- tables
_wide = False  # --wide: tables print their last column whole (set by `main`)
_MIN_LAST = 24  # the last column is never cut narrower than this
_CUT_NOTE = "(… = cut to the terminal's width; --wide prints it whole)"


def set_wide(wide: bool) -> None:
    global _wide
    _wide = wide


def table_width() -> int | None:
    """Columns a table may use: None (unlimited) with --wide or when stdout is not a terminal
    (pipes and files get whole lines), else $COLUMNS or the terminal's width."""
    import shutil

    if _wide:
        return None
    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    try:
        if not sys.stdout.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size().columns


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def fmt(rows: Sequence[Sequence[str]]) -> str:
    """An aligned table (first row = header). The last column (reasons, candidates) is cut to
    the terminal's width (`table_width`), with a note saying so."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    limit = table_width()
    cut = False
    if limit is not None:
        room = max(limit - sum(widths[:-1]) - 2 * (len(widths) - 1), _MIN_LAST)
        if widths[-1] > room:
            widths[-1], cut = room, True
            rows = [(*r[:-1], _cut(r[-1], room)) for r in rows]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if cut:
        lines.append(_CUT_NOTE)
    return "\n".join(lines)


def fit(table: str) -> str:
    """A table formatted elsewhere (the parity table), its long lines cut to the terminal's
    width (its last column is the message), with a note when any was cut."""
    limit = table_width()
    if limit is None:
        return table
    lines = table.split("\n")
    out = [_cut(ln, max(limit, _MIN_LAST)) for ln in lines]
    return "\n".join(out + ([_CUT_NOTE] if out != lines else []))
