"""A graph replayed with no parameter record copied in for it (a bare ``graph.replay()``, as a profiler or a
benchmark may run): the last program of the kernel that read the last record to count itself on the ticket
cleared its ``H_LIVE`` word, so the kernel writes nothing, the buffers keep the last staged batch and the next
step stages as it should. A replay here is what :meth:`Stager.replay` and a graph made by :meth:`Stager.record`
do: the ring slot copied into the graphs' device record, the kernel over it. On the CPU the Triton interpreter
runs it (its programs count at their end, with Triton's atomic); on a CUDA device the compiled kernel (thread 0
of each program counts by inline PTX once it has read ``H_LIVE``)."""

import pytest
import torch

from slabstage import StagingBuffers, stage_token_inputs
from slabstage.kernels.layout import H_LIVE
from slabstage.kernels.runtime import INTERPRET
from slabstage.staging.stager import Inputs, Stager, stage_batch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def dev(request, ring_of):
    """The interpreter on the CPU, or a CUDA device's compiled kernel; a ring of 4 slots (the steps walk past
    it)."""
    if request.param == "cpu" and not INTERPRET:
        pytest.skip("CPU tensors run the reference unless TRITON_INTERPRET=1")
    if request.param == "cuda" and (INTERPRET or not HAS_CUDA):
        pytest.skip("needs a CUDA device (and no interpreter)")
    ring_of(4)
    return torch.device(request.param)


def graph(st, pad_to: int) -> None:
    """What a captured graph runs: the kernel over the graphs' device record (the last program to count clears
    the record's H_LIVE word and puts the ticket back to 0)."""
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


def test_a_replays_record_is_not_launched_nor_a_launchs_replayed(dev):
    buf = StagingBuffers.allocate(max_num_tokens=16, max_batch_size=2, embed_width=8, embed_dtype=torch.float32,
                                  device=dev)
    st = Stager.for_buffers(buf, embed=False)
    ids = torch.arange(4, device=dev)
    c = st.prepare(Inputs(input_ids=ids, positions=ids), 8, replay=True)
    with pytest.raises(RuntimeError, match="replay"):
        st.launch(c, 8)
    st.prepare(Inputs(input_ids=ids, positions=ids), 8)
    with pytest.raises(RuntimeError, match="replay=True"):
        st.replay(None)


@pytest.mark.parametrize("steps", [1, 3, 5, 9])
@pytest.mark.parametrize("last", ["replay", "launch"])
def test_token_inputs(dev, steps, last):
    """Bare replays after a replay or after an eager launch of the same stager write nothing, whatever the grid
    (each graph of a runner has its own, all counting on the one ticket)."""
    buf = StagingBuffers.allocate(max_num_tokens=400, max_batch_size=4, embed_width=8, embed_dtype=torch.bfloat16,
                                  device=dev)
    st = Stager.for_buffers(buf, embed=False)
    for step in range(1, steps + 1):
        ids = torch.arange(step * 100, step * 100 + 8 + step, device=dev)
        if last == "launch" and step == steps:
            stage_token_inputs(buf, input_ids=ids, positions=ids + 1, pad_to=32)
        else:
            replay(st, 32, input_ids=ids, positions=ids + 1)
        assert torch.equal(buf.input_ids[:8 + step], ids.to(buf.input_ids.dtype))
    ids_before, pos_before = buf.input_ids.clone(), buf.positions.clone()
    for pad_to in (32, 8, 384, 32):  # (grids of 2, 2 and 6 programs a slot block: the ticket back to 0 each time)
        graph(st, pad_to)
        assert torch.equal(buf.input_ids, ids_before) and torch.equal(buf.positions, pos_before)
        assert int(st.ring.done[0]) == steps  # (not moved back)
    ids = torch.arange(900, 911, device=dev)
    replay(st, 32, input_ids=ids, positions=ids + 1)
    assert torch.equal(buf.input_ids[:11], ids.to(buf.input_ids.dtype))
    assert torch.equal(buf.positions[:11], (ids + 1).to(buf.positions.dtype))
    assert int(st.ring.done[0]) == steps + 1


def test_slab_and_slots(dev):
    """The whole batch (slab rows, media, integer slots): a bare replay leaves every buffer as the last step
    staged it; the next step stages its own batch."""
    g = torch.Generator().manual_seed(3)
    buf = StagingBuffers.allocate(max_num_tokens=32, max_batch_size=4, embed_width=12, embed_dtype=torch.float32,
                                  device=dev)
    st = Stager.for_buffers(buf, embed=True)
    table = torch.randn(50, 12, generator=g).to(dev)

    def step(n, how):
        ids = torch.randint(0, 50, (n,), generator=g).to(dev)
        media = torch.randn(4, 12, generator=g).to(dev)
        index = torch.full((n,), -1, device=dev)
        index[2:6] = torch.arange(4)
        kw = dict(input_ids=ids, positions=torch.arange(n, device=dev), table=table, media=media, media_index=index)
        if how == "replay":
            replay(st, 24, **kw)
        else:
            stage_batch(buf, pad_to=24, **kw)
        return ids, media

    for n, how in ((20, "replay"), (9, "launch"), (17, "replay"), (23, "replay"), (11, "launch")):
        step(n, how)
    before = {name: buf.registry[name].clone() for name in buf.registry}
    for pad_to in (24, 8, 32):
        graph(st, pad_to)
        for name, t in before.items():  # (byte for byte: rows never written may hold NaN)
            assert torch.equal(buf.registry[name].flatten().view(torch.uint8), t.flatten().view(torch.uint8)), name
    ids, media = step(13, "replay")
    rows = table[ids]
    rows[2:6] = media
    assert torch.equal(buf.input_embeds[:13], rows) and buf.input_embeds[13:24].eq(0).all()
    assert torch.equal(buf.input_ids[:13], ids.to(buf.input_ids.dtype))
