"""`glm5 serve`: the options of the OpenAI-compatible HTTP server; `glm5.serve.server.serve`
builds the engine and runs it."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse

from glm5.cli.common import option_names
from glm5.cli.errors import CommandError, UsageError

# EngineConfig fields set by the options of the same name
ENGINE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "page_size",
                  "num_pages", "max_model_len", "num_speculative_tokens",
                  "long_prompt_tokens", "long_prompt_qps", "max_decode_slowdown",
                  "min_prefill_tokens")
DTYPES = ("float32", "bfloat16", "float16")

# The client-limit flags: (ServeLimits field, type, help); defaults in the help are
# ServeLimits' (README "Serving" has the same table, with vLLM's).
LIMIT_FLAGS = (
    ("max_body_bytes", int, "request body size; over it: 413 before it is read (8388608)"),
    ("header_timeout", float, "s for a request's line and headers to arrive (10)"),
    ("body_timeout", float, "s for a request's body to arrive; then 408 (30)"),
    ("timeout_keep_alive", float, "s an idle keep-alive connection stays open (5)"),
    ("max_header_bytes", int, "request line + headers size; over it: 400 (65536)"),
    ("max_connections", int, "open connections; over it: 503 and closed (default: the "
                             "descriptor limit, raised to its hard limit, less 256)"),
    ("stream_backlog", int, "outputs per choice a client may leave unread before its request "
                            "is aborted (256)"),
    ("stall_timeout", float, "s a client may leave its socket unwritable (not reading) before "
                             "it is dropped (30)"),
    ("graceful_timeout", float, "s after SIGTERM before open streams get a final error event "
                                "and the server exits (30)"),
    ("send_buffer_bytes", int, "each connection's kernel send buffer (SO_SNDBUF; default: the "
                               "kernel's autotuning)"),
)


def add_parser(sub) -> argparse.ArgumentParser:
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (FastAPI + uvicorn) "
                        "over the serving engine")
    sv.add_argument("model_dir", metavar="MODEL_DIR",
                    help="checkpoint directory (config.json + safetensors; tokenizer.json for "
                         "text and chat)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                    "127.0.0.1; 0.0.0.0 for every interface)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one)")
    sv.add_argument("--backend", help="ops backend (default: the usual selection)")
    sv.add_argument("--dtype", choices=DTYPES, type=str.lower,
                    help="weights dtype (default: the checkpoint's)")
    sv.add_argument("--indexer-dtype", choices=("bf16", "fp8"), type=str.lower,
                    help="the DSA indexer's precision (default: the checkpoint's config, "
                         "dsa_indexer_dtype); fp8: DeepSeek-V3.2's fp8 indexer, its keys "
                         "cached in fp8")
    sv.add_argument("--indexer-hadamard", action="store_true",
                    help="with the fp8 indexer: rotate its q and k by the Hadamard matrix before "
                         "quantizing (DeepSeek-V3.2's official code, SGLang) (default: the "
                         "checkpoint's config, dsa_indexer_hadamard)")
    sv.add_argument("--served-model-name", help="the model name clients send (default: the "
                    "directory's name)")
    sv.add_argument("--max-num-seqs", type=int, help="sequences in the running batch (256)")
    sv.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (8192)")
    sv.add_argument("--chunk-size", type=int, help="prefill tokens per request and step (512)")
    sv.add_argument("--max-decode-slowdown", type=_slowdown, metavar="X|off",
                    help="while decodes run, a step carrying prefill takes at most X times a "
                         "decode-only step (measured; 2.5); off: --chunk-size alone")
    sv.add_argument("--min-prefill-tokens", type=int,
                    help="the smallest prefill allowance of a step while decodes run (16)")
    sv.add_argument("--page-size", type=int, help="tokens per cache page (64)")
    sv.add_argument("--num-pages", type=int, help="cache pages (default: as many as 2 GiB hold)")
    sv.add_argument("--max-model-len", type=int,
                    help="context length (default: the model's max_position_embeddings)")
    sv.add_argument("--num-speculative-tokens", type=int, help="MTP drafts per step (0: off)")
    sv.add_argument("--no-prefix-cache", action="store_true", help="disable prefix reuse")
    sv.add_argument("--long-prompt-tokens", type=int,
                    help="prompts longer than this get their own rate limit (32768)")
    sv.add_argument("--long-prompt-qps", type=float,
                    help="long prompts admitted per second; over it: 429 + Retry-After (0.5)")
    sv.add_argument("--allow-weight-updates", action="store_true",
                    help="accept RL weight updates at POST /glm5/v1/weights (an RL rollout "
                         "engine; never on a public server)")
    lim = sv.add_argument_group("client limits", "what one client may cost the server (see "
                                "README, Serving: limits; vLLM sets none of these but keep-alive)")
    for name, kind, what in LIMIT_FLAGS:
        lim.add_argument("--" + name.replace("_", "-"), type=kind, help=what)
    par = sv.add_argument_group("across devices", "the ranks a GLM-5 deployment splits the "
                                "model over (README, Serving across devices); glm5 serve "
                                "starts them with torchrun, rank 0 answers HTTP")
    par.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel ranks (attention heads, MLP columns; experts split "
                          "over them too) (1)")
    par.add_argument("--ep", type=int, default=1,
                     help="expert-parallel ranks with tp 1 (each rank holds 1/N of the routed "
                          "experts) (1)")
    par.add_argument("--dp-attention", action="store_true",
                     help="with --ep: each rank runs attention on its own requests and pages "
                          "(all-to-all MoE); rank 0 routes requests by load and prefix hits")
    par.add_argument("--flashcomm", action="store_true",
                     help="with --tp: reduce-scatter / all-gather instead of all-reduce")
    par.add_argument("--flashcomm-min-tokens", type=int,
                     help="FlashComm from this many tokens per forward on (1000; `glm5 plan` "
                          "gives a chip's threshold)")
    par.add_argument("--rank-timeout", type=float,
                     help="s a collective may take; a rank lost answers 503 and stops the "
                          "server within it (60)")
    par.add_argument("--nnodes", default=None, help="nodes (multi-node: torchrun's rendezvous)")
    par.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT every node joins")
    par.add_argument("--rdzv-id", default="glm5-serve", help="the job's rendezvous id")
    sv.add_argument("--log-level", default="info", type=str.lower,
                    choices=("critical", "error", "warning", "info", "debug"),
                    help="uvicorn's log level (default info: one line per request)")
    sv.set_defaults(func=run)
    return sv


def _slowdown(text: str) -> float | str:
    """``--max-decode-slowdown``: a number (EngineConfig checks it is > 1) or ``off``."""
    if text.strip().lower() == "off":
        return "off"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 1 or 'off', got {text!r}")


def _given(args: argparse.Namespace, names) -> dict:
    got = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if got.get("max_decode_slowdown") == "off":
        got["max_decode_slowdown"] = None
    return got


def _parallel(args: argparse.Namespace) -> dict:
    got = {"tp": args.tp, "ep": args.ep, "dp_attention": args.dp_attention,
           "flashcomm": args.flashcomm}
    if args.flashcomm_min_tokens is not None:
        got["flashcomm_min_tokens"] = args.flashcomm_min_tokens
    return got


def _world(args: argparse.Namespace) -> int:
    from glm5.serve.ranks import ServeLayout, ServeLayoutError

    try:
        return ServeLayout(**_parallel(args)).world
    except ServeLayoutError as e:
        raise UsageError(option_names(str(e), {})) from None


def ranks_argv(args: argparse.Namespace, world: int) -> list[str]:
    """The torchrun command line that runs this command again on ``world`` ranks (``world /
    nnodes`` on this node; `glm5 launch`'s rendezvous options)."""
    from glm5.cli.launch import launch_argv

    if args.nnodes is None and args.rdzv_endpoint is not None:
        raise UsageError("--rdzv-endpoint expected with --nnodes")
    try:
        nnodes = int(str(args.nnodes).split(":")[-1]) if args.nnodes else 1
    except ValueError:
        raise UsageError(f"--nnodes expected N or MIN:MAX, got {args.nnodes!r}") from None
    if nnodes < 1 or world % nnodes:
        raise UsageError(f"--nnodes {args.nnodes}: the layout's {world} ranks expected to "
                         f"divide evenly over the nodes")
    la = argparse.Namespace(nproc=world // nnodes, nnodes=args.nnodes, timeout=None,
                            rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                            cmd=["-m", "glm5.cli", *args.argv])
    return launch_argv(la)


def _start_ranks(args: argparse.Namespace, world: int) -> int:
    """This command again, on ``world`` processes under torchrun (`ranks_argv`); SIGINT /
    SIGTERM go to rank 0 once it serves (it drains, then stops the others), to torchrun
    before. The exit status is torchrun's (non-zero when a rank failed)."""
    import os
    import signal
    import subprocess
    import tempfile

    from glm5.core.config import missing_config
    from glm5.serve.ranks import PIDFILE_ENV

    why = missing_config(args.model_dir)  # said once here, not by every rank
    if why:
        raise UsageError(f"MODEL_DIR {args.model_dir}: {why}")
    argv = ranks_argv(args, world)

    env = dict(os.environ)
    if args.rank_timeout is not None:
        env["GLM5_DIST_TIMEOUT"] = str(args.rank_timeout)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, said so it is not warned
    with tempfile.TemporaryDirectory(prefix="glm5-serve-") as tmp:
        pidfile = os.path.join(tmp, "rank0.pid")
        env[PIDFILE_ENV] = pidfile
        # torchrun in a session of its own: a terminal's Ctrl-C reaches this process only,
        # which hands it to rank 0 (its server drains, then tells the other ranks to stop:
        # a clean exit 0); torchrun would kill the ranks with a traceback and status 1
        proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent)

        got: list[int] = []

        def forward(sig, _frame) -> None:
            got.append(sig)
            try:
                with open(pidfile) as f:
                    os.kill(int(f.read()), sig)  # rank 0 serves: it drains and stops the rest
                return
            except (OSError, ValueError):  # not serving yet (loading) or gone
                pass
            proc.send_signal(sig)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            rc = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if rc:
        raise CommandError(f"a rank failed (torchrun exit status {rc}; its error is above)")
    if got:  # drained and stopped on a signal: end as one process would (uvicorn does so)
        signal.raise_signal(got[0])
    return 0


