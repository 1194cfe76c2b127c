"""MSA transforms: residue re-ordering, cluster sampling, BERT masking, cluster profiles, features.

Supplementary 1.2.6 (MSA clustering), 1.2.7 (MSA block deletion), 1.2.9 (input features),
Algorithm 2 / Table 1 (``msa_feat``, ``target_feat``, extra-MSA features) and 1.9.9 (masked MSA).
Semantics and the order of random draws follow the MLPerf HPC OpenFold reference pipeline, so a
sample built from the same raw features and seed is identical to the reference's.

Every function takes and returns a feature dict (``Dict[str, Tensor]``); random ones take an
explicit ``torch.Generator``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from scalefold import residue_constants as rc

Features = dict[str, torch.Tensor]

#: Number of MSA residue classes: 20 amino acids, X (unknown), gap.
MSA_NUM_CLASSES = 22
#: ... plus the BERT ``[MASK]`` token (index 22), used by ``msa_feat`` and cluster profiles.
MSA_NUM_CLASSES_WITH_MASK = 23
UNKNOWN_INDEX = 20
GAP_INDEX = 21

#: Keys that have one row per MSA sequence; ``sample_msa`` moves unselected rows to ``extra_<key>``.
MSA_ROW_FEATURES = ("msa", "deletion_matrix", "msa_mask", "msa_row_mask", "bert_mask", "true_msa")


def one_hot(x: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One-hot encode integer tensor ``x`` -> ``[*x.shape, num_classes]``."""
    out = torch.zeros((*x.shape, num_classes), dtype=dtype, device=x.device)
    return out.scatter_(-1, x.long().unsqueeze(-1), 1)


def hhblits_to_our_restypes(indices: torch.Tensor) -> torch.Tensor:
    """Map residue indices from HHblits order to ours (any shape, int64)."""
    table = torch.tensor(rc.MAP_HHBLITS_AATYPE_TO_OUR_AATYPE, dtype=torch.int64, device=indices.device)
    return table[indices.long()]


def correct_msa_restypes(feats: Features) -> Features:
    """Re-index ``msa`` from HHblits residue order to ours."""
    feats["msa"] = hhblits_to_our_restypes(feats["msa"])
    return feats


def make_msa_mask(feats: Features) -> Features:
    """``msa_mask`` [N_seq, N_res] and ``msa_row_mask`` [N_seq]: ones, zero-padded later."""
    msa = feats["msa"]
    feats["msa_mask"] = torch.ones(msa.shape, dtype=torch.float32, device=msa.device)
    feats["msa_row_mask"] = torch.ones(msa.shape[0], dtype=torch.float32, device=msa.device)
    return feats


def make_hhblits_profile(feats: Features) -> Features:
    """Per-residue residue-class frequencies over the whole MSA: ``hhblits_profile`` [N_res, 22].

    Counted with one ``bincount`` instead of averaging a ``[N_seq, N_res, 22]`` one-hot (the
    reference, :func:`hhblits_profile_reference`); counts are exact in float32, so ``count / N_seq``
    equals the one-hot mean bit for bit.
    """
    if "hhblits_profile" not in feats:
        msa = feats["msa"]
        num_seq, num_res = msa.shape
        flat = (torch.arange(num_res, device=msa.device)[None, :] * MSA_NUM_CLASSES + msa).reshape(-1)
        counts = torch.bincount(flat, minlength=num_res * MSA_NUM_CLASSES).reshape(num_res, MSA_NUM_CLASSES)
        feats["hhblits_profile"] = counts.to(torch.float32) / num_seq
    return feats


def hhblits_profile_reference(msa: torch.Tensor) -> torch.Tensor:
    """Plain definition of ``hhblits_profile``: mean one-hot over the MSA rows ([N_res, 22])."""
    return one_hot(msa, MSA_NUM_CLASSES).mean(dim=0)


def sample_msa(feats: Features, max_seq: int, generator: torch.Generator, keep_extra: bool = True) -> Features:
    """Pick ``max_seq`` cluster centres: the query (row 0) plus a random subset of the rest.

    Rows not selected become ``extra_*`` features (in the shuffled order) when ``keep_extra``.
    """
    num_seq = feats["msa"].shape[0]
    shuffled = torch.randperm(num_seq - 1, generator=generator) + 1
    order = torch.cat([torch.zeros(1, dtype=shuffled.dtype), shuffled]).to(feats["msa"].device)
    num_sel = min(max_seq, num_seq)
    selected, not_selected = order[:num_sel], order[num_sel:]
    for key in MSA_ROW_FEATURES:
        if key in feats:
            if keep_extra:
                feats["extra_" + key] = feats[key].index_select(0, not_selected)
            feats[key] = feats[key].index_select(0, selected)
    return feats


