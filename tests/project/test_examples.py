"""examples/quickstart.py runs as written (eagerly on CPU, the kernels under the Triton interpreter; replayed
on CUDA, the real kernels), and the README's example is its marked part, word for word."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def _marked(text: str) -> str:
    start = text.index("# --8<-- [start:example]\n") + len("# --8<-- [start:example]\n")
    return text[start:text.index("# --8<-- [end:example]")]


def test_quickstart_runs():
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)  # (TRITON_INTERPRET as conftest set it: 1 without a GPU, else unset)
    proc = subprocess.run([sys.executable, str(QUICKSTART)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "quickstart OK" in proc.stdout


def test_readme_quotes_the_quickstart():
    readme = (ROOT / "README.md").read_text()
    assert _marked(QUICKSTART.read_text()) in readme, "README's example is not examples/quickstart.py's marked part"
