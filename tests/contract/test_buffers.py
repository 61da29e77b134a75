"""StagingBuffers.allocate: every slot's shape, stride, dtype, device; argument checks."""

import numpy as np
import pytest
import torch

from slabstage import BufferRegistry, StagingBuffers, new_error_word
from slabstage.staging import ERROR_WORD_SIZE

NO_ROW = 2**31 - 1


def allocate(device, **kw):
    args = dict(max_num_tokens=37, max_batch_size=5, embed_width=24, embed_dtype=torch.bfloat16, device=device)
    args.update(kw)
    return StagingBuffers.allocate(**args)


def same_device(t, device):
    """``t`` (a tensor or a device) is on ``device``; "cuda" matches any index."""
    t = t if isinstance(t, torch.device) else t.device
    return t.type == device.type and (device.index is None or t.index == device.index)


@pytest.mark.parametrize("T, B, W", [(37, 5, 24), (64, 8, 4096), (1, 1, 1), (33, 3, 4097)])
@pytest.mark.parametrize("embed_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cache_loc_dtype", [torch.int64, torch.int32])
def test_slots(T, B, W, embed_dtype, cache_loc_dtype, device):
    buf = allocate(device, max_num_tokens=T, max_batch_size=B, embed_width=W, embed_dtype=embed_dtype,
                   cache_loc_dtype=cache_loc_dtype)
    reg = buf.registry
    want = {  # name: (shape, dtype, token axis)
        "input_ids": ((T,), torch.int64, 0),
        "positions": ((T,), torch.int64, 0),
        "out_cache_loc": ((T,), cache_loc_dtype, 0),
        "input_embeds": ((T, W), embed_dtype, 0),
        "seq_lens": ((B,), torch.int32, None),
        "extend_start_loc": ((B,), torch.int32, None),
        "prefix_lens": ((B,), torch.int32, None),
        "req_indices": ((B,), torch.int32, None),
        "num_tokens_non_padded": ((1,), torch.int32, None),
    }
    assert set(reg) == set(want)
    for name, (shape, dtype, axis) in want.items():
        t = reg[name]
        assert tuple(t.shape) == shape, name
        assert t.dtype == dtype, name
        assert same_device(t, device), name
        assert t.is_contiguous(), name
        assert reg.slot(name).token_axis == axis, name
        assert getattr(buf, name) is t
    assert buf.input_embeds.stride() == (W, 1)
    assert buf.mrope_positions is None and "mrope_positions" not in reg
    assert buf.max_num_tokens == T and buf.max_batch_size == B and buf.embed_width == W
    assert isinstance(buf.device, torch.device) and same_device(buf.device, device)
    assert reg.capacity == T


def test_pad_policies(device):
    reg = allocate(device, mrope=True).registry
    for name in ("input_ids", "positions", "out_cache_loc", "input_embeds", "mrope_positions", "seq_lens",
                 "extend_start_loc"):
        assert reg.slot(name).pad == "zeros" and reg.slot(name).fill_value == 0, name
    assert reg.slot("num_tokens_non_padded").pad is None
    assert reg.slot("num_tokens_non_padded").fill_value is None


@pytest.mark.parametrize("T", [1, 37, 64])
def test_mrope_slot(T, device):
    buf = allocate(device, max_num_tokens=T, mrope=True)
    m = buf.mrope_positions
    assert m is buf.registry["mrope_positions"]
    assert tuple(m.shape) == (3, T) and m.dtype == torch.int64 and m.stride() == (T, 1)
    assert same_device(m, device)
    assert buf.registry.slot("mrope_positions").token_axis == 1
    assert buf.registry.views(T - 1 if T > 1 else 0)["mrope_positions"].shape == (3, max(T - 1, 0))


