"""slabstage in one page: a DeepStack-style model, its slab, a captured ladder, one batch of media items.

    python examples/quickstart.py            # CUDA when present (graphs replayed), else CPU (eager)

tests/project/test_examples.py runs it; the README quotes the part between the markers.
"""

import torch

import slabstage as ss

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
H, K, VOCAB = 256, 2, 1000  # hidden size, DeepStack levels, vocabulary


class Model(torch.nn.Module):
    """Reads column block 0 of the slab; adds block i + 1 after layer i (a DeepStack decoder, much shrunk)."""

    input_embeds_hidden_size = H * (1 + K)  # the declared slab width

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, H, device=device, dtype=dtype)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(H, H, device=device, dtype=dtype) for _ in range(3))

    def forward(self, views):  # views: every registered buffer cut to the bucket's token count
        x = views["input_embeds"]
        h = x[:, :H]
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if i < K:
                h = h + x[:, H * (i + 1):H * (i + 2)]
        return h


model = Model()

# --8<-- [start:example]
# the width contract: the declared width wins; a typo of the attribute or a too-narrow value raises
width = ss.resolve_input_embeds_width(model, H)  # H * (1 + K)

buffers = ss.StagingBuffers.allocate(max_num_tokens=1024, max_batch_size=8, embed_width=width,
                                     embed_dtype=dtype, device=device)
runner = ss.PrefillGraphRunner(model.forward, buffers).capture()  # a ladder of buckets, each checked

# one request: 40 text tokens around one image of 24 rows, as the encoder emits it:
# (main, level_0, level_1) column blocks of [24, H] each, read where they are (no torch.cat)
n = 64
image = tuple(torch.randn(24, H, device=device, dtype=dtype) for _ in range(1 + K))
batch = ss.PrefillBatch(
    input_ids=torch.randint(0, VOCAB, (n,), device=device),
    positions=torch.arange(n, device=device),
    table=model.embed_tokens.weight,
    media=[image],                                                         # a list of items
    media_index=ss.media_index_from_spans([(8, 24, 0)], n, device=device),  # rows 8..31 <- image rows 0..23
    expand="zeros",                                                        # text rows: zeros past column H
)
hidden = runner.run(batch)          # [n, H]: the first n rows of the bucket's static output
ss.raise_if_errors(buffers.errors)  # bad ids or media indices the kernel found on the device, when you look
print(f"bucket {runner.last_bucket}, fell back: {runner.last_fallback}, stats {runner.stats()}")
# --8<-- [end:example]

expected = model.forward(buffers.registry.views(runner.last_bucket or n))[:n]  # eager, same rows
assert torch.equal(hidden, expected), "replay differs from eager"
print("quickstart OK", tuple(hidden.shape), device)
