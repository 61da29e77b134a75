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
# Python writes the bytecode of what it imports as it goes (the first process to import torch compiles it,
# every later one reads it): an environment that says PYTHONDONTWRITEBYTECODE would have every test process
# compile torch again (10 s an import, against 3.5), and compiling all that was installed takes longer still.
unexport PYTHONDONTWRITEBYTECODE

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
	@# the rest through uv when it installs (downloads and unpacks in parallel: a quarter of pip's time), else pip;
	@# not beside a system torch (uv would not see it there and could fetch a CUDA build)
	@if grep -q "include-system-site-packages = false" $(VENV)/pyvenv.cfg && \
	    $(PY) -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then \
	  $(VENV)/bin/uv pip install -q --python $(PY) -e ".[test,bench]"; \
	else \
	  $(PY) -m pip install -q --no-compile --disable-pip-version-check -e ".[test,bench]"; \
	fi
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
