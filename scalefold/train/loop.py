"""The training loop of ``scalefold train`` (single process; reads top to bottom).

One step (supplement 1.11, MLPerf HPC OpenFold):

1. take the next ready batch from the priority-queue loader (``[1, ..., R]``);
2. draw the recycling count ``n`` uniformly from ``{0 .. R-1}`` (a function of seed and step, so
   identical on every rank and after a resume) and keep ``t[..., :n + 1]``;
3. seed the forward pass from (seed, data-parallel rank, step) (dropout);
4. forward (no-grad recycling passes, then one grad pass), loss, backward;
5. global-norm clipping on the flat gradient buffers (``GradClipper`` single-process path),
   non-finite gradients skip the step;
6. Adam + SWA over flat buffers (``FlatAdamSWA``) with the warm-up learning rate.

Every ``eval_every`` steps the SWA weights are evaluated (mean lDDT-Cα over held-out validation
chains released in the CAMEO window); every ``checkpoint_every`` steps an atomic checkpoint is
written. Outputs in ``out``: ``metrics.jsonl``, the MLPerf log, ``checkpoints/``, ``curves.png``.
"""

from __future__ import annotations

import gc
import json
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from scalefold.data.loader import PriorityQueueLoader, Sampler
from scalefold.data.pipeline import FeatureConfig, TrainingChainFilter, sampling_weights
from scalefold.data.store import Store
from scalefold.losses import AlphaFoldLoss
from scalefold.metrics import validation_lddt_ca
from scalefold.model import AlphaFold, AlphaFoldConfig
from scalefold.train import mlperf_logging as mll
from scalefold.train.checkpoint_io import CheckpointManager, build_checkpoint, capture_rng_state, restore_rng_state
from scalefold.train.config import TrainConfig
from scalefold.train.flat_optimizer import FlatAdamSWA
from scalefold.train.grad_clipping import GradClipper
from scalefold.train.lr_schedule import WarmupConstantLR
from scalefold.train.plots import plot_metrics
from scalefold.train.sample import StoreSample

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.float32}  # bf16: fp32 master + autocast
DATA_PARALLEL_RANK = 0  # single process
SEED_MODULUS = 2**63 - 1


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
    precision = "fp32" if cfg.precision == "fp64" else cfg.precision
    return AlphaFoldConfig.from_preset(
        cfg.model_preset, precision=precision, overrides={k: v for k, v in overrides.items() if v is not None}
    )


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


def recycling_count(seed: int, step: int, num_ensembles: int) -> int:
    """Recycling iterations of 1-based ``step``: uniform on ``{0 .. R-1}``, a pure function of (seed, step)."""
    return random.Random(f"recycling:{seed}:{step}").randrange(num_ensembles)


def forward_seed(seed: int, rank: int, step: int) -> int:
    """Per-step seed of the forward pass (dropout) from (seed, data-parallel rank, step)."""
    return random.Random(f"forward:{seed}:{rank}:{step}").randrange(SEED_MODULUS)


