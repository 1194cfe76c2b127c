"""One training step: the object the Trainer, the memory model and the step benchmark all take.

One step (supplement 1.11, MLPerf HPC OpenFold): ``n`` no-grad recycling passes and the grad pass (bf16
autocast with the structure module and heads in fp32), the AlphaFold loss in fp32, backward into the
flat gradient buffer (with DDP: bucket all-reduce and the clipping norm), the global norm and clip
scale, the fused Adam + SWA update. :class:`TrainingStep` holds those parts: the
:class:`~scalefold.train.trainer.Trainer` calls its phases (:meth:`~TrainingStep.forward_loss`,
:meth:`~TrainingStep.backward`, :meth:`~TrainingStep.clip`, :meth:`~TrainingStep.update`) with its
cross-rank agreement between them; :meth:`TrainingStep.build` makes one from a
:class:`~scalefold.config.training.TrainConfig` on a synthetic batch of the run's shapes for
``scalefold estimate-memory`` and ``scalefold bench step`` (:mod:`scalefold.perf`), whose
:meth:`~TrainingStep.run` takes the step with the same calls. The model comes from the one factory
(:mod:`scalefold.model.factory`), the optimizer from :func:`make_optimizer`, for both.

Also here: the step's per-step randomness as pure functions (:func:`recycling_count`,
:func:`forward_seed`) and :func:`nonfinite_terms_to_nan`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from scalefold.compilation.graphed_step import synthetic_step_batch
from scalefold.config.training import TrainConfig
from scalefold.data.pipeline import FeatureConfig
from scalefold.losses import AlphaFoldLoss
from scalefold.model.factory import build_model, build_model_config
from scalefold.model.precision import MASTER_DTYPES, float_outputs, keep_fp32_regions
from scalefold.optim.adam_swa import FlatAdamSWA
from scalefold.optim.clipping import GradClipper

SEED_MODULUS = 2**63 - 1


def recycling_count(seed: int, step: int, num_ensembles: int) -> int:
    """Recycling iterations of 1-based ``step``: uniform on ``{0 .. R-1}``, a pure function of (seed, step),
    hence identical on every rank and after a resume."""
    return random.Random(f"recycling:{seed}:{step}").randrange(num_ensembles)


def forward_seed(seed: int, rank: int, step: int) -> int:
    """Per-step seed of the forward pass (dropout) from (seed, data-parallel rank, step)."""
    return random.Random(f"forward:{seed}:{rank}:{step}").randrange(SEED_MODULUS)


def nonfinite_terms_to_nan(loss: torch.Tensor, terms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The detached ``loss``, or NaN if any reported loss term is non-finite.

    :class:`~scalefold.losses.AlphaFoldLoss` replaces a non-finite term by a constant 0 (as the
    reference does), which can leave a finite loss, even zero gradients, on a step whose model output
    was garbage; the loop treats such a step as non-finite and skips it. No host synchronisation.
    """
    loss = loss.detach()
    if not terms:
        return loss
    finite = torch.stack([v.detach().to(loss.device, torch.float64).reshape(()) for v in terms.values()]).isfinite().all()
    return torch.where(finite, loss, torch.full_like(loss, float("nan")))


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> FlatAdamSWA:
    """Adam + SWA over flat buffers of ``model``'s parameters, as the run configures it."""
    return FlatAdamSWA(list(model.named_parameters()), lr=cfg.lr, eps=1e-6, swa_decay=cfg.swa_decay)


