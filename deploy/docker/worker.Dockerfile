# syntax=docker/dockerfile:1
# Workers: a PyTorch image with torch_bps built against its torch (CUDA). Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t torch-bps/worker:0.1.0 .
# The base must be a -devel image (the build needs the compiler and torch's headers) whose torch setup.py
# accepts (>=2.13,<2.15); the BASE tag below is an example: pick your CUDA's. Workers take BPS_SERVERS and the
# pool credential (BPS_POOL_CREDENTIAL, from a Secret) from the environment; see deploy/k8s/examples/jobset and
# docs/deploy.md. Not built on the development machines (no Docker daemon, no registry there).

ARG BASE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-devel
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends g++ libzmq3-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/torch_bps
COPY setup.py pyproject.toml ./
COPY cpp_ext cpp_ext
COPY torch_bps torch_bps
COPY triton_kernels triton_kernels
COPY examples examples
# --no-build-isolation: against the image's own torch; --no-deps: never replace it (pip would see no other change).
RUN pip install --no-cache-dir "setuptools>=70.1" ninja "pyzmq>=25" numpy \
 && MAX_JOBS=4 pip install --no-cache-dir --no-build-isolation --no-deps . \
 && python -c "import torch_bps, torch_bps._C; print('torch_bps', torch_bps.__version__)"
RUN useradd --uid 10001 --user-group --create-home bps
ENV PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/bps
# 29500: torchrun's c10d rendezvous (on the first node)
EXPOSE 29500
CMD ["torchrun", "--help"]