def to_device(batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Move a batch; floating features take the run's compute dtype."""
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: AlphaFold, batches: list[dict[str, torch.Tensor]], autocast: bool) -> float:
    """Mean chain-level lDDT-Cα of ``model`` over the validation ``batches`` (all recycling passes)."""
    model.eval()
    scores = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
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
    out: Path
    steps: int
    final_loss: float
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def train(cfg: TrainConfig) -> TrainResult:
    """Run ``cfg``; returns a summary (everything else is in ``cfg.out``)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu")
    dtype = DTYPES[cfg.precision]
    autocast = cfg.precision == "bf16"
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)

    # -- MLPerf init block ------------------------------------------------------------------------
    mlperf_log_path = out / "mlperf.log"
    mllog = mll.MLPerfLogger(mlperf_log_path)
    mllog.init_start()
    model_cfg = build_model_config(cfg)
    features = FeatureConfig.from_reference_config(model_cfg.to_dict())
    eval_every = cfg.eval_every or cfg.max_steps
    # -- data ---------------------------------------------------------------------------------------
    store_path = ensure_store(cfg)
    store = Store.open(store_path)
    train_ids, weights, val_ids = split_chains(store, cfg)
    store.close()
    eval_sample = StoreSample(str(store_path), val_ids, features, mode="eval")
    eval_batches = [to_device(eval_sample(i, 0), device, dtype) for i in range(len(val_ids))] if cfg.eval_every else []

    # -- model, loss, optimizer (flat buffers built before any DDP wrap) -------------------------------
    torch.manual_seed(cfg.seed)
    model = AlphaFold(model_cfg, activation_checkpointing=cfg.activation_checkpointing).to(device, dtype)
    eval_model = AlphaFold(model_cfg, activation_checkpointing=False).to(device, dtype)
    loss_fn = AlphaFoldLoss(model_cfg.loss_config)
    opt = FlatAdamSWA(list(model.named_parameters()), lr=cfg.lr, eps=1e-6, swa_decay=cfg.swa_decay)
    opt.bind_module_to_swa(eval_model)  # zero-copy: evaluation reads the SWA buffer
    clipper = GradClipper(max_norm=cfg.clip_grad_max_norm)
    lr_schedule = WarmupConstantLR(opt.lr, base_lr=cfg.lr, warmup_lr_init=cfg.warmup_lr_init, warmup_lr_iters=cfg.warmup_steps)
    print(f"model {cfg.model_preset}: {opt.num_params:,} parameters; {len(train_ids)} training / {len(val_ids)} validation chains")

    mllog.log_init_block(
        mll.MLPerfRunInfo(
            seed=cfg.seed, val_every_iters=eval_every, precision=cfg.precision,
            target_avg_lddt_ca_value=cfg.target_lddt, val_min_cameo_submission_date=cfg.val_min_date,
            val_max_cameo_submission_date=cfg.val_max_date, train_max_pdb_release_date=_day_before(cfg.val_min_date),
            val_max_sequence_length=cfg.val_max_sequence_length,
            train_sequence_crop_size=features.train_sequence_crop_size,
            num_recycling_iters=features.num_recycling_iters, max_msa_clusters=features.max_msa_clusters,
            max_extra_msa=features.max_extra_msa, max_templates=features.max_templates,
            opt_base_learning_rate=cfg.lr, opt_gradient_clip_norm=cfg.clip_grad_max_norm,
            opt_learning_rate_warmup_init=cfg.warmup_lr_init, opt_learning_rate_warmup_steps=cfg.warmup_steps,
            swa_decay_rate=cfg.swa_decay, model_parameters_count=opt.num_params,
        )
    )  # fmt: skip

    # -- resume -----------------------------------------------------------------------------------
    checkpoints = CheckpointManager(out / "checkpoints", keep_last=cfg.keep_last)
    start_step = 0
    metrics_path = out / "metrics.jsonl"
    if cfg.resume:
        ckpt = checkpoints.load_latest()
        if ckpt is not None:
            model.load_state_dict(ckpt["alphafold_state_dict"])  # copies into the flat master views
            opt.load_state_dict(ckpt["optimizer_state_dict"])
            opt.load_swa_state_dict(ckpt["swa_state_dict"])
            restore_rng_state(ckpt["rng_state"])
            start_step = int(ckpt["iteration"])
            _truncate_metrics(metrics_path, start_step)
            print(f"resumed from step {start_step}")
    elif metrics_path.exists():
        metrics_path.unlink()

    sampler = Sampler(weights, num_samples=cfg.max_steps, seed=cfg.seed, start=start_step)
    train_sample = StoreSample(str(store_path), train_ids, features, mode="train")
    loader = PriorityQueueLoader(train_sample, sampler, num_workers=cfg.num_workers, deterministic=cfg.deterministic)

    mllog.init_stop_run_start()
    mllog.dataset_info(train_samples=len(train_ids), eval_samples=len(val_ids), dataloader_type="priority_queue")

    # -- train ------------------------------------------------------------------------------------
    timings: dict[str, float] = defaultdict(float)
    result = TrainResult(out=out, steps=start_step, final_loss=float("nan"))
    status = mll.STATUS_ABORTED
    consecutive_nonfinite = 0
    if cfg.eval_every and start_step == 0:  # the untrained model's score, for the curves (not logged to MLPerf)
        baseline = evaluate(eval_model, eval_batches, autocast)
        with metrics_path.open("a") as metrics:
            metrics.write(json.dumps({"step": 0, "eval_lddt_ca": baseline, "epoch_num": 0}) + "\n")
        result.eval_history.append((0, baseline))
        print(f"step 0: eval lDDT-Cα {baseline:.4f}")
    progress = _progress(cfg, start_step)
    gc.disable()
    try:
        with metrics_path.open("a") as metrics:
            step = start_step
            t_wait = time.perf_counter()
            for _, batch in loader:
                step += 1
                timings["data_wait"] += time.perf_counter() - t_wait
                cycle = mll.cycle_of_iteration(step, eval_every)
                if (step - 1) % eval_every == 0:
                    mllog.epoch_start(mll.epoch_num(cycle - 1, 1, eval_every))

                # forward + loss on t[..., :n+1]
                t0 = time.perf_counter()
                model.train()
                n = recycling_count(cfg.seed, step, features.num_ensembles)
                batch = to_device({k: v[..., : n + 1] for k, v in batch.items()}, device, dtype)
                torch.manual_seed(forward_seed(cfg.seed, DATA_PARALLEL_RANK, step))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    outputs = model(batch)
                loss, terms = loss_fn(_float_outputs(outputs) if autocast else outputs, batch)
                t1 = time.perf_counter()
                timings["forward"] += t1 - t0

                # backward, clip, Adam + SWA
                opt.zero_grad()
                loss.backward()
                t2 = time.perf_counter()
                timings["backward"] += t2 - t1
                clip = clipper.clip_flat_(opt.grad_buffers())
                lr = lr_schedule(step)
                skipped = not clip.is_finite() or not math.isfinite(float(loss.detach()))
                if skipped:
                    consecutive_nonfinite += 1
                    result.skipped_steps += 1
                    if consecutive_nonfinite > cfg.max_consecutive_nonfinite:
                        raise FloatingPointError(f"{consecutive_nonfinite} consecutive non-finite steps")
                else:
                    consecutive_nonfinite = 0
                    opt.step(clip_scale=clip.clip_scale)
                t3 = time.perf_counter()
                timings["optimizer"] += t3 - t2

                record = {
                    "step": step, "loss": float(loss.detach()), "recycling_iters": n, "lr": lr,
                    "grad_norm": float(clip.grad_norm), "skipped": skipped,
                    **{(k if k.startswith("loss") else f"loss_{k}"): float(v) for k, v in terms.items()},
                    "time_data_wait": timings["data_wait"], "time_step": t3 - t0,
                }  # fmt: skip
                metrics.write(json.dumps(record) + "\n")
                result.final_loss = record["loss"]
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.3f}", n=n)

                # evaluation with the SWA weights at the end of each train-eval cycle
                if cfg.eval_every and step % eval_every == 0:
                    t_eval = time.perf_counter()
                    epoch = mll.epoch_num(cycle, 1, eval_every)
                    mllog.epoch_stop(epoch)
                    mllog.eval_start(epoch)
                    score = evaluate(eval_model, eval_batches, autocast)
                    mllog.eval_accuracy(score, epoch)
                    mllog.eval_stop(epoch)
                    metrics.write(json.dumps({"step": step, "eval_lddt_ca": score, "epoch_num": epoch}) + "\n")
                    result.eval_history.append((step, score))
                    progress.write(f"step {step}: eval lDDT-Cα {score:.4f}")
                    timings["eval"] += time.perf_counter() - t_eval
                    if score >= cfg.target_lddt:
                        status = mll.STATUS_SUCCESS
                        break
                metrics.flush()

                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    t_ckpt = time.perf_counter()
                    save_checkpoint(checkpoints, model, opt, step)
                    timings["checkpoint"] += time.perf_counter() - t_ckpt
                result.steps = step
                t_wait = time.perf_counter()
    finally:
        gc.enable()
        progress.close()
        loader.close()
        mllog.run_stop(status)
        mllog.close()

    result.timings = dict(timings)
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


def _float_outputs(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loss runs in fp32 under bf16 autocast."""
    return {k: v.float() if v.is_floating_point() else v for k, v in outputs.items()}


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after ``last_step`` (written after the checkpoint a resumed run restarts from)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last_step]
    path.write_text("".join(ln + "\n" for ln in lines))


def _progress(cfg: TrainConfig, start: int):
    from tqdm import tqdm

    return tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step", disable=not cfg.progress, dynamic_ncols=True)


def print_breakdown(result: TrainResult) -> None:
    """Step-time breakdown: data wait, forward, backward, optimizer, eval, checkpoint."""
    total = sum(result.timings.values()) or 1.0
    print(f"step-time breakdown over {result.steps} steps ({result.skipped_steps} skipped):")
    for key, seconds in result.timings.items():
        print(f"  {key:<11s} {seconds:8.2f} s  {100 * seconds / total:5.1f} %")
    if result.eval_history:
        print("eval lDDT-Cα: " + ", ".join(f"step {s}: {v:.4f}" for s, v in result.eval_history))


__all__ = ["TrainResult", "train", "evaluate", "recycling_count", "forward_seed", "build_model_config", "split_chains"]
