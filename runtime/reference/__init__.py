"""Reference attention implementations that check the runtime's kernels: naive_attention (textbook
softmax(QK^T / sqrt(d) + mask) V swapped into a model, the same-math reference for SDPA) and tiled_attention
(FlashAttention's forward and paged decode attention in NumPy, against naive attention). Command:
``python -m runtime.reference.tiled_attention``."""
