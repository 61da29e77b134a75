"""Every script in tools/ is kept in step with today's code on a CPU machine, though most of them run on a GPU.

Each script has one check here or in the test named in ``CHECKS``: a Python script answers ``--help``
(and runs a CPU mode where it has one); a shell script names only files that exist, Python modules that
import, and options its Python scripts and slabstage's commands take; the phases ``gpu_run_phases.sh``
runs are the ones tools/README.md lists. (``tests/project/test_scripts.py`` parses the shell scripts with
``bash -n`` and checks the slabstage names every Python script uses.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
README = (TOOLS / "README.md").read_text()

# each script in tools/ and where its CPU check lives
CHECKS = {
    "compile_stage_kernel.py": "tests/ops/test_stage_kernel_codegen.py",  # compiles for sm_90, counts 16-byte loads
    "sanitize_workload.py": "tests/project/test_sanitize_workload.py",  # --small runs to its OK line
    "probe_capture_memory.py": __name__,
    "probe_graph_launch.py": __name__,
    "probe_replay_record.py": __name__,
    "gpu_full_pass.sh": __name__,
    "gpu_hf.sh": __name__,
    "gpu_run_phases.sh": __name__,
    "gpu_sanitize.sh": __name__,
}
PYTHON = sorted(n for n in CHECKS if n.endswith(".py"))
SHELL = sorted(n for n in CHECKS if n.endswith(".sh"))
PATH_RE = re.compile(r"\b((?:tools|bench|tests|examples)/[\w./-]+\.(?:py|sh))\b")
SCRIPT_RUN_RE = re.compile(r"python3?\s+((?:tools|bench|examples)/[\w./-]+\.py)([^;|&>)]*)")
MODULE_RUN_RE = re.compile(r"python3?\s+-m\s+([\w.]+)([^;|&>)]*)")
OPTION_RE = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")


def _shell(name: str) -> str:
    return (TOOLS / name).read_text().replace("\\\n", " ")  # continued lines as one


def _module_source(module: str, base: Path = ROOT) -> str:
    """The source of a slabstage module, or of every module of a slabstage package (of ``base``)."""
    folder = base / Path(*module.split("."))
    files = sorted(folder.glob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]
    return "".join(f.read_text() for f in files if f.is_file())


def _script_source(path: str) -> str:
    """A script's source and that of the slabstage modules it imports from (a thin script's parser lives there;
    bench/'s scripts' in the benchmark harness beside them)."""
    text = (ROOT / path).read_text()
    text += "".join(_module_source(m) for m in re.findall(r"^from (slabstage[\w.]*) import", text, re.M))
    return text + "".join(_module_source(m, ROOT / "bench") for m in re.findall(r"^from (harness[\w.]*) import",
                                                                              text, re.M))


def test_every_script_in_tools_has_a_check_and_a_line_in_the_readme():
    found = {p.name for p in TOOLS.iterdir() if p.is_file() and p.name != "README.md"}
    assert found == set(CHECKS), f"scripts without a check: {found - set(CHECKS)}; gone: {set(CHECKS) - found}"
    for name in CHECKS:
        assert f"`{name}" in README, f"tools/README.md does not list {name}"


@pytest.mark.parametrize("name", sorted(n for n, t in CHECKS.items() if t != __name__))
def test_the_test_that_checks_it_runs_it(name):
    test = ROOT / CHECKS[name]
    assert test.is_file() and f'"{name}"' in test.read_text(), f"{CHECKS[name]} does not run tools/{name}"


# Runs each Python script as ``python script.py ARGS`` would, one after another in one process (one torch
# import for all of them, not one a script), each with the environment and sys.path it started with.
_RUNNER = r"""
import contextlib, io, json, os, runpy, sys
out = {}
for key, path, *args in json.loads(sys.argv[1]):
    env, path0, argv = dict(os.environ), list(sys.path), sys.argv
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv, sys.path[0] = [path, *args], os.path.dirname(path)
    code = 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):  # (what Python prints of an exit with a message)
            stderr.write(str(e.code))
    except Exception as e:
        code = 1
        stderr.write(repr(e))
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:], sys.argv = path0, argv
    out[key] = [code, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def script_runs():
    """``{key: (exit code, stdout, stderr)}`` of every Python script's ``--help`` (key: its name) and of
    ``probe_capture_memory.py --tokens 64`` (key ``"probe"``), ``probe_graph_launch.py --nodes 1`` (key
    ``"launch"``) and ``probe_replay_record.py --tokens 256`` (key ``"record"``), run where CUDA is hidden."""
    calls = [[name, str(TOOLS / name), "--help"] for name in PYTHON]
    calls.append(["probe", str(TOOLS / "probe_capture_memory.py"), "--tokens", "64"])
    calls.append(["launch", str(TOOLS / "probe_graph_launch.py"), "--nodes", "1"])
    calls.append(["record", str(TOOLS / "probe_replay_record.py"), "--tokens", "256"])
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(calls)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", PYTHON)
def test_python_script_answers_help(script_runs, name):
    code, out, err = script_runs[name]
    assert code == 0, out + err
    assert out.startswith("usage:"), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what it says without CUDA")
@pytest.mark.parametrize("key", ["probe", "launch", "record"])
def test_a_probe_says_it_needs_cuda(script_runs, key):
    code, out, err = script_runs[key]
    assert code != 0 and "needs a CUDA device" in err, out + err


@pytest.mark.parametrize("name", SHELL)
def test_shell_script_names_files_that_exist(name):
    paths = set(PATH_RE.findall(_shell(name)))
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"tools/{name} names files that do not exist: {missing}"


@pytest.mark.parametrize("name", SHELL)
def test_shell_script_passes_only_options_its_python_takes(name):
    text = _shell(name)
    wrong = []
    for path, args in SCRIPT_RUN_RE.findall(text):
        source = _script_source(path)
        wrong += [f"{path} {o}" for o in OPTION_RE.findall(args) if f'"{o}"' not in source]
    for module, args in MODULE_RUN_RE.findall(text):
        if module != "pip":
            assert importlib.util.find_spec(module) is not None, f"tools/{name} runs python -m {module}: not found"
        if module.split(".")[0] == "slabstage":  # slabstage's own commands: their options are in the package's source
            source = _module_source(module)
            wrong += [f"-m {module} {o}" for o in OPTION_RE.findall(args) if f'"{o}"' not in source]
    assert not wrong, f"tools/{name} passes options no parser takes: {wrong}"


def test_the_phases_gpu_run_phases_runs_are_the_readmes():
    text = _shell("gpu_run_phases.sh")
    phases = set(re.findall(r"^ {4}(\w+)\)", text, re.M))
    assert {"tests", "soak", "sanitize", "bench", "tp", "profile"} <= phases
    for phase in phases:
        assert f"`{phase}`" in README, f"tools/README.md does not describe the phase {phase!r}"
    asked = set()
    for call in re.findall(r"gpu_run_phases\.sh((?: \w+)+)", _shell("gpu_full_pass.sh")):
        asked |= set(call.split())
    assert asked and asked <= phases, f"gpu_full_pass.sh asks for phases that do not exist: {asked - phases}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.skipif(shutil.which("compute-sanitizer") is not None, reason="checks the refusal without it")
def test_gpu_sanitize_refuses_to_run_without_compute_sanitizer(tmp_path):
    proc = subprocess.run(["bash", str(TOOLS / "gpu_sanitize.sh"), str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "compute-sanitizer is not on PATH" in proc.stderr, proc.stderr
    usage = subprocess.run(["bash", str(TOOLS / "gpu_sanitize.sh")], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage:" in usage.stderr
