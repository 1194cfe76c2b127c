"""What the kernel tools compile for and check, by name (standard library only: the command line's
choices come from here without importing torch)."""

from __future__ import annotations

#: ``--arch`` -> (compute capability, opt-in dynamic shared memory per block in bytes)
ARCHS = {"sm_90": (90, 227 * 1024), "sm_80": (80, 163 * 1024)}
#: ``--dtype`` names; ``tf32`` is fp32 storage with TF32 matmuls (``torch.backends.cuda.matmul.allow_tf32``),
#: which changes only the dots of the attention, triangle-multiplication and outer-product-mean kernels
DTYPE_NAMES = ("bf16", "fp16", "fp32", "tf32")
KERNELS = ("attention_fwd", "attention_bwd", "layer_norm_fwd", "layer_norm_bwd", "adam_swa", "trimul", "opm")
