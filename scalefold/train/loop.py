"""The training loop of ``scalefold train`` (reads top to bottom; step components in :mod:`.steps`).

One step (supplement 1.11, MLPerf HPC OpenFold), on every data-parallel rank:

1. take the next ready batch from the priority-queue loader (``[1, ..., R]``); each rank reads its
   own strided share of one position-indexed sample stream (:func:`~.steps.sample_pairs`); a sample
   the loader gives up on (corrupt chain, feature error) is logged with its chain and reason, counted,
   and replaced by a fresh draw, so every rank still takes exactly ``max_steps`` steps; with DAP / BP
   one rank per group loads and broadcasts each step's header (position, end of data, or the
   loader's error) and batch;
2. draw the recycling count ``n`` uniformly from ``{0 .. R-1}`` (a function of seed and step, so
   identical on every rank and after a resume) and keep ``t[..., :n + 1]``;
3. seed the forward pass from (seed, data-parallel rank, step) (dropout);
4. forward (no-grad recycling passes, then one grad pass), loss, backward; with several ranks DDP
   averages the gradients and its communication hook accumulates the squared norm of each reduced
   bucket (:class:`GradClipper`), single-process runs take the norm of the flat gradient buffers;
5. one clip scale per step; a non-finite loss or gradient skips the step (counted; too many in a row
   abort the run with ``run_stop status=aborted``);
6. Adam + SWA over flat buffers (``FlatAdamSWA``) with the warm-up learning rate.

Every ``eval_every`` steps the SWA weights are evaluated (mean lDDT-Cα over held-out validation
chains released in the CAMEO window): on the main training rank, the score broadcast so all ranks
stop together, or asynchronously on the last ``num_async_eval_ranks`` ranks. Every
``checkpoint_every`` steps, and on SIGTERM/SIGUSR1, the main training rank writes an atomic
checkpoint (pre-emption: Slurm signals every task; evaluation ranks keep serving until training's
end-of-training sentinel, then exit 0 too). Outputs (main training rank only) in ``out``:
``metrics.jsonl`` (strict JSON: a non-finite value is ``null``), ``mlperf.log`` (a resumed run:
``mlperf_resumed_<step>.log``, named after the checkpoint it loaded), ``checkpoints/``, ``curves.png``.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from scalefold.data.eval_cache import EvalCache
from scalefold.data.loader import SEED_HIGH, PriorityQueueLoader, group_batches
from scalefold.data.pipeline import FeatureConfig, TrainingChainFilter, sampling_weights
from scalefold.data.store import Store
from scalefold.distributed import setup_model_parallel
from scalefold.losses import AlphaFoldLoss
from scalefold.metrics import validation_lddt_ca
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.train import mlperf_logging as mll
from scalefold.train.checkpoint_io import (
    CHECKPOINT_PREFIX,
    CheckpointError,
    CheckpointManager,
    build_checkpoint,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    sha256sum,
)
from scalefold.train.config import TrainConfig
from scalefold.train.flat_optimizer import FlatAdamSWA
from scalefold.train.grad_clipping import GradClipper
from scalefold.train.graphed_step import PARALLEL_EVOFORMER_UNCAPTURABLE, setup_graphed_step, synthetic_step_batch
from scalefold.train.graphed_step import resolve_mode as resolve_graph_mode
from scalefold.train.lr_schedule import WarmupConstantLR
from scalefold.train.plots import plot_metrics
from scalefold.train.runtime import Runtime, init_distributed, shutdown
from scalefold.train.sample import StoreSample, validation_cache
from scalefold.train.steps import (
    StopRequest,
    allreduce_step_stats,
    broadcast_float,
    compile_blocks,
    deterministic_environment,
    float_outputs,
    forward_seed,
    ignore_stop_signals,
    keep_fp32_regions,
    nonfinite_terms_to_nan,
    recycling_count,
    sample_pairs,
    setup_precision,
    start_multiprocessing_helpers_ignoring_stop_signals,
    step_batch,
    to_device,
    warm_up,
)


class TrainingAborted(RuntimeError):
    """The run stopped without reaching its end (``run_stop status=aborted`` was logged)."""


def announce(line: str) -> None:
    """Print ``line`` with one ``write`` of the whole line (newline included), flushed at once.

    Ranks share the launcher's stdout pipe; ``print`` may issue the text and the newline as separate
    writes, so two ranks' lines could interleave. A single write of at most ``PIPE_BUF`` bytes to a
    pipe is atomic (POSIX), so each rank's line arrives whole.
    """
    stream = sys.stdout
    stream.flush()  # anything buffered before goes out first, on its own
    data = (line + "\n").encode(getattr(stream, "encoding", None) or "utf-8", errors="replace")
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stdout without a descriptor (e.g. captured)
        stream.write(line + "\n")
        stream.flush()
        return
    while data:  # a pipe write of <= PIPE_BUF bytes is never partial; longer lines are written in pieces
        data = data[os.write(fd, data) :]


# ---------------------------------------------------------------------------------------------
# Setup helpers
# ---------------------------------------------------------------------------------------------


def build_model_config(cfg: TrainConfig) -> AlphaFoldConfig:
    """The model preset with the run's data-pipeline overrides (crop, MSA sizes, recycling)."""
    overrides = {
        "train_sequence_crop_size": cfg.crop_size, "max_msa_clusters": cfg.max_msa_clusters,
        "max_extra_msa": cfg.max_extra_msa, "num_recycling_iters": cfg.num_recycling_iters,
        "clip_grad_max_norm": cfg.clip_grad_max_norm, "swa_decay_rate": cfg.swa_decay,
    }  # fmt: skip
    precision = "fp32" if cfg.precision in ("fp64", "tf32") else cfg.precision
    return AlphaFoldConfig.from_preset(
        cfg.model_preset, precision=precision, overrides={k: v for k, v in overrides.items() if v is not None}
    )


def build_model(cfg: TrainConfig, model_cfg: AlphaFoldConfig, device: torch.device, dtype: torch.dtype) -> AlphaFold:
    """The run's model, initialised from ``cfg.seed`` (identical on every rank)."""
    torch.manual_seed(cfg.seed)
    return AlphaFold(
        model_cfg, activation_checkpointing=cfg.activation_checkpointing, parallel_evoformer=cfg.parallel_evoformer
    ).to(device, dtype)


