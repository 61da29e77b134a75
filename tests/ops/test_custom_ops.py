"""The staging ops as torch.library custom ops: traced by torch.compile with no graph break."""

import pytest
import torch

import slabstage as ss
from slabstage.ops import HAS_CUSTOM_OPS, stage_embeddings_op, stage_token_inputs_op

pytestmark = pytest.mark.skipif(not HAS_CUSTOM_OPS, reason="needs torch.library.custom_op (torch >= 2.4)")


def _backend(device):
    # inductor on CUDA (the Triton kernels inside a compiled region); aot_eager on CPU keeps CI quick
    return "inductor" if device.type == "cuda" else "aot_eager"


def _inputs(device, n=37, width=96):
    g = torch.Generator().manual_seed(n)
    table = torch.randn(50, 48, generator=g).to(device)
    media = torch.randn(9, width, generator=g).to(device)
    ids = torch.randint(0, 50, (n,), generator=g).to(device)
    index = ss.media_index_from_spans([(3, 5, 0), (20, 4, 5)], n, device=device)
    return table, media, ids, index


def test_stage_embeddings_compiles_without_graph_break(device):
    torch._dynamo.reset()
    table, media, ids, index = _inputs(device)

    def step(slab, errors, ids, table, media, index, scale):
        stage_embeddings_op(slab, ids, table, media=media, media_index=index, pad_to=48, expand="repeat",
                            text_scale=2.0, errors=errors)
        return slab.float().sum(dim=1) * scale

    compiled = torch.compile(step, backend=_backend(device), fullgraph=True)
    eager_slab = torch.full((64, 96), float("nan"), device=device, dtype=torch.bfloat16)
    comp_slab = eager_slab.clone()
    e1, e2 = ss.new_error_word(device), ss.new_error_word(device)
    want = step(eager_slab, e1, ids, table, media, index, 3.0)
    got = compiled(comp_slab, e2, ids, table, media, index, 3.0)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(comp_slab.nan_to_num(7.0), eager_slab.nan_to_num(7.0))
    assert torch.isnan(comp_slab[48:].float()).all()  # past pad_to: untouched inside the compiled region too
    assert torch.equal(e1, e2)


def test_stage_token_inputs_compiles_without_graph_break(device):
    torch._dynamo.reset()
    n = 29

    def make():
        buf = ss.StagingBuffers.allocate(max_num_tokens=64, max_batch_size=4, embed_width=8,
                                         embed_dtype=torch.float32, device=device, mrope=True)
        for name in buf.registry:
            t = buf.registry[name]
            if not t.dtype.is_floating_point:
                t.fill_(-3)
        return buf

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (n,), generator=g).to(device)
    pos = torch.randint(0, 1000, (n,), generator=g).to(device)
    mrope = torch.randint(0, 1000, (3, n), generator=g).to(device)
    seq = torch.tensor([10, 19], dtype=torch.int32, device=device)
    ext = torch.tensor([0, 10], dtype=torch.int32, device=device)
    eager, comp = make(), make()

    def step(buf, ids, pos, mrope, seq, ext):
        stage_token_inputs_op(buf, input_ids=ids, positions=pos, mrope_positions=mrope, seq_lens=seq,
                              extend_start_loc=ext, pad_to=40)
        return buf.input_ids[:40] + buf.positions[:40]

    want = step(eager, ids, pos, mrope, seq, ext)
    got = torch.compile(step, backend=_backend(device), fullgraph=True)(comp, ids, pos, mrope, seq, ext)
    assert torch.equal(got, want)
    for name in eager.registry:
        assert torch.equal(comp.registry[name], eager.registry[name]), name


def _small(device):
    g = torch.Generator().manual_seed(0)
    return torch.randn(50, 48, generator=g).to(device), torch.randint(0, 50, (7,), generator=g).to(device)


def test_the_default_error_word_is_made_inside_a_compiled_region(device, monkeypatch):
    """errors=None in a fresh process, where the first staging on the device is compiled with fullgraph: the
    device's default word is made as the trace runs (no lock, no graph break) and records the call's errors."""
    from slabstage.staging import errors as E

    monkeypatch.setattr(E, "_DEFAULT_WORDS", {})  # as in a fresh process: no call has staged on this device yet
    torch._dynamo.reset()
    table, ids = _small(device)

    def step(slab, ids):
        stage_embeddings_op(slab, ids, table, pad_to=8)  # errors=None: the device's default word
        return slab[:8] * 1

    out = torch.compile(step, backend=_backend(device), fullgraph=True)(torch.zeros(16, 48, device=device), ids + 100)
    assert torch.equal(out, torch.zeros_like(out))  # every id out of the vocabulary: zero rows
    assert E._DEFAULT_WORDS[ids.device][1].item() == 7  # and the word holds the 7 bad rows (keyed cuda:N, not cuda)


def test_a_text_scale_that_changes_between_calls_compiles_without_graph_break(device):
    torch._dynamo.reset()
    table, ids = _small(device)
    errors = ss.new_error_word(device)

    def step(slab, ids, scale):
        stage_embeddings_op(slab, ids, table, pad_to=8, text_scale=scale, errors=errors)
        return slab[:7] * 1

    compiled = torch.compile(step, backend=_backend(device), fullgraph=True)
    for scale in (1.0, 2.0, 3.5):
        out = compiled(torch.zeros(16, 48, device=device), ids, scale)
        assert torch.equal(out, table[ids] * scale)
