"""One training step: the object the Trainer, the memory model and the step benchmark all take.

One step (supplement 1.11, MLPerf HPC OpenFold): ``n`` no-grad recycling passes and the grad pass (bf16
autocast with the structure module and heads in fp32), the AlphaFold loss in fp32, backward into the
flat gradient buffer (with DDP: bucket all-reduce and the clipping norm), the global norm and clip
scale, the cross-rank agreement (mean loss, stop requests, the verdict), and the fused Adam + SWA
update -- applied or skipped **on the device** (a non-finite loss or gradient on any rank skips it).
:class:`TrainingStep` owns that whole sequence: the :class:`~scalefold.train.trainer.Trainer` calls
:meth:`TrainingStep.train` once per step (slicing the loader's batch to the step's recycling count,
the DAP/BP broadcast hook, the forward seed, then :meth:`TrainingStep.compute`), and reads its
:class:`StepResult` from the device **once**, after the step (:meth:`StepResult.read`). Nothing inside
:meth:`~TrainingStep.compute` reads a value back to the host (``scalefold bench step`` counts it:
``host_syncs_per_step``, :mod:`scalefold.perf.host_syncs`), so a CUDA graph can capture it whole
(``--cuda-graphs step``: :mod:`scalefold.compilation.graphed_step`, which replays it through
:attr:`TrainingStep.graphs`).

:meth:`TrainingStep.build` makes one from a :class:`~scalefold.config.training.TrainConfig` on a
synthetic batch of the run's shapes for ``scalefold estimate-memory`` and ``scalefold bench step``
(:mod:`scalefold.perf`), whose :meth:`~TrainingStep.run` takes the same :meth:`~TrainingStep.compute`.
The model comes from the one factory (:mod:`scalefold.model.factory`), the optimizer from
:func:`make_optimizer`, for both.

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
from scalefold.data.batch import step_batch
from scalefold.data.pipeline import FeatureConfig
from scalefold.distributed.agreement import agree_on_device, read_agreement
from scalefold.distributed.branch_parallel import model_branch_generators, seed_forward
from scalefold.losses import AlphaFoldLoss
from scalefold.model.factory import build_model, build_model_config
from scalefold.model.precision import MASTER_DTYPES, float_outputs, keep_fp32_regions
from scalefold.optim.adam_swa import FlatAdamSWA
from scalefold.optim.clipping import GradClipper
from scalefold.optim.grad_slots import attach_grad_slots

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


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module, report: Callable[[str], None] | None = None) -> FlatAdamSWA:
    """Adam + SWA over flat buffers of ``model``'s parameters, as the run configures it; the model's weight groups
    write their gradients into the flat buffer themselves (:func:`scalefold.optim.grad_slots.attach_grad_slots`;
    ``report``: its one line on the parameters that take the slow path)."""
    opt = FlatAdamSWA(list(model.named_parameters()), lr=cfg.lr, eps=1e-6, swa_decay=cfg.swa_decay)
    attach_grad_slots(model, opt, report)
    return opt


def training_model(cfg: TrainConfig, model_cfg: Any, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The run's model from the factory (seeded as the run seeds it) in the master dtype, in training mode;
    bf16 runs keep the structure module and the heads in fp32 as the Trainer does."""
    model = build_model(cfg, model_cfg, torch.device(device), MASTER_DTYPES[cfg.precision]).train()
    if cfg.precision == "bf16":
        keep_fp32_regions(model)
    return model


@dataclass
class StepOutcome:
    """A step's results on the host (one read after the step)."""

    mean_loss: float  # mean over the training ranks (NaN where a term was non-finite)
    stop: bool  # some rank asked to stop
    count: int  # the ``count`` summed over the ranks (samples the loaders replaced)
    skipped: bool  # the update was not applied (non-finite loss or gradient on some rank)
    grad_norm: float
    terms: dict[str, float]


@dataclass(eq=False)
class StepResult:
    """A step's results on the device: nothing of it has been read by the host yet."""

    n: int  # no-grad recycling passes
    loss: torch.Tensor  # this rank's detached loss
    stats: torch.Tensor  # float64 [sum of the ranks' losses, stop requests, count]
    apply: torch.Tensor  # bool: the update was applied
    grad_norm: torch.Tensor
    terms: dict[str, torch.Tensor]

    def clone(self) -> StepResult:
        """A copy (a graph's static outputs are overwritten by its next replay)."""
        return StepResult(n=self.n, loss=self.loss.clone(), stats=self.stats.clone(), apply=self.apply.clone(),
                          grad_norm=self.grad_norm.clone(), terms={k: v.detach().clone() for k, v in self.terms.items()})  # fmt: skip

    def read(self, world_size: int) -> StepOutcome:
        """Everything the loop records, in **one** device-to-host read."""
        names = list(self.terms)
        values = [self.stats.reshape(3), self.apply.to(torch.float64).reshape(1), self.grad_norm.to(torch.float64).reshape(1)]
        values += [self.terms[k].detach().to(torch.float64).reshape(1) for k in names]
        host = torch.cat([v.to(self.stats.device) for v in values]).tolist()
        mean_loss, stop, count = read_agreement(host[:3], world_size)
        return StepOutcome(mean_loss=mean_loss, stop=stop, count=count, skipped=not host[3] > 0, grad_norm=host[4],
                           terms=dict(zip(names, host[5:])))  # fmt: skip


