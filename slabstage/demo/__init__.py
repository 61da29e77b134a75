"""``python -m slabstage demo``: stage random multimodal batches, run the prefill forward, check each one independently.

For each layout of :class:`slabstage.models.ToyMultimodalModel` (plain, deepstack, hyper-connections) the demo
allocates :class:`StagingBuffers` at the model's declared slab width, hands the forward to
:class:`PrefillGraphRunner` and runs random batches built as an engine builds them (media as a list of items, one
encoder output per image; ``media_index`` from the host-side spans). Every batch is checked against a merge that
shares no code with slabstage (plain torch: table rows by id, media rows at their placeholders, widened by the
model's policy, zero padding). The demo requires, bit for bit, that

1. the staged slab (the bucket's rows) equals that merge, and
2. the runner's output equals an eager forward of the model over that merge,

and that the device error word stays clean; exit status 1 when any check fails. On a GPU the runner captures
CUDA graphs and the report shows where each batch ran and device times from CUDA events; without one every batch
runs eagerly, the kernels under Triton's interpreter (``slabstage.__main__``). ``--model`` naming a Hugging Face
family (``qwen3-vl``, ``llama``, ...) hands the arguments to ``slabstage.hf.demo``.
"""

from .batches import build_batch, reference_merge, widen
from .cli import HF_MODELS, MODELS, kernel_path, main
from .run import plan_sizes

__all__ = ["main", "build_batch", "reference_merge", "widen", "plan_sizes", "kernel_path", "HF_MODELS", "MODELS"]
