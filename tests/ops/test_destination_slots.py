"""Every destination slot is checked: an empty slot or one of another dtype is refused, and a value that does not
fit an int32 slot is refused on the host (nothing written) or recorded in the error word on the device.
"""

import pytest
import torch
import slabstage as ss

from builders import assert_registry_unchanged as _unchanged, ids_and_table, registry_snapshot as _snapshot  # noqa: I001
from builders import staging_buffers  # noqa: I001 - tests/builders.py

V, W, T = 40, 24, 64


def _buffers(device="cpu", **kw):
    return staging_buffers(T, W, device, **kw)


def _inputs(n=10, seed=0):
    return ids_and_table(V, W, n, seed)


def test_empty_token_count_slot_is_refused():
    buf = _buffers()
    buf.registry.replace("num_tokens_non_padded", buf.num_tokens_non_padded[:0])
    ids, _ = _inputs()
    snap = _snapshot(buf)
    with pytest.raises(ValueError, match="num_tokens_non_padded"):
        ss.stage_token_inputs(buf, input_ids=ids, positions=torch.arange(10), pad_to=12)
    _unchanged(buf, snap)


def test_slot_of_another_dtype_or_device_is_refused():
    buf = _buffers()
    buf.registry.replace("seq_lens", torch.zeros(4, dtype=torch.float32))
    ids, _ = _inputs()
    with pytest.raises(TypeError, match="seq_lens"):
        ss.stage_token_inputs(buf, input_ids=ids, positions=torch.arange(10), pad_to=12)


@pytest.mark.parametrize("slot, value", [("out_cache_loc", 2**32 + 5), ("seq_lens", 2**31)])
def test_host_values_that_do_not_fit_are_refused(slot, value):
    buf = _buffers(cache_loc_dtype=torch.int32)
    ids, _ = _inputs()
    kw = dict(input_ids=ids, positions=torch.arange(10), pad_to=12)
    if slot == "out_cache_loc":
        kw["out_cache_loc"] = torch.full((10,), value, dtype=torch.int64)
    else:
        kw["seq_lens"] = torch.tensor([value, 5], dtype=torch.int64)
        kw["extend_start_loc"] = torch.tensor([0, 5], dtype=torch.int64)
    snap = _snapshot(buf)
    with pytest.raises(ValueError, match=slot):
        ss.stage_token_inputs(buf, **kw)
    _unchanged(buf, snap)


@pytest.mark.cuda
def test_device_values_that_do_not_fit_are_recorded():
    buf = _buffers("cuda", cache_loc_dtype=torch.int32)
    ids = torch.randint(0, V, (10,), device="cuda")
    loc = torch.full((10,), 2**32 + 5, dtype=torch.int64, device="cuda")
    ss.stage_token_inputs(buf, input_ids=ids, positions=torch.arange(10, device="cuda"), out_cache_loc=loc,
                          pad_to=12)
    with pytest.raises(ss.StagingError, match="does not fit"):
        ss.raise_if_errors(buf.errors)
