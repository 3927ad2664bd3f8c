"""Multi-turn episodes on the engine: the chat-format token layout (`Dialogue`), trajectories
whose environment tokens are masked out of the loss, the engine's context equal to the
trajectory's (the trainer's logprob of every sampled token matches the engine's), and episodes
that end by the environment, the turn limit, the token budget, a timeout or an error — with
their earlier turns kept."""

from __future__ import annotations

import random

import pytest
import torch

from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.rl.envs.base import ENVS, StepResult, register_env
from glm5.rl.envs.dialogue import TRUNCATED, Dialogue
from glm5.rl.episodes import EnvTask, EpisodeLimits, EpisodePlayer
from glm5.rl.rollout import PromptGroup, RolloutWorker
from glm5.rl.trainer import pack, token_logprobs
from glm5.rl.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from glm5.text.bpe import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=400)


class ScriptedEnv:
    """Ends after ``turns`` turns with reward 1; records the actions; ``fail_at`` raises;
    ``sleep`` stalls each step."""

    name = "scripted"
    observation_role = "tool"
    log: list[str] = []

    def __init__(self, turns: int = 3, fail_at: int = 0, sleep: float = 0.0) -> None:
        self.turns, self.fail_at, self.sleep = turns, fail_at, sleep
        self.n = 0

    def reset(self, seed: int) -> str:
        self.n = 0
        return f"Scripted task {seed}: talk {self.turns} times."

    def step(self, action: str) -> StepResult:
        import time

        self.n += 1
        ScriptedEnv.log.append(action)
        time.sleep(self.sleep)
        if self.n == self.fail_at:
            raise RuntimeError("the environment broke")
        done = self.n >= self.turns
        return StepResult(f"result {self.n}", 1.0 if done else 0.25 * 0, done,
                          {"error": "x"} if self.n == 1 else {})

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, s):
        self.n = s["n"]


if "scripted" not in ENVS:
    register_env("scripted", ScriptedEnv)


def _engine(tok):
    cfg = preset("tiny").replace(vocab_size=tok.vocab_size, num_hidden_layers=1,
                                 indexer_types=["full"], mlp_layer_types=["dense"],
                                 num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).eval()
    return LLMEngine(model, EngineConfig(max_num_seqs=8, page_size=16, num_pages=256, seed=0))


def _play(tok, limits=EpisodeLimits(max_turns=6, max_episode_tokens=200), size=2, **params):
    d = Dialogue(tok)
    task = EnvTask("scripted", params, d, limits)
    inst = task.sample(random.Random(0))
    group = PromptGroup("g0", "scripted", inst.prompt_ids, size, max_tokens=6,
                        stop_token_ids=d.stop_token_ids, seed=3, meta=inst.meta)
    engine = _engine(tok)
    player = EpisodePlayer(engine, d, limits)
    worker = RolloutWorker(engine, "w0", episodes=player)
    ScriptedEnv.log = []
    worker.submit(group)
    out = []
    for _ in range(2000):
        out += worker.step()
        if worker.num_open() == 0:
            break
    player.close()
    return d, task, engine, out, worker


def test_dialogue_renders_segments_with_the_chat_template(tok):
    d = Dialogue(tok)
    obs_id = tok.token_to_id("<|observation|>")
    text = tok.decode(d.observation_ids("R", "tool", last_token=obs_id), False)
    assert text == "<tool_response>R</tool_response><|assistant|><think></think>"
    # the policy stopped on another token: the segment opens its own role token
    text = tok.decode(d.observation_ids("R", "tool", last_token=tok.token_to_id("<|user|>")),
                      False)
    assert text.startswith("<|observation|><tool_response>R")
    assert tok.decode(d.observation_ids("no", "user", None), False) == \
        "<|user|>no<|assistant|><think></think>"
    first = tok.decode(d.prompt_ids("Q?", [{"type": "function", "function": {"name": "f"}}]),
                       False)
    assert first.startswith("[gMASK]<sop><|system|>") and first.endswith(
        "<|user|>Q?<|assistant|><think></think>")
    assert sorted(d.stop_token_ids) == sorted(tok.token_to_id(s) for s in
                                              ("<|observation|>", "<|user|>", "<|endoftext|>"))
    with pytest.raises(ValueError, match="role"):
        d.observation_ids("R", "assistant")