def training_model(cfg: TrainConfig, model_cfg: Any, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The run's model from the factory (seeded as the run seeds it) in the master dtype, in training mode;
    bf16 runs keep the structure module and the heads in fp32 as the Trainer does."""
    model = build_model(cfg, model_cfg, torch.device(device), MASTER_DTYPES[cfg.precision]).train()
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
    #: what computes the outputs from a batch: the model (default), DDP's wrapper, a graphed forward
    forward: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    #: gradients are all-reduced by DDP, whose communication hook accumulates the clipping norm
    ddp: bool = False

    @classmethod
    def build(
        cls, cfg: TrainConfig, device: torch.device | str = "cpu", model: torch.nn.Module | None = None,
        batch: dict[str, torch.Tensor] | None = None,
    ) -> TrainingStep:  # fmt: skip
        """Model (unless given), loss, optimizer, clipper and a synthetic batch (unless given) for ``cfg``."""
        device = torch.device(device)
        model_cfg = build_model_config(cfg)
        features = FeatureConfig.from_reference_config(model_cfg.to_dict())
        if model is None:
            model = training_model(cfg, model_cfg, device)
        if batch is None:
            batch = synthetic_batch(cfg, model, device)
        return cls(
            model=model, loss_fn=AlphaFoldLoss(model_cfg.loss_config), opt=make_optimizer(cfg, model),
            clipper=GradClipper(max_norm=cfg.clip_grad_max_norm), batch=batch,
            num_ensembles=features.num_ensembles, autocast=cfg.precision == "bf16", device=device,
        )  # fmt: skip

    def sliced(self, n: int) -> dict[str, torch.Tensor]:
        """The batch of a step with ``n`` no-grad recycling passes: slices ``0 .. n``."""
        if not 0 <= n < self.num_ensembles:
            raise ValueError(f"recycling passes {n} outside 0 .. {self.num_ensembles - 1}")
        return {k: v[..., : n + 1] for k, v in self.batch.items()}

    def forward_loss(self, batch: dict[str, torch.Tensor],
                     forward: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        """The no-grad recycling passes and the grad pass (bf16 autocast where the run uses it), then the
        AlphaFold loss in fp32: ``(loss, terms)``."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            outputs = (forward or self.forward or self.model)(batch)
        return self.loss_fn(float_outputs(outputs) if self.autocast else outputs, batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients into the optimizer's flat buffer (with DDP: the bucket all-reduce and the norm)."""
        self.opt.zero_grad()
        loss.backward()

    def clip(self) -> Any:
        """The step's global gradient norm and clip scale: from DDP's buckets, else the flat buffer."""
        return self.clipper.compute() if self.ddp else self.clipper.clip_flat_(self.opt.grad_buffers())

    def update(self, clip: Any) -> None:
        """Adam + SWA with the clip scale."""
        self.opt.step(clip_scale=clip.clip_scale)

    def run(self, n: int, phase: Callable[[str], None] | None = None,
            forward: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> torch.Tensor:  # fmt: skip
        """One step with ``n`` no-grad recycling passes on the synthetic batch (the Trainer's order, without
        its cross-rank agreement and non-finite skip); returns the detached loss.

        ``phase(name)`` is called as the step enters ``forward`` (recycling passes and grad pass),
        ``loss``, ``backward`` and ``optimizer``. ``forward`` replaces ``model(batch)`` (e.g. a
        compiled or graphed forward); default :attr:`forward`, else the model.
        """
        mark = phase or (lambda name: None)
        batch = self.sliced(n)
        self.model.train()
        mark("forward")
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            outputs = (forward or self.forward or self.model)(batch)
        mark("loss")
        loss, _ = self.loss_fn(float_outputs(outputs) if self.autocast else outputs, batch)
        mark("backward")
        self.backward(loss)
        mark("optimizer")
        self.update(self.clip())
        return loss.detach()


def synthetic_batch(cfg: TrainConfig, model: torch.nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A random batch with the run's training shapes (all ``R`` recycling slices), floating features in
    the master dtype."""
    features = FeatureConfig.from_reference_config(build_model_config(cfg).to_dict())
    torch.manual_seed(cfg.seed)
    return synthetic_step_batch(features, model, torch.device(device), MASTER_DTYPES[cfg.precision])


__all__ = [
    "TrainingStep", "forward_seed", "make_optimizer", "nonfinite_terms_to_nan", "recycling_count",
    "synthetic_batch", "training_model",
]  # fmt: skip
