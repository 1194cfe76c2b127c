"""Checkpoint formats: the MLPerf reference checkpoint / SWA files and upstream OpenFold names."""

from scalefold.checkpoint.adapters import (
    CheckpointError,
    LoadReport,
    StateDictMismatchError,
    compare_state_dict,
    extract_model_state_dict,
    load_reference_checkpoint,
    load_reference_state_dict,
    load_swa_checkpoint,
    read_checkpoint,
    reference_name_to_upstream,
    reference_to_upstream_openfold,
    save_reference_checkpoint,
    swa_state_dict,
    upstream_name_to_reference,
    upstream_openfold_to_reference,
)

__all__ = [
    "CheckpointError",
    "LoadReport",
    "StateDictMismatchError",
    "compare_state_dict",
    "extract_model_state_dict",
    "load_reference_checkpoint",
    "load_reference_state_dict",
    "load_swa_checkpoint",
    "read_checkpoint",
    "reference_name_to_upstream",
    "reference_to_upstream_openfold",
    "save_reference_checkpoint",
    "swa_state_dict",
    "upstream_name_to_reference",
    "upstream_openfold_to_reference",
]
