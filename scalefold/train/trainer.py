"""The training loop of ``scalefold train``: :func:`train` and the :class:`Trainer` (build -> warm-up ->
step loop -> finish). Its parts are components in their own modules; the step itself is one object,
:class:`~scalefold.train.step.TrainingStep`, called once per step (points 2-6 below, no host read inside;
whole-step CUDA graphs with ``--cuda-graphs step``), whose results the loop reads once after it.

One step (supplement 1.11, MLPerf HPC OpenFold), on every data-parallel rank:

1. take the next ready batch (:class:`~.training_data.TrainingData`: the priority-queue loader, ``[1, ..., R]``;
   one loader per DAP group / BP pair; a sample the loader gives up on is replaced, so every rank takes
   exactly ``max_steps`` steps);
2. draw the recycling count ``n`` uniformly from ``{0 .. R-1}`` (a function of seed and step, so
   identical on every rank and after a resume) and keep ``t[..., :n + 1]``;
3. seed the forward pass from (seed, data-parallel rank, step) (dropout);
4. forward (no-grad recycling passes, CUDA-graphed where possible, then one grad pass), loss, backward;
   with several ranks DDP averages the gradients and its communication hook accumulates the squared
   norm of each reduced bucket (:class:`~scalefold.optim.clipping.GradClipper`), single-process runs take the
   norm of the flat gradient buffers;
5. one clip scale per step; a non-finite loss or gradient skips the step -- decided on the device, the
   same verdict on every rank (counted; too many in a row abort the run with ``run_stop status=aborted``:
   :class:`~.stopping.NonFiniteGuard`);
6. Adam + SWA over flat buffers (``FlatAdamSWA``) with the warm-up learning rate.

Components the loop calls: evaluation at the end of each train-eval cycle (:mod:`scalefold.evaluation`:
synchronous on the main training rank, or on the last ``num_async_eval_ranks`` ranks, which
:func:`train` sends to :func:`~scalefold.evaluation.server.serve_evaluations` before any training setup), the checkpoint
policy and the starting point (:mod:`.run_checkpoints`), the MLPerf cycles (:mod:`scalefold.mlperf.cycles`), the
CUDA-graphed forward (:mod:`scalefold.compilation.graphed_step`), stop handling (:mod:`.stopping`: SIGTERM / SIGUSR1:
checkpoint at the end of the step and exit 0) and the run's records (:mod:`.reporting`). Outputs (main
training rank only) in ``out``: ``metrics.jsonl`` (strict JSON: a non-finite value is ``null``),
``mlperf.log`` (a resumed run: ``mlperf_resumed_<step>.log``), ``checkpoints/``, ``curves.png``.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scalefold.checkpoint.files import CheckpointManager
from scalefold.compilation.cache import compile_with_rebuild, configure_compile_cache
from scalefold.compilation.graphed_step import (
    PARALLEL_EVOFORMER_UNCAPTURABLE,
    resolve_step_mode,
    setup_graphed_step,
    setup_step_graphs,
    synthetic_step_batch,
)
from scalefold.compilation.graphed_step import resolve_mode as resolve_graph_mode
from scalefold.compilation.regions import compile_blocks, warm_up
from scalefold.config.training import TrainConfig
from scalefold.data.pipeline import FeatureConfig
from scalefold.data.store import Store
from scalefold.distributed.layout import ParallelLayout
from scalefold.distributed.runtime import Runtime, init_distributed, resume_command, shutdown
from scalefold.evaluation.cache import validation_cache
from scalefold.evaluation.client import AsyncEvaluation, EvaluationRanksFailed
from scalefold.evaluation.server import serve_evaluations
from scalefold.evaluation.sync import EvalContext, SyncEvaluation
from scalefold.kernels import elementwise
from scalefold.losses import AlphaFoldLoss
from scalefold.mlperf import logger as mll
from scalefold.mlperf.clock import RunClock
from scalefold.mlperf.cycles import MLPerfCycles, mlperf_log_path, run_info
from scalefold.mlperf.provenance import write_provenance
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.model.factory import build_model, build_model_config
from scalefold.model.precision import (
    deterministic_environment,
    keep_fp32_regions,
    set_deterministic_algorithms,
    setup_precision,
)
from scalefold.optim.clipping import GradClipper
from scalefold.optim.flat_reduce import FlatGradReducer, graphed_reduce_line, resolve_grad_reduce
from scalefold.optim.lr_schedule import WarmupConstantLR
from scalefold.train.curves import read_metrics
from scalefold.train.reporting import (
    MetricsLog,
    TrainResult,
    announce,
    final_report,
    progress_bar,
    time_to_train_line,
    truncate_metrics,
)
from scalefold.train.run_checkpoints import (
    CheckpointNotWritten,
    CheckpointPolicy,
    choose_resume_checkpoint,
    init_from_checkpoint,
    resume_args,
    resume_from_checkpoint,
    save_checkpoint,
)
from scalefold.train.run_directory import check_out, check_starting_point, check_store, clear_previous_run, ensure_store
from scalefold.train.step import TrainingStep, forward_seed, make_optimizer, recycling_count
from scalefold.train.stopping import (
    NonFiniteGuard,
    StopRequest,
    TrainingAborted,
    start_multiprocessing_helpers_ignoring_stop_signals,
)
from scalefold.train.time_account import TimeAccount, summary_lines, write_account
from scalefold.train.training_data import TrainingData, day_before, split_chains, validation_chain_ids


@dataclass
class RunHooks:
    """Optional features a command wires into a run; the Trainer imports none of them.

    ``memory_check(cfg, model_cfg, device)`` returns a warning or ``None``: the start-up prediction of
    the step's peak memory (``cfg.memory_check``, main training rank, CUDA only); ``trace_picture(store,
    chain, panels, path)`` draws ``trace.png`` and returns ``(path, traces)`` (``cfg.trace_plot``).
    ``flops`` / ``peak_flops``: the step's FLOPs per recycling count and the device's peak, for the
    ``tflops`` / ``mfu`` of every step. ``scalefold train`` wires them all
    (:func:`scalefold.commands.train.run_hooks`); without a hook the feature is off.
    """

    memory_check: Callable[[TrainConfig, AlphaFoldConfig, torch.device], str | None] | None = None
    trace_picture: Callable[..., tuple[Any, list]] | None = None
    #: ``{n: (executed FLOPs, model FLOPs)}`` per rank of a step with ``n`` no-grad recycling passes
    #: (``scalefold.perf.flops.run_flops_table``): each step's record gets ``tflops``
    flops: Mapping[int, tuple[float, float]] | None = None
    #: the device's dense peak FLOP/s at the run's precision (None: unknown): records get ``mfu`` / ``hfu``
    peak_flops: float | None = None
    device_name: str | None = None


def train(cfg: TrainConfig, hooks: RunHooks | None = None) -> TrainResult:
    """Run ``cfg`` on every rank of the launch; returns a summary (everything else is in ``cfg.out``).

    Raises :class:`TrainingAborted` (after logging ``run_stop status=aborted``) when the run aborts,
    :class:`~.run_directory.StoreNotFoundError` when the store is missing and may not be synthesised,
    :class:`~scalefold.distributed.layout.LayoutError` when the rank layout does not fit the launch.
    """
    account = TimeAccount()  # where the run's seconds go (time_account.json): from here on
    check_store(cfg)  # every rank, before anything is logged: a missing store is a configuration error
    check_out(cfg)  # nor may a previous run in --out be replaced without --resume / --overwrite
    check_starting_point(cfg)  # a shipped --init-from is intact, and the target is not met before training
    if cfg.deterministic:
        deterministic_environment()  # CUBLAS_WORKSPACE_CONFIG before CUDA / cuBLAS initialise
    model_cfg = build_model_config(cfg)
    features = FeatureConfig.from_reference_config(model_cfg.to_dict())
    runtime = init_distributed(
        cfg.num_async_eval_ranks, timeout_s=cfg.process_group_timeout_s, dap=cfg.dap, bp=cfg.bp,
        parallel_evoformer=cfg.parallel_evoformer, crop_size=features.train_sequence_crop_size,
        stall_timeout_s=cfg.stall_timeout_s, dead_peer_timeout_s=cfg.dead_peer_timeout_s,
        fault_dir=Path(cfg.out) / "faults", resume=resume_command(default_args=resume_args(cfg)),
        preflight=lambda layout, device, rank: check_graph_modes(cfg, layout, device.type, rank),
    )  # fmt: skip
    parallel = runtime.parallel
    # inductor's and Triton's caches in --compile-cache (a subfolder per torch/Triton/GPU), before anything
    # compiles (--compile, or the Triton kernels on a GPU); on the CPU without --compile nothing compiles
    compiles = cfg.compile or runtime.device.type == "cuda"
    rank = runtime.rank if runtime.distributed else None
    compile_cache = configure_compile_cache(cfg.compile_cache, runtime.device, rank) if compiles else None
    role = "eval" if parallel.is_eval_rank else "train"
    announce(f"scalefold: rank {runtime.rank}/{runtime.world_size} backend {runtime.backend or 'none'} role {role}")
    if parallel.is_main_train_rank:
        print(f"scalefold: parallel layout: {parallel.describe()}", flush=True)
        if compile_cache is not None:
            print(f"scalefold: {compile_cache.describe()}", flush=True)
    numerics = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32)  # fmt: skip
    # from here on SIGTERM / SIGUSR1 (Slurm pre-emption; every process of every task gets it) ask for a
    # clean stop: training ranks checkpoint at the end of the step, evaluation ranks serve until training's
    # sentinel; the loader's helper processes and workers ignore them
    start_multiprocessing_helpers_ignoring_stop_signals()
    finished = False  # this rank's run returned: it meets its peers at the exit barrier (shutdown)
    try:
        with StopRequest() as stop_request:
            try:
                if parallel.is_eval_rank:  # asynchronous evaluation ranks: serve evaluations until training ends
                    result = _evaluation_rank(cfg, runtime, stop_request, model_cfg, features)
                else:
                    result = Trainer(cfg, runtime, stop_request, model_cfg, features, hooks, account).run()
            except Exception:  # a failed rank of a launch: the launcher's SIGTERM must not cut its line (below)
                if runtime.distributed:
                    stop_request.ignore_after_exit()
                raise
        finished = True
    except TrainingAborted as exc:  # an orderly abort (its own status), unless a lost peer (an evaluation rank) caused it
        failure = runtime.heartbeat.explain(exc, claim=False)
        if failure is not None:
            raise failure from exc
        raise
    except Exception as exc:  # a dead or stalled peer: one line naming it, not the transport's traceback
        failure = runtime.heartbeat.explain(exc)
        if failure is not None:
            raise failure from exc
        raise
    finally:  # process-wide switches go back to what the caller had
        if cfg.compile:
            elementwise.disable()  # the compiled elementwise chains (compile_blocks' default region)
        set_deterministic_algorithms(numerics[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = numerics[1:]
        shutdown(runtime, clean=finished)
    if result.unsaved_checkpoint is not None:  # a full disk took the last checkpoint: the run fails, after its peers
        raise CheckpointNotWritten(f"the run's last {result.unsaved_checkpoint}; after freeing space, continue "
                                   f"from it with: {resume_command(default_args=resume_args(cfg))}")  # fmt: skip
    return result


def check_graph_modes(cfg: TrainConfig, layout: ParallelLayout, device_type: str, rank: int = 0) -> None:
    """``--cuda-graphs`` and ``--grad-reduce`` against the launch, on every rank before the process group forms
    (:func:`~scalefold.distributed.runtime.init_distributed`'s ``preflight``): graphs where they cannot run are
    refused (:class:`~scalefold.compilation.graphed_step.CudaGraphsUnavailable`, one line per rank, exit status 3;
    evaluation ranks included, which would otherwise wait for a run_start that never comes); whole-step graphs on
    several training ranks take the capturable flat gradient all-reduce, said in one line by the main rank."""
    unsupported = PARALLEL_EVOFORMER_UNCAPTURABLE if cfg.parallel_evoformer else None
    if cfg.cuda_graphs != "step":  # the recycling passes' graphs (step: the whole step's, below)
        resolve_graph_mode(cfg.cuda_graphs, device_type, model_parallel=layout.model_parallel, unsupported=unsupported)
    graphed = cfg.cuda_graphs == "step"
    flat = resolve_grad_reduce(cfg.grad_reduce, layout.num_train_ranks, graphed=graphed) == "flat"
    resolve_step_mode(cfg.cuda_graphs, device_type, layout.model_parallel, layout.num_train_ranks, bp=cfg.bp,
                      flat_reduce=flat)  # fmt: skip
    line = graphed_reduce_line(cfg.grad_reduce, layout.num_train_ranks) if graphed else None
    if line is not None and rank == layout.main_train_rank:
        print(line, flush=True)


def prepare_run(cfg: TrainConfig, runtime: Runtime, checkpoints: CheckpointManager) -> tuple[Path | None, dict | None]:
    """What every rank (training and evaluation) does before the model exists: rank 0 creates a missing
    synthetic store, then every rank learns the ``--resume`` checkpoint, if any (collective)."""
    if runtime.rank == 0:
        ensure_store(cfg)
    if runtime.distributed:
        dist.barrier()
    return choose_resume_checkpoint(cfg, runtime, checkpoints) if cfg.resume else (None, None)


def _evaluation_rank(cfg: TrainConfig, runtime: Runtime, stop_request: StopRequest, model_cfg: AlphaFoldConfig,
                     features: FeatureConfig) -> TrainResult:  # fmt: skip
    """An asynchronous evaluation rank: the run's preamble, training's ``run_start``, then serve."""
    dtype, autocast = setup_precision(cfg.precision, cfg.deterministic)
    resume_path, _ = prepare_run(cfg, runtime, CheckpointManager(Path(cfg.out) / "checkpoints", keep_last=cfg.keep_last))
    if runtime.distributed:  # training's run_start: the validation features are built after it (timed)
        dist.barrier()
    # a SIGTERM / SIGUSR1 meanwhile (stop_request) changes nothing: training decides when it ends
    build = lambda: AlphaFold(model_cfg, parallel_evoformer=cfg.parallel_evoformer).to(runtime.device, dtype)  # noqa: E731
    with Store.open(Path(cfg.store)) as store:
        val_ids = validation_chain_ids(store, cfg)
    serve_evaluations(cfg, runtime, build, features, val_ids, mlperf_log_path(cfg, resume_path), autocast, dtype)
    if stop_request.requested:
        announce(f"scalefold train: evaluation rank {runtime.rank}: {stop_request.signal_name} received; served "
                 "evaluations until training ended; exiting")  # fmt: skip
    return TrainResult(out=None, steps=0, final_loss=float("nan"))


class Trainer:
    """One training rank's run: :meth:`build` (MLPerf init block, model, optimizer, starting point),
    :meth:`warm_up` (compile, DDP, CUDA graphs; before run_start), :meth:`start` (run_start, data,
    evaluation), :meth:`fit` (the step loop), :meth:`finish` (loader, evaluations, logs, report)."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime, stop_request: StopRequest, model_cfg: AlphaFoldConfig,
                 features: FeatureConfig, hooks: RunHooks | None = None, account: TimeAccount | None = None) -> None:  # fmt: skip
        self.cfg, self.runtime, self.stop_request = cfg, runtime, stop_request
        self.account = account or TimeAccount()  # the run's phases (scalefold.train.time_account)
        self.hooks = hooks or RunHooks()
        self.model_cfg, self.features = model_cfg, features
        self.parallel = runtime.parallel
        self.main = self.parallel.is_main_train_rank
        self.device = runtime.device
        self.dtype, self.autocast = setup_precision(cfg.precision, cfg.deterministic)
        self.out = Path(cfg.out)
        self.metrics_path = self.out / "metrics.jsonl"
        self.eval_every = cfg.eval_every or cfg.max_steps or 1
        self.ddp_world = self.parallel.num_train_ranks if runtime.distributed else 1
        self.timings: dict[str, float] = defaultdict(float)
        self.clock = RunClock()  # time to train, carried across --resume

    def run(self) -> TrainResult:
        self.account.switch("init_build")
        self.build()
        self.account.switch("init_warm_up")
        self.warm_up()
        self.account.switch("init_other")
        self.start()
        return self.fit()

    # -- build: inside the MLPerf init block (expensive setup belongs between init_start and init_stop) --

    def build(self) -> None:
        cfg, main = self.cfg, self.main
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            if cfg.overwrite and not cfg.resume and clear_previous_run(self.out):
                print(f"scalefold train: --overwrite: the previous run's outputs in {self.out} were deleted", flush=True)
        # the file is named once the starting point is known (a resumed run logs to its own file)
        self.mllog = mll.MLPerfLogger.for_rank(
            self.runtime.rank, (self.parallel.main_train_rank,), None, instance=mll.throughput_instance(), deferred=True
        )  # fmt: skip
        self.mllog.init_start()
        self.runtime.heartbeat.on_fatal.append(self._log_abort)  # a rank ended by its heartbeat: run_stop first
        self.checkpoints = CheckpointPolicy(cfg, self.runtime, self.out)
        resume_path, resume_ckpt = prepare_run(cfg, self.runtime, self.checkpoints.manager)
        self.mllog.open_file(mlperf_log_path(cfg, resume_path))
        if main:  # the code and machine behind this log, for `scalefold submission pack`
            write_provenance(self.out, self.runtime.num_nodes, self.runtime.local_world_size, self.device.type == "cuda")
        if main and cfg.memory_check and self.device.type == "cuda" and self.hooks.memory_check is not None:
            self._check_memory()
        # model, loss, optimizer (flat buffers built before the DDP wrap)
        # --grad-reduce: DDP (the factor hooks on the model) or the flat buffers' reducer (the factors fused into it)
        self.grad_reduce = resolve_grad_reduce(cfg.grad_reduce, self.ddp_world, graphed=cfg.cuda_graphs == "step")
        self.model = self.parallel.wrap(build_model(cfg, self.model_cfg, self.device, self.dtype),
                                        grad_hooks=self.grad_reduce != "flat")  # DAP/BP (+ grad factors)
        self.eval_model = build_model(cfg, self.model_cfg, self.device, self.dtype, training=False) if main else None
        self.loss_fn = AlphaFoldLoss(self.model_cfg.loss_config)
        self.opt = make_optimizer(cfg, self.model, report=partial(print, flush=True) if main else None)
        if self.eval_model is not None:
            self.opt.bind_module_to_swa(self.eval_model)  # zero-copy: evaluation reads the SWA buffer
        if self.autocast:  # bf16 compute; the structure module and the heads stay fp32
            for module in (self.model, self.eval_model):
                if module is not None:
                    keep_fp32_regions(module)
        self.lr_schedule = WarmupConstantLR(self.opt.lr, base_lr=cfg.lr, warmup_lr_init=cfg.warmup_lr_init,
                                            warmup_lr_iters=cfg.warmup_steps)  # fmt: skip
        if main:
            print(f"model {cfg.model_preset}: {self.opt.num_params:,} parameters; "
                  f"{self.parallel.num_train_ranks} training rank(s)", flush=True)  # fmt: skip
        self.init_sha = self._init_from() if cfg.init_from else None
        self.start_step = self._resume(resume_path, resume_ckpt)

    def _log_abort(self) -> None:
        """The MLPerf log's ``run_stop aborted`` and the metrics so far, from the heartbeat's thread (the main
        thread is blocked by a stalled peer)."""
        self.mllog.run_stop(mll.STATUS_ABORTED)
        self.mllog.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.flush()

    def _check_memory(self) -> None:
        """Predict the step's peak memory per rank (fake tensors, ``scalefold estimate-memory``); warn, naming
        the DAP size that fits, when it exceeds the device. A failing estimate never stops the run."""
        try:
            warning = self.hooks.memory_check(self.cfg, self.model_cfg, self.device)
        except Exception as exc:  # noqa: BLE001 -- a planning aid, not a requirement
            warning = f"the memory estimate failed ({type(exc).__name__}: {exc}); training goes on"
        if warning:
            print(f"scalefold train: WARNING: {warning}", flush=True)

    def _init_from(self) -> str:
        """``--init-from``: every training rank loads the file; only the logging rank hashes it (1.1 GiB),
        then shares the hash."""
        iteration, sha = init_from_checkpoint(self.cfg.init_from, self.model, self.opt, hash_file=self.main,
                                              say=partial(print, flush=True) if self.main else None)  # fmt: skip
        if self.runtime.distributed and self.parallel.num_train_ranks > 1:
            box = [sha]
            dist.broadcast_object_list(box, src=self.parallel.main_train_rank, group=self.parallel.train_group)
            sha = box[0]
        if self.main:
            print(f"init checkpoint: {self.cfg.init_from}", flush=True)  # a line of its own, for scripts
            print(f"initialised from {self.cfg.init_from} (iteration {iteration}, sha256 {sha})", flush=True)
        return sha

    def _resume(self, path: Path | None, ckpt: dict | None) -> int:
        """The first step's predecessor: the ``--resume`` checkpoint's step (metrics after it dropped), else 0
        (a fresh start: an old ``metrics.jsonl`` goes)."""
        if ckpt is None:
            if self.main and self.metrics_path.exists():  # a fresh start (also --resume without any checkpoint)
                self.metrics_path.unlink()
            return 0
        step = resume_from_checkpoint(ckpt, self.cfg, self.model, self.opt, source=path)
        self.clock.carry(ckpt, step)
        if self.main:
            truncate_metrics(self.metrics_path, step)
            print(f"resumed from step {step} ({path})", flush=True)
        return step

    # -- warm-up: compiled blocks, DDP, CUDA graphs (all before run_start) -------------------------------

    def warm_up(self) -> None:
        cfg, model = self.cfg, self.model
        if cfg.compile:  # one warm-up step on a synthetic batch of the training shapes
            t_compile = time.perf_counter()
            regions = tuple(r.strip() for r in cfg.compile_regions.split(",") if r.strip())
            self.compiled = compile_blocks(model, regions=regions, backend=cfg.compile_backend,
                                           strict=cfg.compile_strict, loss_fn=self.loss_fn)  # fmt: skip
            n_warm = min(1, self.features.num_ensembles - 1)  # a no-grad recycling pass and the grad pass
            synthetic = synthetic_step_batch(self.features, model, self.device, self.dtype)
            warm = {k: v[..., : n_warm + 1] for k, v in synthetic.items()}
            compile_with_rebuild(lambda: warm_up(model, warm, self.autocast, self.loss_fn))  # a corrupt cache: rebuilt
            self.compiled.mark_warm()
            if cfg.compile_strict:
                self.compiled.check()  # graph breaks raised already; recompilations raise here
            if self.main:
                fallback = "strict" if cfg.compile_strict else "eager fallback on failure"
                print(f"torch.compile: {self.compiled} blocks compiled in {time.perf_counter() - t_compile:.1f} s "
                      f"({fallback})", flush=True)  # fmt: skip
        # data parallelism: DDP averages gradients, its comm hook accumulates the clipping norm
        self.clipper = GradClipper(max_norm=cfg.clip_grad_max_norm, process_group=self.parallel.train_group)
        self.net: torch.nn.Module = model
        reduce = self.clipper.compute if self.ddp_world > 1 else None
        if self.grad_reduce == "flat":  # the same average on the optimizer's flat buffers, no DDP
            self.reducer = FlatGradReducer(self.opt, self.parallel.train_group, self.parallel.grad_scales(model))
            self.reducer.broadcast_parameters()  # rank 0's weights everywhere, as DDP's construction
            reduce = partial(self.reducer.reduce_and_clip, self.clipper)
            if self.main:
                print(f"gradient reduction: {self.reducer.describe()}", flush=True)
        elif self.ddp_world > 1:
            # gradient_as_bucket_view=False: DDP copies reduced buckets into .grad, which stays a view of
            # the optimizer's flat gradient buffer (bucket views would replace it).
            self.net = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                process_group=self.parallel.train_group, gradient_as_bucket_view=False,
                find_unused_parameters=cfg.bp > 1,  # BP: the other branch's parameters get no gradient here
            )  # fmt: skip
            self.clipper.register(self.net)
        # CUDA graphs: the whole step (--cuda-graphs step; auto where it can), else the no-grad recycling passes;
        # forward(batch) is net(batch) where the recycling graphs are off
        model_parallel = self.parallel.layout.model_parallel
        whole, _ = resolve_step_mode(cfg.cuda_graphs, self.device.type, model_parallel, self.ddp_world,
                                     torch.cuda.is_available(), bp=cfg.bp, flat_reduce=self.grad_reduce == "flat")  # fmt: skip
        self.forward = setup_graphed_step("off" if whole else cfg.cuda_graphs, model, self.net, self.features,
                                          self.device, self.dtype, self.autocast, model_parallel=model_parallel,
                                          rank=self.runtime.rank, verbose=self.main)  # fmt: skip
        # the step the memory model and the step benchmark take too (scalefold.train.step)
        self.step = TrainingStep(model=self.net, loss_fn=self.loss_fn, opt=self.opt, clipper=self.clipper, batch={},
                                 num_ensembles=self.features.num_ensembles, autocast=self.autocast, device=self.device,
                                 forward=self.forward, reduce=reduce, group=self.parallel.train_group,
                                 world_size=self.ddp_world, dtype=self.dtype,
                                 broadcast=lambda b: self.parallel.broadcast_batch(b, self.device))  # fmt: skip
        self.step_graphs = None
        if whole:
            self._whole_step_graphs(model, model_parallel)

    def _whole_step_graphs(self, model: torch.nn.Module, model_parallel: int) -> None:
        """Capture the whole step per recycling count; where that fails, ``auto`` falls back to the recycling
        passes' graphs (``step``: eager, the reason said in one line)."""
        cfg = self.cfg
        graphs = setup_step_graphs(cfg.cuda_graphs, self.step, model, self.features, self.device, self.dtype,
                                   world_size=self.ddp_world, model_parallel=model_parallel, rank=self.runtime.rank,
                                   verbose=self.main, bp=cfg.bp, flat_reduce=self.grad_reduce == "flat",
                                   group=self.parallel.train_group if self.ddp_world > 1 else None,
                                   before_capture=self._reduce_after_backward, stall_timeout_s=cfg.stall_timeout_s,
                                   on_fatal=self.runtime.heartbeat.on_fatal)  # fmt: skip
        self.step_graphs = graphs
        if graphs.active:
            self.step.graphs = graphs
        elif getattr(self, "reducer", None) is not None:
            self.reducer.set_overlap(True)  # eager steps: buckets out as backward fills them
        elif cfg.cuda_graphs == "auto":
            self.forward = setup_graphed_step("auto", model, self.net, self.features, self.device, self.dtype,
                                              self.autocast, model_parallel=model_parallel, rank=self.runtime.rank,
                                              verbose=self.main)  # fmt: skip
            self.step.forward = self.forward

    def _reduce_after_backward(self) -> None:
        """Before a whole-step capture: the flat reducer issues its buckets after backward (a replay runs no
        gradient-ready hook; the captured collectives keep one order on every rank)."""
        if getattr(self, "reducer", None) is not None:
            self.reducer.set_overlap(False)

    # -- start: run_start, then the timed dataset work ----------------------------------------------

    def start(self) -> None:
        cfg, main = self.cfg, self.main
        self.result = TrainResult(out=self.out if main else None, steps=self.start_step, final_loss=float("nan"),
                                  start_step=self.start_step)  # fmt: skip
        if main and self.start_step and self.metrics_path.exists():  # a resumed run: the curve so far
            self.result.eval_history = [(r["step"], r["eval_lddt_ca"]) for r in read_metrics(self.metrics_path)[1]]
        self.metrics = MetricsLog(self.metrics_path, enabled=main)
        self.progress = progress_bar(cfg.max_steps, self.start_step, enabled=cfg.progress and main)
        ctx = EvalContext(self.metrics, self.result, self.progress, self.mllog, self.device, self.dtype,
                          self.autocast, cfg.target_lddt)  # fmt: skip
        self.evaluation = (AsyncEvaluation(ctx, self.runtime, self.opt, cfg.eval_timeout_s) if self.parallel.async_eval
                           else SyncEvaluation(ctx, self.runtime, self.eval_model, self._eval_cache, bool(cfg.eval_every)))  # fmt: skip
        # the starting point's score (step 0, for the curves; not MLPerf's) is taken after run_stop, untimed:
        # its weights are kept now
        self.baseline = cfg.eval_baseline and self.start_step == 0
        if self.baseline:
            self.evaluation.keep_start()
        self.mllog.log_init_block(run_info(
            cfg, self.runtime, self.features, eval_every=self.eval_every, num_params=self.opt.num_params,
            init_sha=self.init_sha, train_max_pdb_release_date=day_before(cfg.val_min_date),
        ))  # fmt: skip
        if self.runtime.distributed:  # every rank is ready: the clock starts (evaluation ranks wait for it too)
            dist.barrier()
        self.mllog.init_stop_run_start()
        self.account.run_start()
        self.clock.start()  # time to train (MLPerf): run_start to run_stop
        self.cycles = MLPerfCycles(self.mllog, self.eval_every, self.parallel.dp_size, self.start_step)
        with Store.open(Path(cfg.store)) as store:
            self.train_ids, weights, self.val_ids = split_chains(store, cfg)
        if main:
            print(f"data: {len(self.train_ids)} training / {len(self.val_ids)} validation chains in {Path(cfg.store)}",
                  flush=True)  # fmt: skip
        with self.account.phase("data_setup"):
            self.data = TrainingData(cfg, self.parallel, self.runtime.rank, self.features, self.train_ids, weights,
                                     self.start_step)  # fmt: skip
        # the compliance checker accepts the reference loaders' names only (PT: in order, PQ: priority queue)
        self.mllog.dataset_info(len(self.train_ids), len(self.val_ids), dataloader_type="InitialTrainingDataloaderPQ")
        t_val = time.perf_counter()
        with self.account.phase("eval_cache"):
            self.evaluation.prepare()
        self.timings["eval"] += time.perf_counter() - t_val

    def _eval_cache(self):
        """Synchronous evaluation's validation batches, built once (in a background thread, by ``num_workers``
        loader workers) and kept in host DRAM (pinned on CUDA)."""
        cache = validation_cache(str(Path(self.cfg.store)), self.val_ids, self.features, num_workers=self.cfg.num_workers,
                                 pin_memory=self.device.type == "cuda")  # fmt: skip
        cache.fill()
        return cache

    # -- the step loop ------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Steps until ``max_steps``, the evaluation target or a stop request; then :meth:`finish`."""
        self.guard, aborted = NonFiniteGuard(self.cfg.max_consecutive_nonfinite), False
        gc.disable()
        try:
            with self.stop_request:  # installed by train(): a signal during the setup counts too
                step, t_wait = self.start_step, self.account.switch("data_wait")
                for _, batch in self.data:  # the loader's get: data wait
                    step += 1
                    self.runtime.heartbeat.mark(step)  # progress, for the stalled-rank watch
                    self.timings["data_wait"] += self.account.switch("host") - t_wait
                    new_skips = self.data.report_skips(step)
                    self.cycles.step(step)
                    stop = self.train_step(step, batch, new_skips)
                    last = step >= self.cfg.max_steps  # a finished run ends evaluated and checkpointed
                    due_eval = self.cfg.eval_every and (step % self.eval_every == 0 or last)
                    with self.runtime.heartbeat.busy("evaluation"):  # long on one rank by design
                        done = self.after_cycle(step, stop) if due_eval else False
                    self.metrics.flush()
                    if self.checkpoints.due(step, stop, last or done):  # the trained model is kept
                        with self.account.phase("checkpoint"):
                            self.checkpoints.save(self.model, self.opt, step, self.timings, self.clock)
                    if stop:
                        self._stopped_by_signal(step)
                        break
                    if done:
                        break
                    self.runtime.heartbeat.mark(step, waiting=True)
                    t_wait = self.account.switch("data_wait")
        except BaseException:
            aborted = True
            raise
        finally:
            gc.enable()
            self.runtime.heartbeat.idle()
            eval_failure = self.finish(aborted)
        self.account.switch("report")  # the summary, curves.png, trace.png (after run_stop)
        if eval_failure is not None:
            raise TrainingAborted(str(eval_failure)) from eval_failure
        announce(f"scalefold train: rank {self.runtime.rank} finished at step {self.result.steps} "
                 f"({len(self.result.skipped_samples)} sample(s) skipped and replaced by its loader)")  # fmt: skip
        if self.main:
            self._report(self.result)
            if self.cfg.trace_plot and self.hooks.trace_picture is not None:
                self._trace_picture()
            self._write_time_account()  # the command prints its summary last
        return self.result

    def _report(self, result: TrainResult) -> None:
        final_report(self.cfg.preset, self.out, self.metrics_path, result, target=self.cfg.target_lddt,
                     start_label="initial checkpoint" if self.cfg.init_from else "untrained model")  # fmt: skip

    def _trace_picture(self) -> None:
        """``trace.png``: the first validation chain predicted by the starting checkpoint and by the newest
        checkpoint of this run (SWA weights), superposed on the true Cα trace. Drawn after run_stop."""
        newest = self.checkpoints.manager.latest()
        if newest is None or not self.val_ids:
            return
        panels = [("initial checkpoint", self.cfg.init_from)] if self.cfg.init_from else []
        panels.append((f"after training (step {self.result.steps}, SWA)", newest))
        chain = self.val_ids[0]
        try:
            path, traces = self.hooks.trace_picture(self.cfg.store, chain, panels, self.out / "trace.png")
        except Exception as exc:  # noqa: BLE001 -- a picture never fails a finished run
            print(f"scalefold train: could not draw the Cα trace: {type(exc).__name__}: {exc}", flush=True)
            return
        scores = " -> ".join(f"{t.lddt_ca:.3f}" for t in traces)
        print(f"Cα trace of validation chain {chain} (lDDT-Cα {scores}): {path}", flush=True)

    def train_step(self, step: int, batch: dict[str, torch.Tensor] | None, new_skips: list[dict[str, Any]]) -> bool:
        """The step (:class:`~scalefold.train.step.TrainingStep`: forward, backward, clip, agreement, Adam +
        SWA or the skip, all on the device), then its results read once; writes the step's record.
        Returns whether any rank asked to stop."""
        cfg, timings, result = self.cfg, self.timings, self.result
        t0 = self.account.step_started()
        n = recycling_count(cfg.seed, step, self.features.num_ensembles)
        if self.step_graphs is not None:
            self.step_graphs.watch.at(step)  # the step a stalled replay is named at
        lr = self.lr_schedule(step)  # written into the optimizer's device tensor (no host read)
        marks: list[tuple[str, float]] = [("forward", t0)]  # host time per phase (on a GPU: the launches)
        out = self.step.train(batch, n, forward_seed(cfg.seed, self.parallel.dp_rank, step),
                              stop=self.stop_request.requested, count=len(self.data.skipped),
                              phase=lambda name: marks.append((name, time.perf_counter())))  # fmt: skip
        got = out.read(self.ddp_world)  # the step's one host read (waits for the device): loss, verdict, norm, terms
        t1 = self.account.step_read(step)  # the step ends at its host read; host work follows
        marks.append(("end", t1))
        for (name, a), (_, b) in zip(marks, marks[1:]):  # the loss counts with the forward, as before
            timings["forward" if name == "loss" else name] += b - a
        self.step.settle(got)
        if got.skipped:  # same verdict on every rank
            result.skipped_steps += 1
            self.guard.skipped(step, result.skipped_steps, self.progress.write if self.main else None)
        else:
            self.guard.ok()
        t3 = time.perf_counter()
        timings["optimizer"] += t3 - t1
        mean_loss = got.mean_loss
        record = {
            "step": step, "loss": mean_loss, "recycling_iters": n, "lr": lr, **self._throughput(n, t3 - t0),
            "grad_norm": got.grad_norm, "skipped": got.skipped, "skipped_total": result.skipped_steps,
            **{(k if k.startswith("loss") else f"loss_{k}"): v for k, v in got.terms.items()},
            "time_data_wait": timings["data_wait"], "time_step": t3 - t0,
            "samples_skipped": got.count,  # by the loaders of all training ranks, each replaced
        }  # fmt: skip
        if new_skips:
            record["skipped_samples"] = [{"chain_id": s["chain_id"], "reason": s["reason"],
                                          "replaced_by": s["replaced_by"]} for s in new_skips]  # fmt: skip
        self.metrics.write(record)
        result.final_loss, result.steps = mean_loss, step
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{mean_loss:.3f}", recycling=n)
        self.guard.check(step, self.metrics.flush)
        return got.stop

    def _throughput(self, n: int, seconds: float) -> dict[str, float]:
        """``tflops`` (executed FLOPs per second, recomputation included, / 10^12) of a step with ``n``
        no-grad passes that took ``seconds``, and ``mfu`` (model FLOPs, no recomputation) / ``hfu`` (executed)
        over the device's peak where it is known. Empty without a FLOP table."""
        flops = self.hooks.flops
        if not flops or n not in flops or seconds <= 0:
            return {}
        executed, model = flops[n]
        out = {"tflops": executed / seconds / 1e12}
        peak = self.hooks.peak_flops
        if peak:
            out["mfu"], out["hfu"] = model / seconds / peak, executed / seconds / peak
        self.result.throughput.append((out["tflops"], out.get("mfu")))
        return out

    def after_cycle(self, step: int, stop: bool) -> bool:
        """The end of a train-eval cycle: the SWA weights are evaluated; ``True`` when the run is done."""
        t_eval = time.perf_counter()
        self.account.evaluated(step)
        self.account.switch("eval_cache")
        self.evaluation.ready()  # the validation cache, built in the background since run_start
        self.account.switch("eval_cycle")
        epoch = self.cycles.end(step)
        try:
            done = self.evaluation.after_cycle(step, epoch)
        except EvaluationRanksFailed as exc:
            if self.main and (stop or self.stop_request.requested):  # pre-empted: keep the step first
                ckpt_path = save_checkpoint(self.checkpoints.manager, self.model, self.opt, step,
                                            model_preset=self.cfg.model_preset, run_clock=self.clock,
                                            model_options=self.checkpoints.model_options)  # fmt: skip
                self.progress.write(f"scalefold train: stop requested (signal); checkpoint of step {step} "
                                    f"written to {ckpt_path} before aborting (continue with --resume)")  # fmt: skip
            raise TrainingAborted(str(exc)) from exc
        self.timings["eval"] += time.perf_counter() - t_eval
        # the run's last evaluation (the target, or synchronous at max_steps): run_stop now; the checkpoint and
        # closing the loader after it
        final = done or (step >= self.cfg.max_steps and not self.parallel.async_eval)
        if final and not self.evaluation.run_stop_logged:
            self.mllog.run_stop(self.result.status)
            self._account_run_stop()
        self.account.switch("host")
        return done

    def _stopped_by_signal(self, step: int) -> None:
        self.result.stopped_by_signal = self.stop_request.signum or -1
        if self.main and self.checkpoints.unsaved is None:
            self.progress.write(f"scalefold train: stop requested (signal); checkpoint of step {step} written "
                                f"to {self.checkpoints.manager.path_for(step)}; exiting (continue with --resume)")  # fmt: skip
        elif self.main:  # a full disk took it: the run ends with CheckpointNotWritten's line and status
            self.progress.write(f"scalefold train: stop requested (signal); the checkpoint of step {step} could not "
                                "be written; exiting")  # fmt: skip

    # -- finish -------------------------------------------------------------------------------------

    def finish(self, aborted: bool) -> RuntimeError | None:
        """Close the loader, wait for pending evaluations, close the logs (``run_stop``); returns an
        evaluation failure that surfaced while closing (the run then aborts)."""
        result, mllog = self.result, self.mllog
        self.account.switch("close")
        self.progress.close()
        self.data.close(result.steps)
        result.skipped_samples = self.data.skipped
        if self.evaluation.failed:  # logged first: the evaluation ranks exit once close() releases them
            self.cycles.close()  # the cycle the run ended in, before run_stop (nothing follows run_stop)
            mllog.run_stop(mll.STATUS_ABORTED)
            self.account.run_stop()
        t_close = time.perf_counter()
        with self.account.phase("eval_final"):
            eval_failure = self.evaluation.close()  # asynchronous: pending evaluations finish first (in order)
        self.timings["eval"] += time.perf_counter() - t_close
        self.cycles.close()  # the run ended inside a cycle: close it (samples seen so far)
        if not self.evaluation.run_stop_logged:  # the main evaluation rank logs run_stop success itself
            mllog.run_stop(mll.STATUS_ABORTED if eval_failure is not None else result.status)
        self._account_run_stop()
        mllog.close()
        if self.baseline and not aborted and eval_failure is None:  # after run_stop: untimed
            with self.account.phase("eval_baseline"):
                self.evaluation.score_start("initial checkpoint" if self.cfg.init_from else "untrained model")
        self.metrics.close()
        if self.clock.running:
            result.time_to_train_s = self.clock.total_s()
            if self.main:
                print(time_to_train_line(self.clock, result), flush=True)
        result.timings = dict(self.timings)
        result.device_name = self.hooks.device_name
        result.unsaved_checkpoint = self.checkpoints.unsaved
        if self.device.type == "cuda":  # graphed / eager step counts (on CPU the recycling passes are always eager)
            result.notes.append(self.forward.summary())
        if getattr(self, "step_graphs", None) is not None and (self.device.type == "cuda" or self.step_graphs.emulated):
            result.notes.append(self.step_graphs.summary())
        if getattr(self, "compiled", None) is not None:  # graph breaks / recompilations of the compiled regions
            result.notes.append(self.compiled.summary())
        if self.main and (aborted or eval_failure is not None):  # an aborted run gets its curves and breakdown too
            self.account.switch("report")
            self._report(result)
            print("\n".join(self._write_time_account()), flush=True)
        return eval_failure

    def _account_run_stop(self) -> None:
        """The time account's ``run_stop``: now (logged by this rank), or when the first evaluation rank
        logged it (asynchronous evaluation: the wall time its reply carries)."""
        evaluation = self.evaluation
        if evaluation.run_stop_logged:
            self.account.run_stop(target_step=evaluation.target_step, wall=evaluation.run_stop_at)
            self.clock.stop(at=evaluation.run_stop_at)
        else:
            success = self.result.status == mll.STATUS_SUCCESS and self.result.eval_history
            self.account.run_stop(target_step=self.result.eval_history[-1][0] if success else None)
            self.clock.stop()

    def _write_time_account(self) -> list[str]:
        """``time_account.json`` / ``.png`` in the run directory (main training rank); the summary lines."""
        if not self.main:
            return []
        cfg, result = self.cfg, self.result
        info = self.account.report({
            "title": f"scalefold train --preset {cfg.preset}", "status": result.status,
            "time_to_train_s": result.time_to_train_s, "segment_from_step": result.start_step,
            "evaluation": f"asynchronous ({cfg.num_async_eval_ranks} ranks)" if self.parallel.async_eval else "synchronous",
            "eval_every": self.eval_every, "device": str(self.device),
        })  # fmt: skip
        path, _ = write_account(info, self.out)
        result.time_account = summary_lines(info, where=str(path))
        return result.time_account


__all__ = ["RunHooks", "Trainer", "prepare_run", "train"]
