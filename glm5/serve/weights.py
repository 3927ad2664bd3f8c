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

    if getattr(engine.engine, "weights", None) is not None:  # a RankFront that takes updates
        _rank_routes(app, engine)
        return
    receiver = WeightReceiver(engine.engine.model, engine.engine.weights_version)

    @app.post(WEIGHTS_PATH)
    async def post_weights(request: Request) -> Response:
        data = await request.body()

        def apply() -> int:  # parsing and checking a large update takes a while: off the loop
            return apply_to_engine(engine, receiver, WeightUpdate.from_bytes(data))

        try:
            version = await asyncio.to_thread(apply)
        except StaleUpdateError as e:
            raise APIError(409, str(e)) from None
        except WeightSyncError as e:
            raise APIError(400, str(e)) from None
        return JSONResponse({"version": version})

    @app.get(WEIGHTS_PATH)
    async def get_weights(checksums: bool = True) -> Response:
        def read(e: Any) -> dict[str, Any]:  # both from one moment between steps
            out: dict[str, Any] = {"version": e.weights_version}
            if checksums:
                out["checksums"] = state_checksums(e.model)
            return out

        return JSONResponse(await asyncio.to_thread(engine.between_steps, read))


def _rank_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """`weight_routes` for a `RankFront`: the same answers, each update or checksum read a
    weights round between two steps."""

    def between(fn: Callable[[Any], Any]) -> Any:
        try:
            return engine.between_steps(fn)
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
        version = await asyncio.to_thread(between, lambda f: f.weights_round("apply", data))
        return JSONResponse({"version": version})

    @app.get(WEIGHTS_PATH)
    async def get_weights(checksums: bool = True) -> Response:
        def read(f: Any) -> dict[str, Any]:  # both from one moment between steps
            out: dict[str, Any] = {"version": f.weights_version}
            if checksums:
                out["checksums"] = f.weights_round("checksums")
            return out

        return JSONResponse(await asyncio.to_thread(between, read))
