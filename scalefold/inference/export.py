"""``scalefold export-chain``'s work (its command line: :mod:`scalefold.commands.data`): one chain of a store as the files ``scalefold predict`` reads.

Writes ``target.fasta`` (the sequence), ``target.a3m`` (the stored MSA, query first) and
``target_true.pdb`` (the stored true structure, all atoms; B-factors 0), so a prediction of the
chain can be compared with its true structure (``scalefold predict ... --reference target_true.pdb``).
The default chain is the first held-out validation chain of the demo preset's split, which the demo
training never sees; ``examples/demo_target/`` holds that export of the demo store.

The store keeps an MSA as aligned columns (HHblits ids) plus per-column deletion counts, not the
inserted residues themselves: each insertion is written as a lower-case ``x``, which a3m readers
drop and count, so the exported file gives back exactly the stored rows and deletion counts.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from scalefold.errors import UserError

FILE_NAMES = {"fasta": "target.fasta", "a3m": "target.a3m", "structure": "target_true.pdb"}
DEFAULT_SPLIT_PRESET = "demo"


def msa_to_a3m(msa: np.ndarray, deletions: np.ndarray, names: list[str]) -> str:
    """a3m text of HHblits ids ``[N_seq, N_res]`` and deletion counts of the same shape."""
    from scalefold.residue_constants import ID_TO_HHBLITS_AA

    letters = np.array([ID_TO_HHBLITS_AA[i] for i in range(len(ID_TO_HHBLITS_AA))])
    lines = []
    for name, row, dels in zip(names, msa, deletions):
        text = "".join("x" * int(d) + c for c, d in zip(letters[row.astype(np.int64)], dels))
        lines += [f">{name}", text]
    return "\n".join(lines) + "\n"


def default_chain(store_path: str | os.PathLike[str]) -> str:
    """The first validation chain of the demo preset's split of the store."""
    from scalefold.inference.evaluate import validation_chains

    return validation_chains(store_path, DEFAULT_SPLIT_PRESET, max_chains=0)[0]


def export_chain(store_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], chain_id: str | None = None) -> dict[str, Path]:
    """Write the chain's FASTA, a3m and true structure into ``out_dir``; returns the paths by kind."""
    from scalefold.data.store import Store
    from scalefold.inference.structure_io import PredictedStructure, write_structure

    chain_id = chain_id or default_chain(store_path)
    with Store.open(store_path) as store:
        if chain_id not in store.chain_ids:
            raise UserError(f"--chain {chain_id}: not in store {store_path} ({len(store.chain_ids)} chains)")
        chain = store.get(chain_id)
    if chain.get("msa") is None or len(chain["msa"]) == 0:
        raise UserError(f"chain {chain_id} of {store_path} has no MSA to export")
    sequence = chain["sequence"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / name for kind, name in FILE_NAMES.items()}
    paths["fasta"].write_text(f">{chain_id} from {Path(store_path).name}\n{sequence}\n")
    names = [chain_id] + [f"{chain_id}_msa{k}" for k in range(1, len(chain["msa"]))]
    paths["a3m"].write_text(msa_to_a3m(chain["msa"], chain["deletion_matrix"], names))
    structure = PredictedStructure(
        sequence=sequence,
        atom_positions=np.asarray(chain["all_atom_positions"], np.float32),  # [N_res, 37, 3]
        atom_mask=np.asarray(chain["all_atom_mask"], np.float32),  # [N_res, 37]
        plddt=np.zeros(len(sequence), np.float32),  # a true structure has no confidence: B-factor 0
        name=chain_id,
    )
    write_structure(structure, paths["structure"])
    return paths


__all__ = ["FILE_NAMES", "default_chain", "export_chain", "msa_to_a3m"]
