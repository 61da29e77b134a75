"""Error words made once and usable anywhere: the default word is created once per device whatever the
threads, and default, new and user words made under inference mode still take the kernels' writes.
"""

import threading
import time
import pytest
import torch
from slabstage import StagingError, media_index_from_mask, new_error_word, raise_if_errors, reset_errors
from slabstage.staging import MEDIA_COUNT_MISMATCH, default_error_word
from slabstage.staging import errors as errors_module


NO_ROW = 2**31 - 1


CLEAN = [0, 0, NO_ROW, 0]


@pytest.fixture
def fresh_default_words(monkeypatch):
    """Forget the module-level default words for the test, so that the next call creates one."""
    monkeypatch.setattr(errors_module, "_DEFAULT_WORDS", {})


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
