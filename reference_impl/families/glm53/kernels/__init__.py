"""GLM-5.3's Triton kernels (the chunked KDA recurrence and its span map) and their dispatch table,
:data:`.dispatch.KDA_KERNEL_OPS`."""