def test_dialogue_action_drops_reasoning_and_stop_and_cuts_long_observations(tok):
    d = Dialogue(tok, thinking=True, max_observation_tokens=10)
    call = "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    ids = tok.encode("let me see</think>ok" + call) + [tok.token_to_id("<|observation|>")]
    assert d.action(ids) == ("ok" + call, "let me see")
    assert d.action(d.assistant_ids(call)) == (call, None)
    long = "word " * 200
    text = tok.decode(d.observation_ids(long, "user"), False)
    n = len(tok.encode(long)) - 10
    assert TRUNCATED.format(n=n) in text and text.count("word") < 20


def test_mask_keeps_environment_tokens_out_of_the_loss():
    t = Trajectory("g/0", "g", "x", [1, 2], [3, 4, 5, 6], [-0.5, 0.0, 0.0, -0.75], [1, 1, 1, 2],
                   advantage=1.0, mask=[1, 0, 0, 1])
    b = pack([t])
    assert b.targets.tolist() == [3, 6] and b.rollout_logp.tolist() == [-0.5, -0.75]
    # the hidden state predicting token 6 is at position P + 3 - 1 = 4
    assert b.rows.tolist() == [1, 4] and b.input_ids[0].tolist() == [1, 2, 3, 4, 5]
    assert t.sampled == [0, 3] and t.min_version == 1
    with pytest.raises(ValueError, match="mask"):
        Trajectory("g/0", "g", "x", [1], [3, 4], [0.0, 0.0], [0, 0], mask=[1])
    with pytest.raises(ValueError, match="mask"):
        Trajectory("g/0", "g", "x", [1], [3, 4], [0.0, 0.0], [0, 0], mask=[1, 2])


def test_episodes_interleave_turns_and_observations_token_for_token(tok):
    d, task, engine, out, worker = _play(tok, turns=3)
    assert len(out) == 2 and {t.traj_id for t in out} == {"g0/0", "g0/1"}
    obs_id, assistant = tok.token_to_id("<|observation|>"), tok.token_to_id("<|assistant|>")
    for t in out:
        ep = t.meta["episode"]
        assert ep["ended"] == "done" and ep["turns"] == 3 and ep["rewards"] == [0.0, 0.0, 1.0]
        assert ep["errors"] == 1  # the first step's info had an error
        s = task.score(t.meta, t.completion_ids)
        assert s == {"correctness": 1.0, "exact": 1.0, "format": pytest.approx(2 / 3)}
        # turns: sampled runs (mask 1) separated by observation segments (mask 0)
        runs, cur = [], [t.mask[0], 0]
        for m in t.mask:
            if m != cur[0]:
                runs.append(tuple(cur))
                cur = [m, 0]
            cur[1] += 1
        runs.append(tuple(cur))
        assert [r[0] for r in runs] == [1, 0, 1, 0, 1]
        masked = [i for i, m in enumerate(t.mask) if not m]
        assert all(t.logprobs[i] == 0.0 for i in masked)
        segs = tok.decode([t.completion_ids[i] for i in masked], False)
        assert "result 1" in segs and "result 2" in segs and "result 3" not in segs
        assert t.completion_ids.count(assistant) == 2  # one generation prompt per new turn
        assert t.finish_reason == "stop" and len(t.versions) == len(t.completion_ids)
    # the environment got each turn's text (stop tokens and reasoning removed)
    assert len(ScriptedEnv.log) == 6 and all("<|" not in a for a in ScriptedEnv.log)
    # what the engine conditioned each turn on is the trajectory itself: the trainer's
    # logprob of every sampled token equals the engine's
    model = engine.model
    b = pack(out)
    with torch.no_grad():
        lp = token_logprobs(model, b)[0]
    assert torch.allclose(lp, b.rollout_logp, atol=2e-4), (lp - b.rollout_logp).abs().max()
    del obs_id


