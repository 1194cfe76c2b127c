"""The DAP process group handle and its communication counter."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes this rank sent, per collective kind (logical volume, see ``primitives``), and the
    asynchronous collectives launched but not yet waited for (``in_flight``: 0 between steps; a
    collective left in flight is never synchronised with and outlives its step)."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    in_flight: int = 0

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        """Zero the byte and call counters (``in_flight`` is state, not a counter: kept)."""
        self.bytes.clear()
        self.calls.clear()


@dataclass(eq=False)
class DAPGroup:
    """One DAP group as seen from one of its ranks: ``group`` (``None`` = the default group),
    ``size`` ranks, this rank's index ``rank`` inside it, and a :class:`CommStats` counter.
    ``overlap`` (default on) runs the model's overlapped collectives asynchronously (Duality Async
    Operations, :mod:`scalefold.distributed.async_ops`); off, the same calls are synchronous."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    stats: CommStats = field(default_factory=CommStats)
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid DAP group: rank {self.rank} of size {self.size}")

    @classmethod
    def world(cls, overlap: bool = True) -> DAPGroup:
        """The whole default process group as one DAP group (tests, benchmarks)."""
        return cls(group=None, size=dist.get_world_size(), rank=dist.get_rank(), overlap=overlap)


__all__ = ["CommStats", "DAPGroup"]
