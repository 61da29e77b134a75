"""Device code: the Triton kernels and the one layout of their parameter record.

The staging kernel (:mod:`~slabstage.kernels.stage_kernel`, with its row helpers
:mod:`~slabstage.kernels.embed_rows` and :mod:`~slabstage.kernels.slot_rows`) reads
:mod:`~slabstage.kernels.layout`; :mod:`~slabstage.kernels.media_index` builds ``media_index`` from a mask;
:mod:`~slabstage.kernels.packed_attention` is the packed-prefill attention. Their host launchers, checks and
PyTorch references live in :mod:`slabstage.staging`.
"""
