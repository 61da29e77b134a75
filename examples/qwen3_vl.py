"""A tiny random Qwen3-VL (DeepStack) through slabstage's graph runner, checked against Hugging Face.

Two requests with images: the vision tower's outputs become media items
``(main, ds_0, ds_1)`` (``slabstage.hf.media_items``), the requests are packed into
one ``PrefillBatch`` with their mrope positions (``slabstage.hf.pack_requests``), the
slab is ``hidden * 3`` wide (``slabstage.hf.input_embeds_width``), and the prefill runs
under ``PrefillGraphRunner`` with ``slabstage.hf.prefill_forward`` (captured on CUDA,
eager on CPU). Nothing is downloaded. Needs transformers::

    pip install 'slabstage[hf]'
    python examples/qwen3_vl.py [--device cuda] [--dtype bf16] [--model qwen2.5-vl]
"""

import sys

from slabstage.hf.demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
