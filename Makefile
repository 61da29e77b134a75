# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Setup keeps a torch already importable by $(PYTHON) (a CUDA build, say) and
# otherwise installs the CPU build pinned below, never a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slabstage-installed
CPU_TORCH ?= torch==2.13.0
CPU_TRITON ?= triton==3.6.0
PYTEST_ARGS ?=

.PHONY: setup demo test lint bench bench-report profile clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "setup: keeping the torch that $(PYTHON) already has"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
	  echo "setup: installing $(CPU_TORCH) (CPU build) and $(CPU_TRITON)"; \
	  $(PY) -m pip install -q --no-compile --disable-pip-version-check "$(CPU_TORCH)" "$(CPU_TRITON)"; \
	fi
	$(PY) -m pip install -q --no-compile --disable-pip-version-check -e ".[test,bench]"
	@# bytecode for what was installed, on every core (pip compiles one file at a time: 4x longer); a file
	@# that is not Python 3 (a template, test data) fails to compile and is left as it is
	@$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
	@touch $(STAMP)

demo: setup
	$(PY) -m slabstage demo

# ruff first (configured in pyproject.toml), then the suite, one worker a core (pytest-xdist);
# tests/project/test_packaging.py builds and installs the wheel.
test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -n auto $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .

bench: setup
	$(PY) -m slabstage.bench run

bench-report: setup
	$(PY) -m slabstage.bench report

profile: setup
	$(PY) bench/nvtx_workload.py

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks .hypothesis .ruff_cache build dist
