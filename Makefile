# Two commands: `make serve` and `make test`. Both create .venv when missing.
PYTHON_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: setup build serve test clean

$(STAMP): requirements.txt requirements-dev.txt setup.py pyproject.toml
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=24"
	# the CPU build of torch first, alone, so nothing pulls a CUDA build
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	@touch $@

setup: $(STAMP)

opt_serving/_speedups.so.stamp: $(STAMP) opt_serving/_speedups.pyx
	PYTHON=$(PY) ./build.sh
	@touch $@

build: opt_serving/_speedups.so.stamp

serve: build
	$(PY) -m opt_serving serve --host $(HOST) --port $(PORT)

test: build
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info opt_serving/_speedups*.so opt_serving/_speedups.c opt_serving/*.stamp