def test_the_reward_gets_every_turns_text_and_the_tool_results(tok):
    """The staged reward of an episode reads what the policy wrote in each turn and what the
    environment answered (tests/test_rl_reward.py has the loop's wiring for single turns)."""
    from glm5.rl.reward import CompositeReward, RewardContext

    d, task, _, out, _ = _play(tok, turns=3)
    stops = set(d.stop_token_ids)
    for t in out:
        ep = t.meta["episode"]
        assert ep["observations"] == ["result 1", "result 2", "result 3"]
        assert ep["observation_role"] == "tool"
        ctx = RewardContext.from_trajectory(t, task.score(t.meta, t.completion_ids), task=task)
        # each sampled run (mask 1), decoded on its own, then the environment's answer to it
        runs, cur = [], []
        for x, m in zip(t.completion_ids + [None], t.mask + [0]):
            if m:
                cur.append(x)
            elif cur:
                runs.append(tok.decode([i for i in cur if i not in stops], True))
                cur = []
        assert len(runs) == 3
        assert ctx.turns == [{"role": "assistant", "text": runs[0]},
                             {"role": "tool", "text": "result 1"},
                             {"role": "assistant", "text": runs[1]},
                             {"role": "tool", "text": "result 2"},
                             {"role": "assistant", "text": runs[2]},
                             {"role": "tool", "text": "result 3"}]
        assert ctx.text == "\n".join(runs) and "result" not in ctx.text
        total, parts = CompositeReward()(ctx)
        assert set(parts) == {"correctness", "reasoning_steps", "clarity"}
        assert parts["correctness"] == 1.0 and 0.6 <= total <= 1.0
    # a long environment answer is kept as the policy saw it: cut, and the cut said
    text = "word " * 400
    assert d.cut(text).endswith(TRUNCATED.format(n=len(tok.encode(text)) - 256))


def test_episode_limits_and_errors_end_episodes_with_their_reason(tok):
    _, _, _, out, _ = _play(tok, EpisodeLimits(max_turns=2, max_episode_tokens=400), turns=5)
    assert {t.meta["episode"]["ended"] for t in out} == {"max_steps"}
    assert all(t.meta["episode"]["turns"] == 2 for t in out)
    _, _, _, out, _ = _play(tok, EpisodeLimits(max_turns=9, max_episode_tokens=30), turns=9)
    for t in out:
        assert t.meta["episode"]["ended"] == "length" and len(t.completion_ids) <= 30
    _, _, _, out, _ = _play(tok, turns=5, fail_at=2)
    for t in out:  # the environment broke at turn 2: the first turn's step is kept
        ep = t.meta["episode"]
        assert ep["ended"].startswith("error: RuntimeError: the environment broke")
        assert ep["rewards"] == [0.0] and ep["turns"] == 2
    _, _, _, out, _ = _play(tok, EpisodeLimits(max_turns=9, max_episode_tokens=400,
                                               episode_timeout_s=0.05), turns=9, sleep=0.06)
    assert {t.meta["episode"]["ended"] for t in out} == {"timeout"}


def test_worker_reports_unfinished_episodes_and_abort_closes_them(tok):
    d = Dialogue(tok)
    limits = EpisodeLimits()
    task = EnvTask("scripted", {"turns": 50}, d, limits)
    inst = task.sample(random.Random(1))
    group = PromptGroup("g7", "scripted", inst.prompt_ids, 3, max_tokens=4,
                        stop_token_ids=d.stop_token_ids, meta=inst.meta)
    engine = _engine(tok)
    player = EpisodePlayer(engine, d, limits)
    worker = RolloutWorker(engine, "w0", episodes=player)
    worker.submit(group)
    for _ in range(5):
        worker.step()
    assert worker.num_open() == 3
    (g,) = worker.in_flight()
    assert g.group_id == "g7" and g.pending == [0, 1, 2]
    assert [x.pending for x in worker.abort_all()] == [[0, 1, 2]]
    assert worker.num_open() == 0 and not engine.has_unfinished()
    assert not list(player.dir.iterdir())  # episode checkpoints removed with them
    # a different first observation on the worker than in the prompt is refused
    bad = PromptGroup("g8", "scripted", inst.prompt_ids, 1, meta={**inst.meta, "env_seed": 99})
    worker.submit(bad)
    assert worker.failed and "deterministic" in worker.failed[0][2]
    player.close()


def test_a_worker_without_a_tokenizer_refuses_environment_groups(tok):
    worker = RolloutWorker(_engine(tok), "w0")
    g = PromptGroup("g", "scripted", [1, 2], 2, meta={"env": "scripted", "env_seed": 0})
    with pytest.raises(ValueError, match="no episode player"):
        worker.submit(g)


