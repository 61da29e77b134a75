import torch

import slabstage as ss


def test_import_and_stage_once(device):
    buf = ss.StagingBuffers.allocate(max_num_tokens=32, max_batch_size=2, embed_width=64,
                                     embed_dtype=torch.bfloat16, device=device)
    table = torch.randn(40, 64, device=device)
    ids = torch.randint(0, 40, (9,), device=device)
    buf.input_embeds.fill_(float("nan"))
    ss.stage_embeddings(buf.input_embeds, ids, table, pad_to=12, errors=buf.errors)
    assert torch.equal(buf.input_embeds[:9], table[ids].to(torch.bfloat16))
    assert torch.all(buf.input_embeds[9:12] == 0)
    assert torch.isnan(buf.input_embeds[12:].float()).all()
