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
