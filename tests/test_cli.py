"""The `glm5` command line as a new user meets it: one-line errors (`glm5 <command>: ...`) with
exit status 2 for a wrong command line and 1 for a failure, tracebacks only with --debug,
--version, closed pipes ending quietly, case-insensitive chip / scheme / preset names, tables
cut to the terminal with --wide for the whole text, and the commands that write (quantize,
export) refusing to overwrite without --force and leaving nothing behind when they fail."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch

import glm5
from glm5 import cli
from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from hf_oracle import randomize


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("glm5").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "tiny"
    randomize(GLM5ForCausalLM(preset("tiny"))).save_pretrained(d)
    return d


def _src(ckpt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    return src


def _one_line(capsys, start: str) -> str:
    """stderr holds exactly one line, starting with ``start``, and no traceback."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(start), err
    return err


def _entries(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# --------------------------------------------------------------------------- writing commands
def test_quantize_of_a_corrupt_checkpoint_is_one_line_and_leaves_nothing(ckpt, tmp_path,
                                                                         capsys):
    """Defect 3: a SafetensorError traceback, and an empty DST left behind."""
    src = _src(ckpt, tmp_path)
    (src / "model.safetensors").write_bytes(b"\x00" * 7)
    assert cli.main(["quantize", "--scheme", "w8a16", str(src), str(tmp_path / "q")]) == 1
    err = _one_line(capsys, "glm5 quantize: ")
    assert "model.safetensors is not a valid safetensors file" in err
    assert _entries(tmp_path) == ["src"]  # no DST, no temporary directory


def test_export_of_a_corrupt_checkpoint_is_one_line_and_leaves_nothing(ckpt, tmp_path, capsys):
    src = _src(ckpt, tmp_path)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])  # truncated
    out = tmp_path / "out" / "m.onnx"
    assert cli.main(["export", "--model", str(src), str(out)]) == 1
    err = _one_line(capsys, "glm5 export: ")
    assert "model.safetensors is not a valid safetensors file" in err and "incomplete" in err
    assert _entries(tmp_path) == ["src"]


def test_quantize_refuses_an_existing_checkpoint_unless_force(ckpt, tmp_path, capsys):
    """Also: the error's prefix was printed twice (`glm5 quantize: glm5 quantize: DST ...`)."""
    dst = tmp_path / "q"
    assert cli.main(["quantize", "--scheme", "w8a16", str(ckpt), str(dst)]) == 0
    capsys.readouterr()
    before = {f.name: f.read_bytes() for f in dst.iterdir()}
    assert cli.main(["quantize", "--scheme", "w4a8", str(ckpt), str(dst)]) == 2
    err = _one_line(capsys, "glm5 quantize: ")
    assert err.count("glm5") == 1 and "already holds a checkpoint" in err and "--force" in err
    assert {f.name: f.read_bytes() for f in dst.iterdir()} == before
    # --force replaces it whole: a stale shard of an earlier save does not survive
    (dst / "model-00001-of-00002.safetensors").write_bytes(before["model.safetensors"])
    assert cli.main(["quantize", "--scheme", "w4a8", "--force", str(ckpt), str(dst)]) == 0
    assert _entries(dst) == ["config.json", "model.safetensors", "quant_description.json"]
    assert json.loads((dst / "quant_description.json").read_text())["scheme"] == "w4a8"
    assert _entries(tmp_path) == ["q"]


def test_quantize_into_a_file_is_a_usage_error(ckpt, tmp_path, capsys):
    """Defect 3: `glm5 quantize SRC afile` ended in NotADirectoryError."""
    afile = tmp_path / "afile"
    afile.write_text("keep")
    assert cli.main(["quantize", "--scheme", "w8a16", str(ckpt), str(afile)]) == 2
    err = _one_line(capsys, "glm5 quantize: ")
    assert "afile is a file, expected a directory" in err
    assert afile.read_text() == "keep" and _entries(tmp_path) == ["afile"]