def test_error_word(device):
    buf = allocate(device)
    e = buf.errors
    assert e.dtype == torch.int32 and tuple(e.shape) == (ERROR_WORD_SIZE,) and same_device(e, device)
    assert e.tolist() == [0, 0, NO_ROW, 0]
    other = allocate(device)
    assert other.errors.data_ptr() != e.data_ptr()  # one word per buffers, not shared
    w = new_error_word(device)
    assert w.tolist() == [0, 0, NO_ROW, 0] and w.dtype == torch.int32 and same_device(w, device)


def test_device_given_as_string(device):
    buf = allocate(str(device))
    assert same_device(buf.input_embeds, device)


# -- invalid arguments ------------------------------------------------------------------------

BAD_SIZES = [0, -1, -37, True, False, 37.0, 2.5, "37", None, np.float64(8.0)]


@pytest.mark.parametrize("field", ["max_num_tokens", "max_batch_size", "embed_width"])
@pytest.mark.parametrize("value", BAD_SIZES, ids=repr)
def test_invalid_sizes(field, value, device):
    with pytest.raises(ValueError, match=field):
        allocate(device, **{field: value})


@pytest.mark.parametrize("field", ["max_num_tokens", "max_batch_size", "embed_width"])
def test_numpy_sizes_accepted(field, device):
    buf = allocate(device, **{field: np.int64(9)})
    assert {"max_num_tokens": buf.max_num_tokens, "max_batch_size": buf.max_batch_size,
            "embed_width": buf.embed_width}[field] == 9


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64, "bfloat16",
                                   None, float], ids=repr)
def test_invalid_embed_dtype(dtype, device):
    with pytest.raises(ValueError, match="embed_dtype"):
        allocate(device, embed_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.float32, torch.bfloat16, "int64", None], ids=repr)
def test_invalid_cache_loc_dtype(dtype, device):
    with pytest.raises(ValueError, match="cache_loc_dtype"):
        allocate(device, cache_loc_dtype=dtype)


@pytest.mark.parametrize("mrope", [1, 0, "yes", None])
def test_invalid_mrope_flag(mrope, device):
    with pytest.raises(ValueError, match="mrope"):
        allocate(device, mrope=mrope)


@pytest.mark.parametrize("bad", ["nonsense", "gpu", "cuda:99", "cpu:x"])
def test_invalid_device(bad):
    with pytest.raises(ValueError, match="device"):
        allocate(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_cuda_device_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="device"):
        allocate("cuda")


# -- reads go through the registry -------------------------------------------------------------

def test_attribute_access_reads_registry(device):
    buf = allocate(device, mrope=True)
    reg = buf.registry
    new_embeds = torch.randn(50, 48, device=device, dtype=torch.float16)
    reg.replace("input_embeds", new_embeds)
    assert buf.input_embeds is new_embeds
    assert buf.embed_width == 48
    assert buf.device == new_embeds.device
    for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "extend_start_loc",
                 "num_tokens_non_padded", "mrope_positions"):
        new = torch.zeros_like(reg[name])
        reg.replace(name, new)
        assert getattr(buf, name) is new, name


def test_extra_slots_can_be_registered(device):
    buf = allocate(device)
    extra = torch.randn(37, 16, device=device)
    buf.registry.register("deepstack_embeds", extra)
    assert buf.registry.views(9)["deepstack_embeds"].shape == (9, 16)


def test_constructor_with_own_registry(device):
    reg = BufferRegistry()
    for name in ("input_ids", "positions", "out_cache_loc"):
        reg.register(name, torch.zeros(20, dtype=torch.int64, device=device), pad=-1)
    reg.register("input_embeds", torch.zeros(20, 8, device=device))
    reg.register("num_tokens_non_padded", torch.zeros(1, dtype=torch.int32, device=device), token_axis=None,
                 pad=None)
    buf = StagingBuffers(reg, max_num_tokens=20, max_batch_size=2, errors=new_error_word(device))
    assert buf.registry is reg and buf.embed_width == 8 and buf.mrope_positions is None
    assert reg.slot("positions").fill_value == -1


def test_repr_names_slots(device):
    r = repr(allocate(device, mrope=True))
    assert "mrope_positions" in r and "embed_width=24" in r and "bfloat16" in r
