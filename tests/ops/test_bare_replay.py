"""A graph replayed with no parameter record prepared for it (a bare ``graph.replay()``, as a profiler or a
benchmark may run): its fetch finds an older step in the ring slot it reads and the kernel writes nothing, so the
buffers keep the last staged batch, and the next prepared step stages as it should. On the CPU a launch is the
graph's two kernels, fetch then stage (under the Triton interpreter)."""

import pytest
import torch

from slabstage import StagingBuffers, stage_token_inputs
from slabstage.staging.stager import stage_batch
from slabstage.staging import stager as stager_module


@pytest.fixture
def four_slots(ring_of):
    """A ring of 4 slots, so that a bare replay finds an older step in the slot it reads."""
    ring_of(4)


def bare_replay(stager, pad_to: int) -> None:
    """What a captured graph runs, with no prepare() before it."""
    stager._fetch(-(-stager.words_for(pad_to) // stager_module.FETCH_CHUNK))
    stager._kernel(max(stager._grid(pad_to), 1), stager.params)


@pytest.mark.parametrize("steps", [1, 3, 5, 9])
def test_token_inputs(four_slots, steps):
    buf = StagingBuffers.allocate(max_num_tokens=64, max_batch_size=4, embed_width=8, embed_dtype=torch.bfloat16,
                                  device="cpu")
    st = stager_module.Stager.for_buffers(buf, embed=False)
    for step in range(1, steps + 1):
        ids = torch.arange(step * 100, step * 100 + 8 + step)
        stage_token_inputs(buf, input_ids=ids, positions=ids + 1, pad_to=32)
    ids_before, pos_before = buf.input_ids.clone(), buf.positions.clone()
    for _ in range(3):
        bare_replay(st, 32)
        assert torch.equal(buf.input_ids, ids_before) and torch.equal(buf.positions, pos_before)
        assert int(st.counter[0]) == steps and int(st.ring.done[0]) == steps  # neither moved back
    ids = torch.arange(900, 911)
    stage_token_inputs(buf, input_ids=ids, positions=ids + 1, pad_to=32)
    assert torch.equal(buf.input_ids[:11], ids) and torch.equal(buf.positions[:11], ids + 1)
    assert int(st.counter[0]) == steps + 1


def test_slab_and_slots(four_slots):
    """The whole batch (slab rows, media, integer slots): a bare replay leaves every buffer as the last step
    staged it; the next step stages its own batch."""
    g = torch.Generator().manual_seed(3)
    buf = StagingBuffers.allocate(max_num_tokens=32, max_batch_size=4, embed_width=12, embed_dtype=torch.float32,
                                  device="cpu")
    st = stager_module.Stager.for_buffers(buf, embed=True)
    table = torch.randn(50, 12, generator=g)

    def step(n):
        ids = torch.randint(0, 50, (n,), generator=g)
        media = torch.randn(4, 12, generator=g)
        index = torch.full((n,), -1)
        index[2:6] = torch.arange(4)
        stage_batch(buf, pad_to=24, input_ids=ids, positions=torch.arange(n), table=table, media=media,
                    media_index=index)
        return ids, media

    for n in (20, 9, 17, 23, 11):
        step(n)
    before = {name: buf.registry[name].clone() for name in buf.registry}
    for _ in range(2):
        bare_replay(st, 24)
        for name, t in before.items():  # (byte for byte: rows never written may hold NaN)
            assert torch.equal(buf.registry[name].flatten().view(torch.uint8), t.flatten().view(torch.uint8)), name
    ids, media = step(13)
    rows = table[ids]
    rows[2:6] = media
    assert torch.equal(buf.input_embeds[:13], rows) and buf.input_embeds[13:24].eq(0).all()
    assert torch.equal(buf.input_ids[:13], ids.to(buf.input_ids.dtype))
