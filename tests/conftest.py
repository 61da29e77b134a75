"""Test setup: the Triton interpreter runs the kernels on CPU tensors when no GPU is here.

TRITON_INTERPRET must be set before slabstage's kernels are defined, so this runs
before any test module imports slabstage. Under the interpreter, two patches of its
internals (below) make the suite's launches faster with the same results.
"""

import os
import threading

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _patch_once_per_launch() -> None:
    """Under the interpreter, patch ``triton.language`` for a device function once per launch, not per call.

    Triton's interpreter (3.x) re-patches ``triton.language`` every time a program calls a ``@triton.jit``
    function (``tl.zeros`` is one), a scan of the language's modules that took about a third of the staging
    kernel's interpreted time. A second patch for the same function within one launch finds everything
    patched by the first and changes nothing, so it is skipped: the same results, sooner. Nothing changes
    where the interpreter's internals are not the ones this was written against.
    """
    from triton.runtime import interpreter

    patch, grid_call = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or grid_call is None or getattr(patch, "_sped_up", False):
        return
    grid_call = grid_call.__call__
    state = threading.local()  # the functions patched in this thread's launch

    class _Patched:
        def restore(self) -> None:
            pass

    def patch_once(fn, *args):
        seen = getattr(state, "seen", None)
        if seen is not None:
            if fn in seen:
                return _Patched()
            seen.add(fn)
        return patch(fn, *args)

    def launch(self, *args, **kwargs):
        outer, state.seen = getattr(state, "seen", None), set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.seen = outer

    patch_once._sped_up = True
    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch


def _cache_np_dtypes() -> None:
    """Under the interpreter, remember the numpy dtype of each Triton dtype: the interpreter's lookup builds a
    table of 19 dtypes at every call (an interpreted staging launch 18-25% faster without it). The same
    answers, from a dict; nothing changes where the interpreter's internals are not the ones this was
    written against."""
    import triton.language as tl
    from triton.runtime import interpreter

    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None or getattr(lookup, "_sped_up", False):
        return
    known: dict = {}
    block = tl.block_type

    def np_dtype(tt):
        if isinstance(tt, block):  # (a block's numpy dtype is its element's)
            tt = tt.element_ty
        try:
            found = known.get(tt)
        except TypeError:  # (a pointer type is unhashable: the lookup answers it first, at once)
            return lookup(tt)
        if found is None:
            found = known[tt] = lookup(tt)
        return found

    np_dtype._sped_up = True
    interpreter._get_np_dtype = np_dtype


def _speed_up_interpreter() -> None:
    """Both patches, where triton is installed and the interpreter runs the kernels."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        import triton.runtime.interpreter  # noqa: F401
    except ImportError:  # pragma: no cover - no triton here: the references run
        return
    _patch_once_per_launch()
    _cache_np_dtypes()


_speed_up_interpreter()

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
