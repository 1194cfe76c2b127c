"""One training step as ``scalefold train`` takes it, on a synthetic batch of the run's shapes.

The memory model (:mod:`scalefold.perf.memory`) and the step benchmark (:mod:`scalefold.perf.step_bench`)
must measure the *same* step as the loop (:mod:`scalefold.train.loop`): ``n`` no-grad recycling passes
and the grad pass (bf16 autocast with the structure module and heads in fp32), the AlphaFold loss in
fp32, backward into the flat gradient buffer, the flat gradient norm and clip scale, and the fused
Adam + SWA update. :class:`TrainingStep` holds those parts and :meth:`TrainingStep.run` takes one
step; it is built from a :class:`~scalefold.train.config.TrainConfig`, so presets, config files and
overrides mean what they mean for ``scalefold train``.

Not included: the data loader (the batch is synthetic, padded to the training shapes as the pipeline
pads every sample), DDP's bucket all-reduce (no data-parallel peers here), evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from scalefold.train.config import TrainConfig


def model_config(cfg: TrainConfig) -> Any:
    """The model preset with the run's overrides, as the training loop builds it
    (:func:`scalefold.train.build.build_model_config`: crop, MSA sizes, recycling, structure-module
    iterations)."""
    from scalefold.train.build import build_model_config

    return build_model_config(cfg)


def build_model(cfg: TrainConfig, model_cfg: Any, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The run's model (seeded as the loop seeds it), in the master dtype, in training mode; bf16 runs
    keep the structure module and the heads in fp32 as the loop does."""
    from scalefold.model import AlphaFold
    from scalefold.train.steps import MASTER_DTYPES, keep_fp32_regions

    torch.manual_seed(cfg.seed)
    model = AlphaFold(model_cfg, activation_checkpointing=cfg.activation_checkpointing,
                      parallel_evoformer=cfg.parallel_evoformer)  # fmt: skip
    model = model.to(device, MASTER_DTYPES[cfg.precision]).train()
    if cfg.precision == "bf16":
        keep_fp32_regions(model)
    return model


@dataclass(eq=False)
class TrainingStep:
    """The parts of one training step; :meth:`run` takes it. Build with :meth:`build`."""

    model: torch.nn.Module
    loss_fn: torch.nn.Module
    opt: Any  # FlatAdamSWA
    clipper: Any  # GradClipper
    batch: dict[str, torch.Tensor]  # all R recycling slices, [..., R]
    num_ensembles: int  # R: a step takes 0 .. R-1 no-grad passes
    autocast: bool
    device: torch.device

    @classmethod
    def build(
        cls, cfg: TrainConfig, device: torch.device | str = "cpu", model: torch.nn.Module | None = None,
        batch: dict[str, torch.Tensor] | None = None,
    ) -> TrainingStep:  # fmt: skip
        """Model (unless given), loss, optimizer, clipper and a synthetic batch (unless given) for ``cfg``."""
        from scalefold.data.pipeline import FeatureConfig
        from scalefold.losses import AlphaFoldLoss
        from scalefold.train.flat_optimizer import FlatAdamSWA
        from scalefold.train.grad_clipping import GradClipper

        device = torch.device(device)
        model_cfg = model_config(cfg)
        features = FeatureConfig.from_reference_config(model_cfg.to_dict())
        if model is None:
            model = build_model(cfg, model_cfg, device)
        if batch is None:
            batch = synthetic_batch(cfg, model, device)
        opt = FlatAdamSWA(list(model.named_parameters()), lr=cfg.lr, eps=1e-6, swa_decay=cfg.swa_decay)
        return cls(
            model=model, loss_fn=AlphaFoldLoss(model_cfg.loss_config), opt=opt,
            clipper=GradClipper(max_norm=cfg.clip_grad_max_norm), batch=batch,
            num_ensembles=features.num_ensembles, autocast=cfg.precision == "bf16", device=device,
        )  # fmt: skip

    def sliced(self, n: int) -> dict[str, torch.Tensor]:
        """The batch of a step with ``n`` no-grad recycling passes: slices ``0 .. n``."""
        if not 0 <= n < self.num_ensembles:
            raise ValueError(f"recycling passes {n} outside 0 .. {self.num_ensembles - 1}")
        return {k: v[..., : n + 1] for k, v in self.batch.items()}

    def run(self, n: int, phase: Callable[[str], None] | None = None,
            forward: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> torch.Tensor:  # fmt: skip
        """One step with ``n`` no-grad recycling passes (the loop's order); returns the detached loss.

        ``phase(name)`` is called as the step enters ``forward`` (recycling passes and grad pass),
        ``loss``, ``backward`` and ``optimizer``. ``forward`` replaces ``model(batch)`` (e.g. a
        compiled or graphed forward); default the model.
        """
        from scalefold.train.steps import float_outputs

        mark = phase or (lambda name: None)
        batch = self.sliced(n)
        self.model.train()
        mark("forward")
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            outputs = (forward or self.model)(batch)
        mark("loss")
        loss, _ = self.loss_fn(float_outputs(outputs) if self.autocast else outputs, batch)
        mark("backward")
        self.opt.zero_grad()
        loss.backward()
        mark("optimizer")
        clip = self.clipper.clip_flat_(self.opt.grad_buffers())
        self.opt.step(clip_scale=clip.clip_scale)
        return loss.detach()


def synthetic_batch(cfg: TrainConfig, model: torch.nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A random batch with the run's training shapes (all ``R`` recycling slices), floating features in
    the master dtype."""
    from scalefold.data.pipeline import FeatureConfig
    from scalefold.train.graphed_step import synthetic_step_batch
    from scalefold.train.steps import MASTER_DTYPES

    features = FeatureConfig.from_reference_config(model_config(cfg).to_dict())
    torch.manual_seed(cfg.seed)
    return synthetic_step_batch(features, model, torch.device(device), MASTER_DTYPES[cfg.precision])


__all__ = ["TrainingStep", "build_model", "model_config", "synthetic_batch"]
