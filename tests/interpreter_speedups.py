"""Four patches of Triton's interpreter internals that make the suite's interpreted launches faster with the
same results: ``speed_up()``, called by tests/conftest.py before any test runs and by the tensor-parallel
tests' spawned ranks. Each does nothing where the interpreter is off or its internals are not the ones it
was written against.
"""

import os
import threading

__all__ = ["speed_up"]


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


def _share_tensor_shapes() -> None:
    """Under the interpreter, make each tensor's shape once per block shape, not once per tensor.

    ``triton.language.tensor.__init__`` (3.x) builds a new shape (a ``triton.language.tuple`` of constexprs,
    whose type names every element in a string) and element count for every value a program computes, and
    ``block_type.__init__`` a shape, count and name for every block type. Tensors of one block shape, and block
    types of one element type and shape, get the same objects, which nothing changes (built by the original
    ``__init__``, once): the same results, sooner. Nothing changes where the classes are not the ones this was
    written against.
    """
    import builtins

    import triton.language.core as core

    init = core.tensor.__init__
    if getattr(init, "_sped_up", False) or init.__code__.co_varnames[:3] != ("self", "handle", "type"):
        return
    known: dict = {}

    def tensor_init(self, handle, type):
        shape = type.shape if type.is_block() else ()
        key = builtins.tuple(shape.values) if builtins.type(shape) is core.tuple else shape
        got = known.get(key)
        if got is None:
            init(self, handle, type)
            known[key] = (self.numel, self.shape)
            return
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.numel, self.shape = got

    tensor_init._sped_up = True
    core.tensor.__init__ = tensor_init

    block_init = core.block_type.__init__
    if block_init.__code__.co_varnames[:3] != ("self", "element_ty", "shape"):
        return
    blocks: dict = {}

    def block_type_init(self, element_ty, shape):
        # (its shape, count and name: made from the shape and the element type's name, once for each pair)
        dims = shape.values if builtins.type(shape) is core.tuple else shape
        if builtins.type(dims) not in (list, builtins.tuple) or any(builtins.type(d) is not int for d in dims):
            dims = core._unwrap_shape(shape)
        try:
            key = (str(element_ty), builtins.tuple(dims))
            got = blocks.get(key)
        except TypeError:  # (an unhashable part: the original answers, or raises)
            return block_init(self, element_ty, shape)
        if got is None:
            block_init(self, element_ty, shape)
            blocks[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = got

    core.block_type.__init__ = block_type_init


def _unwrap_plain_values_at_once() -> None:
    """Under the interpreter, answer ``_unwrap_if_constexpr`` for a tensor, a Python scalar or a constexpr without
    its chain of ``isinstance`` checks (the interpreter's most called function: millions of calls a test file).
    Those answers are the original's; anything else goes to the original."""
    import triton.language as tl
    import triton.language.core as core

    slow = getattr(core, "_unwrap_if_constexpr", None)
    if slow is None or getattr(slow, "_sped_up", False):
        return
    constexpr, plain = core.constexpr, {int, float, bool, str, type(None), core.tensor}

    def unwrap(o):
        t = type(o)
        if t in plain:
            return o
        if t is constexpr:
            return o.value
        return slow(o)

    unwrap._sped_up = True
    core._unwrap_if_constexpr = unwrap
    if getattr(tl, "_unwrap_if_constexpr", None) is slow:
        tl._unwrap_if_constexpr = unwrap


def speed_up() -> None:
    """The four patches, where triton is installed and the interpreter runs the kernels."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        import triton.runtime.interpreter  # noqa: F401
    except ImportError:  # pragma: no cover - no triton here: the references run
        return
    _patch_once_per_launch()
    _cache_np_dtypes()
    _share_tensor_shapes()
    _unwrap_plain_values_at_once()
