"""What StagingBuffers.allocate (and a registry replace) takes and refuses: buffers made under inference mode,
a pad value the dtype cannot hold, a token axis that is not an int, and whatever staging would refuse later.
"""

import pytest
import torch
from slabstage import BufferRegistry, StagingBuffers


def allocate(device, **kw):
    args = dict(max_num_tokens=16, max_batch_size=3, embed_width=8, embed_dtype=torch.float32, device=device)
    return StagingBuffers.allocate(**{**args, **kw})


def test_buffers_allocated_under_inference_mode(device):
    with torch.inference_mode():
        buf = allocate(device, mrope=True)
    tensors = {name: buf.registry[name] for name in buf.registry}
    tensors.update(errors=buf.errors)
    for name, t in tensors.items():
        assert not t.is_inference(), name
        t.fill_(1)  # an in-place write outside inference mode
        t.zero_()


@pytest.mark.parametrize("dtype, pad", [
    (torch.int64, float("nan")),
    (torch.int32, 2**40),
    (torch.int32, -2**31 - 1),
    (torch.int64, 2**63),
    (torch.int64, 2.5),
    (torch.uint8, -1),
    (torch.float16, 1e6),
    (torch.float32, 10**400),
    (torch.bfloat16, -1e300),
], ids=lambda v: str(v)[:16])
def test_pad_the_dtype_cannot_hold(dtype, pad, device):
    reg = BufferRegistry()
    with pytest.raises(ValueError, match="'x'") as info:
        reg.register("x", torch.zeros(5, dtype=dtype, device=device), pad=pad)
    assert str(dtype) in str(info.value)
    assert "x" not in reg


def test_replace_with_a_dtype_that_cannot_hold_the_pad(device):
    reg = BufferRegistry()
    old = reg.register("x", torch.zeros(5, dtype=torch.int64, device=device), pad=2**40)
    with pytest.raises(ValueError, match="'x'"):
        reg.replace("x", torch.zeros(5, dtype=torch.int32, device=device))
    assert reg["x"] is old and reg.slot("x").pad == 2**40
    reg.replace("x", torch.zeros(7, dtype=torch.int64, device=device))  # a dtype that holds it: fine


@pytest.mark.parametrize("axis", [0.5, 1.0, "0", True, [0]], ids=repr)
def test_token_axis_not_an_int(axis, device):
    reg = BufferRegistry()
    with pytest.raises(TypeError, match="'x'.*token_axis"):
        reg.register("x", torch.zeros(4, 3, device=device), token_axis=axis)
    assert "x" not in reg
    reg.register("y", torch.zeros(4, 3, device=device), token_axis=1)
    assert reg.views(2)["y"].shape == (4, 2)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(embed_dtype=torch.float64), ValueError, "embed_dtype"),
    (dict(embed_dtype=torch.float8_e4m3fn), ValueError, "embed_dtype"),
    (dict(embed_dtype=torch.float8_e5m2), ValueError, "embed_dtype"),
    (dict(max_num_tokens=2**64), ValueError, "max_num_tokens"),
    (dict(max_num_tokens=2**40), ValueError, "max_num_tokens"),
    (dict(max_batch_size=2**63), ValueError, "max_batch_size"),
    (dict(embed_width=2**64), ValueError, "embed_width"),
], ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_allocate_refuses_what_staging_refuses(kw, exc, match, device):
    with pytest.raises(exc, match=match):
        allocate(device, **kw)