# ---------------------------------------------------------------------------- the RL loop
ENV_TYPES = ("countdown", "search", "codefix", "terminal", "data")
needs_bwrap = pytest.mark.skipif(
    __import__("shutil").which("bwrap") is None and __import__("os").environ.get("CI") != "true",
    reason="bubblewrap (bwrap) is not installed (CI installs it)")


def _loop_cfg(tmp_path, mode="sync"):
    """examples/rl/agentic_ci.yaml (the example is what the test runs) into tmp_path."""
    from pathlib import Path

    import yaml

    from glm5.rl.config import RLConfig

    d = yaml.safe_load((Path(__file__).parents[1] / "examples/rl/agentic_ci.yaml").read_text())
    d["run"].update(mode=mode, out_dir=str(tmp_path))
    cfg = RLConfig.from_dict(d)
    assert [t.name for t in cfg.tasks] == list(ENV_TYPES)
    return cfg


@needs_bwrap
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_rl_loop_trains_on_a_mixture_of_five_environment_types(tmp_path, mode):
    import json

    from glm5.rl.loop import JOURNAL, RLRun

    run = RLRun(_loop_cfg(tmp_path, mode), resume=False, use_ray=False)
    try:
        s = run.train(2)
    finally:
        run.close()
    ws = json.loads((tmp_path / "warm_start.json").read_text())
    assert ws["warm_start_demos"] == 10 and ws["warm_start_tokens"] > 0
    # sync: each batch is one round of groups, every type in it; async: what the pool held
    assert all(r["task_types"] == 5 if mode == "sync" else r["task_types"] >= 2
               for r in s.history), s.history
    assert all(r["trained"] == 10 for r in s.history)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in s.history)
    trajs = [json.loads(x)["traj"] for x in (tmp_path / JOURNAL).read_text().splitlines()
             if json.loads(x)["kind"] == "traj"]
    assert {t["task_type"] for t in trajs} == set(ENV_TYPES)
    from glm5.rl.reward import DEFAULT_WEIGHTS, RewardContext

    assert run.reward.weights == DEFAULT_WEIGHTS  # the example's staged reward
    for t in trajs:
        ep = t["meta"]["episode"]
        assert ep["ended"] in ("done", "max_steps", "length") and ep["turns"] >= 1
        assert len(t["mask"]) == len(t["completion_ids"]) and sum(t["mask"]) >= 1
        # the reward's text: every turn the policy wrote, each with the environment's answer
        assert len(ep["observations"]) == ep["turns"]
        traj, task = Trajectory.from_dict(t), run.tasks[t["task_type"]]
        ctx = RewardContext.from_trajectory(traj, task.score(traj.meta, traj.completion_ids),
                                            task=task)
        assert [x["role"] for x in ctx.turns] == ["assistant", ep["observation_role"]] * \
            ep["turns"]
        assert ctx.text == "\n".join(x["text"] for x in ctx.turns[::2])
        assert 0.0 <= run.reward(ctx)[0] <= 1.0
    # countdown gives feedback and another try: multi-turn episodes with masked feedback
    multi = [t for t in trajs if t["meta"]["episode"]["turns"] == 2]
    assert multi and all(0 in t["mask"] for t in multi)
    # the run resumes from its checkpoint without a second warm start
    run = RLRun(_loop_cfg(tmp_path, mode), resume=True, use_ray=False)
    try:
        assert run.step == 2 and run.warm_start == {}
        assert run.train(3).steps == 3
    finally:
        run.close()


@needs_bwrap
def test_demonstrations_are_laid_out_as_rollouts_are(tmp_path):
    from glm5.rl.envs.dialogue import toy_tokenizer
    from glm5.rl.warmstart import demonstrations

    tok = toy_tokenizer(tmp_path / "tok", 512, ENV_TYPES, seeds=2)
    d = Dialogue(tok)
    tasks = [EnvTask(n, {}, d, EpisodeLimits()) for n in ENV_TYPES]
    demos = demonstrations(tasks, 2, seed=5)
    assert sorted({t.task_type for t in demos}) == sorted(ENV_TYPES) and len(demos) == 10
    for t in demos:
        text = tok.decode(t.completion_ids, False)
        assert t.reward == 1.0 and t.completion_ids[-1] in d.stop_token_ids
        if t.task_type != "countdown":  # tool results follow the call's <|observation|>
            assert "<|observation|><tool_response>" in text
            assert "<|observation|><|" not in text
        runs, cur = [], []
        for x, m in zip(t.completion_ids + [None], t.mask + [1]):
            if m == 0:
                cur.append(x)
            elif cur:
                runs.append(tok.decode(cur, False))
                cur = []
        for seg in runs:  # each environment answer: one rendered template segment
            assert seg.startswith("<tool_response>") and seg.endswith(
                "</tool_response><|assistant|><think></think>"), seg


