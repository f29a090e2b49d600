# Every set-up step lives here: `make test` on a fresh machine installs what it needs and runs the suite.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
EXT    := $(wildcard cpp_ext/*.cpp cpp_ext/*.h)
PYTEST ?= $(PY) -m pytest

.PHONY: test stress demo bench cluster lint install zmq-dev clean

test: install
	$(PYTEST) -q tests -m "not slow"

stress: install
	$(PYTEST) -q tests -m slow

demo: install
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/train_ddp.py --steps 30
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/train_ddp.py --steps 30 --backend gloo

bench: install
	$(PY) benchmarks/pushpull.py --quick

cluster: install
	$(PY) -m benchmarks.cluster --quick

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

zmq-dev:
	@test -f /usr/include/zmq.h || (apt-get update -qq && apt-get install -y -qq libzmq3-dev) \
	  || (echo "install Debian's libzmq3-dev (headers for libzmq) and retry" && exit 1)

torch_bps/_C.stamp: $(STAMP) $(EXT) setup.py | zmq-dev
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf build *.egg-info torch_bps/_C*.so torch_bps/_C.stamp
