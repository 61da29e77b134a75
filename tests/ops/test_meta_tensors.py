"""A ``meta`` tensor (a table never materialised, meta positions) given to a custom op is refused with the
``ValueError`` the plain function raises, naming it, before anything is written: the op's fake implementation
is for tracers' fake tensors, not for real meta tensors."""

import pytest
import torch

import slabstage as ss
from slabstage.ops import HAS_CUSTOM_OPS, stage_embeddings_op, stage_token_inputs_op

pytestmark = pytest.mark.skipif(not HAS_CUSTOM_OPS, reason="needs torch.library.custom_op")

W, T, V, N = 12, 20, 31, 9


def _error(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def _embeddings_args(device, meta):
    g = torch.Generator().manual_seed(4)
    args = dict(input_ids=torch.randint(0, V, (N,), generator=g).to(device), table=torch.randn(V, W, generator=g)
                .to(device), media=torch.randn(3, W, generator=g).to(device),
                media_index=ss.media_index_from_spans([(2, 3, 0)], N, device=device))
    args[meta] = torch.empty_like(args[meta], device="meta")
    return args


@pytest.mark.parametrize("meta", ["input_ids", "table", "media", "media_index"])
def test_stage_embeddings_op_refuses_a_meta_tensor_as_the_function_does(meta, device, stage_path):
    a = _embeddings_args(device, meta)
    slab = torch.full((T, W), float("nan"), device=device)
    plain = _error(lambda: ss.stage_embeddings(slab, a["input_ids"], a["table"], media=a["media"],
                                               media_index=a["media_index"]))
    assert meta in plain and "meta" in plain
    assert _error(lambda: stage_embeddings_op(slab, a["input_ids"], a["table"], media=a["media"],
                                              media_index=a["media_index"])) == plain
    errors = ss.new_error_word(device)
    assert _error(lambda: torch.ops.slabstage.stage_embeddings(
        slab, a["input_ids"], a["table"], a["media"], a["media_index"], errors, N, "zeros", None, 0, V, V,
        True)) == plain
    assert torch.isnan(slab).all()


@pytest.mark.parametrize("meta", ["input_ids", "positions", "out_cache_loc", "seq_lens"])
def test_stage_token_inputs_op_refuses_a_meta_tensor_as_the_function_does(meta, device, stage_path):
    buf = ss.StagingBuffers.allocate(max_num_tokens=T, max_batch_size=2, embed_width=W, embed_dtype=torch.float32,
                                     device=device)
    for name in buf.registry:
        buf.registry[name].fill_(float("nan") if buf.registry[name].dtype.is_floating_point else -3)
    before = {name: buf.registry[name].clone() for name in buf.registry}
    errors = buf.errors.clone()
    g = torch.Generator().manual_seed(5)
    src = dict(input_ids=torch.randint(0, V, (N,), generator=g).to(device), positions=torch.arange(N, device=device),
               out_cache_loc=torch.randint(0, 99, (N,), generator=g).to(device),
               seq_lens=torch.tensor([4, 5], device=device))
    src[meta] = torch.empty_like(src[meta], device="meta")
    plain = _error(lambda: ss.stage_token_inputs(buf, pad_to=N + 2, **src))
    assert meta in plain and "meta" in plain
    assert _error(lambda: stage_token_inputs_op(buf, pad_to=N + 2, **src)) == plain
    for name, t in before.items():
        assert torch.equal(buf.registry[name].nan_to_num(7.0), t.nan_to_num(7.0)), f"{name} was written"
    assert torch.equal(buf.errors, errors)


def test_fake_tensors_still_trace(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    slab = torch.zeros(T, W, device=device)
    ids, table = torch.randint(0, V, (N,), device=device), torch.randn(V, W, device=device)
    errors = ss.new_error_word(device)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in (slab, ids, table, errors)]
        torch.ops.slabstage.stage_embeddings(fake[0], fake[1], fake[2], None, None, fake[3], N, "zeros", None, 0, V,
                                             V, True)
