"""The wheel: ``python -m build`` makes one that installs into a fresh venv and imports, with no network.

The build runs without isolation (its backend, setuptools, comes from the test
extra) on a copy of the source tree, so the checkout gets no build/ or egg-info.
The venv sees the running interpreter's packages (torch, triton) through a
``.pth`` file, so nothing is downloaded; the wheel goes in with ``--no-deps``.
A couple of seconds to build, a few more to make the venv and import.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

import slabstage

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".ruff_cache", ".benchmarks", ".hypothesis", "results", ".whl", ".gpu-out")


def _run(cmd, *, check: bool = True, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # only what is installed
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=300, **kw)
    if check:
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="python -m build is in the test extra: pip install -e '.[test]'")
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", work / "dist", src])
    (built,) = (work / "dist").glob("slabstage-*.whl")
    return built


def test_the_wheel_holds_the_package_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert f"slabstage-{slabstage.__version__}-" in wheel.name
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "slabstage").rglob("*.py")}
    missing = source - set(names)
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    for package in ("slabstage/kernels/", "slabstage/staging/", "slabstage/graph_runner/", "slabstage/models/"):
        assert any(n.startswith(package) for n in names), package
    assert not any(n.startswith("slabstage/bench/") for n in names), "the benchmark harness lives in bench/"
    if (ROOT / "slabstage" / "hf").is_dir():
        assert any(n.startswith("slabstage/hf/") for n in names)
    stray = [n for n in names if not (n.startswith("slabstage/") or n.startswith("slabstage-"))]
    assert not stray, f"the wheel carries more than the package: {stray}"  # no tests/, bench/, tools/, docs/


def test_the_wheel_installs_into_a_fresh_venv_and_imports(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # torch and triton from the interpreter running this test (itself often a venv), never downloaded;
    # a .pth line adds a folder but runs none of its .pth files, so an editable slabstage there stays out
    parents = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_parent_site.pth").write_text("\n".join(sorted(parents)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet",
          "--disable-pip-version-check", wheel])
    probe = ("import pathlib, slabstage, slabstage.kernels, slabstage.staging, slabstage.graph_runner;"
             "print(slabstage.__version__); print(pathlib.Path(slabstage.__file__).resolve())")
    out = _run([python, "-c", probe], cwd=tmp_path).stdout.split("\n")
    assert out[0] == slabstage.__version__
    assert Path(out[1]).is_relative_to(site.resolve()), f"imported {out[1]}, not the installed wheel"
    # the command line works from the install; the benchmark harness is not shipped (it is bench/ of a checkout)
    assert "usage: python -m slabstage demo" in _run([python, "-m", "slabstage", "--help"], cwd=tmp_path).stdout
    proc = _run([python, "-m", "slabstage.bench", "run"], check=False, cwd=tmp_path)
    assert proc.returncode != 0 and "No module named slabstage.bench" in proc.stderr, proc.stderr
