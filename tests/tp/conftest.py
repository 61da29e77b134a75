"""The tensor-parallel tests' ranks: WORLD processes spawned once per test session for each worker function."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from filelock import FileLock

WORLD = 2


@pytest.fixture(scope="session")
def spawn_ranks(tmp_path_factory):
    """``spawn_ranks(worker, name)``: run ``worker(rank, WORLD, folder)`` in WORLD processes and return
    ``{rank: what it saved in folder/rank{rank}.pt}``. Once per session: under pytest-xdist the first worker
    that needs them runs them, and another waits for them and reads what they saved."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # (the session's, every worker's)

    def run(worker, name: str) -> dict[int, dict]:
        folder = shared / f"ranks_{name}"
        with FileLock(str(folder) + ".lock"):
            if not (folder / "done").exists():
                folder.mkdir(exist_ok=True)
                mp.spawn(worker, args=(WORLD, str(folder)), nprocs=WORLD, join=True)
                (folder / "done").touch()
        return {rank: torch.load(folder / f"rank{rank}.pt") for rank in range(WORLD)}

    return run
