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
# Bytecode: setup compiles what the tests import, on every core, leaving out what nothing here imports (the
# model folders of other families, parts of sympy, plotting, installers' own code, packages' tests): about
# 20-24 s on 2 cores, against 41 for all that was installed. Python writes the rest as it imports it,
# whatever the environment says (PYTHONDONTWRITEBYTECODE would have every test process compile torch again:
# 10 s an import, against 3.5).
unexport PYTHONDONTWRITEBYTECODE
NOT_IMPORTED := /transformers/models/(?!(auto|llama|qwen2|qwen3|qwen2_vl|qwen2_5_vl|qwen3_vl|qwen3_vl_moe|gpt2)/)|/transformers/(exporters|pipelines|cli|data)/|/sympy/(physics|combinatorics|stats|vector|codegen|categories|holonomic|crypto|diffgeom|liealgebras|unify)/|/torch/testing/_internal/|/(pip|setuptools|networkx|fontTools|matplotlib|mpl_toolkits|PIL|uv|_vendor|tests?|benchmarks)/

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
	@$(PY) -m compileall -q -j 0 -x '$(NOT_IMPORTED)' \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
	@touch $(STAMP)

demo: setup
	$(PY) -m slabstage demo
	$(PY) -m slabstage demo --model qwen3-vl

# ruff first (configured in pyproject.toml), then the suite, one worker a core (pytest-xdist), a test file to
# a worker (a tensor-parallel module's ranks are then spawned by the worker that runs it: none waits for them);
# tests/project/test_packaging.py builds and installs the wheel.
test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -n auto --dist loadfile $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .

bench: setup
	$(PY) bench/run.py

bench-report: setup
	$(PY) bench/report.py --readme README.md

profile: setup
	$(PY) bench/nvtx_workload.py

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks .hypothesis .ruff_cache build dist
