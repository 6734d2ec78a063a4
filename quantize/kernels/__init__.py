"""Quantized matmul kernels, separate from the QuantLinear module that selects them.

cpu.py: torch's packed CPU ops (int4 weight-only, int8 weight-only, int8 x int8 W8A8).
triton_qmm.py: Triton kernels for CUDA (int2/3/4/8 dequantize fused into the matmul, GEMM and GEMV shapes).
"""
