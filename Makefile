# Quick start: `make demo` and `make test`. Both create .venv (Python 3.12) and install
# everything a fresh machine needs (pinned Python packages, bubblewrap for the sandbox).
SHELL := /bin/bash
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	if $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then echo $$p; break; fi; done)
VENV := .venv
PY := $(VENV)/bin/python
export JAX_PLATFORMS ?= cpu
export TF_CPP_MIN_LOG_LEVEL ?= 3
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: venv demo test test-fast test-multidevice lint clean system-deps

venv: $(VENV)/.installed system-deps

$(VENV)/.installed: requirements.lock setup.py
	@test -n "$(PYTHON312)" || { echo "error: python3.12 not found; install Python 3.12 (e.g. pyenv install 3.12)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# bubblewrap isolates model-written code (c2jax/agent/sandbox.py refuses to run without it);
# g++ builds the CPU decode kernel (c2jax/backends/cpu/cpu_kernels.cc; without it decode keeps XLA's path).
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; \
	  else echo "warning: bubblewrap missing; run: sudo apt-get install bubblewrap (make test fails without it unless C2JAX_ALLOW_MISSING=bwrap)"; fi; }
	@command -v g++ >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq g++ >/dev/null; \
	  else echo "warning: g++ missing (CPU kernels off); run: sudo apt-get install g++ (make test fails without it unless C2JAX_ALLOW_MISSING=cpu_kernels)"; fi; }

demo: venv
	$(PY) -m c2jax demo --workdir runs/demo

# Each pytest run first checks for bubblewrap and g++ (tests/conftest.py) and fails, saying how
# to install them, unless C2JAX_ALLOW_MISSING=bwrap,cpu_kernels opts out (their tests then skip).
# Ray tests start a local Ray cluster inside the pytest process (its core worker threads stay
# for the process's life), so they run in their own process, like the 8-device tests. The
# sampler tests run in their own process too: after the rest of the suite, XLA:CPU has crashed
# (SIGSEGV) executing the speculative sampler's decode chunk in the same process, twice at the
# same test; alone they pass. Each group runs on TEST_WORKERS pytest-xdist worker processes
# (2 by default: the suite is mostly single-threaded XLA compiles, so two processes keep both
# cores of a 2-core machine busy; `make test TEST_WORKERS=0` runs each group in one process).
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests --ignore=tests/multidevice --ignore=tests/rl/test_rl_ray.py --ignore=tests/sampling $(PYTEST_ARGS)
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests/sampling $(PYTEST_ARGS)
	$(PY) -m pytest -q tests/rl/test_rl_ray.py $(PYTEST_ARGS)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m pytest -q -n $(TEST_WORKERS) tests/multidevice $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check c2jax pallas_kernels tests experiments configs

clean:
	rm -rf $(VENV) build *.egg-info