@needs_bwrap
@pytest.mark.parametrize("name", ENV_TYPES)
def test_an_episode_reset_in_one_thread_is_stepped_in_another(name):
    """The rollout worker resets an episode in its own thread and steps it in an environment
    thread (SQLite connections, sandboxes and file handles must allow that)."""
    import concurrent.futures as cf

    from glm5.rl.envs.base import make_env

    env = make_env(name)
    try:
        env.reset(11)
        with cf.ThreadPoolExecutor(1) as pool:
            results = [pool.submit(env.step, a).result() for a in env.demonstration()]
        assert results[-1].done and sum(r.reward for r in results) == 1.0
    finally:
        getattr(env, "close", lambda: None)()


class EchoEnv(ScriptedEnv):
    name = "echo-plugin"


def test_environment_types_from_installed_packages_entry_points(monkeypatch):
    """A package declares `[project.entry-points."glm5.rl_envs"] name = "module:Class"`; the
    RL loop's workers (other processes too) find it by name."""
    import importlib.metadata as md

    from glm5.rl.envs import base
    from glm5.rl.tasks import is_env_task

    eps = md.EntryPoints([md.EntryPoint("echo-plugin", f"{__name__}:EchoEnv", "glm5.rl_envs"),
                          md.EntryPoint("broken", "no_such_module_x:Env", "glm5.rl_envs")])
    real = md.entry_points
    monkeypatch.setattr(md, "entry_points",
                        lambda **kw: eps.select(**kw) if kw.get("group") == "glm5.rl_envs"
                        else real(**kw))
    monkeypatch.delitem(base.ENVS, "echo-plugin", raising=False)
    assert is_env_task("echo-plugin") and not is_env_task("nothing-like-it")
    assert not is_env_task("reverse")  # a digit task stays a token task
    env = base.make_env("echo-plugin", turns=2)
    assert isinstance(env, EchoEnv) and env.turns == 2
    with pytest.raises(ValueError, match="'broken'.*failed to load: ModuleNotFoundError"):
        base.make_env("broken")
    with pytest.raises(ValueError, match="unknown environment type 'nothing-like-it'"):
        base.make_env("nothing-like-it")
    monkeypatch.delitem(base.ENVS, "echo-plugin")


def test_the_readme_environment_example_works(tok):
    """README's "Adding an environment" code, run as written: its demonstration solves the
    episode, a wrong lookup is an error observation, and it lays out as a rollout."""
    import re
    from pathlib import Path

    from glm5.rl.envs import base
    from glm5.rl.warmstart import demonstration

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", readme, re.S)
               if "class Capitals" in c]
    base.ENVS.pop("capitals", None)
    ns: dict = {}
    try:
        exec(compile(code, "README.md", "exec"), ns)
        env = base.make_env("capitals")
        assert "Kenya" in env.reset(0)
        from glm5.rl.envs.tools import tool_call

        bad = env.step(tool_call("lookup", country="Atlantis"))
        assert "no country 'Atlantis'" in bad.observation and not bad.done
        env.reset(1)
        rs = [env.step(a) for a in env.demonstration()]
        assert rs[-1].done and rs[-1].reward == 1.0
        task = EnvTask("capitals", {}, Dialogue(tok), EpisodeLimits())
        t = demonstration(task, random.Random(0))
        assert t.reward == 1.0 and 0 in t.mask
    finally:
        base.ENVS.pop("capitals", None)


def test_a_tool_env_without_check_answer_says_what_is_missing():
    from glm5.rl.envs.tools import ToolEnv

    class Bare(ToolEnv):
        pass

    with pytest.raises(NotImplementedError, match=r"Bare\.check_answer: .*must define"):
        Bare().check_answer("42")
