"""`glm5 serve` behind its options: `serve` builds the serving engine from a checkpoint
directory (model, tokenizer, `LLMEngine` under an `AsyncEngine`), binds the socket, builds the
app (`glm5.serve.app.build_app`) and runs it under uvicorn (`glm5.serve.http.make_server`)
until SIGINT / SIGTERM drains and stops it.

Errors name `serve`'s own arguments (``argument 'port'``), or EngineConfig's and ServeLimits'
fields, so that a command line can say them with its option names: a setting that cannot work
is a `ServeOptionError` (a ValueError), a server that cannot start with good settings (the
serve extra missing, a corrupt config.json or tokenizer, a port taken) a `ServeError`.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

import glm5
from glm5.core import checkpoint
from glm5.core.config import ConfigError, GLM5Config, missing_config
from glm5.engine.async_engine import AsyncEngine
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.engine.llm import load_tokenizer
from glm5.serve.limits import ServeLimits, raise_descriptor_limit


class ServeError(Exception):
    """The server cannot start, its settings being good: exit 1 on the command line."""


class ServeOptionError(ValueError):
    """A setting of `serve` cannot work; the message names it (``argument 'port'``)."""


def _say(line: str, err: bool = False) -> None:
    try:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
    except (OSError, ValueError):  # a closed stream: nothing more can be said
        if not err:
            raise


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one) and listening, before the model loads: a
    port in use fails in a second, not after the load."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeOptionError(f"argument 'host' {host}: not an address of this machine "
                               f"({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        # listening from now on: a client that connects once the "at http://..." line is out
        # waits in the backlog until the server accepts, instead of being refused while
        # uvicorn starts (a race seen in CI)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _check_model_dir(model_dir: str | Path) -> None:
    """``model_dir`` holds a valid config.json (a missing one is a setting error, an invalid
    one a `ServeError`)."""
    why = missing_config(model_dir)
    if why:
        raise ServeOptionError(f"argument 'model_dir' {model_dir}: {why}")
    try:
        GLM5Config.from_pretrained(Path(model_dir))
    except ConfigError as e:
        raise ServeError(str(e).removeprefix("glm5 config: ")) from e


def serve(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000,
          backend: str | None = None, dtype: str | torch.dtype | None = None,
          indexer_dtype: str | None = None, indexer_hadamard: bool = False,
          served_model_name: str | None = None,
          engine_options: Mapping[str, Any] | None = None,
          limits: Mapping[str, Any] | None = None, allow_weight_updates: bool = False,
          log_level: str = "info", parallel: Mapping[str, Any] | None = None,
          rank_timeout: float | None = None) -> None:
    """Serve the checkpoint ``model_dir`` at ``http://host:port/v1`` until SIGINT / SIGTERM.

    ``backend``: the ops' backend (None: the usual selection); ``dtype`` (a torch dtype or its
    name): the weights' (None: the checkpoint's); ``indexer_dtype`` / ``indexer_hadamard``: the
    DSA indexer's precision and rotation (None / False: the checkpoint's config);
    ``served_model_name``: the model name clients send (default: the directory's name);
    ``engine_options``: `EngineConfig` fields; ``limits``: `ServeLimits` fields;
    ``allow_weight_updates``: accept RL weight updates (`glm5.serve.app.build_app`; across
    ranks every rank applies each update to its own cut: `glm5.serve.rank_weights`).
    ``parallel``: `glm5.serve.ranks.ServeLayout` fields (tp, ep, dp_attention, flashcomm,
    flashcomm_min_tokens); a layout of more than one rank runs in each of torchrun's processes
    (`glm5 serve --tp N` starts them): rank 0 serves HTTP, the others follow it
    (`glm5.serve.ranks`); ``rank_timeout``: seconds a collective may take (default 60).
    Prints what it loads and where it listens; a checkpoint without tokenizer.json serves
    token-id prompts only (said on stderr)."""
    # a server of one process never needs glm5.parallel (torch.distributed), which ranks imports
    from glm5.serve import ranks  # lazy: see the line above

    try:
        layout = ranks.ServeLayout(**dict(parallel or {}))
    except ranks.ServeLayoutError as e:
        raise ServeOptionError(str(e)) from None
    if rank_timeout is not None and not rank_timeout > 0:
        raise ServeOptionError(f"argument 'rank_timeout' expected a positive number of "
                               f"seconds, got {rank_timeout}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ServeError(f"needs the serve extra ({e.name} is not installed): "
                         f"pip install 'glm5[serve]'") from None
    if not 0 <= port <= 65535:
        raise ServeOptionError(f"argument 'port' expected 0..65535, got {port}")
    try:
        engine_config = EngineConfig(**dict(engine_options or {}))
    except ValueError as e:
        raise ServeOptionError(str(e).removeprefix("glm5 EngineConfig: ")) from None
    try:
        serve_limits = ServeLimits(**dict(limits or {}))
    except ValueError as e:
        raise ServeOptionError(str(e).removeprefix("glm5 ServeLimits: ")) from None
    _check_model_dir(model_dir)
    if backend:
        b = glm5.get_registry().get(backend)  # an unknown name: KeyError
        ok, reason = b.is_available()
        if not ok:
            raise ServeOptionError(f"argument 'backend' {b.name} is unavailable here: {reason}")
    name = served_model_name or Path(model_dir).resolve().name
    ctx, own_ctx = ranks.join(layout, rank_timeout) if layout.world > 1 else (None, False)
    rank = ctx.rank if ctx is not None else 0
    front = None
    sock = None
    try:
        if rank == 0:
            raise_descriptor_limit()  # before the connection cap is derived from it
            sock = listen_socket(host, port)
        # lazy: fastapi and uvicorn are the serve extra, checked above to say so
        from glm5.serve.app import build_app
        from glm5.serve.http import make_server  # lazy: uvicorn, the serve extra (as above)

        if rank == 0:
            _say(f"glm5 serve: loading {model_dir}"
                 + (f" on {layout.world} ranks ({layout.describe()})" if ctx else ""))
        weights = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        hadamard = True if indexer_hadamard else None
        if ctx is None:
            model = checkpoint.load_model(model_dir, weights, indexer_dtype=indexer_dtype,
                                          indexer_hadamard=hadamard)
        else:
            model = ranks.load_rank_model(model_dir, layout, ctx, weights,
                                          indexer_dtype=indexer_dtype,
                                          indexer_hadamard=hadamard)
        try:
            tokenizer = load_tokenizer(Path(model_dir))
        except (OSError, ValueError) as e:  # a broken tokenizer file is a bad input
            raise ServeError(str(e)) from None
        if tokenizer is None and rank == 0:
            _say(f"glm5 serve: {model_dir} has no tokenizer.json: only token-id prompts are "
                 f"served (no text, no chat)", err=True)
        try:
            engine = LLMEngine(model, engine_config, tokenizer, backend)
            ranks.check_engine(engine, layout)
        except ValueError as e:
            raise ServeOptionError(str(e).removeprefix("glm5 engine: ")) from None
        updates = None
        if ctx is not None and allow_weight_updates:
            try:  # every rank: each applies an update to its own cut
                updates = ranks.weights(engine)
            except ranks.RankWeightsError as e:
                raise ServeOptionError(str(e).removeprefix("glm5 RankWeights: ")) from None
        if ctx is not None and rank != 0:
            ranks.follow(engine, layout, updates)  # until rank 0 stops (or a rank is lost)
            return
        if ctx is not None:
            front = ranks.front(engine, layout, updates)
        async_engine = AsyncEngine(front if front is not None else engine)
        app = build_app(async_engine, name, tokenizer,
                        allow_weight_updates=allow_weight_updates, limits=serve_limits)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        _say(f"glm5 serve: {name} at http://{shown}:{bound_port}/v1 "
             f"({engine.allocator.num_pages} pages of {engine_config.page_size} tokens, backend "
             f"{backend or 'auto'}; Ctrl-C or SIGTERM drains and stops)")
        # uvicorn handles SIGINT / SIGTERM: it stops accepting connections, lets the open ones
        # finish (for up to graceful_timeout s: then what is left gets a final error), then
        # the app's lifespan drains the engine (a second Ctrl-C forces the exit).
        server = make_server(app, log_level=log_level)
        if front is not None:
            server.reraise_signals = False  # `glm5 serve` raises it once every rank is done
            ranks.announce_rank0()
        # a lost rank: every open request has its 503; the server stops (exit status 1)
        async_engine.on_fatal = lambda e: setattr(server, "should_exit", True)
        server.run(sockets=[sock])
        if async_engine.fatal:
            raise ServeError(f"stopped: {async_engine.fatal}")
    except Exception as e:
        if getattr(e, "fatal_to_step", False):  # RankLost, CollectiveError: a rank was lost
            raise ServeError(str(e).removeprefix("glm5 serve: ")) from None
        raise
    finally:
        if sock is not None:
            sock.close()
        if front is not None and not front.lost:
            front.close()
        if own_ctx:
            ctx.destroy()
