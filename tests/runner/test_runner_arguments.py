"""The runner's arguments are checked as every other argument is: a wrong kind of value raises ``TypeError``
naming it, and a forward's output without a token axis is refused in words, not with an ``IndexError``."""

import numpy as np
import pytest
import torch

import slabstage as ss
from slabstage.graph_runner.capture import CaptureError

W, T, V = 16, 24, 29


def buffers(device="cpu"):
    return ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=2, embed_width=W, embed_dtype=torch.float32,
                                      device=device)


@pytest.mark.parametrize("value", ["false", "False", 0, 1, np.False_, None], ids=repr)
def test_enforce_eager_must_be_a_bool(value):
    with pytest.raises(TypeError, match="enforce_eager must be a bool"):
        ss.PrefillGraphRunner(lambda v: v["input_embeds"], buffers(), enforce_eager=value)


@pytest.mark.parametrize("value", [5, 5.0, "16", object()], ids=lambda v: type(v).__name__)
def test_buckets_must_be_a_sequence_of_counts(value):
    with pytest.raises(TypeError, match="buckets"):
        ss.PrefillGraphRunner(lambda v: v["input_embeds"], buffers(), buckets=value)


def test_buckets_as_any_iterable_of_ints():
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"], buffers(), buckets=range(4, 20, 4))
    assert runner.buckets == [4, 8, 12, 16]


@pytest.mark.parametrize("out", [lambda v: v["input_embeds"].sum(), lambda v: (v["input_embeds"], torch.tensor(1.0)),
                                 lambda v: {"x": v["input_embeds"].sum()}], ids=["tensor", "tuple", "dict"])
def test_forward_returning_a_0d_tensor_is_refused_clearly(out, device, stage_path):
    buf = buffers(device)
    runner = ss.PrefillGraphRunner(out, buf, buckets=[8, 16], progress=False, verify="off")
    batch = ss.PrefillBatch(input_ids=torch.randint(0, V, (7,), device=device),
                            positions=torch.arange(7, device=device), table=torch.randn(V, W, device=device))
    with pytest.raises(ValueError, match="forward must return tensors whose first axis is the token axis"):
        runner.run(batch)  # eager
    if device.type == "cuda":  # (capture names the bucket and keeps nothing: CaptureError, with the same words)
        with pytest.raises(CaptureError, match="forward must return tensors whose first axis is the token axis"):
            runner.capture()


@pytest.mark.parametrize("lazy", [False, True])
def test_capture_under_the_interpreter_is_refused_clearly(monkeypatch, lazy):
    """On CUDA with TRITON_INTERPRET set, capture() raises (the interpreter runs the kernels on the host, which a
    graph cannot capture) before it stages anything or freezes the registry; here a CPU runner stands in for one
    on CUDA."""
    from slabstage.kernels import runtime
    buf = buffers()
    before = {name: buf.registry[name].clone() for name in buf.registry}
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"], buf, buckets=[8, 16], progress=False)
    monkeypatch.setattr(runner, "eager", False)
    monkeypatch.setattr(runtime, "INTERPRET", True)
    with pytest.raises(CaptureError, match="TRITON_INTERPRET is set: .* cannot capture; unset it on a GPU, or pass "
                                           "enforce_eager=True"):
        runner.capture(lazy=lazy)
    assert not runner.captured and not buf.registry._frozen
    assert all(torch.equal(buf.registry[name], t) for name, t in before.items())
