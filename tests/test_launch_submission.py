"""The cluster submission without a cluster: config layouts, run.sub's srun command lines (DRYRUN=1,
incl. the pyxis container flags that cannot run here), run_and_time.sh's env -> flag mapping.

The real submission (sbatch on a local Slurm) is tested in test_slurm_submission.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
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
    drop = {
        *LAYOUT_VARS,
        "CONT",
        "DATADIR",
        "LOGDIR",
        "SEED",
        "SEED_BASE",
        "NEXP",
        "DATESTAMP",
        "LOCAL_RANKS",
        "BP_SIZE",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in drop}
    env.update(extra)
    return env


def _bash(script: str, **env: str) -> subprocess.CompletedProcess:
    # timeout: a hang guard, generous for a loaded box (the scripts take seconds)
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=_clean_env(**env), capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip


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


def _fake_bin(bindir: Path, name: str, body: str) -> None:
    bindir.mkdir(exist_ok=True)
    (bindir / name).write_text(f"#!/bin/bash\n{body}\n")
    (bindir / name).chmod(0o755)


def test_clear_caches_as_root_or_with_sudo_else_fails_naming_the_fix(tmp_path):
    """The per-node cache drop run.sub srun's: writes drop_caches as root, else `sudo -n sysctl`
    (cluster users are rarely root), else fails naming the node, the requirement and CLEAR_CACHES=0.
    Run here on fake files and a fake sudo (nothing touches this machine's page cache)."""
    _, cmds = _dryrun("config_DGXH100_1x8x1x1.sh", CLEAR_CACHES="1")
    (clear,) = [c for c in cmds if "drop_caches" in c[-1]]
    assert _flags(clear) == {"ntasks": "1", "ntasks-per-node": "1"}
    assert clear[-1] == "/proc/sys/vm/drop_caches"
    node_cmd = clear[clear.index("bash") : -1]
    bindir, sudo_log = tmp_path / "bin", tmp_path / "sudo.log"

    def on_node(target: Path, sudo_rc: int) -> subprocess.CompletedProcess:
        _fake_bin(bindir, "sudo", f'printf "%s\\n" "$*" >> {sudo_log}; exit {sudo_rc}')
        env = _clean_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
        return subprocess.run([*node_cmd, str(target)], env=env, capture_output=True, text=True, timeout=60, check=False)

    writable = tmp_path / "drop_caches"
    writable.write_text("")
    root = on_node(writable, sudo_rc=1)
    assert root.returncode == 0 and writable.read_text().strip() == "3" and "cleared the page cache" in root.stdout
    assert not sudo_log.exists()
    user = on_node(tmp_path / "missing" / "drop_caches", sudo_rc=0)
    assert user.returncode == 0 and "cleared the page cache" in user.stdout, user.stderr
    assert sudo_log.read_text().split() == ["-n", "/sbin/sysctl", "-q", "vm.drop_caches=3"]
    denied = on_node(tmp_path / "missing" / "drop_caches", sudo_rc=1)
    assert denied.returncode == 1 and "cleared" not in denied.stdout
    assert "cannot drop the page cache on" in denied.stderr and "passwordless sudo" in denied.stderr
    assert "CLEAR_CACHES=0" in denied.stderr


def test_run_sub_stops_before_training_when_caches_cannot_be_dropped(tmp_path):
    """Under a fake srun (runs its command once, locally): a failed cache drop ends the job with a
    clear message before any training step is launched."""
    bindir = tmp_path / "bin"
    _fake_bin(bindir, "srun", 'echo "srun $*" >> ' + str(tmp_path / "srun.log") + '\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"')
    _fake_bin(bindir, "sudo", "exit 1")
    proc = _bash(
        "source launch/config_DGXH100_1x8x1x1.sh; bash run.sub",
        CONT="none", DATADIR=str(tmp_path), LOGDIR=str(tmp_path / "logs"), SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="9",
        CLEAR_CACHES="1", DROP_CACHES_FILE=str(tmp_path / "missing" / "drop_caches"), SCALEFOLD_DIR=str(REPO),
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "could not drop the page cache before run 1" in proc.stderr and "passwordless sudo" in proc.stderr
    sruns = (tmp_path / "srun.log").read_text().splitlines()
    assert len(sruns) == 1 and "run_and_time.sh" not in sruns[0]
    assert not list((tmp_path / "logs").glob("slurm_*.log"))


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
    assert (
        pairs["--preset"] == "mlperf" and pairs["--store"] == "/data/store.h5" and pairs["--out"] == "/results/run_D_1"
    )
    expected = {"--precision": "bf16", "--max-steps": "1200", "--eval-every": "40", "--target-lddt": "0.8",
                "--seed": "42", "--num-async-eval-ranks": "32", "--dap": "8", "--bp": "2",
                "--init-from": "/data/ckpt.pt", "--num-workers": "6"}  # fmt: skip
    for flag, value in expected.items():
        assert cmd[cmd.index(flag) + 1] == value


@pytest.mark.parametrize("config", sorted(p.name for p in LAUNCH.glob("config_*.sh") if p.name != "config_common.sh"))
def test_every_config_yields_flags_scalefold_train_accepts(config):
    """What run_and_time.sh makes of each config's environment parses with the real `scalefold train`
    parser (flag names, types and choices), with the config's layout."""
    from scalefold.cli import build_parser

    proc = _bash(
        f"set -euo pipefail; source launch/{config}; DRYRUN=1 ./launch/run_and_time.sh",
        INIT_CHECKPOINT="/data/ckpt.pt", SLURM_PROCID="0", DATA_ROOT="/data", RESULTS_ROOT="/results",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    args = build_parser().parse_args(argv[argv.index("scalefold") + 1 :])  # argparse exits on a bad flag
    lay = _layout(config)
    assert args.command == "train" and args.preset == ("tiny" if config == "config_local_cpu.sh" else "mlperf")
    assert (args.dap or 1) == int(lay["DAP_SIZE"])
    assert (args.num_async_eval_ranks or 0) == int(lay["NUM_ASYNC_VAL_RANKS"])
    assert args.init_from == "/data/ckpt.pt" and args.store == "/data/store.h5"


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


def test_throughput_instance_id_reaches_the_mlperf_logger():
    """run.sub's SCALEFOLD_MLPERF_INSTANCE is what `scalefold train` tags its MLPerf events with."""
    from scalefold.mlperf.logger import throughput_instance

    assert throughput_instance({}) is None and throughput_instance({"SCALEFOLD_MLPERF_INSTANCE": ""}) is None
    assert throughput_instance({"SCALEFOLD_MLPERF_INSTANCE": "3"}) == 3
    with pytest.raises(ValueError, match="SCALEFOLD_MLPERF_INSTANCE='x'"):
        throughput_instance({"SCALEFOLD_MLPERF_INSTANCE": "x"})
    _, cmds = _dryrun("config_local_cpu.sh", NUM_INSTANCES="2")
    trains = [c for c in cmds if "--mpi=none" in c]
    assert [c[c.index("srun") - 1] for c in trains] == ["SCALEFOLD_MLPERF_INSTANCE=0", "SCALEFOLD_MLPERF_INSTANCE=1"]


def test_dockerfile_matches_the_submission():
    """The image (not buildable here: no Docker engine) is checked against what run.sub expects of it:
    an NGC PyTorch base, every COPY source present and not excluded from the build context, the
    checkout at the container workdir run.sub runs run_and_time.sh from, the issue's packages and
    defaults."""
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG FROM_IMAGE=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", text, re.MULTILINE)
    assert re.search(r"^FROM \$\{FROM_IMAGE\}$", text, re.MULTILINE)
    ignored = {
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip()[:1] not in ("", "#")
    }
    copies = re.findall(r"^COPY (.+)$", text, re.MULTILINE)
    sources = [src for line in copies for src in line.split()[:-1]]
    assert {"pyproject.toml", "scalefold", "launch", "run.sub"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists() and src not in ignored, src
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", text, re.MULTILINE)
    run_sub = (REPO / "run.sub").read_text()
    assert f"RUN_AND_TIME={workdir}/launch/run_and_time.sh" in run_sub
    assert f"--container-workdir={workdir}" in run_sub
    for needed in ("kalign", "mlperf-logging", "mpi]", "PIP_NO_CACHE_DIR=1", "OMP_NUM_THREADS=1"):
        assert needed in text, needed


# ----------------------------------------------------------------------------------------------
# data/ scripts
# ----------------------------------------------------------------------------------------------


def _scalefold_bin() -> str:
    found = shutil.which("scalefold", path=str(Path(sys.executable).parent)) or shutil.which("scalefold")
    if found is None:
        pytest.skip("the `scalefold` console script is not installed")
    return found


def test_preprocess_script_builds_a_store_from_the_download_layout(data_dir, tmp_path):
    """data/preprocess.sh raw on the layout the download scripts produce: gzipped mmCIF under
    PDB_DIR/raw/<xy>/, OpenProteinSet chains with a3m/ subdirectories, one chain stored once for a
    group of identical chains (duplicate_pdb_chains.txt), the RCSB cluster file."""
    pdb, ops = tmp_path / "pdb_mmcif", tmp_path / "open_protein_set"
    (pdb / "raw" / "q2").mkdir(parents=True)
    (pdb / "raw" / "q2" / "2q2k.cif.gz").write_bytes(gzip.compress((data_dir / "mmcif" / "2q2k.cif").read_bytes()))
    (pdb / "clusters-by-entity-40.txt").write_text("1ABC_1 2Q2K_2\n3ZEE_1\n")  # 2q2k entity 2 = chains A, B
    chain_dir = ops / "pdb" / "2q2k_A" / "a3m"
    chain_dir.mkdir(parents=True)
    for f in (data_dir / "alignments" / "2q2k_A").iterdir():
        shutil.copy(f, chain_dir / f.name)
    (ops / "duplicate_pdb_chains.txt").write_text("2q2k_A 2q2k_B\n")  # B has no directory of its own
    store = tmp_path / "store.h5"
    proc = subprocess.run(["bash", "data/preprocess.sh", "raw", str(pdb), str(ops), str(store)], cwd=REPO,
                          env=_clean_env(WORKERS="1", SCALEFOLD=_scalefold_bin(), PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chain directories, 1 duplicate chains linked" in proc.stdout
    assert (tmp_path / "store.h5.alignments" / "2q2k_B").resolve() == (tmp_path / "store.h5.alignments" / "2q2k_A")
    stats = dict(re.findall(r"^\s*(\w+): (.+)$", proc.stdout, re.MULTILINE))  # `scalefold data-stats` output
    assert (stats["chains"], stats["chains_without_msa"], stats["clustered_chains"]) == ("2", "0", "2")
    report = json.loads((tmp_path / "store.h5.report.json").read_text())
    assert report["chains_written"] == 2 and report["chains_skipped"] == 0


def test_preprocess_script_names_what_is_missing(tmp_path):
    usage = _bash("bash data/preprocess.sh raw only-two-args x")
    assert usage.returncode == 2 and "usage:" in usage.stderr
    (tmp_path / "ops" / "pdb").mkdir(parents=True)
    proc = _bash(f"bash data/preprocess.sh raw {tmp_path / 'nopdb'} {tmp_path / 'ops'} {tmp_path / 's.h5'}",
                 SCALEFOLD="false", PYTHON=sys.executable)  # fmt: skip
    assert proc.returncode == 1 and f"{tmp_path / 'nopdb'}/raw not found" in proc.stderr


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("sha256sum") is None, reason="needs curl, sha256sum")
def test_download_mlperf_refuses_a_checkpoint_with_the_wrong_sha256(tmp_path):
    """The checkpoint only lands at its final name when its sha256 is the benchmark's; a corrupt
    download is kept aside as .bad with both hashes in the error."""
    server = tmp_path / "server"
    server.mkdir()
    (server / "mlperf_hpc_openfold_resumable_checkpoint_b518be46.pt").write_bytes(b"not the checkpoint")
    out = tmp_path / "out"
    proc = _bash(f"bash data/download_mlperf.sh {out}", MLPERF_DATA_URL=f"file://{server}")
    assert proc.returncode == 1
    assert (
        "sha256 mismatch" in proc.stderr
        and "b518be4677048f2c0f94889c91e2da73655a73b825a8aa7f8b6f5e580d8ffbed" in proc.stderr
    )
    assert sorted(p.name for p in out.iterdir()) == ["mlperf_hpc_openfold_resumable_checkpoint.pt.bad"]
    missing = _bash(f"bash data/download_mlperf.sh {tmp_path / 'out2'}", MLPERF_DATA_URL=f"file://{tmp_path}/nothing")
    assert missing.returncode != 0 and not (tmp_path / "out2" / "mlperf_hpc_openfold_resumable_checkpoint.pt").exists()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_scripts_are_shellcheck_clean():
    scripts = ["run.sub", *sorted(str(p.relative_to(REPO)) for p in LAUNCH.glob("*.sh")), "tests/slurm_setup.sh",
               *sorted(str(p.relative_to(REPO)) for p in (REPO / "data").glob("*.sh")), ".ci/run", ".ci/floor.sh"]  # fmt: skip
    proc = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout


def test_every_run_and_instance_of_a_job_gets_its_own_seed():
    """MLPerf's seed checker refuses a seed twice in one package: run r, instance i of a job has SEED_BASE +
    (r - 1) * NUM_INSTANCES + i (SEED_BASE defaults to SEED); the run directories run_<DATESTAMP>_<r>[_<i>]."""
    out, cmds = _dryrun("config_local_cpu.sh", NEXP="2", NUM_INSTANCES="2", SEED="100")
    assert re.findall(r"run (\d)/2 seed (\S+) \(one per instance\)", out) == [("1", "100-101"), ("2", "102-103")]
    trains = [c for c in cmds if "--mpi=none" in c]
    seeds = [next(a for a in c if a.startswith("SEED=")) for c in trains]
    dirs = [next(a for a in c if a.startswith("RUN_OUT=")).rsplit("/", 1)[1] for c in trains]
    assert seeds == ["SEED=100", "SEED=101", "SEED=102", "SEED=103"]
    assert dirs == ["run_D_1_0", "run_D_1_1", "run_D_2_0", "run_D_2_1"]
    out, _ = _dryrun("config_DGXH100_1x8x1x1.sh", NEXP="3", SEED="7")
    assert re.findall(r"run \d/3 seed (\d+)", out) == ["7", "8", "9"]
