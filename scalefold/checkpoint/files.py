"""Checkpoint files: atomic writes, keep-last-k, safe loading, sha256.

Content (the MLPerf reference checkpoint format, plus what an exact resume needs):

    {"alphafold_state_dict": model weights,  "optimizer_state_dict": torch.optim.Adam layout,
     "iteration": int,  "swa_state_dict": {"averaged_model.n_averaged", "averaged_model.module.<name>"},
     "rng_state": {...},  "data_position": {...},  "model_preset": str,  "format_version": int}

Writes go to a temporary file in the same directory, are flushed and fsync'ed, then renamed over the
target (``os.replace`` is atomic on POSIX), and the directory is fsync'ed: a crash or a failed write
leaves either the old file or the new one, never a torn file. Loads use ``torch.load(weights_only=True)``
(no arbitrary code from a checkpoint) and turn truncated or corrupt files into a clear
:class:`CheckpointError`.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from scalefold.errors import UserError

FORMAT_VERSION = 1
DEFAULT_KEEP_LAST = 3
HASH_CHUNK_BYTES = 1 << 20
CHECKPOINT_PREFIX = "checkpoint_"
_TMP_MARKER = ".tmp-"

PathLike = Union[str, os.PathLike]


class CheckpointError(UserError, ValueError, RuntimeError):
    """A checkpoint file or state dict that cannot be loaded: missing, truncated, corrupt, not a checkpoint,
    or not matching the model (ScaleFold's one checkpoint error; a ``ValueError`` and a ``RuntimeError``
    for the callers of its two former classes)."""


# ----------------------------------------------------------------------------------------------
# Hashing
# ----------------------------------------------------------------------------------------------


def sha256sum(path: PathLike, chunk_bytes: int = HASH_CHUNK_BYTES) -> str:
    """Hex sha256 of a file, streamed (the 1.1 GiB reference checkpoint never sits in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk_bytes), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# RNG state (as plain tensors / numbers so that weights_only loading accepts it)
# ----------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    keys = npst["keys"].numpy().astype(np.uint32)
    np.random.set_state((npst["kind"], keys, npst["pos"], npst["has_gauss"], npst["gauss"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------
# Content
# ----------------------------------------------------------------------------------------------


def build_checkpoint(
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    iteration: int,
    swa_state: Mapping[str, torch.Tensor] | None = None,
    rng_state: Mapping[str, Any] | None = None,
    data_position: Mapping[str, Any] | None = None,
    model_preset: str | None = None,
) -> dict[str, Any]:
    """The checkpoint dictionary (reference keys first); ``model_preset`` names the model config."""
    checkpoint: dict[str, Any] = {
        "alphafold_state_dict": dict(model_state),
        "optimizer_state_dict": dict(optimizer_state),
        "iteration": int(iteration),
        "format_version": FORMAT_VERSION,
    }
    if swa_state is not None:
        checkpoint["swa_state_dict"] = dict(swa_state)
    if rng_state is not None:
        checkpoint["rng_state"] = dict(rng_state)
    if data_position is not None:
        checkpoint["data_position"] = dict(data_position)
    if model_preset is not None:
        checkpoint["model_preset"] = str(model_preset)
    return checkpoint


# ----------------------------------------------------------------------------------------------
# Atomic save / safe load
# ----------------------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _WriteRecorder:
    """A binary file for ``torch.save`` that remembers the ``OSError`` of a failed write: torch's archive
    writer turns a full disk into ``RuntimeError: ... unexpected pos 704 vs 598``; :func:`save_atomic`
    raises the file system's own error (``ENOSPC``, with the path) instead."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()


def save_atomic(obj: Any, path: PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` via temp file + fsync + rename; the old file survives any failure.

    A write the file system refuses (a full disk, a quota) raises its ``OSError`` naming the target path
    (``errno.ENOSPC``), the temporary file removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{_TMP_MARKER}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            recorder = _WriteRecorder(f)
            try:
                torch.save(obj, recorder)
            except RuntimeError as exc:  # the archive writer's wording of a failed write
                if recorder.error is None:
                    raise
                raise OSError(recorder.error.errno, recorder.error.strerror, str(path)) from exc
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        ours = exc.filename is None or os.fspath(exc.filename) == str(tmp)
        if exc.errno is not None and ours:  # the user knows the target, not our temporary
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"
CHECKPOINT_EXPECTED = "a PyTorch checkpoint (.pt) written by torch.save, e.g. by `scalefold train`"


def check_checkpoint_file(path: Union[str, os.PathLike]) -> str:
    """``path`` if it looks like a ``torch.save`` file, else :class:`CheckpointError` saying what it is
    instead (missing, a directory, empty, another format): checked before ``torch.load``, whose errors
    for such files are long and suggest loading with ``weights_only=False`` -- never the remedy for a
    wrong file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} not found (expected {CHECKPOINT_EXPECTED})")
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is a directory (expected {CHECKPOINT_EXPECTED})")
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc.strerror})") from exc
    if not head:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes; expected {CHECKPOINT_EXPECTED})")
    if not (head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_MAGIC)):
        text = head[:24].decode("latin-1").splitlines()[0] if head[:1].isascii() else ""
        starts = f"it starts with {text!r}" if text and text.isprintable() else "an unknown binary format"
        raise CheckpointError(f"checkpoint {path} is not a PyTorch checkpoint ({starts}; expected {CHECKPOINT_EXPECTED})")
    return path


