"""Fixtures of the ops' tests."""

import gc

import pytest

from slabstage.staging import op_stagers
from slabstage.staging import stager as stager_module
from slabstage.kernels.runtime import INTERPRET


@pytest.fixture(params=["triton", "reference"])
def path(request, monkeypatch):
    """The Triton kernels (the interpreter) or the PyTorch reference, with the ops' stagers made afresh."""
    if request.param == "triton" and not INTERPRET:
        pytest.skip("CPU tensors run the reference unless TRITON_INTERPRET=1")
    if request.param == "reference":
        monkeypatch.setattr(stager_module, "use_triton", lambda device: False)
    op_stagers.clear()
    gc.collect()
    yield request.param
    op_stagers.clear()


@pytest.fixture
def ring_of(monkeypatch):
    """``ring_of(k)``: stagers made after it keep a ring of ``k`` parameter records (CUDA's has 8, the CPU
    path's 1), so a test on the CPU can walk a step past the ring; the ring is the Triton path's."""
    if not INTERPRET:
        pytest.skip("the ring is used on the Triton path")

    def slots(k: int) -> None:
        class Ring(stager_module.PinnedRing):
            def __init__(self, slot_bytes, pinned, **_):
                super().__init__(slot_bytes, pinned, k=k)

        monkeypatch.setattr(stager_module, "PinnedRing", Ring)
    return slots