class StoreNotFoundError(FileNotFoundError):
    """The run's store does not exist and the run may not synthesise one."""


def check_store(cfg: TrainConfig) -> Path:
    """The run's store path; raises :class:`StoreNotFoundError` (naming the path and how to create a
    store) if it is absent and ``cfg.synthesize_missing_store`` is off (every preset but demo / tiny)."""
    path = Path(cfg.store)
    if not path.exists() and not cfg.synthesize_missing_store:
        raise StoreNotFoundError(
            f"dataset store {path} does not exist (--preset {cfg.preset} does not synthesise one). Create it "
            f"with `scalefold preprocess --out {path} ...` (real mmCIF files + alignments, or --mlperf-dir), or "
            f"`scalefold synth --out {path}` (a synthetic store), or pass --synthesize-missing-store "
            "(SCALEFOLD_SYNTHESIZE_MISSING_STORE=1) to have the run synthesise one there"
        )
    return path


def ensure_store(cfg: TrainConfig) -> Path:
    """The run's store; a synthetic one is created there first if the file is absent and
    ``cfg.synthesize_missing_store`` is on (the demo and tiny presets, ``--synthesize-missing-store``),
    else :class:`StoreNotFoundError`."""
    path = check_store(cfg)
    if not path.exists():
        from scalefold.data.synthetic import synthesize

        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"synthesising {cfg.synth_num_chains} chains into {path} ...", flush=True)
        synthesize(
            path, num_chains=cfg.synth_num_chains, num_families=cfg.synth_num_families,
            length_range=tuple(cfg.synth_length_range), seed=cfg.synth_seed,
        )  # fmt: skip
    return path


def split_chains(store: Store, cfg: TrainConfig) -> tuple[list[str], np.ndarray, list[str]]:
    """(training chain ids, their sampling weights, validation chain ids) of the store."""
    table = store.chain_table(with_sequence=True)
    train_filter = TrainingChainFilter(max_release_date=_day_before(cfg.val_min_date))
    keep = train_filter.mask(table["release_date"], table["resolution"], table["sequence"], table["cluster_id"])
    train_ids = [str(c) for c in table["chain_id"][keep]]
    weights = sampling_weights(table["length"][keep], table["cluster_id"][keep])
    if not train_ids:
        raise ValueError(f"no training chains in {store.path}")
    return train_ids, weights, _validation_ids(table, cfg)


def validation_chain_ids(store: Store, cfg: TrainConfig) -> list[str]:
    """The validation chains of the store (released in ``[val_min_date, val_max_date]``, at most
    ``val_max_sequence_length`` residues, the first ``eval_max_chains`` if set), in store order.

    The same list :func:`split_chains` returns; needs no training chains (``scalefold evaluate``).
    """
    return _validation_ids(store.chain_table(with_sequence=False), cfg)


def _validation_ids(table: dict[str, Any], cfg: TrainConfig) -> list[str]:
    dates = [str(d)[:10] for d in table["release_date"]]
    val_ids = [
        str(c) for c, d, n in zip(table["chain_id"], dates, table["length"])
        if cfg.val_min_date <= d <= cfg.val_max_date and n <= cfg.val_max_sequence_length
    ]  # fmt: skip
    return val_ids[: cfg.eval_max_chains] if cfg.eval_max_chains else val_ids


def _day_before(date: str) -> str:
    import datetime

    return (datetime.date.fromisoformat(date) - datetime.timedelta(days=1)).isoformat()


def check_parallelism(cfg: TrainConfig) -> None:
    """Options whose implementation lands elsewhere fail early and clearly."""
    # DAP / BP layouts are validated by scalefold.distributed.setup_model_parallel (in _train)
    if cfg.num_async_eval_ranks > 0 and _async_eval_module() is None:
        raise NotImplementedError(
            "--num-async-eval-ranks > 0 needs scalefold.train.async_eval (asynchronous evaluation), "
            "which is not available in this build; use --num-async-eval-ranks 0 (synchronous evaluation)"
        )


def _async_eval_module() -> Any:
    try:
        from scalefold.train import async_eval
    except ImportError:
        return None
    return async_eval


def init_from_checkpoint(path: str, model: AlphaFold, opt: FlatAdamSWA, hash_file: bool = True) -> tuple[int, str | None]:
    """Load a reference-format checkpoint (weights strictly, Adam moments onto the flat buffers).

    The MLPerf reference layout: ``alphafold_state_dict`` (reference parameter names),
    ``optimizer_state_dict`` (``torch.optim.Adam``: per-parameter ``step``/``exp_avg``/``exp_avg_sq``
    indexed in parameter order) and ``iteration``. Everything is checked before anything is loaded:
    a corrupt file, mismatching names/shapes or Adam moments raise
    :class:`~scalefold.checkpoint.adapters.CheckpointError` naming the file and listing the
    mismatches. SWA restarts from the loaded weights. Returns ``(stored iteration, sha256 of the file)``
    (``None`` instead of the hash with ``hash_file=False``: the training loop hashes on the logging
    rank only and broadcasts the result).
    """
    from scalefold.checkpoint.adapters import (
        CheckpointError,
        _check_adam_state,
        compare_state_dict,
        extract_model_state_dict,
        load_reference_checkpoint,
        read_checkpoint,
    )

    ckpt = read_checkpoint(path)  # torch.load(weights_only=True); unreadable files -> CheckpointError
    for key in ("alphafold_state_dict", "iteration"):
        if key not in ckpt:
            raise CheckpointError(f"{path}: not a reference checkpoint, no {key!r} (keys: {sorted(ckpt)[:10]})")
    report = compare_state_dict(model, extract_model_state_dict(ckpt))
    if not report.ok:
        raise CheckpointError(f"{path}: parameters do not match the model config: {report.describe()}")
    params = list(model.parameters())
    if "optimizer_state_dict" in ckpt:
        try:
            _check_adam_state(ckpt["optimizer_state_dict"], params)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
    iteration = load_reference_checkpoint(ckpt, model, optimizer=None)  # weights -> the flat master views
    if "optimizer_state_dict" in ckpt:
        try:
            opt.load_state_dict(ckpt["optimizer_state_dict"])
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: optimizer state does not fit the model: {exc}") from exc
    opt.sync_compute_from_master()
    opt.reset_swa()
    return iteration, sha256sum(path) if hash_file else None


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: AlphaFold, batches: list[dict[str, torch.Tensor]], autocast: bool) -> float:
    """Mean chain-level lDDT-Cα of ``model`` over the validation ``batches`` (all recycling passes)."""
    model.eval()
    scores = []
    for batch in batches:
        device_type = batch["aatype"].device.type
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            out = model(batch)
        score = validation_lddt_ca(
            out["final_atom_positions"].float(),  # [1, N_res, 37, 3]
            batch["all_atom_positions"][..., -1].float(),
            batch["all_atom_mask"][..., -1].float(),
        )
        scores.append(float(score.mean()))
    return float(np.mean(scores)) if scores else float("nan")


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    out: Path | None  # None on ranks that write nothing
    steps: int
    final_loss: float
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: int = 0
    stopped_by_signal: int | None = None
    status: str = mll.STATUS_ABORTED
    timings: dict[str, float] = field(default_factory=dict)
    # samples this rank's loader gave up on (and replaced): chain_id, reason, ... (loader ranks only)
    skipped_samples: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # extra end-of-run lines (e.g. the CUDA-graph summary)


