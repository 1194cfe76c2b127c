"""``scalefold train``: argument parsing only; the work happens in :mod:`scalefold.train.loop`."""

from __future__ import annotations

import argparse
import sys

from scalefold.train.config import CUDA_GRAPHS_MODES, PRECISIONS, PRESETS, preset_from_env

EXIT_ABORTED = 2  # the run aborted (too many non-finite steps): run_stop status=aborted was logged
EXIT_BAD_INPUT = 3  # a bad configuration, store, launch environment or checkpoint, refused before training


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``train`` (no arguments: the CPU demo)."""
    p = subparsers.add_parser(
        "train",
        help="train AlphaFold2 (no arguments: the CPU demo on a synthetic store)",
        description="Train AlphaFold2. Values come from the preset, then --config FILE (TOML or YAML), then "
        "SCALEFOLD_<OPTION> environment variables, then these flags. Launch under torchrun, srun or mpirun "
        "for data-parallel training.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="run preset (default: SCALEFOLD_PRESET, else PRESET "
                   "of a config_*.sh environment, else demo)")
    p.add_argument("--config", help="TOML/YAML file of training options (between the preset and the environment)")
    p.add_argument("--out", help="run directory (metrics.jsonl, MLPerf log, checkpoints/, curves.png)")
    p.add_argument("--store", help="dataset store (presets demo and tiny create a synthetic one there if absent)")
    p.add_argument("--synthesize-missing-store", action="store_true", default=None,
                   help="create a synthetic store at --store if it is absent (default only for the demo and tiny presets)")
    p.add_argument("--max-steps", type=int, help="training steps")
    p.add_argument("--eval-every", type=int, help="evaluate the SWA weights every N steps (0 = never)")
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every N steps (0 = never)")
    p.add_argument("--keep-last", type=int, help="checkpoints kept in --out/checkpoints (the newest K)")
    p.add_argument("--resume", action="store_true", default=None,
                   help="continue from the newest loadable checkpoint in --out (none there: start from step 0; "
                   "checkpoints that all fail to load: refused)")
    p.add_argument("--init-from", help="start from a reference-format checkpoint (weights + Adam state)")
    p.add_argument("--seed", type=int, help="run seed (data order, recycling counts, dropout)")
    p.add_argument("--deterministic", action="store_true", default=None, help="deterministic algorithms and data order")
    p.add_argument("--precision", choices=PRECISIONS, help="fp32, tf32, bf16 (autocast, fp32 master weights) or fp64")
    p.add_argument("--lr", type=float, help="base learning rate")
    p.add_argument("--target-lddt", type=float, help="stop when the eval lDDT-Cα reaches this")
    p.add_argument("--num-workers", type=int, help="data-loader worker processes")
    p.add_argument("--num-async-eval-ranks", type=int, help="the last N ranks evaluate asynchronously (0 = in the loop)")
    p.add_argument("--eval-timeout-s", type=float,
                   help="seconds without progress after which the evaluation ranks count as stuck (default 1800)")
    p.add_argument("--process-group-timeout-s", type=float,
                   help="timeout of torch.distributed collectives (default 1800)")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the Evoformer blocks")
    p.add_argument("--cuda-graphs", choices=CUDA_GRAPHS_MODES, help="CUDA graphs of the no-grad recycling passes, "
                   "captured before run_start (auto: on for CUDA without DAP/BP, eager elsewhere; on: refuse where "
                   "unusable; default auto)")
    p.add_argument("--dap", type=int, help="dynamic axial parallelism degree (issue 5)")
    p.add_argument("--bp", type=int, choices=(1, 2), help="branch parallelism degree (issue 5)")
    p.add_argument("--parallel-evoformer", action="store_true", default=None, help="parallel Evoformer (issue 5)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    p.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from scalefold.checkpoint.adapters import CheckpointError as ReferenceCheckpointError
    from scalefold.distributed.layout import LayoutError
    from scalefold.train.checkpoint_io import CheckpointError
    from scalefold.train.config import TrainConfig
    from scalefold.train.graphed_step import CudaGraphsUnavailable
    from scalefold.train.loop import StoreNotFoundError, TrainingAborted, train
    from scalefold.train.runtime import LaunchError

    overrides = {
        "out": args.out, "store": args.store, "max_steps": args.max_steps, "eval_every": args.eval_every,
        "checkpoint_every": args.checkpoint_every, "keep_last": args.keep_last, "resume": args.resume, "init_from": args.init_from,
        "seed": args.seed, "deterministic": args.deterministic, "precision": args.precision, "lr": args.lr,
        "target_lddt": args.target_lddt, "num_workers": args.num_workers, "progress": args.progress,
        "num_async_eval_ranks": args.num_async_eval_ranks, "compile": args.compile, "dap": args.dap,
        "bp": args.bp, "parallel_evoformer": args.parallel_evoformer, "cuda_graphs": args.cuda_graphs,
        "synthesize_missing_store": args.synthesize_missing_store, "eval_timeout_s": args.eval_timeout_s,
        "process_group_timeout_s": args.process_group_timeout_s,
    }  # fmt: skip
    preset = args.preset or preset_from_env()
    if preset not in PRESETS:
        print(f"scalefold train: unknown preset {preset!r} from the environment; expected one of {sorted(PRESETS)}",
              file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    try:
        cfg = TrainConfig.from_preset(preset, overrides=overrides, config_file=args.config)
    except (KeyError, ValueError, FileNotFoundError) as exc:  # bad config file / environment / flag value
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # KeyError's str() adds quotes
        print(f"scalefold train: configuration error: {text}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    try:
        result = train(cfg)
    except TrainingAborted as exc:
        print(f"scalefold train: aborted: {exc}", file=sys.stderr, flush=True)
        return EXIT_ABORTED
    except LayoutError as exc:  # --dap / --bp / --parallel-evoformer vs the launch's world size
        print(f"scalefold train: invalid parallel layout: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except CudaGraphsUnavailable as exc:  # --cuda-graphs on without CUDA (or with DAP/BP)
        print(f"scalefold train: configuration error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except (CheckpointError, ReferenceCheckpointError) as exc:  # corrupt / mismatching --init-from or --resume
        from scalefold.errors import shorten  # without PyTorch's weights_only advice; --resume lists every file

        print(f"scalefold train: checkpoint error: {shorten(str(exc), None)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except StoreNotFoundError as exc:  # --store absent and not to be synthesised
        print(f"scalefold train: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except LaunchError as exc:  # e.g. mpirun without mpi4py
        print(f"scalefold train: launch error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if result.out is not None:
        print(f"run directory: {result.out}")
    return 0
