"""The training loop of ``scalefold train`` (reads top to bottom; step components in :mod:`.steps`).

One step (supplement 1.11, MLPerf HPC OpenFold), on every data-parallel rank:

1. take the next ready batch from the priority-queue loader (``[1, ..., R]``); each rank reads its
   own strided share of one position-indexed sample stream (:func:`~.steps.sample_pairs`);
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
checkpoint. Outputs (main training rank only) in ``out``: ``metrics.jsonl``, ``mlperf.log``,
``checkpoints/``, ``curves.png``.
"""

from __future__ import annotations

import gc
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from scalefold.data.loader import PriorityQueueLoader
from scalefold.data.pipeline import FeatureConfig, TrainingChainFilter, sampling_weights
from scalefold.data.store import Store
from scalefold.losses import AlphaFoldLoss
from scalefold.metrics import validation_lddt_ca
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.train import mlperf_logging as mll
from scalefold.train.checkpoint_io import (
    CheckpointManager,
    build_checkpoint,
    capture_rng_state,
    restore_rng_state,
    sha256sum,
)
from scalefold.train.config import TrainConfig
from scalefold.train.flat_optimizer import FlatAdamSWA
from scalefold.train.grad_clipping import GradClipper
from scalefold.train.lr_schedule import WarmupConstantLR
from scalefold.train.plots import plot_metrics
from scalefold.train.runtime import Runtime, init_distributed, shutdown
from scalefold.train.sample import StoreSample
from scalefold.train.steps import (
    StopRequest,
    allreduce_step_stats,
    broadcast_float,
    compile_blocks,
    float_outputs,
    forward_seed,
    recycling_count,
    sample_pairs,
    setup_precision,
    step_batch,
    to_device,
)


class TrainingAborted(RuntimeError):
    """The run stopped without reaching its end (``run_stop status=aborted`` was logged)."""


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
    return AlphaFold(model_cfg, activation_checkpointing=cfg.activation_checkpointing).to(device, dtype)


def ensure_store(cfg: TrainConfig) -> Path:
    """The run's store; a synthetic one is created there first if the file is absent."""
    path = Path(cfg.store)
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
    dates = [str(d)[:10] for d in table["release_date"]]
    val_ids = [
        str(c) for c, d, n in zip(table["chain_id"], dates, table["length"])
        if cfg.val_min_date <= d <= cfg.val_max_date and n <= cfg.val_max_sequence_length
    ]  # fmt: skip
    if cfg.eval_max_chains:
        val_ids = val_ids[: cfg.eval_max_chains]
    if not train_ids:
        raise ValueError(f"no training chains in {store.path}")
    return train_ids, weights, val_ids


def _day_before(date: str) -> str:
    import datetime

    return (datetime.date.fromisoformat(date) - datetime.timedelta(days=1)).isoformat()


def check_parallelism(cfg: TrainConfig) -> None:
    """Options whose implementation lands elsewhere fail early and clearly."""
    if cfg.dap > 1 or cfg.bp > 1 or cfg.parallel_evoformer:
        raise NotImplementedError(
            f"dap={cfg.dap} bp={cfg.bp} parallel_evoformer={cfg.parallel_evoformer}: DAP / branch parallelism "
            "lands with issue 5 (scalefold.distributed); train with --dap 1 --bp 1"
        )
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


def init_from_checkpoint(path: str, model: AlphaFold, opt: FlatAdamSWA) -> tuple[int, str]:
    """Load a reference-format checkpoint (weights strictly, Adam moments onto the flat buffers).

    SWA restarts from the loaded weights. Returns ``(stored iteration, sha256 of the file)``.
    Mismatching names/shapes or a corrupt file raise :class:`~scalefold.checkpoint.adapters.CheckpointError`
    listing the mismatches; nothing is half-loaded into the optimizer.
    """
    from scalefold.checkpoint.adapters import CheckpointError, _check_adam_state, load_reference_checkpoint

    iteration = load_reference_checkpoint(path, model, optimizer=None)  # strict: lists every mismatch
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if "optimizer_state_dict" in ckpt:
        _check_adam_state(ckpt["optimizer_state_dict"], list(model.parameters()))
        try:
            opt.load_state_dict(ckpt["optimizer_state_dict"])
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: optimizer state does not fit the model: {exc}") from exc
    opt.sync_compute_from_master()
    opt.reset_swa()
    return iteration, sha256sum(path)


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


