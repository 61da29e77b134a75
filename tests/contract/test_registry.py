"""BufferRegistry: slots, views(n), signatures, freeze, pad policies."""

import pytest
import torch

from slabstage import BufferRegistry, RegistryMismatchError


def make_registry(device, T=37, W=24, B=5):
    g = torch.Generator().manual_seed(T * 1000 + W)
    reg = BufferRegistry()
    reg.register("input_ids", torch.randint(0, 100, (T,), generator=g).to(device))
    reg.register("input_embeds", torch.randn(T, W, generator=g).to(device))
    reg.register("mrope_positions", torch.randint(0, 100, (3, T), generator=g).to(device), token_axis=1)
    reg.register("seq_lens", torch.randint(1, 9, (B,), generator=g, dtype=torch.int32).to(device),
                 token_axis=None)
    reg.register("num_tokens_non_padded", torch.ones(1, dtype=torch.int32, device=device),
                 token_axis=None, pad=None)
    return reg


# -- register / replace -----------------------------------------------------------------

def test_register_returns_tensor_and_reads_back(device):
    reg = BufferRegistry()
    t = torch.randn(11, 3, device=device)
    assert reg.register("x", t) is t
    assert reg["x"] is t and "x" in reg and "y" not in reg
    assert list(reg) == ["x"] and len(reg) == 1
    s = reg.slot("x")
    assert s.tensor is t and s.token_axis == 0 and s.pad == "zeros" and s.fill_value == 0


def test_register_duplicate_name_raises(device):
    reg = make_registry(device)
    before = reg["input_ids"]
    with pytest.raises(ValueError, match="input_ids"):
        reg.register("input_ids", torch.zeros(37, dtype=torch.int64, device=device))
    assert reg["input_ids"] is before


def test_register_rejects_non_tensor():
    with pytest.raises(TypeError, match="'x'"):
        BufferRegistry().register("x", [1, 2, 3])


@pytest.mark.parametrize("axis", [2, -3, 5])
def test_register_token_axis_out_of_range(axis, device):
    reg = BufferRegistry()
    with pytest.raises(ValueError, match="token_axis"):
        reg.register("x", torch.randn(4, 6, device=device), token_axis=axis)
    assert "x" not in reg


def test_negative_token_axis_is_normalised(device):
    reg = BufferRegistry()
    reg.register("m", torch.randn(3, 13, device=device), token_axis=-1)
    assert reg.slot("m").token_axis == 1
    assert reg.views(5)["m"].shape == (3, 5)


def test_replace_keeps_axis_and_pad(device):
    reg = make_registry(device)
    new = torch.randint(0, 7, (3, 50), device=device)
    assert reg.replace("mrope_positions", new) is new
    s = reg.slot("mrope_positions")
    assert s.tensor is new and s.token_axis == 1 and s.pad == "zeros"
    reg2 = BufferRegistry()
    reg2.register("p", torch.randn(9, device=device), pad=-1)
    reg2.replace("p", torch.randn(12, device=device))
    assert reg2.slot("p").pad == -1 and reg2.slot("p").fill_value == -1


def test_replace_unknown_slot_raises(device):
    reg = make_registry(device)
    with pytest.raises(KeyError, match="nope"):
        reg.replace("nope", torch.randn(3, device=device))
    assert "nope" not in reg


def test_replace_rejects_tensor_with_too_few_dims(device):
    reg = make_registry(device)
    old = reg["mrope_positions"]
    with pytest.raises(ValueError, match="mrope_positions"):
        reg.replace("mrope_positions", torch.randn(10, device=device))  # token axis 1 does not exist
    assert reg["mrope_positions"] is old


def test_missing_slot_error_lists_registered(device):
    reg = make_registry(device)
    with pytest.raises(KeyError) as info:
        reg["positions"]
    assert "positions" in str(info.value) and "input_ids" in str(info.value)
    with pytest.raises(KeyError):
        reg.slot("positions")
    with pytest.raises(KeyError, match="none"):
        BufferRegistry()["x"]


