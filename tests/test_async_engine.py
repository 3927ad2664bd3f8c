"""AsyncEngine: a caller cancelled while its request is still being added (the engine thread
holds the lock for a step) must not leave that request running with nobody listening."""

from __future__ import annotations

import asyncio
import time

import torch

from glm5.core.config import preset
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.async_engine import AsyncEngine
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.engine.sampling import SamplingParams


class _SlowEngine(LLMEngine):
    def step(self):
        time.sleep(0.3)  # a long step: the engine lock stays held
        return super().step()


def test_cancel_during_add_aborts_the_request():
    torch.manual_seed(0)
    eng = _SlowEngine(GLM5ForCausalLM(preset("tiny")).float(),
                      EngineConfig(page_size=16, num_pages=64))
    ae = AsyncEngine(eng)

    async def consume(rid: str, n: int) -> None:
        async for _ in ae.generate(rid, [3, 4, 5], SamplingParams(max_tokens=n, ignore_eos=True)):
            pass

    async def main() -> None:
        busy = asyncio.create_task(consume("busy", 3))
        await asyncio.sleep(0.1)  # the engine thread is inside a step, holding the lock
        victim = asyncio.create_task(consume("victim", 50))
        await asyncio.sleep(0.05)  # the victim's add waits for the lock
        victim.cancel()  # the client goes away
        await asyncio.gather(victim, return_exceptions=True)
        await busy
        deadline = time.monotonic() + 10
        while "victim" in eng.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "victim" not in eng.requests, eng.requests.get("victim")
        assert eng.stats.aborted == 1
        assert await ae.shutdown(5)

    asyncio.run(main())
    # every page is free or held by the prefix cache
    assert eng.allocator.num_free + eng.radix.num_cached_pages == eng.allocator.num_pages
