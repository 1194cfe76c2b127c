# ScaleFold container: NGC PyTorch base (H100-ready CUDA, cuDNN, NCCL, Triton, PyTorch).
#
#   docker build -t scalefold:latest .                                   # or: podman build
#   enroot import -o scalefold.sqsh dockerd://scalefold:latest           # for Slurm + pyxis
#   CONT=$PWD/scalefold.sqsh source launch/config_<SYSTEM>.sh && sbatch -N $DGXNNODES -t $WALLTIME run.sub
#
# run.sub mounts the dataset read-only at /data and the results directory at /results, and runs
# /workspace/scalefold/launch/run_and_time.sh on every rank.
#
# Base image: NGC PyTorch 25.12, which carries torch 2.10.0a0+b4e4ee81d3 (NVIDIA's 25.12 release notes)
# and NVIDIA's Triton build for it. ScaleFold is tested with torch 2.6 to 2.13 and Triton 3.2 to 3.9
# (CI runs both ends: torch 2.13.0 / triton 3.9.0, and the floor torch 2.6.0 / triton 3.2.0), so the
# build first checks the image's torch and Triton against that range (scalefold/tested_versions.py)
# and stops outside it. (The previous base, 25.01, ships torch 2.6.0a0: a snapshot from before 2.6.0.)
# A site image given as FROM_IMAGE passes the same check.
ARG FROM_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${FROM_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    TRITON_CACHE_DIR=/tmp/scalefold_triton \
    DEBIAN_FRONTEND=noninteractive

# Kalign realigns template hits to the query (data pipeline); numactl binds ranks to NUMA nodes.
RUN apt-get update \
 && apt-get install -y --no-install-recommends kalign numactl \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/scalefold
# The base image's torch (a pre-release build such as 2.10.0a0+...) is pinned so pip never replaces
# it with a PyPI wheel, and its Triton is used as it is (no `triton` extra: a PyPI triton would shadow
# NVIDIA's build); mpi4py builds against the image's HPC-X Open MPI.
COPY pyproject.toml README.md LICENSE ./
COPY scalefold ./scalefold
RUN python -m scalefold check-versions \
 && python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-pin.txt \
 && pip install --constraint /tmp/torch-pin.txt ".[mpi]" "mlperf-logging>=3.0" \
 && python -c "import scalefold, mlperf_logging, mpi4py; print('scalefold', scalefold.__version__)" \
 && rm /tmp/torch-pin.txt

COPY launch ./launch
COPY data ./data
COPY run.sub ./
RUN chmod +x launch/run_and_time.sh data/*.sh
