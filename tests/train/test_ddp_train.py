"""Two-rank data-parallel ``scalefold train`` (gloo, CPU, launched with ``torch.distributed.run``).

The 2-rank run's weights after one step must equal a single-process reference built here from the
same two batches (each rank's own sample, recycling count and dropout seed), with the gradients
averaged, clipped with ``torch.nn.utils.clip_grad_norm_`` and stepped with ``torch.optim.Adam``
(fp64). This checks DDP averaging, the bucket-norm clipping hook, the flat optimizer under DDP and
the per-rank data stream together.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from scalefold.checkpoint.files import load_checkpoint
from scalefold.config.training import TrainConfig
from scalefold.data.batch import step_batch
from scalefold.data.dataset import StoreSample
from scalefold.data.pipeline import FeatureConfig
from scalefold.data.store import Store
from scalefold.distributed.launch import free_port
from scalefold.losses import AlphaFoldLoss
from scalefold.model.factory import build_model, build_model_config
from scalefold.train.step import forward_seed, recycling_count
from scalefold.train.training_data import sample_pairs, split_chains

pytestmark = pytest.mark.distributed  # two torchrun ranks

WORLD = 2
ANNOUNCE = re.compile(r"scalefold: rank (\d+)/(\d+) backend (\w+) role (train|eval)\n")


def _launch(tmp_path, nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCALEFOLD_", "SLURM_", "OMPI_", "PMI_"))}
    env.update(OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
        str(free_port()), "-m", "scalefold", "train", *args,
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    out, store = root / "run", root / "store.h5"
    proc = _launch(
        root, WORLD, "--preset", "tiny", "--out", str(out), "--store", str(store), "--max-steps", "1",
        "--eval-every", "0", "--checkpoint-every", "1", "--precision", "fp64", "--deterministic", "--num-workers", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, store, proc


def test_every_rank_announces_itself(ddp_run):
    """Each rank prints its ``scalefold: rank r/2 backend gloo role train`` line exactly once, whole.

    The ranks share the stdout pipe; the announcement is one atomic write, so each line is intact.
    It is searched anywhere in stdout (another process's unterminated output, e.g. a launcher warning,
    may precede it on the same line), and nothing else on stdout may carry a torn copy of it.
    """
    _, _, proc = ddp_run
    found = ANNOUNCE.findall(proc.stdout)
    assert sorted(found) == [(str(r), str(WORLD), "gloo", "train") for r in range(WORLD)], proc.stdout[-2000:]
    assert len(re.findall(r"scalefold: rank \d", proc.stdout)) == WORLD  # no torn or repeated announcement


def test_two_rank_step_equals_averaged_gradient_reference(ddp_run):
    """Weights after step 1 == Adam on the clipped average of the two ranks' gradients (fp64, 1e-10)."""
    out, store_path, _ = ddp_run
    cfg = TrainConfig.from_preset(
        "tiny", overrides={"out": str(out), "store": str(store_path), "precision": "fp64", "eval_every": 0}, env={}
    )
    assert cfg.warmup_steps == 0  # step 1 runs at the base learning rate
    model_cfg = build_model_config(cfg)
    features = FeatureConfig.from_reference_config(model_cfg.to_dict())
    with Store.open(store_path) as store:
        train_ids, weights, _ = split_chains(store, cfg)
    sample = StoreSample(str(store_path), train_ids, features, mode="train")
    n = recycling_count(cfg.seed, 1, features.num_ensembles)

    model = build_model(cfg, model_cfg, torch.device("cpu"), torch.float64)
    model.train()
    loss_fn = AlphaFoldLoss(model_cfg.loss_config)
    params = list(model.parameters())
    losses, grads = [], [torch.zeros_like(p) for p in params]
    for rank in range(WORLD):
        ((index, seed),) = sample_pairs(weights, cfg.seed, 0, 1, rank=rank, world_size=WORLD)
        batch = step_batch(sample(index, seed), n, torch.device("cpu"), torch.float64)
        torch.manual_seed(forward_seed(cfg.seed, rank, 1))
        loss, _ = loss_fn(model(batch), batch)
        for g, gi in zip(grads, torch.autograd.grad(loss, params, allow_unused=True)):
            if gi is not None:
                g += gi / WORLD
        losses.append(float(loss.detach()))
    for p, g in zip(params, grads):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_max_norm)
    torch.optim.Adam(params, lr=cfg.lr, eps=1e-6).step()

    ckpt = load_checkpoint(out / "checkpoints" / "checkpoint_00000001.pt")
    trained = ckpt["alphafold_state_dict"]
    worst = max(float((trained[name] - p.detach()).abs().max()) for name, p in model.named_parameters())
    moved = max(float((trained[name] - p0).abs().max()) for name, p0 in build_model(
        cfg, model_cfg, torch.device("cpu"), torch.float64).state_dict().items() if name in trained)  # fmt: skip
    assert moved > 1e-6  # the step did change the weights
    assert worst < 1e-10, worst

    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    (step1,) = [r for r in records if r.get("step") == 1]
    assert step1["loss"] == pytest.approx(sum(losses) / WORLD, rel=1e-12, abs=1e-12)