# -- views ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 7, 20, 37])
def test_views_slices_token_axis(n, device):
    reg = make_registry(device)
    v = reg.views(n)
    assert list(v) == list(reg)
    assert v["input_ids"].shape == (n,)
    assert v["input_embeds"].shape == (n, 24)
    assert v["mrope_positions"].shape == (3, n)
    for name in ("input_ids", "input_embeds", "mrope_positions"):
        t = reg[name]
        assert v[name].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # a view
        assert v[name].stride() == t.stride()
        assert torch.equal(v[name], t.narrow(reg.slot(name).token_axis, 0, n))
    # slots without a token axis come back whole
    assert v["seq_lens"] is reg["seq_lens"]
    assert v["num_tokens_non_padded"] is reg["num_tokens_non_padded"]


def test_views_write_through(device):
    reg = make_registry(device)
    v = reg.views(4)
    v["mrope_positions"].fill_(-3)
    assert (reg["mrope_positions"][:, :4] == -3).all()
    assert (reg["mrope_positions"][:, 4:] != -3).any()


@pytest.mark.parametrize("n", [38, 64, 1000])
def test_views_above_capacity_names_the_slot(n, device):
    reg = BufferRegistry()
    reg.register("input_ids", torch.zeros(64, dtype=torch.int64, device=device))
    reg.register("mrope_positions", torch.zeros(3, 37, dtype=torch.int64, device=device), token_axis=1)
    if n <= 64:
        with pytest.raises(ValueError, match="mrope_positions") as info:
            reg.views(n)
        assert "37" in str(info.value)
    else:
        with pytest.raises(ValueError, match=str(n)):
            reg.views(n)


@pytest.mark.parametrize("n", [-1, True, 3.0, "3", None])
def test_views_rejects_bad_n(n, device):
    with pytest.raises(ValueError):
        make_registry(device).views(n)


def test_capacity(device):
    reg = BufferRegistry()
    assert reg.capacity == 0
    reg.register("s", torch.zeros(100, device=device), token_axis=None)
    assert reg.capacity == 0
    reg.register("a", torch.zeros(64, device=device))
    reg.register("b", torch.zeros(3, 41, device=device), token_axis=1)
    assert reg.capacity == 41


def test_capacity_follows_tensors_changed_in_place(device):
    """capacity reads the tensors as they are now: a slot shrunk in place lowers it."""
    reg = make_registry(device)
    assert reg.capacity == 37
    reg["mrope_positions"].resize_(3, 20)
    assert reg.capacity == 20
    reg["input_ids"].set_(torch.empty(12, dtype=torch.int64, device=device))
    assert reg.capacity == 12
    with pytest.raises(ValueError, match="input_ids"):
        reg.views(13)
    reg.replace("input_ids", torch.zeros(50, dtype=torch.int64, device=device))
    assert reg.capacity == 20


# -- signature / check --------------------------------------------------------------------

def test_signature_stable(device):
    reg = make_registry(device)
    s1 = reg.signature()
    reg.views(5)["input_embeds"].normal_()  # writing values changes nothing in the signature
    s2 = reg.signature()
    assert s1 == s2
    reg.check(s1)
    for name, sig in s1.items():
        t = reg[name]
        assert sig.data_ptr == t.data_ptr() and sig.shape == tuple(t.shape) and sig.stride == t.stride()
        assert sig.dtype == t.dtype and sig.device == t.device


def test_check_detects_replaced_slot(device):
    reg = make_registry(device)
    sig = reg.signature()
    reg.replace("input_embeds", torch.randn(37, 24, device=device))
    with pytest.raises(RegistryMismatchError) as info:
        reg.check(sig)
    msg = str(info.value)
    assert "'input_embeds'" in msg and "data_ptr" in msg
    assert "input_ids" not in msg


def test_check_detects_dtype_and_shape_change(device):
    reg = make_registry(device)
    sig = reg.signature()
    reg.replace("seq_lens", torch.zeros(6, dtype=torch.int64, device=device))
    with pytest.raises(RegistryMismatchError) as info:
        reg.check(sig)
    msg = str(info.value)
    assert "'seq_lens'" in msg and "dtype" in msg and "shape" in msg


def test_check_detects_set_(device):
    reg = make_registry(device)
    sig = reg.signature()
    reg["input_ids"].set_(torch.empty(37, dtype=torch.int64, device=device))
    with pytest.raises(RegistryMismatchError) as info:
        reg.check(sig)
    assert "'input_ids'" in str(info.value) and "data_ptr" in str(info.value)


