"""The activation-checkpointing policy as an option value: ``on``, ``off``, ``N`` or ``auto``.

Parsed here, torch-free, so that the options can validate it; what a policy means for the model's
blocks is :func:`scalefold.model.memory.checkpointed_blocks`, and ``auto`` is resolved against the
device's memory by :mod:`scalefold.perf.recompute`.
"""

from __future__ import annotations

from typing import Union

#: A parsed policy: True (on), False (off), an int N (the first N blocks recompute) or "auto".
Policy = Union[bool, int, str]
_ON = ("on", "true", "yes", "all")
_OFF = ("off", "false", "no", "none")


def parse_checkpointing(value: object) -> Policy:
    """``value`` as a policy: ``True`` / ``"on"`` -> ``True``; ``False`` / ``None`` / ``"off"`` -> ``False``;
    an integer ``N >= 0`` or its decimal string -> ``N``; ``"auto"`` -> ``"auto"``. Anything else raises
    ``ValueError`` naming the value. (``"1"`` is one block, not "on": say ``on``.)"""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"activation checkpointing {value}: the number of recomputing blocks must be >= 0")
        return value
    text = str(value).strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    if text == "auto":
        return "auto"
    if text.isdigit():
        return int(text)
    raise ValueError(f"activation checkpointing {value!r}: expected on, off, auto or a number of blocks N >= 0")


__all__ = ["Policy", "parse_checkpointing"]
