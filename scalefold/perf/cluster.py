"""The cards and links a cluster is built of: named tables with their sources (``scalefold plan``,
``scalefold estimate-step --dp``).

**Links** (:data:`LINKS`): bandwidth per GPU and direction (the vendors print NVLink as the total of both
directions: half of it is what one GPU sends while it receives the same), a per-message latency, and the
fraction of the line rate NCCL's collectives reach (``efficiency``, a prior: NCCL's ``busbw`` on a DGX
H100 reaches ~80 % of NVLink 4 in all-reduce and ~90 % of a 400 Gb/s NDR port between nodes; the same
fractions are used for the other generations, not measured here).

* ``nvlink3`` -- A100 SXM4: 12 links, 600 GB/s total (NVIDIA A100 Tensor Core GPU data sheet, "NVLink:
  600GB/s"): 300 GB/s per direction.
* ``nvlink4`` -- H100 / H200 SXM: 18 links, 900 GB/s total (NVIDIA H100 Tensor Core GPU data sheet, "NVLink:
  900GB/s"; H200 data sheet, the same): 450 GB/s per direction.
* ``nvlink5`` -- B200: 1.8 TB/s total (NVIDIA DGX B200 / HGX B200 data sheet, "NVLink 5: 1.8TB/s per GPU"):
  900 GB/s per direction.
* ``pcie4`` -- PCIe Gen4 x16: 64 GB/s total (A100 PCIe data sheet, "PCIe Gen4: 64GB/s"): 32 GB/s per direction.
* ``pcie5`` -- PCIe Gen5 x16: 128 GB/s total (H100 PCIe data sheet, "PCIe Gen5: 128GB/s"): 64 GB/s per direction.
* ``ib-hdr`` -- InfiniBand HDR, 200 Gb/s per port (NVIDIA ConnectX-6 / Quantum data sheets; DGX A100: eight
  200 Gb/s compute ports, one per GPU): 25 GB/s per direction.
* ``ib-ndr`` -- InfiniBand NDR, 400 Gb/s per port (ConnectX-7 / Quantum-2; DGX H100, DGX H200 and DGX B200:
  eight 400 Gb/s compute ports, one per GPU): 50 GB/s per direction.
* ``ib-xdr`` -- InfiniBand XDR, 800 Gb/s per port (ConnectX-8 / Quantum-X800): 100 GB/s per direction.

Latencies are priors: ~8 us per collective on NVLink (NCCL's small-message all-reduce inside a DGX node),
~5 us per network step between nodes (a switch hop plus the NIC; NCCL's ring takes ``2(n-1)`` of them, its
tree ``2 log2 n``).

**Cards** (:data:`CARDS`): the GPU (its entry in :data:`scalefold.perf.devices.DEVICES`, or :data:`EXTRA_DEVICES`
for the B200), the GPUs per node and the node's links. ``h100`` / ``h200`` / ``a100-sxm`` / ``b200`` are the
8-GPU DGX / HGX nodes (NVSwitch inside, one InfiniBand port per GPU); ``a100-pcie`` a server of 8 PCIe cards
(PCIe Gen4 inside, one HDR port per two GPUs).

* B200 (NVIDIA DGX B200 data sheet, 8 GPUs: FP8 72 PFLOPS, 1,440 GB HBM3e, 64 TB/s; HGX B200 data sheet:
  FP16/BF16 Tensor Core 36 PFLOPS*, TF32 Tensor Core 18 PFLOPS*, FP64 Tensor Core 296 TFLOPS, FP32 600 TFLOPS
  per 8 GPUs; * with sparsity): per GPU, dense, BF16 2,250 TFLOPS, TF32 1,125, FP32 75, FP64 37; 8 TB/s; 180 GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from scalefold.errors import UserError
from scalefold.perf.devices import DEVICES, TERA, DeviceSpec

GB = 1e9


class UnknownName(UserError, ValueError):
    """A card or link name that is not in the tables (the message names the known ones)."""

    label = "unknown name"


@dataclass(frozen=True)
class Link:
    """One interconnect: bytes/s per GPU and direction, seconds per message (or network step), and the
    fraction of the line rate collectives reach."""

    name: str
    description: str
    bandwidth: float  # bytes/s per direction per GPU (or per port)
    latency_s: float
    efficiency: float

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency

    def to_json(self) -> dict:
        return {"name": self.name, "description": self.description, "gb_per_s": self.bandwidth / GB,
                "latency_us": self.latency_s * 1e6, "efficiency": self.efficiency}  # fmt: skip


#: The links (see the module docstring for the figures' sources).
LINKS: dict[str, Link] = {
    "nvlink3": Link("nvlink3", "NVLink 3 (A100 SXM4, NVSwitch), 600 GB/s total", 300 * GB, 8e-6, 0.8),
    "nvlink4": Link("nvlink4", "NVLink 4 (H100/H200 SXM, NVSwitch), 900 GB/s total", 450 * GB, 8e-6, 0.8),
    "nvlink5": Link("nvlink5", "NVLink 5 (B200, NVSwitch), 1.8 TB/s total", 900 * GB, 8e-6, 0.8),
    "pcie4": Link("pcie4", "PCIe Gen4 x16, 64 GB/s total", 32 * GB, 10e-6, 0.8),
    "pcie5": Link("pcie5", "PCIe Gen5 x16, 128 GB/s total", 64 * GB, 10e-6, 0.8),
    "ib-hdr": Link("ib-hdr", "InfiniBand HDR 200 Gb/s per port", 25 * GB, 5e-6, 0.9),
    "ib-ndr": Link("ib-ndr", "InfiniBand NDR 400 Gb/s per port", 50 * GB, 5e-6, 0.9),
    "ib-xdr": Link("ib-xdr", "InfiniBand XDR 800 Gb/s per port", 100 * GB, 5e-6, 0.9),
}  # fmt: skip

#: GPUs not in :data:`scalefold.perf.devices.DEVICES` (dense figures, see the module docstring).
EXTRA_DEVICES: dict[str, DeviceSpec] = {
    "b200": DeviceSpec("B200 180GB", 2250 * TERA, 1125 * TERA, 75 * TERA, 37 * TERA, 8.0e12, 180),
}


@dataclass(frozen=True)
class Card:
    """One card type as a cluster holds it: the GPU, the GPUs per node, the links inside and between nodes
    (``nics_per_node`` ports of ``inter``)."""

    name: str
    device: str  # key of DEVICES or EXTRA_DEVICES
    gpus_per_node: int
    intra: str  # key of LINKS
    inter: str  # key of LINKS
    nics_per_node: int

    @property
    def spec(self) -> DeviceSpec:
        return EXTRA_DEVICES[self.device] if self.device in EXTRA_DEVICES else DEVICES[self.device]

    @property
    def intra_link(self) -> Link:
        return LINKS[self.intra]

    @property
    def inter_link(self) -> Link:
        return LINKS[self.inter]

    def to_json(self) -> dict:
        return {"name": self.name, "gpu": self.spec.name, "gpus_per_node": self.gpus_per_node,
                "memory_gb": self.spec.memory_gb, "intra_node": self.intra_link.to_json(),
                "inter_node": self.inter_link.to_json(), "nics_per_node": self.nics_per_node}  # fmt: skip


#: The cards ``scalefold plan`` knows (see the module docstring).
CARDS: dict[str, Card] = {
    "h100": Card("h100", "h100-sxm", 8, "nvlink4", "ib-ndr", 8),
    "h200": Card("h200", "h200", 8, "nvlink4", "ib-ndr", 8),
    "a100-sxm": Card("a100-sxm", "a100-sxm-80gb", 8, "nvlink3", "ib-hdr", 8),
    "a100-pcie": Card("a100-pcie", "a100-pcie-80gb", 8, "pcie4", "ib-hdr", 4),
    "b200": Card("b200", "b200", 8, "nvlink5", "ib-ndr", 8),
}


def card(name: str) -> Card:
    """The card called ``name`` (case-insensitive); :class:`UnknownName` naming the known ones."""
    key = name.strip().lower()
    if key not in CARDS:
        raise UnknownName(f"--card {name!r}: not a known card; known: {', '.join(CARDS)}")
    return CARDS[key]


def link(name: str, option: str = "--link") -> Link:
    """The link called ``name`` (case-insensitive); :class:`UnknownName` naming the known ones."""
    key = name.strip().lower()
    if key not in LINKS:
        raise UnknownName(f"{option} {name!r}: not a known link; known: {', '.join(LINKS)}")
    return LINKS[key]


def with_links(base: Card, intra: str | None = None, inter: str | None = None) -> Card:
    """``base`` with its links replaced by the named ones (``None``: kept)."""
    from dataclasses import replace

    return replace(base, intra=link(intra, "--intra-link").name if intra else base.intra,
                   inter=link(inter, "--inter-link").name if inter else base.inter)  # fmt: skip


__all__ = ["CARDS", "EXTRA_DEVICES", "LINKS", "Card", "Link", "UnknownName", "card", "link", "with_links"]