class _Metrics:
    """``metrics.jsonl`` of the main training rank (other ranks: no-op)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self._file = path.open("a") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def train(cfg: TrainConfig) -> TrainResult:
    """Run ``cfg`` on every rank of the launch; returns a summary (everything else is in ``cfg.out``).

    Raises :class:`TrainingAborted` (after logging ``run_stop status=aborted``) when the run aborts.
    """
    check_parallelism(cfg)
    runtime = init_distributed(cfg.num_async_eval_ranks)
    role = "eval" if runtime.is_eval_rank else "train"
    print(f"scalefold: rank {runtime.rank}/{runtime.world_size} backend {runtime.backend or 'none'} role {role}", flush=True)
    numerics = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32)  # fmt: skip
    try:
        return _train(cfg, runtime)
    finally:  # process-wide switches go back to what the caller had
        torch.use_deterministic_algorithms(numerics[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = numerics[1:]
        shutdown(runtime)


def _train(cfg: TrainConfig, runtime: Runtime) -> TrainResult:
    out = Path(cfg.out)
    main = runtime.is_main_train_rank
    device = runtime.device
    dtype, autocast = setup_precision(cfg.precision, cfg.deterministic)
    if main:
        out.mkdir(parents=True, exist_ok=True)

    # -- MLPerf init block (expensive setup belongs between init_start and init_stop) ------------
    mllog = mll.MLPerfLogger.for_rank(runtime.rank, runtime.log_ranks, out / "mlperf.log")
    mllog.init_start()
    model_cfg = build_model_config(cfg)
    features = FeatureConfig.from_reference_config(model_cfg.to_dict())
    eval_every = cfg.eval_every or cfg.max_steps or 1
    # -- data: the store is created once (rank 0), then every rank opens it -------------------------
    if runtime.rank == 0:
        ensure_store(cfg)
    if runtime.distributed:
        dist.barrier()
    store_path = Path(cfg.store)
    store = Store.open(store_path)
    train_ids, weights, val_ids = split_chains(store, cfg)
    store.close()

    def eval_batches() -> list[dict[str, torch.Tensor]]:
        eval_sample = StoreSample(str(store_path), val_ids, features, mode="eval")
        return [to_device(eval_sample(i, 0), device, dtype) for i in range(len(val_ids))]

    if runtime.is_eval_rank:  # asynchronous evaluation ranks: their own loop
        _async_eval_module().run_eval_rank(
            cfg, runtime, lambda: AlphaFold(model_cfg).to(device, dtype), eval_batches, mllog
        )  # fmt: skip
        return TrainResult(out=None, steps=0, final_loss=float("nan"))

    # -- model, loss, optimizer (flat buffers built before the DDP wrap) ------------------------------
    model = build_model(cfg, model_cfg, device, dtype)
    eval_model = AlphaFold(model_cfg, activation_checkpointing=False).to(device, dtype) if main else None
    loss_fn = AlphaFoldLoss(model_cfg.loss_config)
    opt = FlatAdamSWA(list(model.named_parameters()), lr=cfg.lr, eps=1e-6, swa_decay=cfg.swa_decay)
    if eval_model is not None:
        opt.bind_module_to_swa(eval_model)  # zero-copy: evaluation reads the SWA buffer
    lr_schedule = WarmupConstantLR(opt.lr, base_lr=cfg.lr, warmup_lr_init=cfg.warmup_lr_init, warmup_lr_iters=cfg.warmup_steps)
    if main:
        print(f"model {cfg.model_preset}: {opt.num_params:,} parameters; {len(train_ids)} training / "
              f"{len(val_ids)} validation chains; {runtime.num_train_ranks} training rank(s)", flush=True)  # fmt: skip

    # -- starting point: --init-from (reference format) or --resume (own checkpoint) -----------------
    init_sha = None
    if cfg.init_from:
        iteration, init_sha = init_from_checkpoint(cfg.init_from, model, opt)
        if main:
            print(f"initialised from {cfg.init_from} (iteration {iteration}, sha256 {init_sha})", flush=True)
    checkpoints = CheckpointManager(out / "checkpoints", keep_last=cfg.keep_last)
    start_step = 0
    metrics_path = out / "metrics.jsonl"
    if cfg.resume:
        ckpt = checkpoints.load_latest()
        if ckpt is not None:
            model.load_state_dict(ckpt["alphafold_state_dict"])  # copies into the flat master views
            opt.load_state_dict(ckpt["optimizer_state_dict"])
            opt.load_swa_state_dict(ckpt["swa_state_dict"])
            opt.sync_compute_from_master()
            restore_rng_state(ckpt["rng_state"])
            start_step = int(ckpt["iteration"])
            consumed = int(ckpt.get("data_position", {}).get("samples_consumed", start_step))
            if consumed != start_step:
                raise ValueError(f"checkpoint data position {consumed} != iteration {start_step}")
            if main:
                _truncate_metrics(metrics_path, start_step)
                print(f"resumed from step {start_step}", flush=True)
    elif main and metrics_path.exists():
        metrics_path.unlink()

    if cfg.compile:
        compiled = compile_blocks(model)
        if main:
            print(f"torch.compile: {compiled} blocks (eager fallback on failure)", flush=True)

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
        )  # fmt: skip
        clipper.register(net)
    dp_rank = runtime.data_parallel_rank

    # -- evaluation (synchronous on the main training rank, or asynchronous on the eval ranks) -------
    async_client = None
    val_batches: list[dict[str, torch.Tensor]] = []
    if runtime.async_eval:
        async_client = _async_eval_module().AsyncEvalClient(runtime, num_params=opt.num_params)
    elif main and cfg.eval_every:
        val_batches = eval_batches()

    result = TrainResult(out=out if main else None, steps=start_step, final_loss=float("nan"))
    metrics = _Metrics(metrics_path, enabled=main)
    if main and cfg.eval_every and start_step == 0 and not runtime.async_eval:
        # the untrained model's score, for the curves: before run_start and not logged to MLPerf
        baseline = evaluate(eval_model, val_batches, autocast)
        metrics.write({"step": 0, "eval_lddt_ca": baseline, "epoch_num": 0})
        metrics.flush()
        result.eval_history.append((0, baseline))
        print(f"step 0: eval lDDT-Cα {baseline:.4f}", flush=True)

    mllog.log_init_block(
        mll.MLPerfRunInfo(
            seed=cfg.seed, number_of_ranks=runtime.world_size, number_of_nodes=runtime.num_nodes,
            accelerators_per_node=runtime.local_world_size if device.type == "cuda" else 0,
            submission_platform=device.type, global_batch_size=runtime.num_train_ranks,
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
        dist.barrier(group=runtime.train_group)  # every training rank is ready: the clock starts
    mllog.init_stop_run_start()

    # the dataset is built after run_start (timed), each rank reading its own share of the stream
    pairs = sample_pairs(weights, cfg.seed, start_step, cfg.max_steps, rank=dp_rank, world_size=runtime.num_train_ranks)
    train_sample = StoreSample(str(store_path), train_ids, features, mode="train")
    loader = PriorityQueueLoader(train_sample, pairs, num_workers=cfg.num_workers, deterministic=cfg.deterministic)
    mllog.dataset_info(train_samples=len(train_ids), eval_samples=len(val_ids), dataloader_type="priority_queue")

    # -- train ------------------------------------------------------------------------------------
    timings: dict[str, float] = defaultdict(float)
    global_batch = runtime.num_train_ranks
    consecutive_nonfinite = 0
    progress = _progress(cfg, start_step, enabled=main)
    gc.disable()
    try:
        with StopRequest() as stop_request:
            step = start_step
            t_wait = time.perf_counter()
            for _, batch in loader:
                step += 1
                timings["data_wait"] += time.perf_counter() - t_wait
                cycle = mll.cycle_of_iteration(step, eval_every)
                if (step - 1) % eval_every == 0:
                    mllog.epoch_start(mll.epoch_num(cycle - 1, global_batch, eval_every))

                # forward + loss on t[..., :n+1]
                t0 = time.perf_counter()
                net.train()
                n = recycling_count(cfg.seed, step, features.num_ensembles)
                batch = step_batch(batch, n, device, dtype)
                torch.manual_seed(forward_seed(cfg.seed, dp_rank, step))
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    outputs = net(batch)
                loss, terms = loss_fn(float_outputs(outputs) if autocast else outputs, batch)
                t1 = time.perf_counter()
                timings["forward"] += t1 - t0

                # backward (DDP: bucket all-reduce + norm accumulation), clip, Adam + SWA
                opt.zero_grad()
                loss.backward()
                t2 = time.perf_counter()
                timings["backward"] += t2 - t1
                clip = clipper.compute() if ddp_world > 1 else clipper.clip_flat_(opt.grad_buffers())
                mean_loss, stop = allreduce_step_stats(loss, stop_request.requested, runtime.train_group, ddp_world)
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
                }  # fmt: skip
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
                    if async_client is not None:
                        async_client.submit(step, epoch, torch.cat([v.reshape(-1) for v in opt.swa_views()]))
                        done = async_client.should_stop()
                        result.status = mll.STATUS_SUCCESS if done else result.status
                    else:
                        score = float("nan")
                        if main:
                            mllog.eval_start(epoch)
                            score = evaluate(eval_model, val_batches, autocast)
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
                        save_checkpoint(checkpoints, model, opt, step)
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
    finally:
        gc.enable()
        progress.close()
        loader.close()
        metrics.close()
        if async_client is not None:
            async_client.close()
        if not runtime.async_eval:  # with evaluation ranks, the main evaluation rank logs run_stop
            mllog.run_stop(result.status)
        mllog.close()

    result.timings = dict(timings)
    if main:
        if metrics_path.exists():
            plot_metrics(metrics_path, out / "curves.png", title=f"scalefold train --preset {cfg.preset}")
        print_breakdown(result)
    return result


def save_checkpoint(checkpoints: CheckpointManager, model: AlphaFold, opt: FlatAdamSWA, step: int) -> Path:
    """Reference keys (weights, Adam state, iteration) plus SWA state, RNG state and data position."""
    ckpt = build_checkpoint(
        model.state_dict(), opt.state_dict(), step, swa_state=opt.swa_state_dict(),
        rng_state=capture_rng_state(), data_position={"samples_consumed": step},
    )  # fmt: skip
    return checkpoints.save(ckpt)


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


def print_breakdown(result: TrainResult) -> None:
    """Step-time breakdown: data wait, forward, backward, optimizer, eval, checkpoint."""
    total = sum(result.timings.values()) or 1.0
    print(f"step-time breakdown over {result.steps} steps ({result.skipped_steps} skipped):")
    for key, seconds in result.timings.items():
        print(f"  {key:<11s} {seconds:8.2f} s  {100 * seconds / total:5.1f} %")
    if result.eval_history:
        print("eval lDDT-Cα: " + ", ".join(f"step {s}: {v:.4f}" for s, v in result.eval_history))


__all__ = [
    "TrainResult", "TrainingAborted", "train", "evaluate", "recycling_count", "forward_seed", "build_model_config",
    "build_model", "split_chains", "init_from_checkpoint", "save_checkpoint",
]  # fmt: skip
