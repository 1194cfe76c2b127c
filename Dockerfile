# ScaleFold container (NGC PyTorch base: H100-ready CUDA, NCCL, Triton).
# STUB: the full image (kalign, mpi4py, DALI extra, tuned defaults) is built by the HPC-submission
# issue; this file already produces a working image with the package and its runtime extras.
ARG FROM_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${FROM_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    OMP_NUM_THREADS=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /workspace/scalefold
COPY pyproject.toml README.md ./
COPY scalefold ./scalefold
RUN pip install ".[triton,mpi]"
COPY launch ./launch