class _Metrics:
    """``metrics.jsonl`` of the main training rank (other ranks: no-op)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self._file = path.open("a") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:  # strict JSON: NaN / inf (a skipped step's loss) are written as null
            self._file.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON ``null``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class _ReplacementDraw:
    """The training loader's ``replace`` hook: the ``k``-th replacement of a skipped sample at loader
    position ``position`` is a fresh ``(index, seed)`` drawn from the sampling ``weights`` with the
    chains that failed so far excluded -- a function of (run seed, data-parallel rank, global position,
    ``k``), so a resumed run draws the same replacement. Runs in the loader's thread (not pickled)."""

    def __init__(self, weights: Any, seed: int, dp_rank: int, first_position: int) -> None:
        self.weights = np.asarray(weights, dtype=np.float64)
        self.seed, self.dp_rank, self.first_position = seed, dp_rank, first_position

    def __call__(self, position: int, k: int, failed: frozenset) -> tuple[int, int]:
        weights = self.weights.copy()
        weights[[i for i in failed if 0 <= i < len(weights)]] = 0.0
        total = weights.sum()
        if not total > 0:
            raise RuntimeError(f"no training chain left to replace a failed sample with ({len(failed)} failed)")
        rng = random.Random(f"replace:{self.seed}:{self.dp_rank}:{self.first_position + position}:{k}")
        cdf = np.cumsum(weights) / total
        index = int(np.searchsorted(cdf, rng.random(), side="right"))
        index = min(index, len(weights) - 1)
        while weights[index] == 0.0:  # rounding at the top of the cdf: the last chain with weight
            index -= 1
        return index, rng.randrange(SEED_HIGH)


def _report_skips(loader: PriorityQueueLoader | None, result: TrainResult, train_ids: list[str], rank: int,
                  step: int, first_position: int) -> list[dict[str, Any]]:  # fmt: skip
    """Samples the loader gave up on since the last call: one console line each (chain id, reason,
    replacement), appended to ``result.skipped_samples``; returns the new ones."""
    if loader is None:
        return []
    new = []
    for skip in loader.skipped[len(result.skipped_samples) :]:
        chain = train_ids[skip.index] if 0 <= skip.index < len(train_ids) else f"index {skip.index}"
        replacement = train_ids[skip.replaced_by[0]] if skip.replaced_by is not None else None
        reason = skip.reason.splitlines()[0] if skip.reason else "unknown"
        info = {"chain_id": chain, "index": skip.index, "seed": skip.seed, "position": first_position + skip.position,
                "attempts": skip.attempts, "reason": reason, "replaced_by": replacement}  # fmt: skip
        result.skipped_samples.append(info)
        new.append(info)
        announce(f"scalefold train: rank {rank}: step {step}: skipped sample {chain} (data position "
                 f"{info['position']}, seed {skip.seed}) after {skip.attempts} attempt(s): {reason}; "
                 + (f"replaced by {replacement}" if replacement else "not replaced"))  # fmt: skip
    return new


