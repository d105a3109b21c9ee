"""DeepSeek-V4's Triton kernels (attention with sinks, compressor pooling, the per-head norm with tail RoPE, the
FP4 round trip) and their dispatch table, :data:`.dispatch.V4_KERNEL_OPS`."""