def block_delete_msa(
    feats: Features,
    msa_fraction_per_block: float,
    num_blocks: int,
    randomize_num_blocks: bool,
    generator: torch.Generator,
) -> Features:
    """Delete contiguous blocks of MSA rows, never the query (Supplementary 1.2.7, Algorithm 1).

    The MLPerf reference pipeline defines but does not apply this transform (its version is not
    runnable); it is off in :class:`~scalefold.data.pipeline.FeatureConfig` by default.
    """
    num_seq = feats["msa"].shape[0]
    block_size = int(math.floor(num_seq * msa_fraction_per_block))
    if randomize_num_blocks:
        num_blocks = int(torch.randint(0, num_blocks + 1, (1,), generator=generator)[0])
    starts = torch.randint(0, num_seq, (num_blocks,), generator=generator)
    deleted = (starts[:, None] + torch.arange(block_size)[None, :]).clamp(0, num_seq - 1).flatten()
    keep = torch.ones(num_seq, dtype=torch.bool)
    keep[deleted] = False
    keep[0] = True
    keep_indices = torch.nonzero(keep).squeeze(-1).to(feats["msa"].device)
    for key in MSA_ROW_FEATURES:
        if key in feats:
            feats[key] = feats[key].index_select(0, keep_indices)
    return feats


def make_masked_msa(
    feats: Features,
    profile_prob: float,
    same_prob: float,
    uniform_prob: float,
    replace_fraction: float,
    generator: torch.Generator,
) -> Features:
    """BERT-style corruption of the cluster MSA (Supplementary 1.2.7 / 1.9.9).

    Each position is selected with probability ``replace_fraction``; a selected residue is
    replaced by a uniform amino acid (``uniform_prob``), a draw from the MSA profile
    (``profile_prob``), itself (``same_prob``) or the ``[MASK]`` token (the rest).
    Writes ``bert_mask`` (selected positions), ``true_msa`` (the original) and the corrupted ``msa``.
    """
    msa = feats["msa"]
    random_aa = torch.tensor([0.05] * 20 + [0.0, 0.0], dtype=torch.float32, device=msa.device)
    categorical_probs = (
        uniform_prob * random_aa + profile_prob * feats["hhblits_profile"] + same_prob * one_hot(msa, MSA_NUM_CLASSES)
    )  # [N_seq, N_res, 22]
    mask_prob = 1.0 - profile_prob - same_prob - uniform_prob
    if mask_prob < 0.0:
        raise ValueError("masked-MSA probabilities sum to more than 1")
    categorical_probs = F.pad(categorical_probs, (0, 1), value=mask_prob)  # [N_seq, N_res, 23]

    mask_position = torch.rand(msa.shape, generator=generator) < replace_fraction
    mask_position = mask_position.to(msa.device)
    bert_msa = _sample_categorical(categorical_probs, generator)
    bert_msa = torch.where(mask_position, bert_msa, msa)

    feats["bert_mask"] = mask_position.to(torch.float32)
    feats["true_msa"] = msa
    feats["msa"] = bert_msa
    return feats


def _sample_categorical(probs: torch.Tensor, generator: torch.Generator, eps: float = 1e-10) -> torch.Tensor:
    """One draw per leading index from the categorical distributions in the last dim of ``probs``."""
    num_classes = probs.shape[-1]
    flat = (probs + eps).reshape(-1, num_classes)
    draws = torch.multinomial(flat, num_samples=1, replacement=True, generator=generator)
    return draws.squeeze(-1).reshape(probs.shape[:-1])


def _agreement_table(feats: Features, gap_agreement_weight: float) -> torch.Tensor:
    """Weighted one-hot of the cluster centres ``[N_clust, N_res, 23]`` (masked positions zero)."""
    msa = feats["msa"]
    weights = torch.cat(
        [
            torch.ones(21, device=msa.device),
            gap_agreement_weight * torch.ones(1, device=msa.device),
            torch.zeros(1, device=msa.device),
        ]
    )  # [23]
    return feats["msa_mask"][:, :, None] * one_hot(msa, MSA_NUM_CLASSES_WITH_MASK) * weights