class _FakeProgram:
    """What glm5.ir.onnx_export.export returns, writing ``payload`` (the ONNX translation
    itself is tested in test_model_onnx.py; here the file handling is)."""

    def __init__(self, payload: bytes | None) -> None:
        self.payload = payload

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"partial")  # a failing writer leaves a partial file in its directory
            if self.payload is None:
                raise OSError(28, "No space left on device")
            f.write(self.payload)


def test_export_refuses_an_existing_file_unless_force(tmp_path, capsys, monkeypatch):
    """Defect 3: `glm5 export` silently overwrote an existing file (quantize refused)."""
    import glm5.ir.onnx_export as onnx_export

    payload = {"value": b"-new"}
    monkeypatch.setattr(onnx_export, "export",
                        lambda *a, **k: _FakeProgram(payload["value"]))
    out = tmp_path / "m.onnx"
    out.write_bytes(b"keep")
    argv = ["export", "--preset", "tiny", "--seq-len", "4", str(out)]
    assert cli.main(argv) == 2
    err = _one_line(capsys, "glm5 export: ")
    assert "m.onnx exists" in err and "--force" in err and out.read_bytes() == b"keep"
    payload["value"] = None  # a write that fails half-way: the old file stays, nothing else
    assert cli.main([*argv, "--force"]) == 1
    assert "No space left on device" in _one_line(capsys, "glm5 export: ")
    assert out.read_bytes() == b"keep" and _entries(tmp_path) == ["m.onnx"]
    payload["value"] = b"-new"
    assert cli.main([*argv, "--force"]) == 0
    assert out.read_bytes() == b"partial-new" and _entries(tmp_path) == ["m.onnx"]
    assert cli.main(["export", "--preset", "tiny", str(tmp_path / "new" / "x.onnx")]) == 0
    assert (tmp_path / "new" / "x.onnx").read_bytes() == b"partial-new"


# --------------------------------------------------------------------------- the framework
def test_usage_errors_are_one_line_exit_2(capsys):
    cases = [
        (["nosuch"], "glm5: argument COMMAND: invalid choice: 'nosuch'"),
        ([], "glm5: a command is required"),
        (["quantize", "--scheme", "w3a3", "a", "b"], "glm5 quantize: argument --scheme"),
        (["plan", "--preset", "tiny", "--chip", "h900"], "glm5 plan: --chip expected one of"),
        (["info", "--preset", "glm-6"], "glm5 info: unknown preset 'glm-6'"),
        (["quantize", "--scheme", "w8a16", "/no/such/dir", "/tmp/x"], "glm5 quantize: SRC"),
    ]
    for argv, start in cases:
        assert cli.main(argv) == 2, argv
        _one_line(capsys, start)


def test_unexpected_errors_are_one_line_exit_1_with_a_traceback_only_with_debug(capsys,
                                                                                monkeypatch):
    def broken(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli.info, "run", broken)
    assert cli.main(["info", "--preset", "tiny"]) == 1
    err = _one_line(capsys, "glm5 info: ")
    assert "unexpected RuntimeError: boom" in err and "--debug" in err
    for argv in (["--debug", "info", "--preset", "tiny"], ["info", "--preset", "tiny", "--debug"]):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback" in err and "RuntimeError: boom" in err
        assert err.splitlines()[-1].startswith("glm5 info: unexpected RuntimeError: boom")


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"glm5 {glm5.__version__}\n"


