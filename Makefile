# Every set-up step lives here: `make test` on a fresh machine installs what it needs and runs the suite.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
XDIST_STAMP := $(VENV)/.xdist
EXT    := $(shell find cpp_ext -name '*.cpp' -o -name '*.h')
PYTEST ?= $(PY) -m pytest
# Tests at once (pytest-xdist): most of the suite's time is processes waiting (start-ups, timeouts, heartbeats), so
# two fill 2 cores. No test may depend on another having run before it in the same process.
TEST_JOBS ?= 2

.PHONY: test stress demo bench cluster chaos lint install zmq-dev clean deploy-tools deploy-check frameworks torch-suite gpu-wheels gpu-deps gpu-build gpu-test gpu-bench gpu-check gpu-compat

test: install deploy-tools $(XDIST_STAMP)
	$(PYTEST) -q -n $(TEST_JOBS) --durations=15 tests -m "not slow"

stress: install
	$(PYTEST) -q tests -m slow

# "byteps", gloo, then gloo with no communication at all (the most any backend could reach on this model), and the
# share of that bound each reaches.
demo: install
	$(PY) benchmarks/demo_share.py --rounds 1

bench: install
	$(PY) benchmarks/pushpull.py --quick

cluster: install
	$(PY) -m benchmarks.cluster --quick

# The nemesis (benchmarks/chaos.py, its faults in benchmarks/chaos_nemesis.py): WORKLOAD (ddp, backup, async) trains
# for MINUTES under a seeded schedule of faults, then the checker's table. Link faults need root and iproute2 (network
# namespaces); else they are skipped.
# REBALANCE: steps between rebalances (ddp, async; 0: none); NETNS=0: loopback even where namespaces are available.
SEED ?= 1
MINUTES ?= 5
WORKLOAD ?= ddp
REBALANCE ?= 0
NETNS ?= 1
chaos: install
	mkdir -p results
	$(PY) -m benchmarks.chaos run --workload $(WORKLOAD) --seed $(SEED) --minutes $(MINUTES) \
	  --rebalance-every $(REBALANCE) $(if $(filter 0,$(NETNS)),--no-netns) --record results/chaos-$(WORKLOAD)-$(SEED).jsonl

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

install: $(STAMP) torch_bps/_C.stamp

# torch==2.13.0 (CPU, a wheel on disk here) goes in first: a bare `torch` requirement pulls a CUDA build.
$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "pyzmq>=25" numpy "triton==3.9.0" pytest pytest-timeout hypothesis ruff matplotlib
	touch $@

# pytest-xdist for `make test`, in a stamp of its own: a venv made before it came gets it without a rebuild.
$(XDIST_STAMP): $(STAMP)
	$(PIP) install -q pytest-xdist
	touch $@

# What tests/deploy needs besides the package (docs/deploy.md): TorchX and a Kubernetes schema validator in the venv,
# kubectl (its `kustomize`) from Debian. Without kubectl the manifest tests skip, saying so.
DEPLOY_STAMP := $(VENV)/.deploy-tools
deploy-tools: $(DEPLOY_STAMP)

$(DEPLOY_STAMP): $(STAMP)
	$(PIP) install -q "torchx>=0.7" "kubernetes-validate>=1.32"
	@command -v kubectl >/dev/null || (apt-get update -qq && apt-get install -y -qq kubectl) \
	  || echo "kubectl not installed (Debian: apt-get install kubectl): the manifest tests will skip"
	touch $@

# Every deploy check, the slow ones too: the wheel built from scratch in a fresh venv (minutes: the whole C++ client).
deploy-check: install deploy-tools
	$(PYTEST) -q -rs tests/deploy

# Three training frameworks on "byteps" against gloo (examples/frameworks/): installed into the venv beside torch
# 2.13.0 (named, so pip keeps it), then tests/frameworks, which `make test` skips where they are not installed.
frameworks: install
	$(PIP) install -q torch==2.13.0 lightning accelerate pytorch-ignite
	$(PYTEST) -q -rs tests/frameworks

# torch's own distributed test-suite with "byteps" as the default group (tests/torch_suite/): tens of minutes, so
# not in `make test`. expecttest is what the suite needs to import.
torch-suite: install
	$(PIP) install -q torch==2.13.0 expecttest
	$(PY) tests/torch_suite/run.py

zmq-dev:
	@test -f /usr/include/zmq.h || (apt-get update -qq && apt-get install -y -qq libzmq3-dev) \
	  || (echo "install Debian's libzmq3-dev (headers for libzmq) and retry" && exit 1)

torch_bps/_C.stamp: $(STAMP) $(EXT) setup.py | zmq-dev
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf build *.egg-info torch_bps/_C*.so torch_bps/_C.stamp $(GPU_DIR)

# --- A GPU machine: CUDA, torch and triton preinstalled, no network -----------------------------------------
# These targets use the machine's own Python (GPU_PY), never .venv, and never install torch or triton. What it
# lacks comes from a wheelhouse made by `make gpu-wheels` on a machine with network and carried along (docs/gpu.md),
# installed with pip --no-index into $(GPU_DIR)/deps. The C++ client builds in place (torch_bps/_C*.so) against the
# installed torch, with the system's libzmq headers or, without them, pyzmq's bundled libzmq and
# cpp_ext/vendor/zmq/zmq.h. Do not share one checkout between `make test` and these targets on the same Python
# version: both build the same torch_bps/_C*.so.
GPU_PY      ?= python3
GPU_DIR     ?= .gpu
WHEELHOUSE  ?= wheelhouse
# The lent GPU machine (Python 3.12, torch 2.11, Triton 3.6, numpy, pytest, pytest-timeout, ninja) lacks only pyzmq:
# one cp312 abi3 wheel, ~0.9 MB. A machine lacking more: GPU_WHEELS="pyzmq==27.3.0 numpy pytest pytest-timeout ninja".
GPU_PYTHONS ?= 3.12
GPU_WHEELS  ?= pyzmq==27.3.0
GPU_ARCH    ?= x86_64
WHEELS_PIP  ?= python3 -m pip
GPU_TEST_ARGS  ?=
GPU_BENCH_ARGS ?=
GPU_BENCH_JSON ?= results/gpu.json
# deps/bin: ninja from the wheelhouse, so torch's BuildExtension compiles the C++ files in parallel.
GPU_ENV      = PYTHONPATH="$(CURDIR)/$(GPU_DIR)/deps:$(CURDIR)" PATH="$(CURDIR)/$(GPU_DIR)/deps/bin:$$PATH"

