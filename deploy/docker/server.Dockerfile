# syntax=docker/dockerfile:1
# The CPU summation server, bps-server. Build from the repository root:
#   docker build -f deploy/docker/server.Dockerfile -t torch-bps/server:0.1.0 .
# Run (the pool credential from a file, or from the environment: -e BPS_POOL_CREDENTIAL):
#   docker run --network host -v "$PWD/credential:/etc/bps/credential:ro" torch-bps/server:0.1.0 \
#     --host=0.0.0.0 --port=9000 --metrics-port=9100 --credential-file=/etc/bps/credential
# --network host: besides its ports 9000 (push/pull) and 9100 (/metrics, /healthz, /readyz), the server listens for
# the stream transport on a second port it picks at start; behind `-p` port mapping give it --stream off.
# See docs/deploy.md. Not built on the development machines (no Docker daemon there); the same steps run there as
# `make deploy-check`'s wheel test.

ARG PYTHON=3.11
ARG TORCH=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# -- build the wheel against the CPU torch the image will run
FROM python:${PYTHON}-slim AS build
ARG TORCH
ARG TORCH_INDEX
RUN apt-get update && apt-get install -y --no-install-recommends g++ libzmq3-dev && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH}" \
 && pip install --no-cache-dir "setuptools>=70.1" ninja "pyzmq>=25" numpy
WORKDIR /src
COPY setup.py pyproject.toml ./
COPY cpp_ext cpp_ext
COPY torch_bps torch_bps
COPY triton_kernels triton_kernels
RUN MAX_JOBS=4 pip wheel --no-build-isolation --no-deps --wheel-dir /wheels .

# -- run: torch (CPU), pyzmq, numpy and the wheel; no compiler, no headers, no triton (the server never imports it)
FROM python:${PYTHON}-slim
ARG TORCH
ARG TORCH_INDEX
RUN apt-get update && apt-get install -y --no-install-recommends libzmq5 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp bps
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH}" \
 && pip install --no-cache-dir "pyzmq>=25" numpy
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels
ENV HOME=/tmp PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
USER 10001:10001
# 9000: push/pull (ZeroMQ); 9100: --metrics-port (Prometheus /metrics and the probes /healthz, /readyz)
EXPOSE 9000 9100
# SIGTERM drains (--drain-timeout, default 20 s): no new job, the rounds in flight finish, exit 0.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/healthz', timeout=2)"]
ENTRYPOINT ["bps-server"]
CMD ["--host=0.0.0.0", "--port=9000", "--metrics-port=9100"]