def _die_with_parent() -> None:
    """In torchrun's process: SIGTERM when `glm5 serve` itself dies (even by SIGKILL), so
    that no rank outlives the command (Linux; elsewhere nothing)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run(args: argparse.Namespace) -> int:
    import os

    world = _world(args)
    if world > 1 and "RANK" not in os.environ:  # not one of the ranks yet: start them
        return _start_ranks(args, world)
    if world > 1:
        _exit_rank(args)
    return _serve(args)


def _exit_rank(args: argparse.Namespace) -> None:
    """A rank serves, then leaves with os._exit once its server drained and its process group
    is destroyed: the interpreter's teardown can free gloo's worker threads while a peer closes
    its connections, and abort the process (SIGABRT, seen about once in 10 clean shutdowns)
    after everything was done. Its status is the command's (errors said as `glm5` says
    them)."""
    import os
    import sys

    from glm5.cli.errors import classify, err, one_line

    try:
        code = _serve(args)
    except KeyboardInterrupt:
        err("glm5 serve: interrupted")
        code = 130
    except Exception as e:  # noqa: BLE001 - said, then the status, as glm5.cli.main does
        code, msg = classify(e)
        err(f"glm5 serve: {one_line(msg)}")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _serve(args: argparse.Namespace) -> int:
    from glm5.serve.server import ServeError, ServeOptionError, serve

    engine_options = _given(args, ENGINE_OPTIONS)
    if args.no_prefix_cache:
        engine_options["enable_prefix_cache"] = False
    try:
        serve(args.model_dir, host=args.host, port=args.port, backend=args.backend,
              dtype=args.dtype, indexer_dtype=args.indexer_dtype,
              indexer_hadamard=args.indexer_hadamard,
              served_model_name=args.served_model_name, engine_options=engine_options,
              limits=_given(args, (name for name, _, _ in LIMIT_FLAGS)),
              allow_weight_updates=args.allow_weight_updates, log_level=args.log_level,
              parallel=_parallel(args), rank_timeout=args.rank_timeout)
    except ServeOptionError as e:  # name the command line's option, not serve's argument
        raise UsageError(option_names(str(e), {"model_dir": "MODEL_DIR"})) from None
    except ServeError as e:
        raise CommandError(str(e)) from None
    return 0