def train(cfg: TrainConfig) -> TrainResult:
    """Run ``cfg`` on every rank of the launch; returns a summary (everything else is in ``cfg.out``).

    Raises :class:`TrainingAborted` (after logging ``run_stop status=aborted``) when the run aborts,
    :class:`StoreNotFoundError` when the store is missing and may not be synthesised.
    """
    check_parallelism(cfg)
    check_store(cfg)  # every rank, before anything is logged: a missing store is a configuration error
    if cfg.deterministic:
        deterministic_environment()  # CUBLAS_WORKSPACE_CONFIG before CUDA / cuBLAS initialise
    runtime = init_distributed(cfg.num_async_eval_ranks, timeout_s=cfg.process_group_timeout_s)
    role = "eval" if runtime.is_eval_rank else "train"
    announce(f"scalefold: rank {runtime.rank}/{runtime.world_size} backend {runtime.backend or 'none'} role {role}")
    numerics = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32)  # fmt: skip
    # from here on SIGTERM / SIGUSR1 (Slurm pre-emption; every process of every task gets it) ask for a
    # clean stop: training ranks checkpoint at the end of the step, evaluation ranks serve until training's
    # sentinel; the loader's helper processes and workers ignore them
    start_multiprocessing_helpers_ignoring_stop_signals()
    finished = False  # this rank's run returned: it meets its peers at the exit barrier (shutdown)
    try:
        # --cuda-graphs on where graphs cannot run is refused on every rank before anything is logged or built
        # (evaluation ranks included, which would otherwise wait for a run_start that never comes)
        resolve_graph_mode(cfg.cuda_graphs, runtime.device.type, model_parallel=cfg.dap * cfg.bp,
                           unsupported=PARALLEL_EVOFORMER_UNCAPTURABLE if cfg.parallel_evoformer else None)  # fmt: skip
        with StopRequest() as stop_request:
            result = _train(cfg, runtime, stop_request)
        finished = True
        return result
    finally:  # process-wide switches go back to what the caller had
        torch.use_deterministic_algorithms(numerics[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = numerics[1:]
        shutdown(runtime, clean=finished)


def _resume_checkpoint(cfg: TrainConfig, runtime: Runtime, checkpoints: CheckpointManager) -> tuple[Path | None, dict | None]:
    """``--resume``: (path, content) of the newest checkpoint that loads, ``(None, None)`` when there is no
    checkpoint at all (a fresh start). The main training rank chooses and tells every rank (collective
    over all ranks): the other training ranks load the same file, evaluation ranks only need its name
    (the MLPerf log's). Raises :class:`CheckpointError` on every rank, listing each file's error, when
    checkpoint files exist but none of them loads."""
    main = runtime.is_main_train_rank
    choice: list[Any] = [None]
    ckpt = None
    if main:
        checkpoints.prune()  # temporary files of a killed writer go; complete checkpoints stay
        try:
            found = checkpoints.load_resumable()
        except CheckpointError as exc:
            choice[0] = ("error", str(exc))
        else:
            if found is None:
                choice[0] = ("none", str(checkpoints.directory))
            else:
                path, ckpt, skipped = found
                for error in skipped:
                    print(f"scalefold train: --resume: skipping a checkpoint that does not load: {error}", flush=True)
                choice[0] = ("path", str(path))
    if runtime.distributed:
        dist.broadcast_object_list(choice, src=runtime.main_train_rank)
    kind, value = choice[0]
    if kind == "error":
        raise CheckpointError(f"--resume: {value}")
    if kind == "none":
        if main:
            print(f"scalefold train: --resume: no checkpoint in {value}; starting from step 0 (metrics.jsonl "
                  f"restarted, MLPerf log {mlperf_log_path(cfg).name})", flush=True)  # fmt: skip
        return None, None
    path = Path(value)
    if ckpt is None and runtime.is_train_rank:
        ckpt = load_checkpoint(path)
    return path, ckpt


def _train(cfg: TrainConfig, runtime: Runtime, stop_request: StopRequest) -> TrainResult:
    out = Path(cfg.out)
    main = runtime.is_main_train_rank
    device = runtime.device
    dtype, autocast = setup_precision(cfg.precision, cfg.deterministic)
    if main:
        out.mkdir(parents=True, exist_ok=True)

    # -- MLPerf init block (expensive setup belongs between init_start and init_stop) ------------
    # evaluation ranks log through their own logger (below); the file is named once the starting point
    # is known (a resumed run logs to its own file, named after the checkpoint that loads)
    mllog = mll.MLPerfLogger.for_rank(
        runtime.rank, (runtime.main_train_rank,), None, instance=mll.throughput_instance(), deferred=True
    )
    mllog.init_start()
    model_cfg = build_model_config(cfg)
    features = FeatureConfig.from_reference_config(model_cfg.to_dict())
    # model parallelism (issue 5): DAP / BP groups; collective, so every rank (eval ones too) calls it
    pctx = setup_model_parallel(
        cfg.dap, cfg.bp, cfg.num_async_eval_ranks, cfg.parallel_evoformer,
        crop_size=features.train_sequence_crop_size, train_group=runtime.train_group,
        ranks_per_node=runtime.local_world_size,
    )  # fmt: skip
    if main:
        print(f"scalefold: parallel layout: {pctx.describe()}", flush=True)
    eval_every = cfg.eval_every or cfg.max_steps or 1
    # -- data: the store is created once (rank 0), then every rank opens it -------------------------
    if runtime.rank == 0:
        ensure_store(cfg)
    if runtime.distributed:
        dist.barrier()
    # -- --resume: the newest checkpoint that loads (loaded here, inside the init phase) ------------------
    checkpoints = CheckpointManager(out / "checkpoints", keep_last=cfg.keep_last)
    resume_path, resume_ckpt = _resume_checkpoint(cfg, runtime, checkpoints) if cfg.resume else (None, None)
    mllog.open_file(mlperf_log_path(cfg, resume_path))
    # the store's chain table is read after run_start (dataset construction is timed): below for the
    # training ranks, after their run_start barrier for the evaluation ranks
    store_path = Path(cfg.store)

    def eval_cache() -> EvalCache:
        """Synchronous evaluation's validation batches, built once and kept in host DRAM
        (pinned on CUDA); each evaluation copies one batch at a time to the device."""
        cache = validation_cache(str(store_path), val_ids, features, pin_memory=device.type == "cuda")
        cache.fill()
        return cache

    if runtime.is_eval_rank:  # asynchronous evaluation ranks: serve evaluations until training ends
        async_eval = _async_eval_module()
        if runtime.distributed:  # training's run_start: the validation features are built after it (timed)
            dist.barrier()
        with Store.open(store_path) as store:
            val_ids = validation_chain_ids(store, cfg)
        cache = async_eval.store_eval_cache(str(store_path), val_ids, features, runtime, cfg.num_workers)
        # the first evaluation rank logs eval_start/eval_accuracy/eval_stop and run_stop success
        eval_log = mll.MLPerfLogger(mllog.log_path, enabled=runtime.is_main_eval_rank, instance=mllog.instance)
        try:  # a SIGTERM / SIGUSR1 meanwhile (stop_request) changes nothing: training decides when it ends
            async_eval.run_eval_rank(
                cfg, runtime, lambda: AlphaFold(model_cfg, parallel_evoformer=cfg.parallel_evoformer).to(device, dtype), cache,
                lambda m, b: evaluate(m, [to_device(b, device, dtype)], autocast), eval_log,
            )  # fmt: skip
        finally:
            eval_log.close()
        if stop_request.requested:
            announce(f"scalefold train: evaluation rank {runtime.rank}: {stop_request.signal_name} received; served "
                     "evaluations until training ended; exiting")  # fmt: skip
        return TrainResult(out=None, steps=0, final_loss=float("nan"))

    # -- model, loss, optimizer (flat buffers built before the DDP wrap) ------------------------------
    model = pctx.wrap(build_model(cfg, model_cfg, device, dtype))  # DAP/BP groups + gradient factors
    eval_model = (
        AlphaFold(model_cfg, activation_checkpointing=False, parallel_evoformer=cfg.parallel_evoformer).to(device, dtype)
        if main else None
    )  # fmt: skip
    loss_fn = AlphaFoldLoss(model_cfg.loss_config)
    opt = FlatAdamSWA(list(model.named_parameters()), lr=cfg.lr, eps=1e-6, swa_decay=cfg.swa_decay)
    if eval_model is not None:
        opt.bind_module_to_swa(eval_model)  # zero-copy: evaluation reads the SWA buffer
    if autocast:  # bf16 compute; the structure module and the heads stay fp32
        for module in (model, eval_model):
            if module is not None:
                keep_fp32_regions(module)
    lr_schedule = WarmupConstantLR(opt.lr, base_lr=cfg.lr, warmup_lr_init=cfg.warmup_lr_init, warmup_lr_iters=cfg.warmup_steps)
    if main:
        print(f"model {cfg.model_preset}: {opt.num_params:,} parameters; {runtime.num_train_ranks} training rank(s)",
              flush=True)  # fmt: skip

    # -- starting point: --init-from (reference format) or --resume (own checkpoint) -----------------
    init_sha = None
    if cfg.init_from:
        # every training rank loads the file; only the logging rank hashes it (1.1 GiB), then shares the hash
        iteration, init_sha = init_from_checkpoint(cfg.init_from, model, opt, hash_file=main)
        if runtime.distributed and runtime.num_train_ranks > 1:
            box = [init_sha]
            dist.broadcast_object_list(box, src=runtime.main_train_rank, group=runtime.train_group)
            init_sha = box[0]
        if main:
            print(f"initialised from {cfg.init_from} (iteration {iteration}, sha256 {init_sha})", flush=True)
    start_step = 0
    metrics_path = out / "metrics.jsonl"
    if resume_ckpt is not None:
        start_step = resume_from_checkpoint(resume_ckpt, cfg, model, opt, source=resume_path)
        resume_ckpt = None  # its tensors are in the model and the optimizer now
        if main:
            _truncate_metrics(metrics_path, start_step)
            print(f"resumed from step {start_step} ({resume_path})", flush=True)
    elif main and metrics_path.exists():  # a fresh start (also --resume without any checkpoint)
        metrics_path.unlink()

    if cfg.compile:  # compiled before run_start: one warm-up step on a synthetic batch of the training shapes
        t_compile = time.perf_counter()
        compiled = compile_blocks(model, backend=cfg.compile_backend)
        n_warm = min(1, features.num_ensembles - 1)  # a no-grad recycling pass and the grad pass
        synthetic = synthetic_step_batch(features, model, device, dtype)
        warm_up(model, {k: v[..., : n_warm + 1] for k, v in synthetic.items()}, autocast)
        if main:
            print(f"torch.compile: {compiled} blocks compiled in {time.perf_counter() - t_compile:.1f} s "
                  "(eager fallback on failure)", flush=True)  # fmt: skip

    # -- data parallelism: DDP averages gradients, its comm hook accumulates the clipping norm -------
    clipper = GradClipper(max_norm=cfg.clip_grad_max_norm, process_group=runtime.train_group)
    ddp_world = runtime.num_train_ranks if runtime.distributed else 1
    net: torch.nn.Module = model
    if ddp_world > 1:
        # gradient_as_bucket_view=False: DDP copies reduced buckets into .grad, which stays a view of
        # the optimizer's flat gradient buffer (bucket views would replace it).
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=runtime.train_group, gradient_as_bucket_view=False,
            find_unused_parameters=cfg.bp > 1,  # BP: the other branch's parameters get no gradient here
        )  # fmt: skip
        clipper.register(net)
    dp_rank = pctx.dp_rank  # DAP groups / BP pairs share one data-parallel index (sample, dropout seed)
    # CUDA graphs of the no-grad recycling passes (--cuda-graphs), captured here, before run_start;
    # forward(batch) is net(batch) where graphs are off (CPU, DAP/BP, a failed capture)
    forward = setup_graphed_step(cfg.cuda_graphs, model, net, features, device, dtype, autocast,
                                 model_parallel=pctx.layout.dap * pctx.layout.bp, rank=runtime.rank, verbose=main)  # fmt: skip

    # -- evaluation (synchronous on the main training rank, or asynchronous on the eval ranks) -------
    async_client = None
    val_cache: EvalCache | None = None
    if runtime.async_eval:
        swa_flat = _async_eval_module().swa_flat_buffer(opt)  # sent as is: the evaluation model's layout
        async_client = _async_eval_module().AsyncEvalClient(
            runtime, swa_flat.numel(), swa_flat.dtype, timeout_s=cfg.eval_timeout_s
        )

    result = TrainResult(out=out if main else None, steps=start_step, final_loss=float("nan"))
    metrics = _Metrics(metrics_path, enabled=main)

    mllog.log_init_block(
        mll.MLPerfRunInfo(
            seed=cfg.seed, number_of_ranks=runtime.world_size, number_of_nodes=runtime.num_nodes,
            accelerators_per_node=runtime.local_world_size if device.type == "cuda" else 0,
            submission_platform=cfg.submission_platform or device.type, submission_org=cfg.submission_org,
            global_batch_size=pctx.dp_size,
            val_every_iters=eval_every, precision=cfg.precision,
            target_avg_lddt_ca_value=cfg.target_lddt, val_min_cameo_submission_date=cfg.val_min_date,
            val_max_cameo_submission_date=cfg.val_max_date, train_max_pdb_release_date=_day_before(cfg.val_min_date),
            val_max_sequence_length=cfg.val_max_sequence_length,
            train_sequence_crop_size=features.train_sequence_crop_size,
            num_recycling_iters=features.num_recycling_iters, max_msa_clusters=features.max_msa_clusters,
            max_extra_msa=features.max_extra_msa, max_templates=features.max_templates,
            opt_base_learning_rate=cfg.lr, opt_gradient_clip_norm=cfg.clip_grad_max_norm,
            opt_learning_rate_warmup_init=cfg.warmup_lr_init, opt_learning_rate_warmup_steps=cfg.warmup_steps,
            init_checkpoint_sha256sum=init_sha, swa_decay_rate=cfg.swa_decay, model_parameters_count=opt.num_params,
        )
    )  # fmt: skip
    if runtime.distributed:
        # every training rank is ready: the clock starts (all ranks: evaluation ranks wait for run_start
        # before they touch the validation set)
        dist.barrier()
    mllog.init_stop_run_start()
    with Store.open(store_path) as store:
        train_ids, weights, val_ids = split_chains(store, cfg)
    if main:
        print(f"data: {len(train_ids)} training / {len(val_ids)} validation chains in {store_path}", flush=True)

    # the dataset is built after run_start (timed), each rank reading its own share of the stream
    pairs = sample_pairs(weights, cfg.seed, start_step, cfg.max_steps, rank=dp_rank, world_size=pctx.dp_size)
    train_sample = StoreSample(str(store_path), train_ids, features, mode="train")
    # one loader per DAP group / BP pair. A sample it gives up on is replaced (_ReplacementDraw), so it
    # yields exactly len(pairs) batches and every data-parallel rank takes the same number of steps.
    loader = (PriorityQueueLoader(train_sample, pairs, num_workers=cfg.num_workers, deterministic=cfg.deterministic,
                                  worker_init=ignore_stop_signals,  # a pre-emption signal is the trainer's
                                  replace=_ReplacementDraw(weights, cfg.seed, dp_rank, start_step))
              if pctx.is_loader_rank else None)  # fmt: skip
    # DAP / BP: the loader rank broadcasts a header per step (position, end of data, or its loader's
    # error) to its group; the step's batch itself follows below (pctx.broadcast_batch, after slicing)
    batches = (group_batches(loader, src=pctx.loader_rank, group=pctx.model_group, with_batch=False)
               if pctx.layout.dap * pctx.layout.bp > 1 else loader)  # fmt: skip
    # the compliance checker accepts the reference loaders' names only (PT: in order, PQ: priority queue)
    mllog.dataset_info(len(train_ids), len(val_ids), dataloader_type="InitialTrainingDataloaderPQ")

    # synchronous evaluation: the validation features are built once, after run_start like all dataset work
    # (timed), and kept in host DRAM. The untrained model's score (step 0) is for the curves only: timed
    # too (the rules allow no work on the data before run_start), not logged to MLPerf, and skipped with
    # --init-from and for --preset mlperf (eval_baseline)
    t_val = time.perf_counter()
    if main and cfg.eval_every and not runtime.async_eval:
        val_cache = eval_cache()
        if cfg.eval_baseline and not cfg.init_from and start_step == 0:
            baseline = evaluate(eval_model, val_cache.batches(device, dtype), autocast)
            metrics.write({"step": 0, "eval_lddt_ca": baseline, "epoch_num": 0})
            metrics.flush()
            result.eval_history.append((0, baseline))
            print(f"step 0: eval lDDT-Cα {baseline:.4f} (untrained model; not in the MLPerf log)", flush=True)
    validation_setup_s = time.perf_counter() - t_val

    # -- train ------------------------------------------------------------------------------------
    timings: dict[str, float] = defaultdict(float)
    timings["eval"] += validation_setup_s
    global_batch = pctx.dp_size
    consecutive_nonfinite = 0
    progress = _progress(cfg, start_step, enabled=main)
    open_epoch_samples = None  # samples seen by the end of the open train cycle (None: no cycle open)
    aborted = False  # an exception ends the loop (the breakdown is printed all the same)
    gc.disable()
    try:
        with stop_request:  # installed by train(): a signal during the setup counts too
            step = start_step
            t_wait = time.perf_counter()
            for _, batch in batches:
                step += 1
                timings["data_wait"] += time.perf_counter() - t_wait
                new_skips = _report_skips(loader, result, train_ids, runtime.rank, step, start_step)
                cycle = mll.cycle_of_iteration(step, eval_every)
                if (step - 1) % eval_every == 0 or step == start_step + 1:  # a cycle starts (or resumes)
                    mllog.epoch_start(mll.epoch_num(cycle - 1, global_batch, eval_every))
                open_epoch_samples = step * global_batch

                # forward + loss on t[..., :n+1]
                t0 = time.perf_counter()
                net.train()
                n = recycling_count(cfg.seed, step, features.num_ensembles)
                batch = pctx.broadcast_batch(step_batch(batch, n, device, dtype) if batch is not None else None, device)
                torch.manual_seed(forward_seed(cfg.seed, dp_rank, step))
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    outputs = forward(batch)  # net(batch), the no-grad recycling passes graphed on CUDA
                loss, terms = loss_fn(float_outputs(outputs) if autocast else outputs, batch)
                t1 = time.perf_counter()
                timings["forward"] += t1 - t0

                # backward (DDP: bucket all-reduce + norm accumulation), clip, Adam + SWA
                opt.zero_grad()
                loss.backward()
                t2 = time.perf_counter()
                timings["backward"] += t2 - t1
                clip = clipper.compute() if ddp_world > 1 else clipper.clip_flat_(opt.grad_buffers())
                # a loss term the loss module dropped as non-finite makes the step's loss non-finite too
                step_loss = nonfinite_terms_to_nan(loss, terms)
                mean_loss, stop, samples_skipped = allreduce_step_stats(
                    step_loss, stop_request.requested, runtime.train_group, ddp_world, count=len(result.skipped_samples)
                )  # fmt: skip
                lr = lr_schedule(step)
                skipped = not clip.is_finite() or not np.isfinite(mean_loss)  # same verdict on every rank
                if skipped:
                    consecutive_nonfinite += 1
                    result.skipped_steps += 1
                    if main:
                        progress.write(f"step {step}: non-finite loss/gradient, step skipped "
                                       f"({consecutive_nonfinite} in a row, {result.skipped_steps} in total)")  # fmt: skip
                else:
                    consecutive_nonfinite = 0
                    opt.step(clip_scale=clip.clip_scale)
                t3 = time.perf_counter()
                timings["optimizer"] += t3 - t2

                record = {
                    "step": step, "loss": mean_loss, "recycling_iters": n, "lr": lr,
                    "grad_norm": float(clip.grad_norm), "skipped": skipped, "skipped_total": result.skipped_steps,
                    **{(k if k.startswith("loss") else f"loss_{k}"): float(v) for k, v in terms.items()},
                    "time_data_wait": timings["data_wait"], "time_step": t3 - t0,
                    "samples_skipped": samples_skipped,  # by the loaders of all training ranks, each replaced
                }  # fmt: skip
                if new_skips:
                    record["skipped_samples"] = [{"chain_id": s["chain_id"], "reason": s["reason"],
                                                  "replaced_by": s["replaced_by"]} for s in new_skips]  # fmt: skip
                metrics.write(record)
                result.final_loss = mean_loss
                result.steps = step
                progress.update(1)
                progress.set_postfix(loss=f"{mean_loss:.3f}", n=n)
                if consecutive_nonfinite > cfg.max_consecutive_nonfinite:
                    metrics.flush()
                    raise TrainingAborted(
                        f"{consecutive_nonfinite} consecutive non-finite steps (limit {cfg.max_consecutive_nonfinite}) "
                        f"at step {step}"
                    )

                # evaluation with the SWA weights at the end of each train-eval cycle
                done = False
                if cfg.eval_every and step % eval_every == 0:
                    t_eval = time.perf_counter()
                    epoch = mll.epoch_num(cycle, global_batch, eval_every)
                    mllog.epoch_stop(epoch)
                    open_epoch_samples = None
                    if async_client is not None:  # hand the SWA weights over and go on training
                        async_client.submit(step, epoch, swa_flat)
                        try:
                            done = async_client.should_stop()  # an earlier evaluation reached the target
                        except RuntimeError as exc:  # an evaluation rank failed or is stuck
                            if main and (stop or stop_request.requested):  # pre-empted: keep the step first
                                ckpt_path = save_checkpoint(checkpoints, model, opt, step, model_preset=cfg.model_preset)
                                progress.write(f"scalefold train: stop requested (signal); checkpoint of step {step} "
                                               f"written to {ckpt_path} before aborting (continue with --resume)")  # fmt: skip
                            raise TrainingAborted(str(exc)) from exc
                        _record_async_evals(async_client, metrics, result, progress)
                        result.status = mll.STATUS_SUCCESS if done else result.status
                    else:
                        score = float("nan")
                        if main:
                            mllog.eval_start(epoch)
                            score = evaluate(eval_model, val_cache.batches(device, dtype), autocast)
                            mllog.eval_accuracy(score, epoch)
                            mllog.eval_stop(epoch)
                            metrics.write({"step": step, "eval_lddt_ca": score, "epoch_num": epoch})
                            progress.write(f"step {step}: eval lDDT-Cα {score:.4f}")
                        score = broadcast_float(score, runtime.main_train_rank, runtime.train_group, device, ddp_world > 1)
                        result.eval_history.append((step, score))
                        if score >= cfg.target_lddt:
                            result.status = mll.STATUS_SUCCESS
                            done = True
                    timings["eval"] += time.perf_counter() - t_eval
                metrics.flush()

                if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stop:
                    t_ckpt = time.perf_counter()
                    if main:
                        save_checkpoint(checkpoints, model, opt, step, model_preset=cfg.model_preset)
                    timings["checkpoint"] += time.perf_counter() - t_ckpt
                if stop:
                    result.stopped_by_signal = stop_request.signum or -1
                    if main:
                        progress.write(f"scalefold train: stop requested (signal); checkpoint of step {step} written "
                                       f"to {checkpoints.path_for(step)}; exiting (continue with --resume)")  # fmt: skip
                    break
                if done:
                    break
                t_wait = time.perf_counter()
    except BaseException:
        aborted = True
        raise
    finally:
        gc.enable()
        progress.close()
        if batches is not loader:
            batches.close()  # the group's header stream (on the loader rank it closes the loader too)
        if loader is not None:
            _report_skips(loader, result, train_ids, runtime.rank, result.steps, start_step)
            loader.close()
        eval_failure = None
        if async_client is not None:
            if async_client.failed:  # logged first: the evaluation ranks exit once close() releases them
                mllog.run_stop(mll.STATUS_ABORTED)
            t_close = time.perf_counter()
            try:
                async_client.close()  # pending evaluations finish first (in order)
            except RuntimeError as exc:
                eval_failure = exc
            timings["eval"] += time.perf_counter() - t_close  # waiting for the last evaluations
            _record_async_evals(async_client, metrics, result, progress)
            if async_client.target_reached:  # the main evaluation rank logged run_stop success
                result.status = mll.STATUS_SUCCESS
        metrics.close()
        if open_epoch_samples is not None:  # the run ended inside a cycle: close it (samples seen so far)
            mllog.epoch_stop(open_epoch_samples)
        if async_client is None or not async_client.target_reached:
            mllog.run_stop(mll.STATUS_ABORTED if eval_failure is not None else result.status)
        mllog.close()
        result.timings = dict(timings)
        if device.type == "cuda":  # graphed / eager step counts (on CPU the forward is always eager)
            result.notes.append(forward.summary())
        if main and (aborted or eval_failure is not None):  # an aborted run gets its curves and breakdown too
            _final_report(cfg, out, metrics_path, result)
    if eval_failure is not None:
        raise TrainingAborted(str(eval_failure)) from eval_failure

    announce(f"scalefold train: rank {runtime.rank} finished at step {result.steps} "
             f"({len(result.skipped_samples)} sample(s) skipped and replaced by its loader)")  # fmt: skip
    if main:
        _final_report(cfg, out, metrics_path, result)
    return result


def _final_report(cfg: TrainConfig, out: Path, metrics_path: Path, result: TrainResult) -> None:
    """``curves.png`` and the step-time breakdown (main training rank; also after an abort, where a
    failure to plot is reported and never hides the abort's own error)."""
    try:
        if metrics_path.exists():
            plot_metrics(metrics_path, out / "curves.png", title=f"scalefold train --preset {cfg.preset}")
    except Exception as exc:  # noqa: BLE001 -- the breakdown still follows
        print(f"scalefold train: could not plot {metrics_path}: {type(exc).__name__}: {exc}", flush=True)
    print_breakdown(result)


def _record_async_evals(client: Any, metrics: _Metrics, result: TrainResult, progress: Any) -> None:
    """Evaluations the asynchronous evaluation ranks finished since the last call -> metrics, console."""
    for r in client.take_results():
        metrics.write({"step": r.step, "eval_lddt_ca": r.score, "epoch_num": r.epoch})
        result.eval_history.append((r.step, r.score))
        progress.write(f"step {r.step}: eval lDDT-Cα {r.score:.4f} (evaluation ranks)")


def mlperf_log_path(cfg: TrainConfig, resumed_from: Path | None = None) -> Path:
    """``<out>/mlperf.log``; a run resumed from checkpoint ``resumed_from`` (the one that loaded) logs its
    own init..run_stop sequence to ``<out>/mlperf_resumed_<iteration>.log`` (one run per file, as the
    compliance checker expects)."""
    out = Path(cfg.out)
    if resumed_from is None:
        return out / "mlperf.log"
    return out / f"mlperf_resumed_{Path(resumed_from).stem[len(CHECKPOINT_PREFIX):]}.log"


def save_checkpoint(
    checkpoints: CheckpointManager, model: AlphaFold, opt: FlatAdamSWA, step: int, model_preset: str | None = None
) -> Path:
    """Reference keys (weights, Adam state, iteration) plus SWA state, RNG state, data position and
    the model preset name."""
    ckpt = build_checkpoint(
        model.state_dict(), opt.state_dict(), step, swa_state=opt.swa_state_dict(),
        rng_state=capture_rng_state(), data_position={"samples_consumed": step}, model_preset=model_preset,
    )  # fmt: skip
    return checkpoints.save(ckpt)


def resume_from_checkpoint(ckpt: dict[str, Any], cfg: TrainConfig, model: AlphaFold, opt: FlatAdamSWA,
                           source: Any = "checkpoint") -> int:  # fmt: skip
    """Restore weights, Adam and SWA state and RNG state of one of our checkpoints; returns its step.

    A checkpoint of another model preset, or whose parameters do not match the model, is refused
    (:class:`~scalefold.checkpoint.adapters.CheckpointError` listing the mismatches) before anything is
    loaded.
    """
    from scalefold.checkpoint.adapters import CheckpointError, StateDictMismatchError, compare_state_dict

    preset = ckpt.get("model_preset")
    if preset is not None and preset != cfg.model_preset:
        raise CheckpointError(
            f"{source}: checkpoint of model preset {preset!r}, this run builds {cfg.model_preset!r}"
        )
    missing = [k for k in ("alphafold_state_dict", "optimizer_state_dict", "iteration", "swa_state_dict",
                           "rng_state") if k not in ckpt]  # fmt: skip
    if missing:
        raise CheckpointError(f"{source}: not a resumable ScaleFold checkpoint, missing {missing}")
    report = compare_state_dict(model, ckpt["alphafold_state_dict"])
    if not report.ok:
        raise StateDictMismatchError(report)
    model.load_state_dict(ckpt["alphafold_state_dict"])  # copies into the flat master views
    opt.load_state_dict(ckpt["optimizer_state_dict"])
    opt.load_swa_state_dict(ckpt["swa_state_dict"])
    opt.sync_compute_from_master()
    restore_rng_state(ckpt["rng_state"])
    step = int(ckpt["iteration"])
    consumed = int(ckpt.get("data_position", {}).get("samples_consumed", step))
    if consumed != step:
        raise CheckpointError(f"{source}: data position {consumed} != iteration {step}")
    return step


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after ``last_step`` (written after the checkpoint a resumed run restarts from)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last_step]
    path.write_text("".join(ln + "\n" for ln in lines))


