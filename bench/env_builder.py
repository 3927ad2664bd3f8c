"""The environment builder on real projects: download small pure-Python projects' sdists from
PyPI (their own test suites), run `glm5.rl.envs.builder.build_and_test` on each in the
sandbox, and report the test entry found, pass / fail counts and time.

    python bench/env_builder.py --out bench/results/env_builder.json

Success = a test entry was found and the suite ran; a project whose sdist ships no tests is
reported as such (the builder cannot find what is not there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from glm5.rl.envs.builder import build_and_test

PROJECTS = ["six", "more-itertools", "idna", "iniconfig", "toolz", "sortedcontainers", "tomli"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--projects", default=",".join(PROJECTS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for name in a.projects.split(","):
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", ":all:", "-d", str(t / "dl"), name], check=True)
        for sdist in sorted((t / "dl").glob("*.tar.gz")):
            with tarfile.open(sdist) as tf:
                tf.extractall(t / "src", filter="data")
        for repo in sorted((t / "src").iterdir()):
            r = build_and_test(repo, timeout=600)
            rows.append({"project": repo.name, "ok": r.ok, "reason": r.reason,
                         "entry": r.entry.source if r.entry else None,
                         "paths": r.entry.paths if r.entry else None,
                         "passed": r.passed, "failed": r.failed, "errors": r.errors,
                         "skipped": r.skipped, "seconds": round(r.seconds, 2)})
            print(f"{repo.name:28} {'ok ' if r.ok else 'no '} {r.passed:6} passed "
                  f"{r.failed:4} failed {r.seconds:7.1f} s  {r.entry.source if r.entry else ''}"
                  f"  {'' if r.ok else r.reason}", flush=True)
    with_tests = [r for r in rows if r["entry"] is not None]
    summary = {"projects": len(rows), "with_a_test_entry": len(with_tests),
               "ran": sum(r["ok"] for r in rows),
               "success_rate_of_projects_with_tests": round(
                   sum(r["ok"] for r in with_tests) / max(len(with_tests), 1), 3),
               "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
