# Two commands: `make serve` and `make test`. Both create .venv when missing.
PYTHON_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# the suite's files run in two processes (pytest-xdist; a file's tests stay together, with their module
# fixtures): most tests wait on servers, Ray and child processes, and one process kept one core busy
TEST_WORKERS ?= 2
# GPU=cuda12 / GPU=cuda13: also install JAX's CUDA 12 / CUDA 13 plugin (requirements-gpu*.txt) for NVIDIA GPUs
GPU ?=

.PHONY: setup build serve test clean

# serving's packages (requirements.txt: no torch, no test tools); `make test` adds requirements-dev.txt's
$(STAMP): requirements.txt setup.py pyproject.toml
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	# setuptools 70 and newer build the editable install without the wheel package (--no-build-isolation)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=24" "setuptools>=70"
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	@touch $@

$(TEST_STAMP): requirements-dev.txt | $(STAMP)
	# the [torch] extra (tests, the .pt converter), the CPU build first, alone, so nothing pulls a CUDA build
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	@touch $@

$(VENV)/.gpu-cuda12: requirements-gpu.txt | $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-gpu.txt
	@touch $@

$(VENV)/.gpu-cuda13: requirements-gpu-cuda13.txt | $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-gpu-cuda13.txt
	@touch $@

GPU_STAMP := $(if $(GPU),$(VENV)/.gpu-$(GPU),)
ifneq ($(GPU),)
ifeq ($(filter cuda12 cuda13,$(GPU)),)
$(error GPU=$(GPU): the supported values are GPU=cuda12 and GPU=cuda13)
endif
endif

setup: $(STAMP) $(GPU_STAMP)

# The web page test drives Debian's headless Chromium. Installed when missing and
# we may (root, apt available); otherwise that one test skips with its reason.
$(VENV)/.chromium: | $(TEST_STAMP)
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium for the web page test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
	    || echo "chromium install failed: tests/test_service_chromium.py will skip"; \
	fi
	@touch $@

opt_serving/_speedups.so.stamp: $(STAMP) $(GPU_STAMP) opt_serving/_speedups.pyx $(wildcard opt_serving/csrc/*) build.sh
	PYTHON=$(PY) ./build.sh
	@touch $@

build: opt_serving/_speedups.so.stamp

serve: build
	$(PY) -m opt_serving serve --host $(HOST) --port $(PORT)

test: build $(TEST_STAMP) $(VENV)/.chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info opt_serving/_speedups*.so opt_serving/_cpu_kernels.so opt_serving/_speedups.c opt_serving/*.stamp
