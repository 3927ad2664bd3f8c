"""`glm5 rl train | plot`: the asynchronous RL loop run from a YAML config, and its runs
plotted (docs/rl.md)."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
from pathlib import Path

from glm5.cli.common import add_global_options
from glm5.cli.errors import CommandError, UsageError


def add_parser(sub) -> argparse.ArgumentParser:
    rl = sub.add_parser("rl", help="reinforcement learning: train a policy with the async RL "
                        "loop, plot runs (docs/rl.md)")
    rl_sub = rl.add_subparsers(dest="rl_command", required=True, metavar="SUBCOMMAND")
    rt = rl_sub.add_parser("train", help="run (or resume) an RL run from a YAML config")
    rt.add_argument("config", metavar="CONFIG.yaml",
                    help="the run's config (examples/rl/*.yaml; keys in glm5/rl/config.py)")
    rt.add_argument("--out", metavar="DIR", help="run directory: metrics.csv, tb/, checkpoint, "
                    "journal (default: the config's run.out_dir)")
    rt.add_argument("--steps", type=int, help="train until this many trainer steps in total "
                    "(default: run.steps)")
    rt.add_argument("--mode", choices=("sync", "async"), type=str.lower,
                    help="sync: rollouts and training alternate; async: they overlap "
                         "(default: run.mode)")
    rt.add_argument("--ray", action="store_true", help="run rollout workers, pool and trainer "
                    "as Ray actors on a local ray.init (needs the rl extra)")
    rt.add_argument("--no-resume", action="store_true", help="start from step 0 even if DIR "
                    "holds a checkpoint (its metrics.csv is started over)")
    rt.add_argument("--seed", type=int, help="run.seed: prompts and sampling (the model's "
                    "initialisation keeps model.init_seed)")
    rt.add_argument("--nproc", "--trainer-nproc", type=int, metavar="N", help="trainer.nproc: train on N "
                    "data-parallel ranks with FSDP2 (parameters, gradients and optimizer state "
                    "sharded); the command runs again under torchrun, rank 0 runs the loop "
                    "(with --ray: N trainer actors in a placement group)")
    rt.add_argument("--nnodes", metavar="N|MIN:MAX", help="nodes of the trainer's world "
                    "(torchrun rendezvous at --rdzv-endpoint, as `glm5 launch`)")
    rt.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="the rendezvous every node "
                    "joins (with --nnodes)")
    rt.add_argument("--rdzv-id", default="glm5", help="the job id of the rendezvous")
    rt.set_defaults(func=train)
    rp = rl_sub.add_parser("plot", help="reward, exact match, rollout throughput and trainer "
                           "idle fraction of one or more runs, one line per run")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                    help="run directories written by `glm5 rl train`")
    rp.add_argument("-o", "--output", required=True, metavar="OUT.png",
                    help="the figure (.png, .pdf, .svg; replaced if it exists)")
    rp.add_argument("--x", choices=("step", "time"), default="step",
                    help="x axis: trainer step (default) or wall time")
    rp.set_defaults(func=plot)
    for command in rl_sub.choices.values():  # --debug / --wide after the subcommand too
        add_global_options(command, suppress=True)
    return rl


def run(args: argparse.Namespace) -> int:
    """`glm5 rl SUBCOMMAND`."""
    return {"train": train, "plot": plot}[args.rl_command](args)


def rl_config(args: argparse.Namespace):
    """The RLConfig of ``args.config`` with the command line's overrides (a config error is a
    usage error naming the file and the key)."""
    try:
        import yaml
    except ImportError:
        raise CommandError("needs the rl extra (pyyaml is not installed): pip install "
                           "'glm5[rl]'") from None
    from glm5.rl.config import RLConfig, RLConfigError

    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps expected a positive integer, got {args.steps}")
    if args.seed is not None and args.seed < 0:
        raise UsageError(f"--seed expected an integer >= 0, got {args.seed}")
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc expected a positive integer, got {args.nproc}")
    try:
        cfg = RLConfig.from_yaml(args.config)
        d = cfg.to_dict()
        run = d["run"]
        for key, value in (("steps", args.steps), ("mode", args.mode), ("seed", args.seed),
                           ("out_dir", args.out)):
            if value is not None:
                run[key] = value
        if args.ray:
            run["ray"] = True
        if args.nproc is not None:
            d["trainer"]["nproc"] = args.nproc
        return RLConfig.from_dict(d)
    except RLConfigError as e:
        raise UsageError(f"{args.config}: {str(e).removeprefix('glm5 rl config: ')}") from None
    except yaml.YAMLError as e:
        raise CommandError(f"{args.config} is not valid YAML: {e}") from None


def _status(row: dict) -> str:
    return (f"step {int(row['step'])}: reward {row['reward']:.3f}, exact {row['exact']:.3f}, "
            f"trainer idle {row['trainer_idle_frac']:.0%}")


def train(args: argparse.Namespace) -> int:
    from glm5 import progress
    from glm5.rl.metrics import MetricsLogger

    cfg = rl_config(args)
    n = cfg.trainer.nproc
    if n > 1 and not cfg.run.ray:
        import os

        if "RANK" not in os.environ:  # not yet under torchrun: this command again, on n ranks
            return _start_ranks(args, n)
        from glm5.parallel import init_distributed

        if init_distributed().rank != 0:
            return _follow()
    elif args.nnodes is not None:
        raise UsageError("--nnodes expected with --nproc N > 1 (the trainer's ranks)")
    if cfg.run.ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise CommandError("--ray needs the rl extra (ray is not installed): pip install "
                               "'glm5[rl]'") from None
    from glm5.rl.loop import CHECKPOINT, RLRun

    import yaml

    out = Path(cfg.run.out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"run directory {out} (--out or run.out_dir) exists and is not a "
                         f"directory")
    out.mkdir(parents=True, exist_ok=True)
    # The resolved config (file + overrides) beside the run: what produced these metrics.
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    metrics = MetricsLogger(out, tensorboard=cfg.run.tensorboard)
    ws = cfg.warm_start
    if ws.demos and (args.no_resume or not (out / CHECKPOINT).exists()):
        print(f"glm5 rl train: warm start on {ws.demos} demonstration(s) per environment type, "
              f"{ws.steps} step(s) of batch {ws.batch_size} ...", flush=True)
    run = RLRun(cfg, out_dir=out, resume=not args.no_resume, metrics=metrics)
    if run.warm_start:
        w = run.warm_start
        print(f"glm5 rl train: warm start done: {w['warm_start_demos']:.0f} demonstrations, "
              f"loss {w['warm_start_loss_first']:.3f} -> {w['warm_start_loss_last']:.3f} in "
              f"{w['warm_start_seconds']:.1f} s", flush=True)
    try:
        metrics.truncate(run.step)  # rows past the checkpoint are recomputed
        target = cfg.run.steps
        start = run.step
        todo = f"steps {start + 1}..{target}" if start < target else \
            f"nothing to train: run.steps is {target}"
        print(f"glm5 rl train: {args.config} -> {out} ({cfg.run.mode}"
              f"{', ray' if cfg.run.ray else ''}, {f'resumed at step {start}, ' if start else ''}"
              f"{todo})", flush=True)
        drawn = progress.enabled()
        every = max(cfg.run.log_every, 1)
        with progress.progress_bar(max(target - start, 0), "rl train", unit="step",
                                   delay=0.0) as bar:
            def on_step(row: dict) -> None:
                if drawn:
                    # update first: setting the description redraws the bar, so each step
                    # shows even when it took less than tqdm's minimum redraw interval
                    bar.update(1)
                    bar.set_description_str(f"rl train: reward {row['reward']:.3f} exact "
                                            f"{row['exact']:.3f} idle "
                                            f"{row['trainer_idle_frac']:.0%}")
                elif int(row["step"]) % every == 0 or int(row["step"]) == target:
                    print(_status(row), flush=True)  # a log line where no bar is drawn

            summary = run.train(target, progress=on_step)
    finally:
        run.close()  # releases the trainer's other ranks (torchrun mode)
        metrics.close()
        if n > 1 and not cfg.run.ray:
            import torch.distributed as dist

            dist.destroy_process_group()
    done = summary.steps - start
    print(f"glm5 rl train: {done} step(s) in {summary.wall_s:.1f} s (now at step "
          f"{summary.steps}); final reward {summary.final_reward:.3f} (mean of the last 10% of "
          f"steps); trainer idle {summary.idle_fraction:.1%} of wall time")
    tb = f", TensorBoard {out / 'tb'}" if (out / "tb").is_dir() else ""
    print(f"metrics: {metrics.path}{tb}")
    ckpt = out / CHECKPOINT
    print(f"checkpoint: {ckpt}" if ckpt.exists() else
          f"checkpoint: none written (run.checkpoint_every = {cfg.run.checkpoint_every})")
    return 0


def _start_ranks(args: argparse.Namespace, world: int) -> int:
    """This command again on ``world`` ranks under torchrun (`glm5 serve`'s command line);
    the status is torchrun's: non-zero when a rank failed (the run resumes from its last
    checkpoint when the command is run again, at any --nproc)."""
    import os
    import subprocess

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, said so it is not warned
    return subprocess.call(ranks_command(args, world), env=env)


def ranks_command(args: argparse.Namespace, world: int) -> list[str]:
    """The torchrun command line that runs this `glm5 rl train` again on ``world`` ranks
    (``world / nnodes`` per node; `glm5 launch`'s rendezvous options)."""
    from glm5.cli.serve import ranks_argv

    # torchrun's parser reads every "--x" of the command line and finds "--nproc" ambiguous
    # (its --nproc-per-node): the ranks get the same option by its other name
    args = argparse.Namespace(**vars(args))
    args.argv = [("--trainer-nproc" + a[len("--nproc"):]) if a.split("=")[0] == "--nproc" else a
                 for a in args.argv]
    return ranks_argv(args, world)


def _follow() -> int:
    """Ranks 1..N-1: a trainer shard driven by rank 0's loop until it stops."""
    import torch.distributed as dist

    from glm5.rl.trainer_ranks import run_follower

    try:
        run_follower()
    finally:
        dist.destroy_process_group()
    return 0


def plot(args: argparse.Namespace) -> int:
    from glm5.rl.plot import plot_runs

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CommandError("needs matplotlib: pip install 'glm5[rl]'") from None
    if not Path(args.output).resolve().parent.is_dir():
        raise UsageError(f"-o {args.output}: no such directory "
                         f"{str(Path(args.output).parent)!r}")
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    if Path(args.output).suffix.lstrip(".").lower() not in kinds:
        raise UsageError(f"-o {args.output}: expected a file name ending in one of "
                         f"{', '.join('.' + k for k in sorted(kinds))}")
    try:
        out = plot_runs(args.run_dirs, args.output, x=args.x)
    except FileNotFoundError as e:  # a RUN_DIR that is not one: the command line is wrong
        raise UsageError(f"RUN_DIR {e.filename}: {e.strerror}") from None
    except ValueError as e:  # a metrics.csv that holds no usable rows: a bad input
        raise CommandError(str(e).removeprefix("glm5 rl plot: ")) from None
    print(f"wrote {out} ({len(args.run_dirs)} run(s), x = {args.x})")
    return 0