def nearest_neighbor_clusters(feats: Features, gap_agreement_weight: float = 0.0) -> Features:
    """Assign each extra sequence to the cluster centre it agrees with most (Hamming similarity).

    Writes ``extra_cluster_assignment`` [N_extra] (int64). Gaps count with ``gap_agreement_weight``,
    ``[MASK]`` never counts. Ties go to the lowest centre index.

    ``agreement[e, c] = sum_r mask[e, r] * table[c, r, extra_msa[e, r]]`` is a gather-and-sum, done
    as one ``embedding_bag`` over the ``[N_res * 23, N_clust]`` table: ``N_extra * N_res * N_clust``
    additions instead of the reference's one-hot matmul (23x the work plus a ``[N_extra, N_res, 23]``
    one-hot, :func:`nearest_neighbor_clusters_reference`). Agreements are sums of the weights
    (integers for the default weights), so both give the same assignment.
    """
    extra_msa, extra_mask = feats["extra_msa"], feats["extra_msa_mask"]
    table = _agreement_table(feats, gap_agreement_weight)  # [N_clust, N_res, 23]
    num_clust, num_res, _ = table.shape
    if extra_msa.shape[0] == 0:
        feats["extra_cluster_assignment"] = torch.zeros(0, dtype=torch.int64, device=extra_msa.device)
        return feats
    table = table.reshape(num_clust, num_res * MSA_NUM_CLASSES_WITH_MASK).transpose(0, 1).contiguous()
    index = torch.arange(num_res, device=extra_msa.device)[None, :] * MSA_NUM_CLASSES_WITH_MASK + extra_msa
    agreement = F.embedding_bag(
        index, table, mode="sum", per_sample_weights=extra_mask.to(table.dtype)
    )  # [N_extra, N_clust]
    feats["extra_cluster_assignment"] = torch.argmax(agreement, dim=1).to(torch.int64)
    return feats


