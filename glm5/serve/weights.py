"""The RL weight endpoints of `glm5 serve --allow-weight-updates` (``/glm5/v1/weights``):
`WeightUpdate`s applied between engine steps, and the version and checksums read back."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from glm5.engine.async_engine import AsyncEngine
from glm5.engine.weight_sync import (StaleUpdateError, WeightReceiver, WeightSyncError,
                                     WeightUpdate, apply_to_engine, state_checksums)
from glm5.serve.streams import APIError


WEIGHTS_PATH = "/glm5/v1/weights"


def weight_routes(app: FastAPI, engine: AsyncEngine, allow: bool) -> None:
    """``POST /glm5/v1/weights``: body = `WeightUpdate.to_bytes()` (application/octet-stream);
    it is applied between engine steps by a `WeightReceiver` over the engine's model, then the
    engine's weights version moves (tokens sampled after it carry the new version); replies
    ``{"version": new}``. An update that does not start from the version the engine holds is a
    409, a malformed or corrupt one (checksum mismatch, unknown tensor, wrong shape) a 400;
    either way the model is left as it was. ``GET /glm5/v1/weights``: ``{"version": v,
    "checksums": {name: sha256}}`` (`state_checksums`; ``?checksums=false``: the version only,
    without hashing every tensor). Without ``allow`` both answer 404. A server over ranks (the
engine a `glm5.engine.lockstep.RankFront` with a weights handler) answers alike: each update
goes to every rank in a weights round (`glm5.serve.rank_weights`), the checksums are of the
whole tensors assembled from the ranks' cuts, and a lost rank is a 503."""
    if not allow:
        async def off() -> Response:
            raise APIError(404, "weight updates are off on this server (start it with "
                           "`glm5 serve --allow-weight-updates`, or build_app(..., "
                           "allow_weight_updates=True))")

        app.add_api_route(WEIGHTS_PATH, off, methods=["GET", "POST"])
        return

    if getattr(engine.engine, "weights", None) is not None:
        # a RankFront: an update, or a checksum read, is a weights round over the ranks
        def applier(data: bytes) -> Callable[[Any], int]:
            return lambda f: f.weights_round("apply", data)

        def checksums_of(f: Any) -> dict[str, str]:
            return f.weights_round("checksums")
    else:
        receiver = WeightReceiver(engine.engine.model, engine.engine.weights_version)

        def applier(data: bytes) -> Callable[[Any], int]:
            up = WeightUpdate.from_bytes(data)  # parsed and checked before the engine waits
            return lambda e: apply_to_engine(e, receiver, up)

        def checksums_of(e: Any) -> dict[str, str]:
            return state_checksums(e.model)

    def between(make: Callable[[], Callable[[Any], Any]]) -> Any:
        """``make()``'s function run between two engine steps (off the event loop: a large
        update takes a while), its errors as the endpoint's status."""
        try:
            return engine.between_steps(make())
        except StaleUpdateError as e:
            raise APIError(409, str(e)) from None
        except WeightSyncError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            if getattr(e, "fatal_to_step", False):  # RankLost: the ranks cannot go on
                raise APIError(getattr(e, "http_status", 503), str(e)) from None
            raise

    @app.post(WEIGHTS_PATH)
    async def post_weights(request: Request) -> Response:
        data = await request.body()
        version = await asyncio.to_thread(between, lambda: applier(data))
        return JSONResponse({"version": version})

    @app.get(WEIGHTS_PATH)
    async def get_weights(checksums: bool = True) -> Response:
        def read(e: Any) -> dict[str, Any]:  # both from one moment between steps
            out: dict[str, Any] = {"version": e.weights_version}
            if checksums:
                out["checksums"] = checksums_of(e)
            return out

        return JSONResponse(await asyncio.to_thread(between, lambda: read))
