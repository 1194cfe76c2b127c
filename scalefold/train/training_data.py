"""The training run's data: the store, its train / validation split, the loader and its skipped samples.

What the :class:`~scalefold.train.trainer.Trainer` sees is :class:`TrainingData`: an iterator of
``(position, batch)`` that yields exactly one batch per step on every training rank. Each rank reads
its own strided share of one position-indexed sample stream (:func:`sample_pairs`); with DAP /
BP one rank per group loads and broadcasts each step's header (the batch follows after slicing). A
sample the loader gives up on (corrupt chain, feature error) is replaced by a fresh draw
(:class:`ReplacementDraw`), logged with its chain and reason and counted, so no rank loses a step.
"""

from __future__ import annotations

import datetime
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scalefold.config.training import TrainConfig
from scalefold.data.dataset import StoreSample
from scalefold.data.loader import SEED_HIGH, PriorityQueueLoader, Sampler, group_batches
from scalefold.data.pipeline import FeatureConfig, TrainingChainFilter, sampling_weights
from scalefold.data.store import Store
from scalefold.distributed.context import ParallelContext
from scalefold.train.reporting import announce
from scalefold.train.step import SEED_MODULUS
from scalefold.train.stopping import ignore_stop_signals

STREAM_BLOCK = 1024  # samples per rank and block of the position-indexed stream


def sample_pairs(
    weights: Sequence[float] | np.ndarray, seed: int, start: int, stop: int, rank: int = 0, world_size: int = 1
) -> list[tuple[int, int]]:
    """``(chain index, sample seed)`` for positions ``start .. stop-1`` of data-parallel ``rank``.

    The global stream is cut into blocks of ``STREAM_BLOCK * world_size`` draws, each drawn by a
    :class:`~scalefold.data.loader.Sampler` seeded from (seed, block); rank ``r`` takes every
    ``world_size``-th draw of a block starting at ``r`` (strided). Position ``p`` of a rank is thus a
    function of (seed, rank, world size, p) only: neither ``--max-steps`` nor a resume changes it.
    """
    if not 0 <= start <= stop:
        raise ValueError(f"bad position range [{start}, {stop})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    pairs: list[tuple[int, int]] = []
    for block in range(start // STREAM_BLOCK, -(-stop // STREAM_BLOCK)):
        block_seed = random.Random(f"stream:{seed}:{block}").randrange(SEED_MODULUS)
        drawn = Sampler(weights, num_samples=STREAM_BLOCK * world_size, seed=block_seed, rank=rank, world_size=world_size)
        lo = max(start - block * STREAM_BLOCK, 0)
        hi = min(stop - block * STREAM_BLOCK, STREAM_BLOCK)
        pairs.extend(drawn.pairs[lo:hi])
    return pairs


def split_chains(store: Store, cfg: TrainConfig) -> tuple[list[str], np.ndarray, list[str]]:
    """(training chain ids, their sampling weights, validation chain ids) of the store."""
    table = store.chain_table(with_sequence=True)
    train_filter = TrainingChainFilter(max_release_date=day_before(cfg.val_min_date))
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


def day_before(date: str) -> str:
    return (datetime.date.fromisoformat(date) - datetime.timedelta(days=1)).isoformat()


class ReplacementDraw:
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


class TrainingData:
    """The training ranks' batches from ``start_step`` on (built after ``run_start``: dataset work is
    timed) and the samples this rank's loader gave up on.

    One loader per DAP group / BP pair (on its loader rank); the other ranks of the group receive each
    step's header through :func:`~scalefold.data.loader.group_batches` and the batch itself through
    ``parallel.broadcast_batch`` after the step's slice is taken.
    """

    def __init__(self, cfg: TrainConfig, parallel: ParallelContext, rank: int, features: FeatureConfig,
                 train_ids: list[str], weights: np.ndarray, start_step: int) -> None:  # fmt: skip
        self.train_ids, self.rank, self.first_position = train_ids, rank, start_step
        self.skipped: list[dict[str, Any]] = []  # this rank's loader's skips, in order
        dp_rank = parallel.dp_rank
        pairs = sample_pairs(weights, cfg.seed, start_step, cfg.max_steps, rank=dp_rank, world_size=parallel.dp_size)
        sample = StoreSample(str(Path(cfg.store)), train_ids, features, mode="train")
        self.loader = (PriorityQueueLoader(sample, pairs, num_workers=cfg.num_workers, deterministic=cfg.deterministic,
                                           worker_init=ignore_stop_signals,  # a pre-emption signal is the trainer's
                                           replace=ReplacementDraw(weights, cfg.seed, dp_rank, start_step))
                       if parallel.is_loader_rank else None)  # fmt: skip
        # DAP / BP: the loader rank broadcasts a header per step (position, end of data, or its loader's
        # error) to its group; the step's batch itself follows in the step (parallel.broadcast_batch)
        self.batches = (group_batches(self.loader, src=parallel.loader_rank, group=parallel.model_group, with_batch=False)
                        if parallel.layout.model_parallel > 1 else self.loader)  # fmt: skip

    def __iter__(self):
        return iter(self.batches)

    def report_skips(self, step: int) -> list[dict[str, Any]]:
        """Samples the loader gave up on since the last call: one console line each (chain id, reason,
        replacement), appended to :attr:`skipped`; returns the new ones."""
        if self.loader is None:
            return []
        new = []
        for skip in self.loader.skipped[len(self.skipped) :]:
            ids = self.train_ids
            chain = ids[skip.index] if 0 <= skip.index < len(ids) else f"index {skip.index}"
            replacement = ids[skip.replaced_by[0]] if skip.replaced_by is not None else None
            reason = skip.reason.splitlines()[0] if skip.reason else "unknown"
            info = {"chain_id": chain, "index": skip.index, "seed": skip.seed, "position": self.first_position + skip.position,
                    "attempts": skip.attempts, "reason": reason, "replaced_by": replacement}  # fmt: skip
            self.skipped.append(info)
            new.append(info)
            announce(f"scalefold train: rank {self.rank}: step {step}: skipped sample {chain} (data position "
                     f"{info['position']}, seed {skip.seed}) after {skip.attempts} attempt(s): {reason}; "
                     + (f"replaced by {replacement}" if replacement else "not replaced"))  # fmt: skip
        return new

    def close(self, step: int) -> None:
        """Stop the loader (and the group's header stream); skips not yet reported are reported."""
        if self.batches is not self.loader:
            self.batches.close()  # the group's header stream (on the loader rank it closes the loader too)
        if self.loader is not None:
            self.report_skips(step)
            self.loader.close()


__all__ = ["ReplacementDraw", "TrainingData", "day_before", "sample_pairs", "split_chains", "validation_chain_ids"]
