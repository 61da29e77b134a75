"""Every script in bench/ and tools/ is in step with today's API: it compiles, and every slabstage name it
uses exists (`import slabstage as ss` then `ss.NAME`, `from slabstage.x import NAME`). Shell scripts pass
`bash -n`. The GPU scripts cannot run here; this keeps them from drifting onto names that are gone.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
from pathlib import Path

import pytest

import slabstage

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("tools/*.py")])
SHELL = sorted(ROOT.glob("tools/*.sh"))


def _missing_names(tree: ast.AST) -> list[str]:
    aliases = {}  # local name -> module of slabstage
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "slabstage" or a.name.startswith("slabstage."):
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "slabstage":
            mod = importlib.import_module(node.module)
            for a in node.names:
                if a.name != "*" and not hasattr(mod, a.name):
                    try:
                        importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        missing.append(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            mod = importlib.import_module(aliases[node.value.id])
            if not hasattr(mod, node.attr):
                missing.append(f"{aliases[node.value.id]}.{node.attr}")
    return missing


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_compiles_and_uses_existing_names(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    compile(tree, str(path), "exec")
    assert not _missing_names(tree), f"{path.name} uses names slabstage no longer has: {_missing_names(tree)}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("path", SHELL, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_script_parses(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


BENCH_SHARED = {"conftest.py", "peer_lightllm.py", "run.py", "report.py", "nvtx_workload.py"}  # code for the
# suites, their runner and report, the profiling entry point


def test_bench_holds_suites():
    """Every other file of bench/ is a pytest-benchmark suite ``bench_<name>.py``: tests, and no results of its
    own (they go to pytest-benchmark's JSON through ``python bench/run.py``)."""
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name in BENCH_SHARED:
            continue
        assert path.name.startswith("bench_"), f"bench/{path.name} is neither a suite nor shared code"
        tree = ast.parse(path.read_text())
        tests = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        assert tests, f"bench/{path.name} has no test"
        assert '"--out"' not in path.read_text(), f"bench/{path.name} writes results of its own"


def test_scripts_found():
    assert len(SCRIPTS) >= 10 and SHELL and slabstage.__file__