def nearest_neighbor_clusters_reference(
    feats: Features, gap_agreement_weight: float = 0.0, chunk_size: int = 512
) -> Features:
    """Plain one-hot matmul version of :func:`nearest_neighbor_clusters` (the reference's einsum
    ``mrc,nrc->mn``), extra rows one-hot encoded ``chunk_size`` at a time."""
    msa = feats["msa"]
    table = _agreement_table(feats, gap_agreement_weight)  # [N_clust, N_res, 23]
    num_seq, num_res, _ = table.shape
    # einsum("mrc,nrc,c->mn") as matmuls: [chunk, R*23] @ [R*23, N_seq]
    centres = table.reshape(num_seq, num_res * MSA_NUM_CLASSES_WITH_MASK).transpose(0, 1)
    extra_msa, extra_mask = feats["extra_msa"], feats["extra_msa_mask"]
    assignments = []
    for start in range(0, extra_msa.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        extra_one_hot = extra_mask[rows, :, None] * one_hot(extra_msa[rows], MSA_NUM_CLASSES_WITH_MASK)
        agreement = extra_one_hot.reshape(-1, num_res * MSA_NUM_CLASSES_WITH_MASK) @ centres
        assignments.append(torch.argmax(agreement, dim=1))
    if not assignments:
        assignments.append(torch.zeros(0, dtype=torch.int64, device=msa.device))
    feats["extra_cluster_assignment"] = torch.cat(assignments).to(torch.int64)
    return feats


def _segment_sum(data: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum rows of ``data`` into ``num_segments`` buckets given by ``segment_ids`` (1-D).

    Summed in float32 (as the reference); the summands here are counts, so the result is exact
    whatever the accumulation order."""
    out = torch.zeros((num_segments, *data.shape[1:]), dtype=torch.float32, device=data.device)
    return out.index_add_(0, segment_ids, data.float()).to(data.dtype)


def summarize_clusters(feats: Features, eps: float = 1e-6) -> Features:
    """Cluster profile [N_seq, N_res, 23] and mean deletion count [N_seq, N_res] of each cluster.

    Each cluster holds its centre plus the extra sequences assigned to it.
    """
    num_seq = feats["msa"].shape[0]
    assignment = feats["extra_cluster_assignment"]
    extra_mask = feats["extra_msa_mask"]  # [N_extra, N_res]
    mask_counts = eps + feats["msa_mask"] + _segment_sum(extra_mask, assignment, num_seq)

    # Residue-class counts per (cluster, residue), accumulated without one-hot encoding the extra
    # MSA: entry (assignment[e], r, extra_msa[e, r]) += extra_mask[e, r].
    num_res = extra_mask.shape[1]
    flat_index = (assignment[:, None] * num_res + torch.arange(num_res, device=assignment.device)[None, :]) * (
        MSA_NUM_CLASSES_WITH_MASK
    ) + feats["extra_msa"]
    msa_sum = torch.zeros(num_seq * num_res * MSA_NUM_CLASSES_WITH_MASK, dtype=torch.float32, device=extra_mask.device)
    msa_sum.index_add_(0, flat_index.reshape(-1), extra_mask.reshape(-1).float())
    msa_sum = msa_sum.reshape(num_seq, num_res, MSA_NUM_CLASSES_WITH_MASK).to(extra_mask.dtype)
    msa_sum = msa_sum + one_hot(feats["msa"], MSA_NUM_CLASSES_WITH_MASK)
    feats["cluster_profile"] = msa_sum / mask_counts[:, :, None]

    del_sum = _segment_sum(extra_mask * feats["extra_deletion_matrix"], assignment, num_seq)
    del_sum = del_sum + feats["deletion_matrix"]
    feats["cluster_deletion_mean"] = del_sum / mask_counts
    return feats


def crop_extra_msa(feats: Features, max_extra_msa: int, generator: torch.Generator) -> Features:
    """Keep a random subset of at most ``max_extra_msa`` extra sequences."""
    num_seq = feats["extra_msa"].shape[0]
    num_sel = min(max_extra_msa, num_seq)
    select = torch.randperm(num_seq, generator=generator)[:num_sel].to(feats["extra_msa"].device)
    for key in MSA_ROW_FEATURES:
        if "extra_" + key in feats:
            feats["extra_" + key] = feats["extra_" + key].index_select(0, select)
    return feats


def delete_extra_msa(feats: Features) -> Features:
    """Drop all ``extra_*`` MSA features (when the extra MSA stack is disabled)."""
    for key in MSA_ROW_FEATURES:
        feats.pop("extra_" + key, None)
    return feats


def deletion_value(deletion_count: torch.Tensor) -> torch.Tensor:
    """AlphaFold's squashed deletion count ``2/pi * atan(d / 3)`` in [0, 1)."""
    return torch.atan(deletion_count / 3.0) * (2.0 / math.pi)


def make_msa_feat(feats: Features) -> Features:
    """``target_feat`` [N_res, 22], ``msa_feat`` [N_seq, N_res, 49], extra-MSA deletion features.

    ``msa_feat`` channels: one-hot MSA (23), has-deletion (1), deletion value (1),
    cluster profile (23), cluster deletion mean (1).
    """
    has_break = torch.clip(feats["between_segment_residues"].to(torch.float32), 0, 1)
    target_feat = [has_break[..., None], one_hot(feats["aatype"], 21)]

    deletions = feats["deletion_matrix"]
    msa_feat = [
        one_hot(feats["msa"], MSA_NUM_CLASSES_WITH_MASK),
        torch.clip(deletions, 0.0, 1.0)[..., None],
        deletion_value(deletions)[..., None],
    ]
    if "cluster_profile" in feats:
        msa_feat += [feats["cluster_profile"], deletion_value(feats["cluster_deletion_mean"])[..., None]]

    if "extra_deletion_matrix" in feats:
        feats["extra_has_deletion"] = torch.clip(feats["extra_deletion_matrix"], 0.0, 1.0)
        feats["extra_deletion_value"] = deletion_value(feats["extra_deletion_matrix"])

    feats["msa_feat"] = torch.cat(msa_feat, dim=-1)
    feats["target_feat"] = torch.cat(target_feat, dim=-1)
    return feats


def make_generator(seed: int, device: torch.device | None = None) -> torch.Generator:
    """A ``torch.Generator`` seeded with ``seed`` reduced modulo 2**64 (as the reference does)."""
    generator = torch.Generator(device=device) if device is not None else torch.Generator()
    generator.manual_seed(seed % (1 << 64))
    return generator