@dataclass(eq=False)
class TrainingStep:
    """One training step, whole: :meth:`train` (the Trainer's) and :meth:`run` (the tools') take it.
    Build with :meth:`build`."""

    model: torch.nn.Module
    loss_fn: torch.nn.Module
    opt: Any  # FlatAdamSWA
    clipper: Any  # GradClipper
    batch: dict[str, torch.Tensor]  # all R recycling slices, [..., R] (the tools' synthetic batch)
    num_ensembles: int  # R: a step takes 0 .. R-1 no-grad passes
    autocast: bool
    device: torch.device
    #: what computes the outputs from a batch: the model (default), DDP's wrapper, a graphed forward
    forward: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    #: the data-parallel reduction after backward, returning the clip result: DDP's (its communication hook
    #: accumulated the norm: ``GradClipper.compute``) or the flat buffers' (``FlatGradReducer.reduce_and_clip``);
    #: ``None``: one rank, the norm of the local flat buffers
    reduce: Callable[[], Any] | None = None
    #: the cross-rank agreement: the training ranks' group and their number
    group: Any = None
    world_size: int = 1
    #: the loader batch's floating dtype on the device (``None``: as given)
    dtype: torch.dtype | None = None
    #: DAP/BP: the loader rank's slice to its group (``None``: the batch as is)
    broadcast: Callable[[dict[str, torch.Tensor] | None], dict[str, torch.Tensor]] | None = None
    #: whole-step CUDA graphs (``--cuda-graphs step``): ``graphs(batch, n)`` replays the captured
    #: :meth:`compute` of recycling count ``n``, or returns ``None`` (not captured: eager)
    graphs: Callable[[dict[str, torch.Tensor], int], StepResult | None] | None = None
    #: autocast's weight-cast cache (off while a CUDA graph captures the step)
    autocast_cache: bool = True

    def __post_init__(self) -> None:
        # [stop, count]: written before each step, read by the agreement (a graph reads it by address)
        self.flags = torch.zeros(2, dtype=torch.float64, device=self.device)
        # the Parallel Evoformer's branch generators: seeded with the forward seed before each step
        self.branch_generators = model_branch_generators(self.model)

    def seed_forward(self, seed: int) -> None:
        """The step's forward seed on the host, before the step: the global generators and the branches'."""
        seed_forward(seed, self.device, self.branch_generators)

    def generators(self) -> list[torch.Generator]:
        """The generators a capture of the step registers besides the default one (the branches')."""
        return [g for generators in self.branch_generators for g in generators.generators(self.device)]

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
        """The synthetic batch of a step with ``n`` no-grad recycling passes: slices ``0 .. n``."""
        if not 0 <= n < self.num_ensembles:
            raise ValueError(f"recycling passes {n} outside 0 .. {self.num_ensembles - 1}")
        return {k: v[..., : n + 1] for k, v in self.batch.items()}

    # -- the Trainer's step ---------------------------------------------------------------------------

    def train(self, batch: dict[str, torch.Tensor] | None, n: int, seed: int, stop: bool = False, count: int = 0,
              phase: Callable[[str], None] | None = None) -> StepResult:  # fmt: skip
        """The whole step on the loader's ``batch`` (``[..., R]`` on the host; ``None`` on a DAP/BP rank
        that does not load): slices ``0 .. n`` on the device, the group broadcast, the forward seed, then
        :meth:`compute` -- replayed from a CUDA graph where one was captured for ``n``. ``stop`` / ``count``:
        this rank's stop request and loader replacements, agreed between the ranks inside the step;
        ``phase``: as in :meth:`compute` (a graph replay marks nothing)."""
        self.model.train()
        sliced = step_batch(batch, n, self.device, self.dtype or torch.float32) if batch is not None else None
        batch = self.broadcast(sliced) if self.broadcast is not None else sliced
        self.seed_forward(seed)
        self.set_flags(stop, count)
        if self.graphs is not None:
            result = self.graphs(batch, n)
            if result is not None:
                return result
        return self.compute(batch, phase=phase)

    def set_flags(self, stop: bool, count: int) -> None:
        """This rank's stop request and count into the agreement's device buffer (no host read)."""
        self.flags[0].fill_(float(stop))
        self.flags[1].fill_(float(count))

    def compute(self, batch: dict[str, torch.Tensor], phase: Callable[[str], None] | None = None,
                forward: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> StepResult:  # fmt: skip
        """Forward (no-grad passes, grad pass), loss, backward, clipping, the cross-rank agreement and the
        update applied or skipped on the device -- no host read. ``phase(name)`` marks ``forward``,
        ``loss``, ``backward`` and ``optimizer``; ``forward`` replaces :attr:`forward` / the model."""
        mark = phase or (lambda name: None)
        mark("forward")
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast,
                            cache_enabled=self.autocast_cache):  # fmt: skip
            outputs = (forward or self.forward or self.model)(batch)
        mark("loss")
        loss, terms = self.loss_fn(float_outputs(outputs) if self.autocast else outputs, batch)
        mark("backward")
        self.backward(loss)
        mark("optimizer")
        clip = self.clip()
        # a loss term the loss module dropped as non-finite makes the step's loss non-finite too
        agreed = agree_on_device(nonfinite_terms_to_nan(loss, terms), clip.finite, self.flags, self.group,
                                 self.world_size)  # fmt: skip
        self.opt.step(clip_scale=clip.clip_scale, apply=agreed.apply)
        n = int(batch["aatype"].shape[-1]) - 1
        return StepResult(n=n, loss=loss.detach(), stats=agreed.stats, apply=agreed.apply, grad_norm=clip.grad_norm,
                          terms=terms)  # fmt: skip

    def settle(self, outcome: StepOutcome) -> None:
        """After the step's one read: the optimizer's host mirrors follow the device's verdict."""
        self.opt.settle(not outcome.skipped)

    # -- the phases (the Trainer's order) ------------------------------------------------------------

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
        """The step's global gradient norm and clip scale: after the data-parallel :attr:`reduce`, else of the
        local flat buffer."""
        return self.reduce() if self.reduce is not None else self.clipper.clip_flat_(self.opt.grad_buffers())

    # -- the tools' step --------------------------------------------------------------------------------

    def run(self, n: int, phase: Callable[[str], None] | None = None,
            forward: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
            read: bool = True) -> torch.Tensor:  # fmt: skip
        """One step with ``n`` no-grad recycling passes on the synthetic batch: :meth:`compute` (the
        Trainer's step, agreement and device-side skip included), then -- ``read`` -- its one host read
        and the optimizer's settling (on fake tensors, nothing to read: settled as applied). Returns the
        detached loss. ``read=False`` leaves the result unread: call :meth:`finish` after."""
        self.model.train()
        for generators in self.branch_generators:  # the tools' steps: the branches seeded once, outside the step
            if not generators.step_seeded:
                generators.seed(0, self.device)
        batch = self.sliced(n)
        replayed = self.graphs(batch, n) if self.graphs is not None and forward is None else None
        self.last = replayed if replayed is not None else self.compute(batch, phase=phase, forward=forward)
        if read:
            self.finish()
        return self.last.loss

    def use_whole_step_graphs(self, log: Callable[[str], None] | None = None, backend: Any = None,
                              counts: list[int] | None = None) -> Any:  # fmt: skip
        """Capture this step whole per recycling count (``counts``, default every one) on :attr:`batch`
        (``--cuda-graphs step``; the tools' way to the Trainer's graphs; on a CPU the emulated capture) and replay
        them from now on where the capture held; returns the
        :class:`~scalefold.compilation.graphed_step.WholeStepGraphs` (``.active``, ``.reason``)."""
        from scalefold.compilation.graphed_step import WholeStepGraphs, step_graph_backend

        backend, _, _ = step_graph_backend("step", self.device.type, backend)  # the CPU's: the emulated capture
        graphs = WholeStepGraphs(self, backend=backend, log=log, reason="--cuda-graphs step")
        graphs.warm_up(self.batch, counts=counts)
        self.graphs = graphs if graphs.active else None
        return graphs

    def finish(self) -> StepOutcome | None:
        """The host's side of the last :meth:`run`: read its result once and settle the optimizer."""
        from torch._subclasses.fake_tensor import is_fake

        result = self.last
        if is_fake(result.stats):
            self.opt.settle(True)
            return None
        outcome = result.read(self.world_size)
        self.settle(outcome)
        return outcome


def synthetic_batch(cfg: TrainConfig, model: torch.nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A random batch with the run's training shapes (all ``R`` recycling slices), floating features in
    the master dtype."""
    features = FeatureConfig.from_reference_config(build_model_config(cfg).to_dict())
    torch.manual_seed(cfg.seed)
    return synthetic_step_batch(features, model, torch.device(device), MASTER_DTYPES[cfg.precision])


__all__ = [
    "StepOutcome", "StepResult", "TrainingStep", "forward_seed", "make_optimizer", "nonfinite_terms_to_nan", "recycling_count",
    "synthetic_batch", "training_model",
]  # fmt: skip