def load_checkpoint(path: PathLike, map_location: Union[str, torch.device, None] = "cpu") -> dict[str, Any]:
    """ScaleFold's one checkpoint loader: ``torch.load(weights_only=True)`` (tensors and plain containers
    only) of a file :func:`check_checkpoint_file` accepts, with a :class:`CheckpointError` naming the
    file for a missing, empty, truncated, corrupt or foreign file and for one that holds no dict."""
    path = check_checkpoint_file(path)
    size = os.path.getsize(path)
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the error below says it all
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # zipfile / pickle / EOF / RuntimeError from a damaged archive
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if "Weights only load failed" in reason:  # a pickle of arbitrary objects: not a checkpoint of ours
            reason = "it holds objects other than tensors and plain containers"
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded: truncated or corrupt ({size} bytes; {type(exc).__name__}: {reason})"
        ) from exc
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, not a checkpoint dict")
    return dict(obj) if not isinstance(obj, dict) else obj


# ----------------------------------------------------------------------------------------------
# A directory of checkpoints
# ----------------------------------------------------------------------------------------------


class CheckpointManager:
    """``<directory>/checkpoint_<iteration>.pt`` files; keeps the newest ``keep_last``.

    Args:
        directory: where checkpoints live (created on first save).
        keep_last: how many to keep (``None``: keep all).
    """

    _NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)\.pt$")

    def __init__(self, directory: PathLike, keep_last: int | None = DEFAULT_KEEP_LAST) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last

    def path_for(self, iteration: int) -> Path:
        return self.directory / f"{CHECKPOINT_PREFIX}{iteration:08d}.pt"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(iteration, path) of complete checkpoints, oldest first (temporary files ignored)."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            match = self._NAME.match(p.name)
            if match:
                found.append((int(match.group(1)), p))
        return sorted(found)

    def save(self, checkpoint: Mapping[str, Any], iteration: int | None = None) -> Path:
        iteration = int(checkpoint["iteration"]) if iteration is None else iteration
        path = save_atomic(dict(checkpoint), self.path_for(iteration))
        self.prune()
        return path

    def prune(self) -> None:
        """Delete all but the newest ``keep_last`` checkpoints and stale temporary files."""
        if self.directory.is_dir():
            for p in self.directory.iterdir():
                if _TMP_MARKER in p.name and not _pid_alive(p.name.rsplit(_TMP_MARKER, 1)[1]):
                    p.unlink(missing_ok=True)
        if self.keep_last is None:
            return
        for _, path in self.checkpoints()[: -self.keep_last]:
            path.unlink(missing_ok=True)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    def load_latest(self, map_location: Union[str, torch.device, None] = "cpu") -> dict[str, Any] | None:
        """The newest loadable checkpoint (a damaged newest one is reported and skipped), or None."""
        for _, path in reversed(self.checkpoints()):
            try:
                return load_checkpoint(path, map_location=map_location)
            except CheckpointError as exc:
                warnings.warn(f"skipping unreadable checkpoint: {exc}", stacklevel=2)
        return None

    def load_resumable(
        self, map_location: Union[str, torch.device, None] = "cpu"
    ) -> tuple[Path, dict[str, Any], list[str]] | None:
        """``(path, checkpoint, skipped)`` of the newest checkpoint that loads (``skipped``: the error of
        each newer, damaged one), or ``None`` when the directory holds no checkpoint file at all.

        Raises :class:`CheckpointError` listing every file and its error when checkpoint files exist
        but none of them loads (a resume must not silently start over)."""
        found = self.checkpoints()
        if not found:
            return None
        errors: list[str] = []
        for _, path in reversed(found):
            try:
                return path, load_checkpoint(path, map_location=map_location), errors
            except CheckpointError as exc:
                errors.append(str(exc))
        raise CheckpointError(
            f"none of the {len(found)} checkpoint file(s) in {self.directory} can be loaded:\n"
            + "\n".join(f"  - {e}" for e in errors)
            + "\nremove or repair them (or choose another --out) to start over"
        )


def _pid_alive(pid_text: str) -> bool:
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
