"""A graph replayed with no parameter record copied in for it (a bare ``graph.replay()``, as a profiler or a
benchmark may run): the last program of the kernel that read the last record cleared its ``H_LIVE`` word, so the
kernel writes nothing, the buffers keep the last staged batch and the next step stages as it should. On the
CPU (the Triton interpreter) a replay is what :meth:`Stager.replay` and a graph made by :meth:`Stager.record` do
on a GPU: the ring slot copied into the graphs' device record, the kernel over it."""

import pytest
import torch

from slabstage import StagingBuffers, stage_token_inputs
from slabstage.kernels.layout import H_LIVE
from slabstage.staging.stager import Inputs, Stager, stage_batch


@pytest.fixture(autouse=True)
def four_slots(ring_of):
    """A ring of 4 slots (the Triton path's; skips on the reference path): the steps walk past it."""
    ring_of(4)


def graph(st, pad_to: int) -> None:
    """What a captured graph runs: the kernel over the graphs' device record (its last program clears the record's
    H_LIVE word)."""
    st._kernel(max(st._grid(pad_to), 1), st.graph_params)
    assert int(st.graph_params[H_LIVE]) == 0 and int(st.graph_params[-8:].view(torch.int32)[0]) == 0


def replay(st, pad_to: int, **inputs) -> None:
    """``prepare(replay=True)``, the record copied into the graphs' device record, the graph."""
    st.prepare(Inputs(**inputs), pad_to, replay=True)
    step, at, words, for_replay = st._pending
    assert for_replay
    st.graph_params[:words] = st.ring.tensor[at:at + words]
    graph(st, pad_to)
    st.ring.commit(step)


def test_a_replays_record_is_not_launched_nor_a_launchs_replayed():
    buf = StagingBuffers.allocate(max_num_tokens=16, max_batch_size=2, embed_width=8, embed_dtype=torch.float32,
                                  device="cpu")
    st = Stager.for_buffers(buf, embed=False)
    c = st.prepare(Inputs(input_ids=torch.arange(4), positions=torch.arange(4)), 8, replay=True)
    with pytest.raises(RuntimeError, match="replay"):
        st.launch(c, 8)
    st.prepare(Inputs(input_ids=torch.arange(4), positions=torch.arange(4)), 8)
    with pytest.raises(RuntimeError, match="replay=True"):
        st.replay(None)


@pytest.mark.parametrize("steps", [1, 3, 5, 9])
@pytest.mark.parametrize("last", ["replay", "launch"])
def test_token_inputs(steps, last):
    """Bare replays after a replay or after an eager launch of the same stager write nothing."""
    buf = StagingBuffers.allocate(max_num_tokens=64, max_batch_size=4, embed_width=8, embed_dtype=torch.bfloat16,
                                  device="cpu")
    st = Stager.for_buffers(buf, embed=False)
    for step in range(1, steps + 1):
        ids = torch.arange(step * 100, step * 100 + 8 + step)
        if last == "launch" and step == steps:
            stage_token_inputs(buf, input_ids=ids, positions=ids + 1, pad_to=32)
        else:
            replay(st, 32, input_ids=ids, positions=ids + 1)
        assert torch.equal(buf.input_ids[:8 + step], ids)
    ids_before, pos_before = buf.input_ids.clone(), buf.positions.clone()
    for _ in range(3):
        graph(st, 32)
        assert torch.equal(buf.input_ids, ids_before) and torch.equal(buf.positions, pos_before)
        assert int(st.ring.done[0]) == steps  # (not moved back)
    ids = torch.arange(900, 911)
    replay(st, 32, input_ids=ids, positions=ids + 1)
    assert torch.equal(buf.input_ids[:11], ids) and torch.equal(buf.positions[:11], ids + 1)
    assert int(st.ring.done[0]) == steps + 1


def test_slab_and_slots():
    """The whole batch (slab rows, media, integer slots): a bare replay leaves every buffer as the last step
    staged it; the next step stages its own batch."""
    g = torch.Generator().manual_seed(3)
    buf = StagingBuffers.allocate(max_num_tokens=32, max_batch_size=4, embed_width=12, embed_dtype=torch.float32,
                                  device="cpu")
    st = Stager.for_buffers(buf, embed=True)
    table = torch.randn(50, 12, generator=g)

    def step(n, how):
        ids = torch.randint(0, 50, (n,), generator=g)
        media = torch.randn(4, 12, generator=g)
        index = torch.full((n,), -1)
        index[2:6] = torch.arange(4)
        kw = dict(input_ids=ids, positions=torch.arange(n), table=table, media=media, media_index=index)
        if how == "replay":
            replay(st, 24, **kw)
        else:
            stage_batch(buf, pad_to=24, **kw)
        return ids, media

    for n, how in ((20, "replay"), (9, "launch"), (17, "replay"), (23, "replay"), (11, "launch")):
        step(n, how)
    before = {name: buf.registry[name].clone() for name in buf.registry}
    for _ in range(2):
        graph(st, 24)
        for name, t in before.items():  # (byte for byte: rows never written may hold NaN)
            assert torch.equal(buf.registry[name].flatten().view(torch.uint8), t.flatten().view(torch.uint8)), name
    ids, media = step(13, "replay")
    rows = table[ids]
    rows[2:6] = media
    assert torch.equal(buf.input_embeds[:13], rows) and buf.input_embeds[13:24].eq(0).all()
    assert torch.equal(buf.input_ids[:13], ids.to(buf.input_ids.dtype))
