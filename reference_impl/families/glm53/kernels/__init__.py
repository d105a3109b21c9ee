"""GLM-5.3's Triton kernels (the chunked KDA recurrence and its span map) and its dispatch tables,
:data:`.dispatch.KDA_KERNEL_OPS` and :data:`.dispatch.INDEXER_KERNEL_OPS` (the pooled indexer through the
DSA family's logits and top-k kernels)."""
