"""Peak arithmetic and memory bandwidth of the GPUs ScaleFold plans for, and the roofline floor of a step.

Figures are NVIDIA's data-sheet numbers, **dense** (the data sheets print the Tensor Core rates "with
sparsity", i.e. 2:4 structured sparsity, which dense training never uses; the dense rate is half of
it). ``fp32`` is the CUDA-core (non-Tensor-Core) FP32 rate: PyTorch runs fp32 matrix products in full
fp32 unless TF32 is allowed (``torch.backends.cuda.matmul.allow_tf32``, ScaleFold's ``--precision
tf32``), which is the ``tf32`` Tensor Core rate. ``fp64`` is the FP64 Tensor Core rate (cuBLAS DGEMM
uses it on A100/H100/H200).

* H100 SXM5 80 GB (NVIDIA H100 Tensor Core GPU data sheet, "H100 SXM" column): FP64 Tensor Core 67
  TFLOPS, FP32 67 TFLOPS, TF32 Tensor Core 989 TFLOPS*, BF16 Tensor Core 1,979 TFLOPS*, GPU memory
  bandwidth 3.35 TB/s (* with sparsity; the Hopper white paper's dense SXM5 rates: FP64 Tensor Core
  66.9, FP32 66.9, TF32 494.7, BF16 989.4 TFLOPS, used here).
* H100 PCIe 80 GB (same data sheet, "H100 PCIe" column): FP64 Tensor Core 51, FP32 51, TF32 756*, BF16
  1,513*, 2.0 TB/s (dense: TF32 378, BF16 756.5). H100 NVL (94 GB per GPU): FP64 Tensor Core 60, FP32 60,
  TF32 835*, BF16 1,671*, 3.9 TB/s.
* H200 SXM 141 GB (NVIDIA H200 Tensor Core GPU data sheet, "H200 SXM"): the H100 SXM's compute (FP64
  Tensor Core 67, FP32 67, TF32 989*, BF16 1,979*) with 4.8 TB/s. H200 NVL: FP64 Tensor Core 60, FP32
  60, TF32 835*, BF16 1,671*, 4.8 TB/s.
* A100 (NVIDIA A100 Tensor Core GPU data sheet): FP64 Tensor Core 19.5, FP32 19.5, TF32 156 (312*),
  BF16 312 (624*); bandwidth 80 GB SXM 2,039 GB/s, 80 GB PCIe 1,935 GB/s, 40 GB 1,555 GB/s.

``torch.cuda.get_device_name()`` reports e.g. ``NVIDIA H100 80GB HBM3`` (SXM5), ``NVIDIA H100 PCIe``,
``NVIDIA H100 NVL``, ``NVIDIA H200``, ``NVIDIA H200 NVL``, ``NVIDIA A100-SXM4-80GB``,
``NVIDIA A100 80GB PCIe``, ``NVIDIA A100-SXM4-40GB``, ``NVIDIA A100-PCIE-40GB``; :func:`device_spec`
maps those names (case-insensitively, by the patterns below) to an entry and anything else to
``None``: an unknown GPU gives FLOPs without MFU, never an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """Dense peak FLOP/s by compute precision and the memory bandwidth (bytes/s) of one GPU."""

    name: str
    bf16: float  # dense BF16 Tensor Core FLOP/s (also FP16)
    tf32: float  # dense TF32 Tensor Core FLOP/s
    fp32: float  # FP32 on CUDA cores (no TF32)
    fp64: float  # FP64 Tensor Core
    bandwidth: float  # bytes/s
    memory_gb: float  # the card's memory, GB (10^9 bytes), for the table

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s of a run's ``--precision`` (bf16, tf32, fp32, fp64): the matrix-product rate
        MFU is quoted against (a bf16 run: the BF16 Tensor Core rate)."""
        try:
            return {"bf16": self.bf16, "fp16": self.bf16, "tf32": self.tf32, "fp32": self.fp32, "fp64": self.fp64}[precision]
        except KeyError:
            raise ValueError(f"unknown precision {precision!r}; expected bf16, tf32, fp32 or fp64") from None


