"""Store chain -> model batch: the picklable ``(index, seed) -> batch`` the training loader runs.

A chain of a :class:`~scalefold.data.store.Store` is turned into AlphaFold's raw feature dict
(sequence features, the stored MSA, the stored structure, and template features selected from the
template structures precomputed at preprocessing time: in training the top 20 prefiltered hits
shuffled with the sample's seed and the first ``max_templates`` usable ones kept, as the MLPerf
reference does; synthetic stores have no hits, so zero templates) and then through the MLPerf
data pipeline
(:func:`~scalefold.data.pipeline.process_training_features` /
:func:`~scalefold.data.pipeline.process_validation_features`). Batches get a leading batch
dimension of 1 (``[1, ..., R]``), the layout :class:`~scalefold.model.AlphaFold` expects.

Workers open the store lazily (one HDF5 handle per process), so instances are cheap to pickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from scalefold import residue_constants as rc
from scalefold.data.pipeline import (
    FeatureConfig,
    process_training_features,
    process_validation_features,
    validation_seed,
)
from scalefold.data.raw_features import make_sequence_features
from scalefold.data.store import Store
from scalefold.data.templates import empty_template_features, select_templates


def chain_raw_features(
    chain: dict[str, Any], features: FeatureConfig | None = None, mode: str = "train", seed: int | None = None
) -> dict[str, Any]:
    """AlphaFold raw features of one stored chain (``Store.get`` output).

    Template features come from the chain's precomputed ``template_outcomes`` when ``features``
    enables templates: at most ``features.max_templates``; in ``"train"`` mode the top
    ``shuffle_top_k_prefiltered`` hits are shuffled with ``random.Random(seed)`` first. Without
    ``features`` (or hits) the chain gets zero templates.
    """
    sequence = chain["sequence"]
    num_res = len(sequence)
    raw: dict[str, Any] = make_sequence_features(sequence, chain["chain_id"], num_res)
    if "msa" in chain:
        msa, deletions = chain["msa"], chain["deletion_matrix"]
    else:  # no alignment: the query alone, as the reference does
        msa = np.array([[rc.HHBLITS_AA_TO_ID[a] for a in sequence]], dtype=np.int32)
        deletions = np.zeros_like(msa)
    raw["msa"] = msa  # [N_seq, N_res]
    raw["deletion_matrix_int"] = deletions  # [N_seq, N_res]
    raw["num_alignments"] = np.full((num_res,), msa.shape[0], dtype=np.int32)
    outcomes = chain.get("template_outcomes")
    if features is not None and features.templates_enabled and outcomes:
        shuffle_top_k = features.shuffle_top_k_prefiltered if mode == "train" else None
        raw.update(select_templates(outcomes, num_res, features.max_templates, shuffle_top_k, seed))
    else:
        raw.update(empty_template_features(num_res))
    raw["all_atom_positions"] = chain["all_atom_positions"]  # [N_res, 37, 3]
    raw["all_atom_mask"] = chain["all_atom_mask"]  # [N_res, 37]
    raw["resolution"] = np.array([chain["resolution"]], dtype=np.float32)  # NaN (NMR) kept, as the reference
    raw["is_distillation"] = np.array(0.0, dtype=np.float32)
    return raw


def add_batch_dim(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``[..., R]`` -> ``[1, ..., R]`` for every tensor."""
    return {k: v.unsqueeze(0) for k, v in sample.items()}


@dataclass
class StoreSample:
    """Picklable ``(index, seed) -> batch`` over the chains ``chain_ids`` of the store at ``store_path``.

    Args:
        store_path: the HDF5 store.
        chain_ids: the chains ``index`` refers to (e.g. the filtered training set).
        features: data-pipeline configuration.
        mode: ``"train"`` (crop, random MSA sampling seeded by ``seed``) or ``"eval"`` (full chain,
            the reference's fixed per-target seed; ``seed`` is ignored).
    """

    store_path: str
    chain_ids: list[str]
    features: FeatureConfig
    mode: str = "train"
    _store: Store | None = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # never ship an HDF5 handle to a worker
        return state

    def _open(self) -> Store:
        if self._store is None:
            self._store = Store.open(self.store_path)
        return self._store

    def __call__(self, index: int, seed: int) -> dict[str, torch.Tensor]:
        chain_id = self.chain_ids[index]
        chain = self._open().get(chain_id)
        if self.mode == "train":
            raw = chain_raw_features(chain, self.features, self.mode, seed)
            sample = process_training_features(raw, self.features, seed=seed)
        else:
            seed = validation_seed(chain_id)
            raw = chain_raw_features(chain, self.features, self.mode, seed)
            sample = process_validation_features(raw, self.features, seed=seed)
        return add_batch_dim(sample)


__all__ = ["StoreSample", "add_batch_dim", "chain_raw_features"]
