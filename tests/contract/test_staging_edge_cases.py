"""Edge cases of staging state and its checks: the error word under races and inference mode, buffers made
under inference mode, pad values a dtype cannot hold, width attributes that raise, media widths, what
allocate refuses, overflow refused before any write, and unclear span errors."""

import threading
import time

import pytest
import torch
from torch import nn

from slabstage import (BufferRegistry, StagingBuffers, StagingError, WidthContractError, media_index_from_mask,
                       media_index_from_spans, new_error_word, raise_if_errors, reset_errors,
                       resolve_input_embeds_width)
from slabstage.kernels import MEDIA_COUNT_MISMATCH, default_error_word
from slabstage.kernels import errors as errors_module

NO_ROW = 2**31 - 1
CLEAN = [0, 0, NO_ROW, 0]


def allocate(device, **kw):
    args = dict(max_num_tokens=16, max_batch_size=3, embed_width=8, embed_dtype=torch.float32, device=device)
    return StagingBuffers.allocate(**{**args, **kw})


@pytest.fixture
def fresh_default_words(monkeypatch):
    """Forget the module-level default words for the test, so that the next call creates one."""
    monkeypatch.setattr(errors_module, "_DEFAULT_WORDS", {})


# ==================================================================================================
# d. the default error word is created once per device, whatever the threads
# ==================================================================================================
def test_error_word_race(device, fresh_default_words, monkeypatch):
    made = []
    real = errors_module.new_error_word

    def slow_new_error_word(dev):  # widen the window between "none yet" and "stored"
        made.append(dev)
        time.sleep(0.02)
        return real(dev)

    monkeypatch.setattr(errors_module, "new_error_word", slow_new_error_word)
    threads, start, got = 8, threading.Barrier(8), []

    def worker():
        start.wait()
        word = default_error_word(device)
        word[1] += 0  # touch it, as a kernel would
        got.append(word)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert len(got) == threads
    assert len({id(w) for w in got}) == 1, "threads were handed different default words: rows get lost"
    assert len(made) == 1
    assert default_error_word(device) is got[0]


# ==================================================================================================
# e / m. inference mode: words and buffers made inside it work outside it, and the other way round
# ==================================================================================================
def test_default_word_first_made_under_inference_mode(device, fresh_default_words, mask_path):
    mask = torch.tensor([True, False, True, True, False], device=device)
    with torch.inference_mode():
        media_index_from_mask(mask, 2)  # the first use of the default word: 3 placeholders, 2 rows
    word = default_error_word(device)
    assert not word.is_inference()
    with pytest.raises(StagingError) as info:
        raise_if_errors(device=device)
    assert type(info.value) is StagingError and info.value.codes == MEDIA_COUNT_MISMATCH and info.value.count == 3
    assert word.tolist() == CLEAN  # the whole reset ran
    media_index_from_mask(mask, 3)  # outside now: the word is written and read again
    assert word.tolist() == [0, 0, NO_ROW, 3]
    media_index_from_mask(mask, 1)
    with torch.inference_mode():
        with pytest.raises(StagingError):
            raise_if_errors(device=device)
    assert word.tolist() == CLEAN


def test_new_error_word_under_inference_mode(device):
    with torch.inference_mode():
        word = new_error_word(device)
    assert not word.is_inference() and word.tolist() == CLEAN
    word[0] = MEDIA_COUNT_MISMATCH  # outside inference mode: a normal tensor
    reset_errors(word)
    assert word.tolist() == CLEAN


def test_user_word_made_under_inference_mode(device, mask_path):
    """A word the user made as an inference tensor is written, read and reset outside inference mode."""
    with torch.inference_mode():
        word = torch.zeros(4, dtype=torch.int32, device=device)
        word[2] = NO_ROW
    assert word.is_inference()
    mask = torch.tensor([True, True, False], device=device)
    index = media_index_from_mask(mask, 5, errors=word)
    assert index.tolist() == [0, 1, -1]
    assert word.tolist() == [MEDIA_COUNT_MISMATCH, 0, NO_ROW, 2]
    with pytest.raises(StagingError) as info:
        raise_if_errors(word)
    assert type(info.value) is StagingError and info.value.count == 2
    assert word.tolist() == CLEAN
    word_before = word.tolist()
    reset_errors(word)
    assert word.tolist() == word_before


def test_buffers_allocated_under_inference_mode(device):
    with torch.inference_mode():
        buf = allocate(device, mrope=True)
    tensors = {name: buf.registry[name] for name in buf.registry}
    tensors.update(errors=buf.errors)
    for name, t in tensors.items():
        assert not t.is_inference(), name
        t.fill_(1)  # an in-place write outside inference mode
        t.zero_()


# ==================================================================================================
# g. the registry refuses pads the slot cannot hold and a non-integer token axis
# ==================================================================================================
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


# ==================================================================================================
# i. a declared width that fails while computing is an error, not "absent"
# ==================================================================================================
class _Config:
    hidden_size = 32


class _PropertyReadsMissingField:
    config = _Config()

    @property
    def input_embeds_hidden_size(self):
        return self.config.deepstack_levels * self.config.hidden_size  # no such field: AttributeError