@pytest.mark.parametrize("argv", [["ops"], ["--help"]])
def test_closed_stdout_ends_quietly(argv):
    """Defect 3: `glm5 ops | head` ended in a BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, "-m", "glm5.cli", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the command writes anything
    err = p.stderr.read()
    p.stderr.close()
    rc = p.wait(timeout=60)
    assert err == b"" and rc in (0, 141), (rc, err)
    if argv == ["ops"]:
        assert rc == 141


def test_chip_scheme_and_preset_names_are_case_insensitive(ckpt, tmp_path, capsys):
    assert cli.main(["plan", "--preset", "TINY", "--chip", "H200", "--quant", "W8A8",
                     "--kv-dtype", "FP8", "--context", "64", "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert (inputs["chip"], inputs["quant"], inputs["kv_dtype"]) == ("h200", "w8a8", "fp8")
    assert cli.main(["info", "--preset", "Tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == {"preset": "tiny"}
    assert cli.main(["quantize", "--scheme", "W6A12", str(ckpt), str(tmp_path / "q")]) == 0
    assert json.loads((tmp_path / "q" / "quant_description.json").read_text())["scheme"] == \
        "w6a12"


def test_tables_are_cut_to_the_terminal_and_wide_prints_them_whole(capsys, monkeypatch):
    rows = cli.backend_rows()
    longest = max((r["reason"] for r in rows), key=len)
    monkeypatch.setenv("COLUMNS", "100")
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = out[: len(rows) + 2]
    assert all(len(line) <= 100 for line in table), table
    assert longest not in "\n".join(out) and any(line.endswith("…") for line in table)
    assert "--wide" in "\n".join(out)
    for argv in (["backends", "--wide"], ["--wide", "backends"]):
        assert cli.main(argv) == 0
        assert longest in capsys.readouterr().out
    # the parity table (formatted by the kit) is cut the same way
    monkeypatch.setenv("COLUMNS", "60")
    assert cli.main(["parity", "--backend", "reference", "--ops", "silu_mul", "--examples", "1",
                     "--profile", "smoke"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 60 for line in out) and out[-1].endswith("--wide prints it whole)")
    # output to a pipe or file (no COLUMNS, not a terminal) is never cut
    monkeypatch.delenv("COLUMNS")
    assert cli.main(["backends"]) == 0
    assert longest in capsys.readouterr().out


def test_op_shape_message_is_complete():
    """Defect 3: `silu_mul: ... does not fit 2*I with ` stopped mid-sentence."""
    with pytest.raises(glm5.OpInputError) as ei:
        glm5.ops.silu_mul(torch.zeros(2, 3))
    assert str(ei.value) == ("glm5.silu_mul: argument 'x' expected shape [..., 2*I], got a dim "
                             "of 3, which is not 2*I for any whole I >= 0")


# --------------------------------------------------------------------------- progress bars
class _Recorder:
    """Stands in for glm5.progress.progress_bar: records each bar's total and updates."""

    bars: list[_Recorder] = []

    def __init__(self, total, desc, unit="it", delay=0.5):
        self.total, self.desc, self.unit, self.done = total, desc, unit, 0
        _Recorder.bars.append(self)

    def update(self, n=1):
        self.done += n

    def set_description_str(self, desc):
        self.desc = desc

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_quantize_and_export_drive_their_progress_bars_to_the_end(ckpt, tmp_path, capsys,
                                                                  monkeypatch):
    import glm5.ir.onnx_export as onnx_export
    import glm5.progress

    monkeypatch.setattr(glm5.progress, "progress_bar", _Recorder)
    _Recorder.bars = []
    assert cli.main(["quantize", "--scheme", "w8a16", str(ckpt), str(tmp_path / "q")]) == 0
    (q,) = _Recorder.bars
    stored = (ckpt / "model.safetensors").stat().st_size
    assert q.unit == "B" and q.done == q.total and 0.9 * stored < q.total < stored
    _Recorder.bars = []
    monkeypatch.setattr(onnx_export, "export", lambda *a, on_step, **k: (
        [on_step(s) for s in onnx_export.EXPORT_STEPS], _FakeProgram(b""))[1])
    assert cli.main(["export", "--model", str(ckpt), str(tmp_path / "m.onnx")]) == 0
    load, export = _Recorder.bars
    assert load.done == load.total > 0
    assert export.done == export.total == len(onnx_export.EXPORT_STEPS) + 1


def test_progress_bars_only_on_a_terminal(monkeypatch):
    import io

    from glm5 import progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not progress.enabled()  # pytest captures stderr: not a terminal
    assert isinstance(progress.progress_bar(10, "x"), progress._NoBar)
    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert progress.enabled()
    with progress.progress_bar(10, "quantize w8a16", delay=0) as bar:
        bar.update(10)
    assert "quantize w8a16" in tty.getvalue()
