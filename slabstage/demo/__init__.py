"""``python -m slabstage demo``: stage random multimodal batches, run the prefill forward, check each one independently.

For each layout of :class:`slabstage.models.ToyMultimodalModel` (plain, deepstack, hyper-connections) the demo
allocates :class:`StagingBuffers` at the model's declared slab width, hands the forward to
:class:`PrefillGraphRunner` and runs random batches built as an engine builds them: a token stream with a
placeholder token wherever an image goes, the encoder's output for each image (one 2-D tensor per image, passed as
a list of items, never concatenated), and ``media_index`` from the host-side spans.

Every batch is checked against a merge that shares no code with slabstage: plain torch gathers the table rows of
the text tokens, scatters the images' rows to the placeholder rows in order, widens them by the model's policy and
zeroes the padding. The demo requires, bit for bit, that

1. the staged slab (the bucket's rows) equals that merge, and
2. the runner's output equals an eager forward of the model over that merge,

and that the device error word stays clean. On a GPU the runner captures CUDA graphs and the report shows where
each batch ran (its graph bucket, or eager) and device times from CUDA events. Without a GPU the Triton kernels
run under Triton's interpreter (``TRITON_INTERPRET=1``, set by ``slabstage.__main__``), nothing is captured, every
batch runs eagerly, and no times are shown. Exit status 1 when any check fails.

``--model`` naming a Hugging Face family (``qwen3-vl``, ``llama``, ...) hands the arguments to ``slabstage.hf.demo``
(needs ``pip install slabstage[hf]``). Modules: :mod:`.batches` (the batches and the plain-torch merge),
:mod:`.run` (one model layout through the runner), :mod:`.cli` (the options, the hand-off, the verdict).
"""

from .batches import build_batch, reference_merge, widen
from .cli import HF_MODELS, MODELS, kernel_path, main
from .run import plan_sizes

__all__ = ["main", "build_batch", "reference_merge", "widen", "plan_sizes", "kernel_path", "HF_MODELS", "MODELS"]
