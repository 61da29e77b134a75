"""The repository's Markdown links stay inside it and lead somewhere: every relative link names a file or
folder that exists (an anchor after ``#`` is not checked), and no link leaves the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


def _markdown() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True)
    files = out.stdout.split() if out.returncode == 0 else []
    return files or sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("**/*.md")
                           if not {".venv", ".git", ".pytest_cache"} & set(p.parts))


@pytest.mark.parametrize("name", _markdown())
def test_links_lead_to_files_of_the_repository(name):
    page = ROOT / name
    links = LINK_RE.findall(page.read_text())
    outside = [u for u in links if re.match(r"[a-z][\w+.-]*:", u)]
    assert not outside, f"{name} links outside the repository: {outside}"
    missing = [u for u in links if u.split("#")[0] and not (page.parent / u.split("#")[0]).exists()]
    assert not missing, f"{name} links to paths that do not exist: {missing}"