def test_check_detects_resize_(device):
    reg = make_registry(device)
    sig = reg.signature()
    reg["input_embeds"].resize_(64, 24)  # grows: new storage, new shape
    with pytest.raises(RegistryMismatchError) as info:
        reg.check(sig)
    msg = str(info.value)
    assert "'input_embeds'" in msg and "shape" in msg and "(37, 24)" in msg and "(64, 24)" in msg


def test_check_detects_shrink_in_place(device):
    reg = make_registry(device)
    sig = reg.signature()
    reg["mrope_positions"].resize_(3, 20)  # same address, smaller shape
    with pytest.raises(RegistryMismatchError) as info:
        reg.check(sig)
    msg = str(info.value)
    assert "'mrope_positions'" in msg and "shape" in msg and "data_ptr" not in msg


def test_check_detects_stride_change(device):
    reg = make_registry(device)
    sig = reg.signature()
    t = reg["input_embeds"]
    t.as_strided_(t.shape, (1, t.shape[0]))
    with pytest.raises(RegistryMismatchError, match="stride"):
        reg.check(sig)


def test_check_detects_added_and_removed_slots(device):
    reg = make_registry(device)
    sig = reg.signature()
    reg.register("extra", torch.zeros(37, device=device))
    with pytest.raises(RegistryMismatchError, match="'extra' was added"):
        reg.check(sig)
    small = BufferRegistry()
    small.register("input_ids", reg["input_ids"])
    with pytest.raises(RegistryMismatchError, match="'input_embeds' was removed"):
        small.check(sig)


def test_check_names_every_changed_slot(device):
    reg = make_registry(device)
    sig = reg.signature()
    reg.replace("input_ids", torch.zeros(37, dtype=torch.int64, device=device))
    reg.replace("seq_lens", torch.zeros(5, dtype=torch.int32, device=device))
    with pytest.raises(RegistryMismatchError) as info:
        reg.check(sig)
    assert "'input_ids'" in str(info.value) and "'seq_lens'" in str(info.value)


# -- freeze ------------------------------------------------------------------------------

def test_freeze_refuses_register_and_replace(device):
    reg = make_registry(device)
    sig = reg.signature()
    reg.freeze()
    assert reg.frozen
    with pytest.raises(RegistryMismatchError, match="frozen") as info:
        reg.register("extra", torch.zeros(37, device=device))
    assert "'extra'" in str(info.value)
    with pytest.raises(RegistryMismatchError, match="'input_embeds'"):
        reg.replace("input_embeds", torch.randn(37, 24, device=device))
    assert "extra" not in reg
    reg.check(sig)  # nothing changed
    assert reg.views(3)["input_ids"].shape == (3,)  # reading still works
    reg.unfreeze()
    assert not reg.frozen
    reg.register("extra", torch.zeros(37, device=device))
    reg.replace("input_embeds", torch.randn(37, 24, device=device))
    assert "extra" in reg


def test_frozen_duplicate_register_reports_frozen_first(device):
    reg = make_registry(device)
    reg.freeze()
    with pytest.raises(RegistryMismatchError):
        reg.register("input_ids", torch.zeros(37, dtype=torch.int64, device=device))


# -- pad policy --------------------------------------------------------------------------

@pytest.mark.parametrize("pad, fill", [("zeros", 0), (None, None), (0, 0), (-1, -1), (7, 7), (2.5, 2.5),
                                       (-0.0, -0.0)])
def test_pad_policies_accepted(pad, fill, device):
    reg = BufferRegistry()
    reg.register("x", torch.zeros(5, device=device), pad=pad)
    assert reg.slot("x").pad == pad
    assert reg.slot("x").fill_value == fill


@pytest.mark.parametrize("pad", ["zero", "ones", "nan", "", True, False, [0], (0,), object(), torch.tensor(0)],
                         ids=lambda v: "object()" if type(v) is object else repr(v))  # (the same id in every process)
def test_pad_policies_rejected(pad, device):
    reg = BufferRegistry()
    with pytest.raises(ValueError, match="'x'"):
        reg.register("x", torch.zeros(5, device=device), pad=pad)
    assert "x" not in reg
