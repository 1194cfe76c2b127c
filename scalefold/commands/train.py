"""``scalefold train``: argument parsing only; the work happens in :mod:`scalefold.train.trainer`."""

from __future__ import annotations

import argparse
import sys
import traceback

from scalefold.config.options import add_arguments, overrides_from_args
from scalefold.config.training import PRESETS, TrainConfig, preset_from_env
from scalefold.errors import UserError

EXIT_ABORTED = 2  # the run aborted (too many non-finite steps): run_stop status=aborted was logged
# 4: another rank died or stalled (scalefold.distributed.heartbeat.EXIT_RANK_FAILED); 5: the run's last checkpoint
# could not be written (a full disk: scalefold.train.run_checkpoints.EXIT_CHECKPOINT_NOT_WRITTEN); docs/faults.md


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``train`` (no arguments: the CPU demo)."""
    p = subparsers.add_parser(
        "train",
        help="train AlphaFold2 (no arguments: the CPU demo on a synthetic store)",
        description="Train AlphaFold2. Values come from the preset, then --config FILE (TOML or YAML), then "
        "SCALEFOLD_<OPTION> environment variables, then these flags. Launch under torchrun, srun or mpirun "
        "for data-parallel training.",
    )
    p.add_argument("--config", help="TOML/YAML file of training options (between the preset and the environment)")
    add_arguments(p, TrainConfig)  # every other flag: from the options' one declaration (TrainConfig)
    p.set_defaults(handler=_run_train)


def resolve_recompute_policy(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its activation-checkpointing policy checked against the device before anything runs
    (:func:`scalefold.perf.recompute.resolve_policy`): ``auto`` becomes the fewest recomputing blocks whose
    predicted peak, with the calibrated margin, fits the device memory; on CUDA with the memory check on, an
    explicit policy that cannot fit raises ``PolicyDoesNotFit`` (a ``ValueError`` naming the prediction and
    the smallest ``N`` that fits). Elsewhere (CPU) an explicit policy is taken as it is; ``auto`` there is
    refused (no device memory to fit)."""
    import torch

    from scalefold.config.recompute import parse_checkpointing

    policy = parse_checkpointing(cfg.activation_checkpointing)
    if policy != "auto" and not (cfg.memory_check and torch.cuda.is_available()):
        return cfg
    from scalefold.perf.recompute import resolve_policy

    choice = resolve_policy(cfg)
    if choice is None:
        return cfg
    if policy == "auto":
        print(f"scalefold train: activation checkpointing auto -> {choice.policy} ({choice.blocks} of "
              f"{choice.total_blocks} blocks recompute: {choice.checkpointed_blocks}; predicted peak "
              f"{choice.probe.estimate.peak_bytes / 2**30:.2f} GiB, {choice.probe.calibrated_bytes / 2**30:.2f} GiB "
              f"with the margin, of {choice.usable_bytes / 2**30:.2f} GiB usable)", flush=True)  # fmt: skip
    return cfg.replace(activation_checkpointing=choice.policy)


def run_hooks(cfg: TrainConfig | None = None):
    """The optional features ``scalefold train`` wires into the Trainer: the start-up memory check
    (:func:`scalefold.perf.memory.check_fits`), the Cα trace picture
    (:func:`scalefold.inference.trace_plot.plot_checkpoints_on_chain`), each imported when it runs, and,
    given ``cfg`` with ``count_flops``, the step's FLOPs per recycling count and the device's peak for the
    ``tflops`` / ``mfu`` of every step (:func:`step_flops_hooks`)."""
    from scalefold.train.trainer import RunHooks

    def memory_check(cfg, model_cfg, device):
        from scalefold.perf.flops import count_step
        from scalefold.perf.memory import check_fits

        # the fake step of the FLOP count and the recompute policy, cached in this process: no second run
        return check_fits(cfg, model_cfg, device, estimate=lambda c: count_step(c, target="cuda").memory)

    def trace_picture(store, chain, panels, path):
        from scalefold.inference.trace_plot import plot_checkpoints_on_chain

        return plot_checkpoints_on_chain(store, chain, panels, path)

    flops = step_flops_hooks(cfg) if cfg is not None and cfg.count_flops else {}
    return RunHooks(memory_check=memory_check, trace_picture=trace_picture, **flops)


def step_flops_hooks(cfg: TrainConfig) -> dict:
    """``flops`` (:func:`scalefold.perf.flops.run_flops_table`: one fake step per configuration and machine,
    then a cached file), ``peak_flops`` and ``device_name`` (:mod:`scalefold.perf.devices`; an unknown GPU
    or the CPU: no peak, so FLOPs without MFU). Counted here, before the run's process group exists (the
    fake DAP group needs that). A count that fails costs one line, never the run."""
    import torch

    from scalefold.perf.devices import current_device_spec
    from scalefold.perf.flops import run_flops_table

    try:
        table = run_flops_table(cfg)
    except Exception as exc:  # noqa: BLE001 -- a measuring aid, not a requirement
        print(f"scalefold train: the step's FLOPs could not be counted ({type(exc).__name__}: {exc}); "
              "no tflops / mfu in metrics.jsonl", file=sys.stderr, flush=True)  # fmt: skip
        return {}
    spec = current_device_spec()
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"flops": table, "peak_flops": spec.peak_flops(cfg.precision) if spec is not None else None,
            "device_name": spec.name if spec is not None else name}  # fmt: skip


def _run_train(args: argparse.Namespace) -> int:
    """Every mistake in the input (configuration, store, layout, launch, checkpoint) is a ``UserError`` of the
    unit that finds it, reported by :mod:`scalefold.cli`; an aborted run is not the user's: its own status."""
    from scalefold.distributed.heartbeat import RankFailed
    from scalefold.train.reporting import print_run_files
    from scalefold.train.run_checkpoints import CheckpointNotWritten
    from scalefold.train.stopping import TrainingAborted, start_multiprocessing_helpers_ignoring_stop_signals
    from scalefold.train.trainer import train

    # the forkserver first: it imports the loader workers' modules while the options are read and the FLOPs
    # counted, so that the first batch after run_start does not wait for it (train() would start it later)
    start_multiprocessing_helpers_ignoring_stop_signals()
    overrides = overrides_from_args(args, TrainConfig)
    overrides.pop("preset")  # chosen first, below
    preset = args.preset or preset_from_env()
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r} from the environment; expected one of {sorted(PRESETS)}", label="")
    cfg = TrainConfig.from_preset(preset, overrides=overrides, config_file=args.config)
    cfg = resolve_recompute_policy(cfg)  # PolicyDoesNotFit, or auto without a device memory: a ConfigError
    try:
        result = train(cfg, run_hooks(cfg))
    except TrainingAborted as exc:
        print(f"scalefold train: aborted: {exc}", file=sys.stderr, flush=True)
        return EXIT_ABORTED
    except (RankFailed, CheckpointNotWritten) as exc:  # a peer's fault, a full disk: one line, its own status
        if getattr(args, "debug", False):
            traceback.print_exception(exc)
        print(exc.line if isinstance(exc, RankFailed) else f"scalefold train: {exc}", file=sys.stderr, flush=True)
        return exc.exit_status
    if result.out is not None:
        print_run_files(result.out, cfg.store)
        print("\n".join(result.time_account), flush=True)  # the last lines: where the time to train went
    return 0
