"""An RL run's per-step metrics: a CSV file (``<out_dir>/metrics.csv``) and, when the
``tensorboard`` package is installed, TensorBoard scalars (``<out_dir>/tb``).

The CSV has one row per trainer step and a header naming every key seen so far: the keys a
trainer step reports may grow over a run (a task type's first batch adds ``reward/<task>``),
and when one does the file is rewritten once with the union header (earlier rows get empty
cells). Steps in the file only increase: logging step ``s`` first drops every row with
step >= ``s``, so a run resumed from a checkpoint recomputes the steps after it instead of
writing them twice; `truncate` does the same at start-up, before any step runs.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger("glm5.rl")

METRICS_CSV = "metrics.csv"
TB_DIR = "tb"


def _cell(v: Any) -> str:
    # repr of a float round-trips exactly; bools and ints stay as written.
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _value(s: str) -> float | str:
    try:
        return float(s)
    except ValueError:
        return s


def _read_table(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(header, rows as raw strings) of a metrics CSV; a last line cut by a crash (no
    trailing newline) is dropped."""
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        return [], []
    rows = []
    for cells in reader:
        if not cells:
            continue
        if len(cells) != len(header):
            raise ValueError(f"glm5 rl metrics: {path} line {reader.line_num}: expected "
                             f"{len(header)} cells (the header's), got {len(cells)}")
        rows.append(dict(zip(header, cells)))
    return header, rows


def read_metrics(path: str | Path) -> list[dict[str, float | str]]:
    """The rows of a metrics CSV (a file or a run directory holding ``metrics.csv``), oldest
    first. Numbers come back as floats; an empty cell (a key that appeared later in the run)
    is left out of its row."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_CSV
    if not p.is_file():
        raise FileNotFoundError(2, "no metrics CSV (expected a run directory written by "
                                   "`glm5 rl train`, or its metrics.csv)", str(p))
    _, rows = _read_table(p)
    return [{k: _value(v) for k, v in r.items() if v != ""} for r in rows]


class MetricsLogger:
    """Appends one row per trainer step to ``<out_dir>/metrics.csv`` and, with ``tensorboard``
    (and the package importable), writes every numeric value as a TensorBoard scalar (tag = the
    key, global step = the step) under ``<out_dir>/tb``. An existing metrics.csv is continued
    (see `truncate` for resuming)."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_CSV
        self.tensorboard = tensorboard
        self._writer: Any = None  # SummaryWriter, made at the first step (see _tb)
        self._tb_failed = False
        self.header: list[str] = []
        self._last_step: float | None = None
        if self.path.exists():
            self.header, rows = _read_table(self.path)
            if self.header and "step" not in self.header:
                raise ValueError(f"glm5 rl MetricsLogger: {self.path} has no 'step' column; "
                                 f"expected a metrics CSV written by glm5 rl (or no file)")
            self._rewrite(self.header, rows)  # drops a line cut by a crash
            self._last_step = _last_step(rows)

    # ------------------------------------------------------------------ CSV
    def _rewrite(self, header: list[str], rows: list[dict[str, str]]) -> None:
        """Replace the file with ``rows`` under ``header`` (tmp file + rename: a crash leaves
        the old file or the new one)."""
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            for r in rows:
                w.writerow([r.get(k, "") for k in header])
        os.replace(tmp, self.path)
        self.header = list(header)

    def truncate(self, step: int) -> None:
        """Drop the rows after ``step`` (the step a run resumed at; 0 for a fresh run): they
        will be recomputed."""
        if not self.path.exists() or self._last_step is None or self._last_step <= step:
            return
        header, rows = _read_table(self.path)
        keep = [r for r in rows if float(r["step"]) <= step]
        self._rewrite(header, keep)
        self._last_step = _last_step(keep)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        """Record trainer step ``step``: ``row`` maps metric names to numbers (its "step", if
        present, must equal ``step``)."""
        if "step" in row and row["step"] != step:
            raise ValueError(f"glm5 rl MetricsLogger.log: row['step'] = {row['step']} but step "
                             f"= {step}")
        full = {"step": step, **{k: v for k, v in row.items() if k != "step"}}
        cells = {k: _cell(v) for k, v in full.items()}
        new_keys = [k for k in full if k not in self.header]
        stale = self._last_step is not None and self._last_step >= step
        if new_keys or stale or not self.path.exists():
            rows: list[dict[str, str]] = []
            if self.path.exists():
                _, rows = _read_table(self.path)
                rows = [r for r in rows if float(r["step"]) < step]
            self._rewrite(self.header + new_keys, rows + [cells])
        else:
            with open(self.path, "a", newline="") as f:
                csv.writer(f).writerow([cells.get(k, "") for k in self.header])
        self._last_step = step
        self._tb_log(step, full)

    # ------------------------------------------------------------------ TensorBoard
    def _tb(self, first_step: int) -> Any:
        if self._writer is None and self.tensorboard and not self._tb_failed:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                self._tb_failed = True
                log.warning("glm5 rl: TensorBoard scalars not written (%s); metrics go to %s "
                            "only (pip install tensorboard)", e, self.path)
                return None
            # purge_step hides the events an earlier process wrote at this step or later:
            # resumed steps are recomputed, in TensorBoard as in the CSV.
            self._writer = SummaryWriter(str(self.out_dir / TB_DIR), purge_step=first_step)
        return self._writer

    def _tb_log(self, step: int, full: Mapping[str, Any]) -> None:
        w = self._tb(step)
        if w is None:
            return
        for k, v in full.items():
            if k == "step" or isinstance(v, str):
                continue
            try:
                x = float(v)
            except (TypeError, ValueError):
                continue  # not a scalar: the CSV has it as text
            w.add_scalar(k, x, global_step=step)

    def close(self) -> None:
        """Flush and close the TensorBoard writer (the CSV is written at every step)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _last_step(rows: list[dict[str, str]]) -> float | None:
    return max((float(r["step"]) for r in rows), default=None)