#: The cards ScaleFold plans for (the issue's three first: H100 SXM, H200, A100).
DEVICES: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec("H100 SXM5 80GB", 989.4 * TERA, 494.7 * TERA, 66.9 * TERA, 66.9 * TERA, 3.35e12, 80),
    "h200": DeviceSpec("H200 SXM 141GB", 989.4 * TERA, 494.7 * TERA, 66.9 * TERA, 66.9 * TERA, 4.8e12, 141),
    "a100-sxm-80gb": DeviceSpec("A100 SXM4 80GB", 312 * TERA, 156 * TERA, 19.5 * TERA, 19.5 * TERA, 2.039e12, 80),
    "h100-pcie": DeviceSpec("H100 PCIe 80GB", 756.5 * TERA, 378 * TERA, 51 * TERA, 51 * TERA, 2.0e12, 80),
    "h100-nvl": DeviceSpec("H100 NVL 94GB", 835.5 * TERA, 417.5 * TERA, 60 * TERA, 60 * TERA, 3.9e12, 94),
    "h200-nvl": DeviceSpec("H200 NVL 141GB", 835.5 * TERA, 417.5 * TERA, 60 * TERA, 60 * TERA, 4.8e12, 141),
    "a100-pcie-80gb": DeviceSpec("A100 PCIe 80GB", 312 * TERA, 156 * TERA, 19.5 * TERA, 19.5 * TERA, 1.935e12, 80),
    "a100-40gb": DeviceSpec("A100 40GB", 312 * TERA, 156 * TERA, 19.5 * TERA, 19.5 * TERA, 1.555e12, 40),
}  # fmt: skip

#: The cards ``scalefold estimate-step`` prints a floor for.
FLOOR_DEVICES = ("h100-sxm", "h200", "a100-sxm-80gb")

# (pattern on the lower-cased device name, entry); first match wins, so the specific parts come first
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"h200.*nvl", "h200-nvl"),
    (r"h200", "h200"),
    (r"h100.*nvl", "h100-nvl"),
    (r"h100.*pcie", "h100-pcie"),
    (r"h100", "h100-sxm"),  # "NVIDIA H100 80GB HBM3" is the SXM5 part
    (r"a100.*(40gb|-40g)", "a100-40gb"),
    (r"a100.*pcie", "a100-pcie-80gb"),
    (r"a100", "a100-sxm-80gb"),
)


def device_spec(name: str | None) -> DeviceSpec | None:
    """The entry for a ``torch.cuda.get_device_name()`` string (or a key of :data:`DEVICES`), ``None`` for
    a GPU not in the table, an empty name or ``None``."""
    if not name:
        return None
    key = name.strip().lower()
    if key in DEVICES:
        return DEVICES[key]
    for pattern, entry in _NAME_PATTERNS:
        if re.search(pattern, key):
            return DEVICES[entry]
    return None


def current_device_spec() -> DeviceSpec | None:
    """The entry of this process's CUDA device, ``None`` without CUDA or for an unknown GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return device_spec(torch.cuda.get_device_name())


def floor_seconds(
    flops_by_dtype: dict[str, float], nbytes: float, spec: DeviceSpec, precision: str = "bf16"
) -> dict[str, float]:
    """The roofline floor of a step on ``spec``: ``compute_s`` = each dtype's matrix-product FLOPs over
    its dense peak (bf16 products at the BF16 rate; fp32 products at the TF32 rate for a ``tf32`` run,
    else the FP32 rate; fp64 at the FP64 rate), ``memory_s`` = ``nbytes`` over the bandwidth, and
    ``floor_s`` = the larger. The step cannot run faster than ``floor_s`` with these kernels' traffic."""
    rate = {"bf16": spec.bf16, "fp32": spec.tf32 if precision == "tf32" else spec.fp32, "fp64": spec.fp64}
    compute = sum(flops / rate[dtype] for dtype, flops in flops_by_dtype.items() if flops)
    memory = nbytes / spec.bandwidth
    return {"compute_s": compute, "memory_s": memory, "floor_s": max(compute, memory)}


def mfu(flops: float, seconds: float, spec: DeviceSpec | None, precision: str) -> float | None:
    """Model FLOPs utilisation: ``flops / seconds`` over the device's dense peak at ``precision``;
    ``None`` for an unknown device or a non-positive time."""
    if spec is None or seconds <= 0:
        return None
    return flops / seconds / spec.peak_flops(precision)


__all__ = ["DEVICES", "FLOOR_DEVICES", "DeviceSpec", "current_device_spec", "device_spec", "floor_seconds", "mfu"]
