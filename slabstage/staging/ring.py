"""The pinned ring a parameter record travels through: ``K`` pinned slots, step ``s`` written into slot ``s % K``
once the ring's ``done`` word (stored by each staging launch) says step ``s - K`` was read; no event, no host sync
unless the host runs ``K`` steps ahead of the device (docs/design.md, "One kernel, one parameter record").
"""

from __future__ import annotations

import time

import torch

__all__ = ["PinnedRing"]


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
