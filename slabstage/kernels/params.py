"""The staging kernel's parameter block: its layout, and the pinned ring it travels through.

Everything that changes from one batch to the next reaches the kernel as data in
one parameter block of int64 words, not as launch arguments, so a captured launch serves
every batch. Layout (word offsets):

- the header (``H_*``): the step number, where the launch reports it (the ring's
  ``done`` word for the host, a device counter for the fetch), the parameter block's length,
  ``n``, the request count, vocabulary bounds, ``text_scale`` (fp32 bits),
  switches (``F_*``), the table, the ids and ``media_index`` sources, the media
  rows, items and column blocks, where the item list starts, ``pad_to`` (the rows to write: a
  launch's grid may cover more);
- per integer slot (:data:`~slabstage.staging.slots.SLOTS` order) its source
  (``S_*``: address, dtype, row stride), then per slot its destination (``D_*``:
  address, dtype, row stride, pad value, whether padded, kind, rows, length). The
  destinations are the same for every batch of a stager, so every word a batch
  changes lies in one stretch at the start;
- the item list: each item's first media row, then per item and column block its
  fields (``C_*``: address, row stride, first column, end column);
- host integer inputs, each 16-byte aligned (their device address is the device
  parameter block's plus their offset).

Dtype codes: integers ``INT32_CODE``, ``INT64_CODE`` (``NO_INPUT``: no such input); floats ``FLOAT16_CODE``,
``BFLOAT16_CODE``, ``FLOAT32_CODE``. A source of ``LAYOUT_CODE`` (the mrope slot's alone) is a segment list
(:mod:`slabstage.kernels.mrope`) in the parameter block: its address, then its segment count.

The kernels read these constants under the same names (:mod:`slabstage.kernels.consts`).

The ring: ``K`` pinned slots of one pinned buffer, step ``s`` written into slot
``s % K``. Its parameter block reaches the stager's device copy through a copy queued before
the launch (eager paths), or through the fetch kernel that begins every captured
graph: it reads the device counter (the last step staged) and copies slot
``(counter + 1) % K``. Program 0 of each staging launch stores its step into the
counter and into the ring's ``done`` word (pinned, read by the host): the parameter block of
step ``s`` has been read by then. The host writes step ``s`` only once
``done >= s - K``: no event, no host sync unless the host runs ``K`` steps ahead of
the device.
"""

from __future__ import annotations

import time

import torch

__all__ = ["HEADER_WORDS", "MAX_ITEM_WORDS", "SOURCE_WORDS", "DEST_WORDS", "INT_CODE", "LAYOUT_CODE", "FLOAT_CODE",
           "FLOAT_BYTES", "PinnedRing"]

# -- header ------------------------------------------------------------------------------
(H_STEP, H_DONE, H_COUNTER, H_WORDS, H_N, H_B, H_VOCAB_START, H_VOCAB_END, H_VOCAB_SIZE, H_SCALE, H_FLAGS,
 H_TABLE, H_TABLE_STRIDE, H_TABLE_WIDTH, H_TABLE_DTYPE, H_IDS, H_IDS_DTYPE, H_INDEX, H_INDEX_DTYPE,
 H_NUM_MEDIA, H_NUM_ITEMS, H_ITEM_BLOCKS, H_MEDIA_DTYPE, H_MEDIA_WIDTH, H_ITEMS, H_PAD_TO) = range(26)
HEADER_WORDS = 32

# switches in H_FLAGS
F_SCALE = 1  # multiply text rows by text_scale (in fp32)
F_MEDIA = 2  # write media rows (a media owner); off: media rows are zeros
F_TEXT_TILED = 4  # the text width divides the slab's and BLOCK (columns a program writes) divides it: tile by pieces
F_TEXT_WRAP = 8  # tiled, but BLOCK does not divide it: each column wraps on its own
F_MEDIA_TILED = 16
F_MEDIA_WRAP = 32
F_TEXT_VEC = 64  # table address, row stride and width in whole 16-byte vectors: vector loads
F_MEDIA_VEC = 128  # the same for every column block of every media item

