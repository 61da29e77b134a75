"""slabstage.hf with an EncoderCache: media_items fills it (encoding only the misses), pack_requests takes its
handles, and the packed batch stages and runs exactly as the same items given as tensors. Skipped without
transformers."""

import pytest
import torch

import slabstage as ss

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.cache import EncoderCache, Entry  # noqa: E402
from slabstage.hf.tiny import tiny_model, tiny_prompt  # noqa: E402

GRIDS = [[(1, 4, 6)], [(1, 4, 4), (1, 6, 4)]]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_cached_items_run_like_tensors(family):
    model = tiny_model(family)
    width = sshf.input_embeds_width(model)
    cache = EncoderCache(width, torch.float32, "cpu", device_budget_bytes=40 * width * 4,
                         host_budget_bytes=40 * width * 4)
    buffers = ss.StagingBuffers.allocate(max_num_tokens=160, max_batch_size=4, embed_width=width,
                                         embed_dtype=torch.float32, device="cpu", mrope=True)
    runner = ss.PrefillGraphRunner(sshf.prefill_forward(model), buffers, progress=False)
    g = torch.Generator().manual_seed(0)
    plain, cached = [], []
    for k, grids in enumerate(GRIDS):
        ids, pv, grid = tiny_prompt(model, grids, generator=g)
        keys = [f"prompt{k}-image{j}" for j in range(len(grids))]
        items = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid)
        entries = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid, encoder_cache=cache, keys=keys)
        assert all(type(e) is Entry for e in entries)
        plain.append(sshf.Request(ids, items, image_grid_thw=grid))
        cached.append(sshf.Request(ids, entries, image_grid_thw=grid))
    with torch.no_grad():
        want = runner.run(sshf.pack_requests(model, plain), clone=True)
        got = runner.run(sshf.pack_requests(model, cached), clone=True)
        chunk = [sshf.Request(r.input_ids, r.media, image_grid_thw=r.image_grid_thw, chunk=(3, 14)) for r in cached]
        got_chunk = runner.run(sshf.pack_requests(model, chunk), clone=True)
        want_chunk = runner.run(sshf.pack_requests(model, [sshf.Request(r.input_ids, p.media, image_grid_thw=
                                r.image_grid_thw, chunk=(3, 14)) for r, p in zip(cached, plain)]), clone=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # (the tower ran per prompt in both)
    torch.testing.assert_close(got_chunk, want_chunk, rtol=1e-5, atol=1e-5)


def test_hits_are_not_encoded_again(monkeypatch):
    model = tiny_model("qwen3_vl")
    width = sshf.input_embeds_width(model)
    cache = EncoderCache(width, torch.float32, "cpu", device_budget_bytes=100 * width * 4)
    g = torch.Generator().manual_seed(1)
    _, pv, grid = tiny_prompt(model, [(1, 4, 4), (1, 6, 4), (1, 4, 6)], generator=g)
    first = sshf.media_items(model, pixel_values=pv[:16], image_grid_thw=grid[:1], encoder_cache=cache, keys=[b"a"])
    import slabstage.hf.media as media

    seen = []
    tower = media._tower
    monkeypatch.setattr(media, "_tower", lambda fam, px, host, video: seen.append(host.tolist()) or
                        tower(fam, px, host, video))
    entries = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid, encoder_cache=cache,
                               keys=[b"a", b"b", b"c"])
    assert seen == [[[1, 6, 4], [1, 4, 6]]]  # the tower saw the misses alone
    assert entries[0] == first[0]
    alone = sshf.media_items(model, pixel_values=pv, image_grid_thw=grid)
    for e, item in zip(entries, alone):
        torch.testing.assert_close(cache.rows_of(e), torch.cat(item, 1), rtol=1e-5, atol=1e-5)
    # an item twice in one call (same key): encoded once, both handles its entry
    seen.clear()
    again = sshf.media_items(model, pixel_values=torch.cat([pv[16:40], pv[16:40]]),
                             image_grid_thw=torch.tensor([[1, 6, 4], [1, 6, 4]]), encoder_cache=cache,
                             keys=[b"d", b"d"])
    assert seen == [[[1, 6, 4]]] and again[0] == again[1]
    with pytest.raises(ValueError, match="one key per item"):
        sshf.media_items(model, pixel_values=pv, image_grid_thw=grid, encoder_cache=cache, keys=[b"a"])
