"""Inference: ``scalefold predict`` (FASTA + a3m -> PDB/mmCIF with pLDDT) and ``scalefold evaluate``
(per-target lDDT-Cα of a checkpoint on a store).

* :mod:`scalefold.inference.weights` -- checkpoint (ScaleFold / MLPerf reference / SWA) -> eval model;
* :mod:`scalefold.inference.predict` -- FASTA and alignment reading, features, one prediction;
* :mod:`scalefold.inference.evaluate` -- the validation split of a store, scores, reports;
* :mod:`scalefold.inference.structure_io` -- PDB (fixed columns) and mmCIF (gemmi) writers;
* :mod:`scalefold.commands.inference` -- the two subcommands.

Submodules are imported on use, so ``scalefold --help`` stays cheap.
"""
