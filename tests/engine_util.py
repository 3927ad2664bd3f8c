"""Shared by the serving-engine tests: driving an engine to completion, bounded, so that a stuck
request fails the test instead of hanging it."""

from __future__ import annotations

from typing import Iterator

import pytest

from glm5.engine.engine import LLMEngine
from glm5.engine.outputs import RequestOutput
from glm5.engine.sampling import SamplingParams

MAX_STEPS = 400  # far more than any engine test needs (the slowest takes ~60)


def drive(eng: LLMEngine) -> Iterator[list[RequestOutput]]:
    """Step until nothing is left, yielding each step's outputs."""
    for _ in range(MAX_STEPS):
        if not eng.has_unfinished():
            return
        yield eng.step()
    pytest.fail(f"the engine did not finish in {MAX_STEPS} steps: {eng.requests}")


def run_all(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams | list
            ) -> list[RequestOutput]:
    """Add every prompt, step to completion; the final outputs in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        eng.add_request(f"r{i}", p, sp)
    done = {o.request_id: o for outs in drive(eng) for o in outs if o.finished}
    assert sorted(done) == sorted(f"r{i}" for i in range(len(prompts))), "a request was lost"
    return [done[f"r{i}"] for i in range(len(prompts))]