class _PropertyRaisesKeyError:
    @property
    def input_embeds_hidden_size(self):
        return {}["width"]


class _InheritsRaisingProperty(_PropertyReadsMissingField):
    pass


class _ModuleWithRaisingProperty(nn.Module):
    @property
    def input_embeds_hidden_size(self):
        return self.missing_width  # nn.Module.__getattr__ raises AttributeError


@pytest.mark.parametrize("cls, cause", [(_PropertyReadsMissingField, "deepstack_levels"),
                                        (_PropertyRaisesKeyError, "KeyError"),
                                        (_InheritsRaisingProperty, "deepstack_levels"),
                                        (_ModuleWithRaisingProperty, "missing_width")])
def test_width_property_raising_is_not_absent(cls, cause):
    with pytest.raises(WidthContractError, match=f"{cls.__name__}.input_embeds_hidden_size") as info:
        resolve_input_embeds_width(cls(), 32)
    assert cause in str(info.value)  # says what went wrong inside the declaration
    assert info.value.__cause__ is not None  # and keeps the original error


def test_absent_attribute_still_falls_back():
    class Plain:
        pass

    class Module(nn.Module):
        pass

    class Dynamic:
        def __getattr__(self, name):
            if name == "input_embeds_hidden_size":
                return 96
            raise AttributeError(name)

    assert resolve_input_embeds_width(Plain(), 32) == 32
    assert resolve_input_embeds_width(Module(), 32) == 32
    assert resolve_input_embeds_width(Dynamic(), 32) == 96  # served by __getattr__: declared


# ==================================================================================================
# j. media width: the slab width, or the text width with an expand policy, nothing else
# ==================================================================================================
@pytest.mark.parametrize("media, slab, text, expand", [
    (50, 96, 32, "zeros"),
    (50, 96, 32, "repeat"),
    (48, 96, 32, "repeat"),  # divides the slab, but is not the text width
    (64, 96, 32, "zeros"),
    (128, 96, 32, "zeros"),
    (32, 96, 32, "tile"),
    (32, 96, 32, None),
    (32, 100, 32, "repeat"),  # the text width, but does not divide the slab
])
def test_media_width_neither_slab_nor_text(media, slab, text, expand):
    from slabstage.staging.width import check_media_width
    with pytest.raises(WidthContractError) as info:
        check_media_width("media", media, slab, text, expand)
    msg = str(info.value)
    assert "media" in msg and str(media) in msg and str(slab) in msg


@pytest.mark.parametrize("media, slab, text, expand", [
    (96, 96, 32, "zeros"), (96, 96, 32, "repeat"), (96, 96, 96, "zeros"), (96, 96, 32, "anything"),
    (32, 96, 32, "zeros"), (32, 96, 32, "repeat"), (96, 96, 96, None),
])
def test_media_width_accepted(media, slab, text, expand):
    from slabstage.staging import check_media_width
    assert check_media_width("media", media, slab, text, expand) is None


# ==================================================================================================
# k. a slab dtype no staging kernel writes is refused at allocation
# ==================================================================================================
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


# ==================================================================================================
# f. no OverflowError from media_index_from_spans / _from_mask: refused first, naming the argument
# ==================================================================================================
@pytest.mark.parametrize("call, exc, match", [
    (lambda d: media_index_from_spans([(0, 2, 0), (2, 2, 2**31)], 8, device=d), ValueError, "span 1.*src_start"),
    (lambda d: media_index_from_spans([(0, 2, 2**31 - 1)], 8, device=d), ValueError, "span 0"),
    (lambda d: media_index_from_spans([(0, 2, 2**64)], 8, device=d), ValueError, "span 0"),
    (lambda d: media_index_from_spans([(0, 2, 0)], 8, device=d, num_media_rows=2**64), ValueError,
     "num_media_rows"),
    (lambda d: media_index_from_spans([], 2**64, device=d), ValueError, "num_tokens"),
    (lambda d: media_index_from_mask(torch.tensor([True, False], device=d), 2**64, errors=new_error_word(d)),
     ValueError, "num_media_rows"),
    (lambda d: media_index_from_mask(torch.tensor([True, False], device=d), 2**31, errors=new_error_word(d)),
     ValueError, "num_media_rows"),
])
def test_overflow_refused_before_any_write(call, exc, match, device):
    word = new_error_word(device)
    with pytest.raises(exc, match=match):
        call(device)
    assert word.tolist() == CLEAN


# ==================================================================================================
# n. unclear span errors: name the span and what was expected
# ==================================================================================================
@pytest.mark.parametrize("spans, exc, match", [
    ([5], TypeError, r"span 0 .*\(dst_start, length, src_start\)"),
    ([(0, 1, 0), 7], TypeError, r"span 1 .*\(dst_start, length, src_start\)"),
    (None, TypeError, "spans must be"),
    (5, TypeError, "spans must be"),
    ([(0, 1, 2**31)], ValueError, r"span 0 .*src_start.*int32"),
    ([(0, 1, 0), (1, 1, 2**40)], ValueError, r"span 1 .*src_start.*int32"),
], ids=repr)
def test_unclear_span_errors(spans, exc, match, device):
    with pytest.raises(exc, match=match):
        media_index_from_spans(spans, 8, device=device)

