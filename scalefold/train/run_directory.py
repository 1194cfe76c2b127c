"""Where a run may start: its store (present, or synthesised where the preset allows), its ``--out``
directory (no earlier run replaced unless ``--resume`` / ``--overwrite``) and a shipped starting
checkpoint (its manifest's sha256, a target it does not already meet). Checked before any work.
"""

from __future__ import annotations

from pathlib import Path

from scalefold.config.training import DEMO_INIT_CHECKPOINT, TrainConfig
from scalefold.errors import UserError


class StoreNotFoundError(UserError, FileNotFoundError):
    """The run's store does not exist and the run may not synthesise one (its message says what to do)."""

    label = ""


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


#: What a run writes into --out (a previous run's, if present without --resume / --overwrite).
RUN_OUTPUTS = ("metrics.jsonl", "mlperf*.log", "curves.png", "trace.png", "checkpoints/checkpoint_*.pt")


def previous_run_files(out: Path) -> list[Path]:
    return sorted(p for pattern in RUN_OUTPUTS for p in Path(out).glob(pattern))


def check_out(cfg: TrainConfig) -> None:
    """A run may not silently replace an earlier one: ``--out`` holding a previous run's outputs needs
    ``--resume`` (continue it) or ``--overwrite`` (start afresh); ``--out`` must not be a file."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file, expected a run directory")
    if cfg.resume or cfg.overwrite:
        return
    found = previous_run_files(out)
    if found:
        names = ", ".join(str(p.relative_to(out)) for p in found[:4]) + (" ..." if len(found) > 4 else "")
        raise UserError(f"--out {out} holds a previous run ({names}): continue it with --resume, start afresh "
                        "with --overwrite, or choose another --out")  # fmt: skip


def check_starting_point(cfg: TrainConfig) -> None:
    """``--init-from`` a shipped checkpoint (one with a manifest beside it): the file must match the
    manifest's sha256, and the run's target must not be met by the checkpoint already."""
    if not cfg.init_from:
        return
    from scalefold.checkpoint.shipped import manifest_path, verify_shipped

    shipped = Path(cfg.init_from).resolve() == DEMO_INIT_CHECKPOINT.resolve()
    if not shipped and not manifest_path(cfg.init_from).exists():
        return  # e.g. the MLPerf reference checkpoint: checked when it is loaded
    manifest = verify_shipped(cfg.init_from)
    if cfg.target_lddt <= manifest.eval_lddt_ca:
        raise UserError(
            f"--target-lddt {cfg.target_lddt}: already met by the starting checkpoint {cfg.init_from} (lDDT-Cα "
            f"{manifest.eval_lddt_ca:.4f} at step {manifest.step}); choose a target above it"
        )


def clear_previous_run(out: Path) -> list[Path]:
    """``--overwrite``: delete a previous run's outputs in ``out`` (main training rank, before writing)."""
    found = previous_run_files(out)
    for path in found:
        path.unlink(missing_ok=True)
    return found


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


__all__ = [
    "RUN_OUTPUTS", "StoreNotFoundError", "check_out", "check_starting_point", "check_store", "clear_previous_run",
    "ensure_store", "previous_run_files",
]  # fmt: skip
