"""One input, one answer: every path (the runner's graph and eager paths, the standalone op, the custom op)
refuses the same inputs with the same error, before anything is written; storage overlap is refused for
every source against every destination."""

import numpy as np
import pytest
import torch

import slabstage as ss
from slabstage.staging.stager import stage_batch
from slabstage.ops import HAS_CUSTOM_OPS, stage_embeddings_op, stage_token_inputs_op

W, T, V = 32, 24, 40


def buffers(device, **kw):
    return ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=4, embed_width=W, embed_dtype=torch.float32,
                                      device=device, **kw)


def snapshot(buf):
    return {name: buf.registry[name].clone() for name in buf.registry} | {"errors": buf.errors.clone()}


def unchanged(buf, before):
    for name, t in before.items():
        now = buf.errors if name == "errors" else buf.registry[name]
        assert torch.equal(now.nan_to_num(7.0), t.nan_to_num(7.0)), f"{name} was written"


class Str(str):
    pass


LOOKALIKES = [("media_owner", 1, TypeError, "media_owner must be a bool, got 1"),
              ("media_owner", np.False_, TypeError, "media_owner must be a bool"),
              ("expand", Str("zeros"), ValueError, "expand must be one of 'zeros', 'repeat'"),
              ("text_scale", "2", TypeError, "text_scale must be a real number"),
              ("text_scale", float("nan"), ValueError, "text_scale must be a finite number")]


@pytest.mark.parametrize("name, value, exc, match", LOOKALIKES, ids=[f"{c[0]}={c[1]!r}" for c in LOOKALIKES])
def test_values_are_compared_by_type_and_value_on_every_path(name, value, exc, match, device):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, W, generator=g).to(device)
    ids = torch.randint(0, V, (10,), generator=g).to(device)
    media = torch.randn(4, W, generator=g).to(device)
    index = ss.media_index_from_spans([(2, 4, 0)], 10, device=device)
    good = dict(media=media, media_index=index)
    buf = buffers(device)
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"] * 1, buf, buckets=[16], progress=False).capture()
    before = snapshot(buf)
    with pytest.raises(exc, match=match):  # the runner (graph path on CUDA, eager without)
        runner.run(ss.PrefillBatch(input_ids=ids, positions=torch.arange(10, device=device), table=table, **good,
                                   **{name: value}))
    with pytest.raises(exc, match=match):  # the runner's eager path: past the largest bucket
        runner.run(ss.PrefillBatch(input_ids=torch.randint(0, V, (20,), generator=g).to(device),
                                   positions=torch.arange(20, device=device), table=table, **{name: value}))
    unchanged(buf, before)
    slab = torch.full((T, W), float("nan"), device=device)
    with pytest.raises(exc, match=match):
        ss.stage_embeddings(slab, ids, table, **good, **{name: value})
    if HAS_CUSTOM_OPS:
        with pytest.raises(exc, match=match):
            stage_embeddings_op(slab, ids, table, **good, **{name: value})
    assert torch.isnan(slab).all()


CUSTOM_OP_ARGS = [(dict(text_scale="2"), TypeError, "text_scale must be a real number"),
                  (dict(pad_to=6.5), TypeError, r"pad_to must be an int, got 6.5"),
                  (dict(expand=3), ValueError, "expand must be one of 'zeros', 'repeat', got 3"),
                  (dict(errors=[0, 0, 0, 0]), ValueError, "errors must be a contiguous 1-D int32 tensor")]


@pytest.mark.skipif(not HAS_CUSTOM_OPS, reason="needs torch.library.custom_op")
@pytest.mark.parametrize("kw, exc, match", CUSTOM_OP_ARGS, ids=[str(c[0]) for c in CUSTOM_OP_ARGS])
def test_custom_ops_name_the_argument_the_schema_cannot_carry(kw, exc, match, device):
    table = torch.randn(V, W, device=device)
    ids = torch.randint(0, V, (10,), device=device)
    slab = torch.full((T, W), float("nan"), device=device)
    for stage in (ss.stage_embeddings, stage_embeddings_op):
        with pytest.raises(exc, match=match):
            stage(slab, ids, table, **kw)
    assert torch.isnan(slab).all()
    with pytest.raises(TypeError, match=r"pad_to must be an int, got None"):
        stage_token_inputs_op(buffers(device), input_ids=ids, positions=torch.arange(10, device=device), pad_to=None)