# Online, anywhere: the wheels GPU_WHEELS for every Python in GPU_PYTHONS (pyzmq has one wheel per version up to 3.11
# and one abi3 wheel for 3.12 on). The folder is gitignored: name it in the device call's carry (docs/gpu.md).
gpu-wheels:
	for v in $(GPU_PYTHONS); do \
	  $(WHEELS_PIP) download --quiet --no-deps --only-binary=:all: --python-version $$v --implementation cp \
	    --platform manylinux_2_28_$(GPU_ARCH) --platform manylinux_2_27_$(GPU_ARCH) --platform manylinux2014_$(GPU_ARCH) \
	    --dest $(WHEELHOUSE) $(GPU_WHEELS) || exit 1; done
	@echo "wheelhouse: $(WHEELHOUSE) ($$(ls $(WHEELHOUSE) | wc -l) wheels, $$(du -sh $(WHEELHOUSE) | cut -f1)); carry it to the GPU machine"

gpu-deps:
	$(GPU_ENV) $(GPU_PY) tests/gpu/preflight.py deps --wheelhouse $(WHEELHOUSE) --target $(GPU_DIR)/deps

gpu-build: gpu-deps
	$(GPU_ENV) $(GPU_PY) tests/gpu/preflight.py build
	$(GPU_ENV) $(GPU_PY) setup.py --quiet build_ext --inplace --build-temp $(GPU_DIR)/build
	$(GPU_ENV) $(GPU_PY) -c "import torch_bps._C"

# Fails where no GPU is found too, after the suite ran (every test skipped, with its reason), its last line saying
# so: a CPU box never passes. A failing suite fails first.
gpu-test: gpu-build
	$(GPU_ENV) $(GPU_PY) -m pytest -q -rs -p no:cacheprovider tests/gpu -m cuda $(GPU_TEST_ARGS); status=$$?; \
	  $(GPU_ENV) $(GPU_PY) tests/gpu/preflight.py cuda; gpu=$$?; \
	  if [ $$status -ne 0 ]; then exit $$status; fi; exit $$gpu

gpu-bench: gpu-build
	$(GPU_ENV) $(GPU_PY) tests/gpu/preflight.py cuda
	mkdir -p $(dir $(GPU_BENCH_JSON))
	$(GPU_ENV) $(GPU_PY) benchmarks/gpu.py $(GPU_BENCH_ARGS) --json $(GPU_BENCH_JSON)

# One command for a lent GPU machine (one GPU, no network, no make needed: the script is what runs there): the first
# GPU hour's steps, most valuable first, each under its own limit in a 540 s budget, one report rewritten after every
# step (OUT/gpu-check.json and .txt). On CPU: TORCH_BPS_TEST_DEVICE=cpu TRITON_INTERPRET=1 make gpu-check OUT=dir.
gpu-check:
	@test -n "$(OUT)" || { echo "usage: make gpu-check OUT=dir [GPU_PY=python]"; exit 2; }
	$(GPU_PY) tests/gpu/check.py --out "$(OUT)" --python "$(GPU_PY)" $(GPU_CHECK_ARGS)

# Here, without a GPU (downloads ~0.9 GB; not part of `make test`): the C++ client compiled and linked against the
# lent machine's torch (its wheel's headers and libraries), and every Triton kernel compiled ahead of time for sm_80
# and sm_90 with its Triton, in a scratch venv (torch 2.13 CPU beside it: Triton 3.6 needs no particular torch).
COMPAT_DIR    ?= $(GPU_DIR)/compat
COMPAT_TORCH  ?= 2.11.0
COMPAT_TRITON ?= 3.6.0
gpu-compat: $(STAMP) | zmq-dev
	mkdir -p $(COMPAT_DIR)
	ls $(COMPAT_DIR)/torch-$(COMPAT_TORCH)-*.whl >/dev/null 2>&1 || \
	  PIP_CONSTRAINT= $(PIP) download --quiet --no-deps --only-binary=:all: -d $(COMPAT_DIR) torch==$(COMPAT_TORCH)
	$(PY) tests/gpu/preflight.py compat --torch-wheel $$(ls $(COMPAT_DIR)/torch-$(COMPAT_TORCH)-*.whl | head -1) \
	  --work $(COMPAT_DIR)
	test -x $(COMPAT_DIR)/triton-$(COMPAT_TRITON)/bin/python || python3 -m venv $(COMPAT_DIR)/triton-$(COMPAT_TRITON)
	$(COMPAT_DIR)/triton-$(COMPAT_TRITON)/bin/pip install -q torch==2.13.0 triton==$(COMPAT_TRITON) numpy pytest \
	  pytest-timeout
	PYTHONPATH=$(CURDIR) $(COMPAT_DIR)/triton-$(COMPAT_TRITON)/bin/python -m pytest -q -p no:cacheprovider \
	  --noconftest tests/kernels/test_triton_aot.py
