"""examples/dist/generate.py through `glm5 launch` at 2 processes (gloo): tensor parallel, and
data-parallel attention + expert parallel. The tokens rank 0 prints are checked here against the
single-process model run in this process, and the example's own check must say OK; its verdict
function and argument checks are tested without processes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "dist" / "generate.py"


def _example():
    spec = importlib.util.spec_from_file_location("glm5_example_dist_generate", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _launch(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "glm5.cli", "launch", "--nproc", "2",
                           "--timeout", "30", "--", "python", str(EXAMPLE), *args],
                          capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)


@pytest.mark.parametrize("layout, batch", [(["--tp", "2"], 2),
                                           (["--ep", "2", "--dp-attention"], 4)])
def test_example_runs_under_glm5_launch_and_matches_one_process(layout, batch):
    new, plen = 4, 6
    p = _launch("--preset", "tiny", *layout, "--batch", str(batch), "--prompt-len", str(plen),
                "--new-tokens", str(new))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    printed = {int(m.group(1)): (eval(m.group(2)), eval(m.group(3))) for m in re.finditer(
        r"^sequence (\d+): prompt (\[[\d, ]*\]) -> (\[[\d, ]*\])$", p.stdout, re.M)}
    assert sorted(printed) == list(range(batch)), p.stdout  # rank 0 alone prints, every row
    ex = _example()
    model = ex.preset_model("tiny", 0)
    ids = ex.prompt(model.config.vocab_size, batch, plen, 1)
    want = model.generate(ids, new)
    for b, (pr, got) in printed.items():
        assert pr == ids[b].tolist()
        assert got == want[b, plen:].tolist(), (b, got, want[b, plen:].tolist())
    assert "check against the single-process model: OK" in p.stdout, p.stdout


def test_compare_flags_mismatches():
    ex = _example()
    toks = torch.tensor([[1, 2, 3], [4, 5, 6]])
    logits = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(0))
    assert ex.compare(toks, toks.clone(), logits, logits.clone(), False)[0]
    other = toks.clone()
    other[1, 2] = 7
    ok, why = ex.compare(other, toks, logits, logits, False)
    assert not ok and "1/2 sequences' tokens equal" in why
    off = logits.clone()
    off[0, 0, 0] += 1e-3  # equal tokens, logits beyond fp32 rounding
    assert not ex.compare(toks, toks, off, logits, False)[0]
    scale = float(logits.abs().max())
    off[0, 0, 0] = logits[0, 0, 0] + 0.1 * scale  # within the int8 budget (0.15)
    assert ex.compare(other, toks, off, logits, True)[0]  # int8: tokens may differ
    off[0, 0, 0] = logits[0, 0, 0] + 0.2 * scale
    ok, why = ex.compare(toks, toks, off, logits, True)
    assert not ok and "EXCEEDED" in why
    assert not ex.compare(toks[:1], toks, logits, logits, False)[0]  # shapes


@pytest.mark.parametrize("argv, world, msg", [
    (["--tp", "2"], 1, "--tp expected a divisor of the world size 1, got 2 (launch it"),
    (["--tp", "2", "--ep", "2"], 2, "--tp and --ep expected one at a time"),
    (["--dp-attention"], 2, "--dp-attention expected with --ep > 1"),
    (["--ep", "2", "--flashcomm"], 2, "--flashcomm expected with --tp > 1"),
    (["--tp", "2", "--int8"], 2, "--int8 expected with --flashcomm"),
    (["--ep", "2", "--dp-attention", "--batch", "3"], 2, "--batch expected a multiple of the "
     "world size 2"),
    (["--preset", "huge"], 1, "--preset expected one of"),
    (["--new-tokens", "0"], 1, "--new-tokens expected a positive integer, got 0"),
])
def test_bad_arguments_are_refused(argv, world, msg):
    ex = _example()
    with pytest.raises(ex.UsageError) as e:
        ex.check_args(ex.parse_args(argv), world)
    assert msg in str(e.value)


def test_distributed_md_model_example_runs_as_written(tmp_path):
    """docs/distributed.md's parallelize example, under glm5 launch at 2 processes: both ranks
    print the single-process model's greedy tokens."""
    text = (ROOT / "docs" / "distributed.md").read_text()
    code = next(b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
                if "parallelize(" in b)
    script = tmp_path / "model_example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, "-m", "glm5.cli", "launch", "--nproc", "2", "--timeout",
                        "30", str(script)], capture_output=True, text=True, timeout=180,
                       env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ex = _example()
    model = ex.preset_model("tiny", 0)
    ids = torch.randint(0, model.config.vocab_size, (2, 8),
                        generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, 4)[:, 8:].tolist()
    # the ranks share the pipe: a print's text and its newline may be split by the other's
    got = sorted(re.findall(r"rank (\d): (\[\[[\d, \[\]]*\]\])", p.stdout))
    assert got == [(str(r), str(want)) for r in (0, 1)], p.stdout