def _progress(cfg: TrainConfig, start: int, enabled: bool = True):
    from tqdm import tqdm

    return tqdm(
        total=cfg.max_steps, initial=start, desc="train", unit="step", disable=not (cfg.progress and enabled),
        dynamic_ncols=True,
    )  # fmt: skip


BREAKDOWN_KEYS = ("data_wait", "forward", "backward", "optimizer", "eval", "checkpoint")


def print_breakdown(result: TrainResult, file: Any = None) -> None:
    """Step-time breakdown (data wait, forward, backward, optimizer, eval, checkpoint): seconds, share of
    the total, milliseconds per step; then the evaluation history."""
    steps = max(result.steps, 1)
    timings = {k: result.timings.get(k, 0.0) for k in BREAKDOWN_KEYS}
    timings.update({k: v for k, v in result.timings.items() if k not in timings})
    total = sum(timings.values())
    lines = [f"step-time breakdown over {result.steps} steps ({result.skipped_steps} skipped):"]
    for key, seconds in timings.items():
        share = 100 * seconds / total if total > 0 else 0.0
        lines.append(f"  {key:<11s} {seconds:8.2f} s  {share:5.1f} %  {1000 * seconds / steps:9.1f} ms/step")
    lines.append(f"  {'total':<11s} {total:8.2f} s  100.0 %  {1000 * total / steps:9.1f} ms/step")
    if result.skipped_samples:  # data the loader gave up on (each replaced: the step still happened)
        lines.append(f"data: {len(result.skipped_samples)} sample(s) skipped and replaced: " + ", ".join(
            f"{s['chain_id']} ({s['reason']})" for s in result.skipped_samples))  # fmt: skip
    lines.extend(result.notes)
    if result.eval_history:
        lines.append("eval lDDT-Cα: " + ", ".join(f"step {s}: {v:.4f}" for s, v in result.eval_history))
    print("\n".join(lines), file=file, flush=True)


__all__ = [
    "TrainResult", "TrainingAborted", "train", "evaluate", "recycling_count", "forward_seed", "build_model_config",
    "build_model", "split_chains", "validation_chain_ids", "init_from_checkpoint", "save_checkpoint",
    "resume_from_checkpoint", "announce",
]  # fmt: skip
