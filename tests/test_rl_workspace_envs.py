"""The code-fix and terminal environments: tools run in the episode's sandbox, rewards from the
tests / the resulting state, escapes from the work directory refused, checkpoint + resume."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from glm5.rl.envs.base import EpisodeRunner, make_env
from glm5.rl.envs.workspace import BUGS, TERMINAL_TASKS

if shutil.which("bwrap") is None and os.environ.get("CI") != "true":
    pytest.skip("bubblewrap (bwrap) is not installed (CI installs it)", allow_module_level=True)


def _call(name, **args):
    inner = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return f"<tool_call>{name}{inner}</tool_call>"


@pytest.mark.parametrize("seed", range(len(BUGS)))
def test_codefix_reward_from_the_tests(seed):
    env = make_env("codefix")
    try:
        env.reset(seed)
        before = env.run_tests()
        assert before["failed"] > 0 and before["passed"] + before["failed"] >= 3
        name, _, fixed, _ = next(b for b in BUGS if b[0] == env.module)
        obs = json.loads(env.step(_call("read_file", path=f"{name}.py")).observation)
        assert "def " in obs[0]["result"]
        env.step(_call("write_file", path=f"{name}.py", content=fixed))
        r = env.step("fixed it")
        assert r.done and r.reward == 1.0 and r.info["tests"]["failed"] == 0
    finally:
        env.close()


def test_codefix_partial_and_broken_answers():
    env = make_env("codefix")
    try:
        env.reset(0)
        name = env.module
        r = env.step("no change")  # the buggy module as it was: some tests pass, some fail
        t = r.info["tests"]
        assert 0.0 < r.reward < 1.0 and r.reward == t["passed"] / (t["passed"] + t["failed"])
        env.reset(0)
        env.step(_call("write_file", path=f"{name}.py", content="def broken(:\n"))
        r = env.step("done")
        assert r.reward == 0.0 and "1:" in r.info["syntax"]  # the syntax check names the line
    finally:
        env.close()


def test_paths_cannot_leave_the_work_directory():
    env = make_env("codefix")
    try:
        env.reset(1)
        for path in ("/etc/passwd", "../outside.txt", "tests/../../x"):
            obs = json.loads(env.step(_call("read_file", path=path)).observation)
            assert "relative path inside the work directory" in obs[0]["error"], path
        obs = json.loads(env.step(_call("shell", command="cat /etc/shadow; touch /usr/x; "
                                                          "echo $?")).observation)[0]["result"]
        assert obs["stdout"].strip() != "0" and not os.path.exists("/usr/x")
    finally:
        env.close()


@pytest.mark.parametrize("k", range(len(TERMINAL_TASKS)))
def test_terminal_tasks_checked_by_state(k):
    env = make_env("terminal")
    try:
        seed = next(s for s in range(200) if __import__("random").Random(s).randrange(
            len(TERMINAL_TASKS)) == k)
        obs = env.reset(seed)
        r = env.step("nothing done")
        assert r.reward == 0.0  # the initial state does not pass
        env.reset(seed)
        solutions = {
            0: lambda o: (lambda name, word: f"mkdir {name} && printf '{word}\\n' > {name}/a.txt")(
                o.split("directory ")[1].split()[0], o.split("exactly '")[1].split("'")[0]),
            1: lambda o: "wc -l < data.txt > count.txt",
            2: lambda o: "cd logs && for f in *.log; do mv \"$f\" \"${f%.log}.txt\"; done",
        }
        out = json.loads(env.step(_call("shell", command=solutions[k](obs))).observation)
        assert out[0]["result"]["exit"] == 0, out
        r = env.step("done")
        assert r.reward == 1.0 and r.done
    finally:
        env.close()


def test_workspace_episode_resumes_with_its_files(tmp_path):
    env = make_env("terminal")
    run = EpisodeRunner(env, tmp_path / "t.json", every=1)
    try:
        run.reset(seed=3)
        run.step(_call("write_file", path="notes/x.txt", content="kept"))
    finally:
        env.close()
    env2 = make_env("terminal")
    try:
        run2 = EpisodeRunner(env2, tmp_path / "t.json", every=1)
        run2.resume()
        assert (env2.sandbox.workdir / "notes" / "x.txt").read_text() == "kept"
        assert env2.turns == 1
    finally:
        env2.close()


def test_links_planted_by_a_command_are_never_followed(tmp_path):
    """A sandboxed command can make links to host paths; the env's own file access (tools,
    checks, checkpoints) must not read or write through them."""
    secret = tmp_path / "host_secret.txt"
    secret.write_text("host data\n")
    env = make_env("terminal")
    try:
        env.reset(0)
        r = env.step(_call("shell", command=f"ln -s {secret} leak.txt && mkdir -p d && "
                                              f"ln -s {tmp_path} d/up && ln -s {tmp_path} upd"))
        assert json.loads(r.observation)[0]["result"]["exit"] == 0
        for args in ({"path": "leak.txt"}, {"path": "upd/host_secret.txt"},
                     {"path": "d/up/host_secret.txt"}):
            obs = json.loads(env.step(_call("read_file", **args)).observation)[0]
            assert "error" in obs and "host data" not in json.dumps(obs)
        for path in ("upd/new.txt", "d/up/host_secret.txt"):  # a link on the way: refused
            obs = json.loads(env.step(_call("write_file", path=path,
                                            content="pwned")).observation)[0]
            assert "error" in obs, obs
        state = env.state_dict()
        assert "host data" not in json.dumps(state) and "leak.txt" not in state["files"]
        assert env.entries("upd") == [] and env.text("leak.txt") is None
        # a link as the file itself is replaced by the new file, never written through
        obs = json.loads(env.step(_call("write_file", path="leak.txt",
                                        content="pwned")).observation)[0]
        assert "error" not in obs and env.text("leak.txt") == "pwned"
        assert secret.read_text() == "host data\n" and not (tmp_path / "new.txt").exists()
    finally:
        env.close()