# -- slot descriptors: the sources of every slot after the header, then their destinations -----------
S_ADDR, S_DTYPE, S_STRIDE = range(3)  # at HEADER_WORDS + SOURCE_WORDS * slot
SOURCE_WORDS = 3
D_ADDR, D_DTYPE, D_STRIDE, D_FILL, D_PAD, D_KIND, D_ROWS, D_LENGTH = range(8)  # after every source
DEST_WORDS = 8

# -- the item and segment lists after the destinations: their room in every parameter block (checked with
#    the batch)
MAX_ITEM_WORDS = 1 << 14  # 1 + 4 x column blocks words a media item, 8 words a segment of mrope positions
C_ADDR, C_STRIDE, C_FIRST_COL, C_END_COL = range(4)  # an item's column block, after the item starts
COLUMN_BLOCK_WORDS = 4

# -- how the kernels tile a batch -----------------------------------------------------------
TOKEN_ROWS = 128  # integer-slot rows per program
ITEM_CHUNK = 32  # item starts read per vector load when finding a media row's item
FETCH_CHUNK = 512  # parameter-block words a fetch program copies (4 KiB)

NO_INPUT, INT32_CODE, INT64_CODE = 0, 1, 2  # (4 bytes a code)
INT_CODE = {torch.int32: INT32_CODE, torch.int64: INT64_CODE}
LAYOUT_CODE = 3  # a source that is a segment list: positions computed from it
FLOAT16_CODE, BFLOAT16_CODE, FLOAT32_CODE = 0, 1, 2
FLOAT_CODE = {torch.float16: FLOAT16_CODE, torch.bfloat16: BFLOAT16_CODE, torch.float32: FLOAT32_CODE}
FLOAT_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


class PinnedRing:
    """``K`` pinned slots of ``slot_bytes`` each, in one pinned buffer, written in turn (module docstring).

    ``take()`` returns the step the next launch carries and the word offset of its slot;
    ``commit(step)`` records that its launch was queued. ``words`` is the whole ring as
    int64 words (a numpy view for the host, ``tensor`` for a kernel). On the CPU every
    launch has finished when it returns, so nothing is ever waited for.
    """

    def __init__(self, slot_bytes: int, pinned: bool, k: int = 8) -> None:
        self.k = k
        self.slot_words = -(-slot_bytes // 64) * 8  # whole 64-byte lines
        with torch.inference_mode(False):  # normal tensors, in and outside inference mode
            self.tensor = torch.zeros(k * self.slot_words, dtype=torch.int64, device="cpu", pin_memory=pinned)
            self.done = torch.zeros(2, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self.words = self.tensor.numpy()
        self.base = self.tensor.data_ptr()
        self.done_addr = self.done.data_ptr()
        self.spare_done_addr = self.done_addr + 8  # where a launch outside the ring reports
        self._done = memoryview(self.done.numpy())  # (a Python int a read: cheaper than numpy's scalars)
        self.step = 0

    def take(self) -> tuple[int, int]:
        """``(step, word offset of its slot)`` for the next launch."""
        step = self.step + 1
        if self._done[0] < step - self.k:
            self._wait(step - self.k)
        return step, (step % self.k) * self.slot_words

    def commit(self, step: int) -> None:
        """The launch carrying ``step`` was queued (a step whose launch never came is not counted)."""
        self.step = step

    def _wait(self, step: int) -> None:
        """The host is ``K`` steps ahead of the device: wait for the launch of ``step`` to start."""
        deadline = time.monotonic() + 60.0
        while self._done[0] < step:
            if time.monotonic() > deadline:
                raise RuntimeError(f"slabstage: staging step {step} has not started on the device after 60 s "
                                   f"(the ring's done word reads {int(self._done[0])})")
            time.sleep(20e-6)
