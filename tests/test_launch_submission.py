"""The cluster submission without a cluster: config layouts, run.sub's srun command lines (DRYRUN=1,
incl. the pyxis container flags that cannot run here), run_and_time.sh's env -> flag mapping.

The real submission (sbatch on a local Slurm) is tested in test_slurm_submission.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
LAYOUT_VARS = (
    "DGXSYSTEM", "DGXNNODES", "DGXNGPU", "DAP_SIZE", "NUM_ASYNC_VAL_RANKS", "NUM_INSTANCES", "RANKS_PER_INSTANCE",
    "NODES_PER_INSTANCE", "TRAIN_RANKS", "DP_GROUPS", "GLOBAL_BATCH_SIZE", "WALLTIME",
)  # fmt: skip

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the launch scripts need bash")


def _clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without Slurm/launch variables (a test may itself run inside a job)."""
    drop = {*LAYOUT_VARS, "CONT", "DATADIR", "LOGDIR", "SEED", "SEED_BASE", "NEXP", "DATESTAMP", "LOCAL_RANKS", "BP_SIZE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in drop}
    env.update(extra)
    return env


def _bash(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=_clean_env(**env), capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip


def _layout(config: str, **env: str) -> dict[str, str]:
    printer = " ".join(f'{v}="${{{v}}}"' for v in LAYOUT_VARS)
    proc = _bash(f"set -euo pipefail; source launch/{config}; echo {printer}", **env)
    assert proc.returncode == 0, proc.stderr
    return dict(item.split("=", 1) for item in shlex.split(proc.stdout))


def _dryrun(config: str, **env: str) -> tuple[str, list[list[str]]]:
    """run.sub's output with DRYRUN=1 and the srun command lines it would run (as argv lists)."""
    env = {"CONT": "none", "DATADIR": "/lustre/data", "LOGDIR": "/lustre/logs", "DATESTAMP": "D", **env}
    proc = _bash(f"set -euo pipefail; source launch/{config}; DRYRUN=1 bash run.sub", **env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    commands = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]
    return proc.stdout, commands


def _flags(argv: list[str]) -> dict[str, str]:
    """``--name=value`` options of one command line."""
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def _srun_part(argv: list[str]) -> list[str]:
    return argv[argv.index("srun") :]


def _walltime_minutes(walltime: str) -> float:
    h, m, s = (int(x) for x in walltime.split(":"))
    return h * 60 + m + s / 60


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, nodes, gpus, dap, eval_ranks, instances, global_batch",
    [
        ("config_DGXH100_1x8x1x1.sh", 1, 8, 1, 0, 1, 8),
        ("config_DGXH100_32x8x1x2.sh", 32, 8, 2, 0, 1, 128),
        ("config_DGXH100_260x8x1x8.sh", 260, 8, 8, 32, 1, 256),
        ("config_DGXH100_throughput_256x8x1x1.sh", 256, 8, 1, 0, 16, 128),
        ("config_local_cpu.sh", 1, 2, 1, 0, 1, 2),
    ],
)
def test_config_layouts(config, nodes, gpus, dap, eval_ranks, instances, global_batch):
    """Each config computes its layout: ranks per instance, training ranks, DP groups = global batch,
    and a WALLTIME that covers the estimate (iterations x step time) it states."""
    lay = _layout(config)
    assert (int(lay["DGXNNODES"]), int(lay["DGXNGPU"]), int(lay["DAP_SIZE"])) == (nodes, gpus, dap)
    assert (int(lay["NUM_ASYNC_VAL_RANKS"]), int(lay["NUM_INSTANCES"])) == (eval_ranks, instances)
    ranks = nodes * gpus // instances
    assert int(lay["RANKS_PER_INSTANCE"]) == ranks
    assert int(lay["TRAIN_RANKS"]) == ranks - eval_ranks
    assert int(lay["DP_GROUPS"]) * dap == ranks - eval_ranks
    assert int(lay["GLOBAL_BATCH_SIZE"]) == global_batch
    assert re.fullmatch(r"\d\d:\d\d:\d\d", lay["WALLTIME"])
    estimate = _bash(f"source launch/{config}; awk -v i=$EXPECTED_ITERS -v s=$STEP_TIME_S 'BEGIN {{print i*s/60}}'")
    assert _walltime_minutes(lay["WALLTIME"]) > float(estimate.stdout)


def test_record_layout_is_256_dap8_groups_plus_32_eval_gpus():
    """The 260-node record layout: 2080 GPUs = 256 DAP-8 groups (2048 training GPUs) + 32 eval GPUs."""
    lay = _layout("config_DGXH100_260x8x1x8.sh")
    assert int(lay["DGXNNODES"]) * int(lay["DGXNGPU"]) == 2080
    assert (lay["TRAIN_RANKS"], lay["DP_GROUPS"], lay["NUM_ASYNC_VAL_RANKS"]) == ("2048", "256", "32")


def test_walltime_scales_with_nexp():
    one = _walltime_minutes(_layout("config_DGXH100_32x8x1x2.sh")["WALLTIME"])
    ten = _walltime_minutes(_layout("config_DGXH100_32x8x1x2.sh", NEXP="10")["WALLTIME"])
    assert ten == pytest.approx(10 * one, rel=0.01)


@pytest.mark.parametrize(
    "config, env, message",
    [
        ("config_DGXH100_32x8x1x2.sh", {"DAP_SIZE": "3"}, "not a multiple of DAP_SIZE*BP_SIZE=3"),
        ("config_DGXH100_1x8x1x1.sh", {"NUM_ASYNC_VAL_RANKS": "8"}, "leaves no training rank"),
        ("config_DGXH100_throughput_256x8x1x1.sh", {"NUM_INSTANCES": "3"}, "do not split into 3"),
        ("config_local_cpu.sh", {"LOCAL_RANKS": "8"}, "use 2-4 ranks"),
    ],
)
def test_impossible_layouts_are_rejected(config, env, message):
    proc = _bash(f"set -euo pipefail; source launch/{config}; echo sourced", **env)
    assert proc.returncode != 0 and "sourced" not in proc.stdout
    assert message in proc.stderr


def test_local_cpu_throughput_shares_the_node():
    lay = _layout("config_local_cpu.sh", NUM_INSTANCES="2", LOCAL_RANKS="3")
    assert (lay["DGXNGPU"], lay["RANKS_PER_INSTANCE"], lay["NODES_PER_INSTANCE"], lay["GLOBAL_BATCH_SIZE"]) == (
        "6", "3", "1", "3",
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# run.sub
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["CONT", "DGXSYSTEM"])
def test_run_sub_requires_cont_and_dgxsystem(missing):
    env = {"CONT": "none", "DGXSYSTEM": "x", "DATADIR": "/tmp", "DRYRUN": "1"}
    del env[missing]
    proc = _bash("bash run.sub", **env)
    assert proc.returncode != 0
    assert f"{missing} is not set" in proc.stderr


def test_container_flags_of_the_record_layout():
    """pyxis: the image is pulled once per node, then one srun of all 2080 ranks runs
    run_and_time.sh inside the named container with DATADIR read-only at /data and LOGDIR at /results."""
    out, cmds = _dryrun("config_DGXH100_260x8x1x8.sh", CONT="nvcr.io/acme/scalefold:24.09", SEED="3")
    pull, clear, train = cmds
    assert _srun_part(pull)[-1] == "true"
    assert _flags(pull) == {
        "ntasks": "260", "ntasks-per-node": "1", "container-image": "nvcr.io/acme/scalefold:24.09",
        "container-name": "scalefold_dryrun",
    }  # fmt: skip
    assert "drop_caches" in clear[-1] and _flags(clear)["ntasks"] == "260"
    flags = _flags(_srun_part(train))
    assert flags["mpi"] == "pmix" and flags["ntasks"] == "2080" and flags["ntasks-per-node"] == "8"
    assert flags["container-name"] == "scalefold_dryrun"
    assert flags["container-mounts"] == "/lustre/data:/data:ro,/lustre/logs:/results"
    assert train[-1] == "/workspace/scalefold/launch/run_and_time.sh"
    assert "RUN_OUT=/results/run_D_1" in train[: train.index("srun")]
    assert "seed 3" in out


def test_cont_none_runs_the_checkout_without_container_flags(tmp_path):
    _, cmds = _dryrun("config_DGXH100_32x8x1x2.sh", SCALEFOLD_DIR=str(REPO), CLEAR_CACHES="0")
    (train,) = cmds
    assert not any(a.startswith("--container") for a in train)
    assert train[-1] == str(REPO / "launch" / "run_and_time.sh")
    assert "RUN_OUT=/lustre/logs/run_D_1" in train


def test_container_mounts_need_absolute_paths():
    proc = _bash("source launch/config_DGXH100_1x8x1x1.sh; DRYRUN=1 bash run.sub", CONT="img", DATADIR="data",
                 LOGDIR="/x")  # fmt: skip
    assert proc.returncode != 0 and "DATADIR=data must be an absolute path" in proc.stderr


def test_throughput_mode_launches_one_srun_per_instance_on_its_own_nodes():
    """16 instances x 16 nodes: disjoint node ranges (--relative), distinct rendezvous ports,
    run directories and MLPerf instance ids."""
    _, cmds = _dryrun("config_DGXH100_throughput_256x8x1x1.sh", CONT="img", CLEAR_CACHES="0")
    trains = [c for c in cmds if "--mpi=pmix" in c]
    assert len(trains) == 16
    envs = [dict(a.split("=", 1) for a in c[1 : c.index("srun")]) for c in trains]
    flags = [_flags(_srun_part(c)) for c in trains]
    assert [int(f["relative"]) for f in flags] == [16 * i for i in range(16)]
    assert {(f["nodes"], f["ntasks"], f["ntasks-per-node"]) for f in flags} == {("16", "128", "8")}
    assert len({e["MASTER_PORT"] for e in envs}) == 16
    assert [e["RUN_OUT"] for e in envs] == [f"/results/run_D_1_{i}" for i in range(16)]
    assert [e["SCALEFOLD_MLPERF_INSTANCE"] for e in envs] == [str(i) for i in range(16)]


def test_nexp_runs_get_fresh_or_consecutive_seeds():
    out, cmds = _dryrun("config_DGXH100_1x8x1x1.sh", NEXP="3", CLEAR_CACHES="1")
    seeds = re.findall(r"run \d/3 seed (\d+)", out)
    assert len(seeds) == 3 and len(set(seeds)) == 3
    assert sum("drop_caches" in c[-1] for c in cmds) == 3  # caches dropped before every run
    out, _ = _dryrun("config_DGXH100_1x8x1x1.sh", NEXP="3", SEED_BASE="100")
    assert re.findall(r"run \d/3 seed (\d+)", out) == ["100", "101", "102"]


def test_run_sub_refuses_a_node_count_other_than_the_config():
    proc = _bash("source launch/config_DGXH100_32x8x1x2.sh; bash run.sub", CONT="none", DATADIR="/tmp",
                 SLURM_JOB_NUM_NODES="4", SLURM_JOB_ID="1")  # fmt: skip
    assert proc.returncode != 0 and "DGXNNODES=32" in proc.stderr


# ----------------------------------------------------------------------------------------------
# run_and_time.sh
# ----------------------------------------------------------------------------------------------


def _run_and_time(**env: str) -> list[str]:
    proc = _bash("DRYRUN=1 ./launch/run_and_time.sh", **env)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def test_run_and_time_maps_the_environment_to_train_flags():
    argv = _run_and_time(
        PRESET="mlperf", DATA_ROOT="/data", RESULTS_ROOT="/results", RUN_OUT="/results/run_D_1", PRECISION="bf16",
        MAX_STEPS="1200", VAL_EVERY="40", TARGET_LDDT="0.8", SEED="42", NUM_ASYNC_VAL_RANKS="32", DAP_SIZE="8",
        BP_SIZE="2", INIT_CHECKPOINT="/data/ckpt.pt", EXTRA_ARGS="--num-workers 6", SLURM_PROCID="3",
        SLURM_JOB_ID="77", SLURM_STEP_ID="0", ENABLE_BINDING="0", TRITON_CACHE_ROOT="/tmp/tc",
    )  # fmt: skip
    assert argv[0] == "TRITON_CACHE_DIR=/tmp/tc/77_0_rank3"
    cmd = argv[1:]
    assert cmd[:2] == ["scalefold", "train"]
    pairs = dict(zip(cmd[2::2], cmd[3::2]))
    assert pairs["--preset"] == "mlperf" and pairs["--store"] == "/data/store.h5" and pairs["--out"] == "/results/run_D_1"
    expected = {"--precision": "bf16", "--max-steps": "1200", "--eval-every": "40", "--target-lddt": "0.8",
                "--seed": "42", "--num-async-eval-ranks": "32", "--dap": "8", "--bp": "2",
                "--init-from": "/data/ckpt.pt", "--num-workers": "6"}  # fmt: skip
    for flag, value in expected.items():
        assert cmd[cmd.index(flag) + 1] == value


def test_run_and_time_plain_data_parallel_needs_no_parallel_flags():
    argv = _run_and_time(PRESET="tiny", DATA_ROOT="/d", RESULTS_ROOT="/r", DAP_SIZE="1", NUM_ASYNC_VAL_RANKS="0")
    assert not {"--dap", "--bp", "--num-async-eval-ranks", "--init-from"} & set(argv)


def test_run_and_time_per_rank_triton_cache_and_nic():
    a = _run_and_time(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_JOB_ID="5", NIC_LIST="mlx5_0,mlx5_3")
    b = _run_and_time(SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_JOB_ID="5", NIC_LIST="mlx5_0,mlx5_3")
    assert a[0] != b[0] and a[0].startswith("TRITON_CACHE_DIR=") and b[0].endswith("_rank1")
    assert a[1] == "UCX_NET_DEVICES=mlx5_0:1" and b[1] == "UCX_NET_DEVICES=mlx5_3:1"


def test_run_and_time_prints_result_and_keeps_the_exit_status(tmp_path):
    """RESULT,OPENFOLD_HPC,,<seconds>,<org>,<start> on rank 0 only; a failing training fails the rank."""
    ok = _bash("./launch/run_and_time.sh", SCALEFOLD_BIN="true", SUBMISSION_ORG="Acme", RESULTS_ROOT=str(tmp_path),
               SLURM_PROCID="0", TRITON_CACHE_ROOT=str(tmp_path))  # fmt: skip
    assert ok.returncode == 0
    assert re.search(r"^RESULT,OPENFOLD_HPC,,\d+,Acme,\d{4}-\d\d-\d\d .+$", ok.stdout, re.MULTILINE), ok.stdout
    other = _bash("./launch/run_and_time.sh", SCALEFOLD_BIN="true", SLURM_PROCID="1", TRITON_CACHE_ROOT=str(tmp_path))
    assert other.returncode == 0 and "RESULT" not in other.stdout
    bad = _bash("./launch/run_and_time.sh", SCALEFOLD_BIN="false", SLURM_PROCID="0", TRITON_CACHE_ROOT=str(tmp_path))
    assert bad.returncode == 1 and "exit status 1" in bad.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_scripts_are_shellcheck_clean():
    scripts = ["run.sub", *sorted(str(p.relative_to(REPO)) for p in LAUNCH.glob("*.sh")), "tests/slurm_setup.sh",
               *sorted(str(p.relative_to(REPO)) for p in (REPO / "data").glob("*.sh"))]  # fmt: skip
    proc = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout
