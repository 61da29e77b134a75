"""Test setup: the Triton interpreter runs the kernels on CPU tensors when no GPU is here.

TRITON_INTERPRET must be set before slabstage's kernels are defined, so this runs
before any test module imports slabstage. Under the interpreter, four patches of its
internals (tests/interpreter_speedups.py) make the suite's launches faster with the same results.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import interpreter_speedups  # noqa: E402 - tests/interpreter_speedups.py


interpreter_speedups.speed_up()

# Kernel tests run on every device here: the interpreter on CPU, the real kernels on CUDA.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs two CUDA devices")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and (not HAS_CUDA or torch.cuda.device_count() < 2):
            item.add_marker(skip_multi)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(params=["kernel", "reference"])
def mask_path(request, monkeypatch):
    """``media_index_from_mask`` on its Triton kernel (the interpreter on CPU) or on its PyTorch reference."""
    if request.param == "reference":
        from slabstage.staging import media_index

        monkeypatch.setattr(media_index, "use_triton", lambda t: False)
    return request.param


@pytest.fixture
def kernel_only(device, monkeypatch):
    """Make the PyTorch reference fail if the one staging path picks it: under the interpreter (CPU) and on
    CUDA the Triton kernel is what the tests check (CPU tensors without the interpreter skip)."""
    import importlib

    from slabstage.kernels.runtime import INTERPRET

    if device.type == "cpu" and not INTERPRET:
        pytest.skip("CPU tensors run the reference unless TRITON_INTERPRET=1 (the GPU machine's CPU case)")
    mod = importlib.import_module("slabstage.staging.stager")  # where the one path picks kernel or reference

    def no_reference(*args, **kwargs):
        raise AssertionError("the PyTorch reference ran instead of the Triton kernel")

    monkeypatch.setattr(mod, "stage_reference", no_reference)


@pytest.fixture(params=["triton", "reference"])
def stage_path(request, monkeypatch):
    """The one staging path on its Triton kernel (the interpreter on CPU) or on its PyTorch reference: every
    stager, made before or after, takes the path asked for."""
    from slabstage.staging.stager import Stager
    from slabstage.staging.launch import use_triton

    on_cuda = "device" in request.fixturenames and request.getfixturevalue("device").type == "cuda"
    if request.param == "reference" and on_cuda:
        pytest.skip("the PyTorch reference is the CPU's path: CUDA tensors take the kernel")
    if request.param == "reference":
        monkeypatch.setattr(Stager, "triton", property(lambda self: False, lambda self, value: None), raising=False)
    elif not use_triton(torch.device("cpu")) and not HAS_CUDA:
        pytest.skip("the Triton path on CPU needs TRITON_INTERPRET=1")
    return request.param