def overlapping(buf, where):
    """A source that shares storage with a destination (or the error word inside the slab, the table or a slot)."""
    if where == "table in positions":
        return dict(table=buf.positions.view(torch.float32)[:W].view(1, W))
    if where == "input_ids in the slab":
        return dict(input_ids=buf.input_embeds.view(torch.int64)[0, :10])
    if where == "media_index in the slab":
        return dict(media_index=buf.input_embeds.view(torch.int64)[1, :10])
    if where == "media in out_cache_loc":
        return dict(media=buf.out_cache_loc.view(torch.float32)[:W].view(1, W))
    if where == "item in positions":
        return dict(media=[torch.randn(2, W, device=buf.device), buf.positions.view(torch.float32)[:W].view(1, W)])
    if where == "stride-0 table over the slab":  # its rows overlap: only the first row's bytes are its own
        return dict(table=buf.input_embeds[5].expand(V, W))
    raise AssertionError(where)


OVERLAPS = ["table in positions", "input_ids in the slab", "media_index in the slab", "media in out_cache_loc",
            "item in positions", "stride-0 table over the slab"]


@pytest.mark.parametrize("where", OVERLAPS)
def test_every_source_sharing_storage_with_a_destination_is_refused(where, device):
    buf = buffers(device)
    g = torch.Generator().manual_seed(1)
    args = dict(input_ids=torch.randint(0, 1, (10,), generator=g).to(device), positions=torch.arange(10).to(device),
                table=torch.randn(V, W, generator=g).to(device), media=torch.randn(4, W, generator=g).to(device),
                media_index=ss.media_index_from_spans([(2, 3, 0)], 10, device=device),
                out_cache_loc=torch.arange(10).to(device), seq_lens=torch.tensor([4, 6], dtype=torch.int32).to(device),
                extend_start_loc=torch.tensor([0, 4], dtype=torch.int32).to(device))
    args.update(overlapping(buf, where))
    before = snapshot(buf)
    with pytest.raises(ValueError, match="overlaps .* in memory"):
        stage_batch(buf, pad_to=12, **args)
    unchanged(buf, before)
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"] * 1, buf, buckets=[16], progress=False)
    with pytest.raises(ValueError, match="overlaps .* in memory"):
        runner.run(ss.PrefillBatch(**args))
    unchanged(buf, before)


@pytest.mark.parametrize("inside", ["the slab", "the table", "a slot"])
def test_an_error_word_inside_a_buffer_or_a_source_is_refused(inside, device):
    buf = buffers(device)
    table = torch.randn(V, W, device=device)
    ids = torch.randint(0, V, (10,), device=device)
    word = {"the slab": lambda: buf.input_embeds.view(torch.int32)[3, :4],
            "the table": lambda: table.view(torch.int32)[0, :4],
            "a slot": lambda: buf.positions.view(torch.int32)[:4]}[inside]()
    before = snapshot(buf)
    if inside != "a slot":
        with pytest.raises(ValueError, match="overlaps"):
            ss.stage_embeddings(buf.input_embeds, ids, table, errors=word)
    buf.errors = word
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"] * 1, buf, buckets=[16], progress=False)
    with pytest.raises(ValueError, match="overlaps"):
        runner.run(ss.PrefillBatch(input_ids=ids, positions=torch.arange(10, device=device), table=table))
    if inside == "a slot":
        with pytest.raises(ValueError, match="overlaps"):
            ss.stage_token_inputs(buf, input_ids=ids, positions=torch.arange(10, device=device), pad_to=12)
    buf.errors = before["errors"]
    unchanged(buf, before)


def test_a_batch_changed_after_it_was_made_is_checked_again(device):
    buf = buffers(device)
    runner = ss.PrefillGraphRunner(lambda v: v["input_embeds"] * 1, buf, buckets=[16], progress=False).capture()
    batch = ss.PrefillBatch(input_ids=torch.zeros(8, dtype=torch.int64), positions=torch.arange(8),
                            table=torch.randn(V, W, device=device))
    for bad in ([0] * 8, None):
        batch.input_ids = bad
        with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
            runner.run(batch)


@pytest.mark.parametrize("kind", ["sparse", "mkldnn", "nested"])
def test_items_that_are_not_dense_tensors_are_named(kind):
    dense = torch.randn(3, W)
    item = {"sparse": lambda: dense.to_sparse(), "mkldnn": lambda: dense.to_mkldnn(),
            "nested": lambda: torch.nested.nested_tensor([dense, dense])}[kind]()
    with pytest.raises(TypeError, match="media item 1 must be a dense"):
        ss.stage_embeddings(torch.zeros(T, W), torch.zeros(6, dtype=torch.int64), torch.randn(V, W),
                            media=[dense, item], media_index=torch.arange(6))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_spans_for_a_cuda_device_without_one_say_so():
    with pytest.raises(ValueError, match="no CUDA device"):
        ss.media_index_from_spans([(0, 2, 0)], 4, device="cuda")
