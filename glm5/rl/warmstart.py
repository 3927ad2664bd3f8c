"""A supervised warm start from demonstrations, before RL.

A policy that has never emitted a tool call gets no reward from a tool-using environment, so
GRPO has nothing to compare. As in GLM-5's pipeline (SFT, then agentic RL), the policy first
learns the format from expert episodes: every environment type with a ``demonstration()``
plays its expert turns through the environment, laid out token for token as a rollout would be
(`glm5.rl.envs.dialogue`; the environment's tokens masked out), and the policy is trained on the
turns' tokens by cross-entropy (mean over the demonstrated tokens).
"""

from __future__ import annotations

import random
import time
from typing import Any, Sequence

import torch

from glm5.rl.envs.base import make_env
from glm5.rl.episodes import SUCCESS, close_env, declared_tools
from glm5.rl.trainer import pack, token_logprobs
from glm5.rl.trajectory import Trajectory


class DemonstrationError(RuntimeError):
    """An environment's demonstration does not solve its episode."""


def demonstration(task: Any, rng: random.Random, index: int = 0) -> Trajectory | None:
    """One expert episode of an `EnvTask` as a trajectory (mask 1 on the expert's turns, the
    stop token after each included); None when the environment type has no demonstrations.
    Raises `DemonstrationError` when the demonstration does not reach reward 1."""
    inst = task.sample(rng)
    env = make_env(task.name, **task.params)
    try:
        if not callable(getattr(env, "demonstration", None)):
            return None
        d = task.dialogue
        obs = env.reset(inst.meta["env_seed"])
        if d.prompt_ids(obs, declared_tools(env, task.limits)) != inst.prompt_ids:
            raise DemonstrationError(f"glm5 rl warm start: environment {task.name!r} is not "
                                     f"deterministic in its seed")
        ids: list[int] = []
        mask: list[int] = []
        total, done = 0.0, False
        for action in env.demonstration():
            turn = d.assistant_ids(action)
            ids += turn
            mask += [1] * len(turn)
            r = env.step(action)
            total += r.reward
            if r.done:
                done = True
                break
            obs_ids = d.observation_ids(r.observation, getattr(env, "observation_role", "user"),
                                        turn[-1])
            ids += obs_ids
            mask += [0] * len(obs_ids)
        if not done or total < SUCCESS:
            raise DemonstrationError(f"glm5 rl warm start: the demonstration of {task.name!r} "
                                     f"(seed {inst.meta['env_seed']}) ended with reward {total} "
                                     f"(done: {done}); expected an episode solved with reward 1")
    finally:
        close_env(env)
    n = len(ids)
    return Trajectory(f"demo/{task.name}/{index}", f"demo/{task.name}", task.name,
                      inst.prompt_ids, ids, [0.0] * n, [0] * n, reward=total,
                      meta={**inst.meta, "demonstration": True}, mask=mask)


def demonstrations(tasks: Sequence[Any], per_task: int, seed: int = 0) -> list[Trajectory]:
    """``per_task`` expert episodes of every task that has demonstrations."""
    rng = random.Random(seed)
    out = []
    for task in tasks:
        for i in range(per_task):
            t = demonstration(task, rng, i)
            if t is None:
                break
            out.append(t)
    return out


def supervised_warm_start(model: torch.nn.Module, trajs: Sequence[Trajectory], steps: int,
                          lr: float, batch_size: int, seed: int = 0) -> dict[str, float]:
    """Train ``model`` in place for ``steps`` AdamW steps on random batches of ``trajs``: the
    mean negative log-likelihood of their sampled (mask 1) tokens at temperature 1. Returns
    the first and last batch's loss, the seconds taken and the tokens trained on."""
    if not trajs:
        raise ValueError("glm5 rl supervised_warm_start: trajs expected at least one "
                         "demonstration")
    for name, v, lo in (("steps", steps, 1), ("batch_size", batch_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"glm5 rl supervised_warm_start: {name} expected an int >= {lo}, "
                             f"got {v!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    t0, losses, tokens = time.perf_counter(), [], 0
    for _ in range(steps):
        batch = [trajs[rng.randrange(len(trajs))] for _ in range(min(batch_size, len(trajs)))]
        b = pack(batch, device=model.device)
        lp = token_logprobs(model, b)[0]
        loss = -lp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        tokens += b.num_tokens
    return {"warm_start_loss_first": losses[0], "warm_start_loss_last": losses[-1],
            "warm_start_seconds": time.perf_counter() - t0, "warm_start_tokens": tokens}
