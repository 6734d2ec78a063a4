"""Backends of runtime.model: which path runs a model's steps, chosen outside the model (as gpt-fast keeps model.py
plain and nano-vllm keeps a runner beside it).

``Backend`` (runtime.model) is the plain PyTorch path. ``CpuStepBackend`` runs what the compiled CPU step
(runtime.kernels.cpu_step) implements, and declines the rest (CUDA tensors, autograd, torch.compile tracing, layers
or caches the step does not run), so the plain layers take over there. runtime/__init__ installs it for the whole
process: every model, however it was built (the loader, random_model, Transformer(config), a draft), runs through
it. ``use_backend`` swaps the backend for a block (tests compare the two paths with it).

Its kernels are row-invariant: a row's result does not depend on how many rows share the call. The norm therefore
takes the compiled norm at ANY row count, the head runs MAX_ROWS rows per call, and candidate trees of any size run
as one step, so a position's logits are the same bits in a decode step, a verification or a batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from runtime.kernels import cpu_step
from runtime.kernels.huge_pages import place_member
from runtime.model import AttentionMetadata, Backend, Linear, RMSNorm, Transformer, set_backend

# Linear -> ((weight pointer, dtype, bias pointer), the kernels' handle): rebuilt when a weight tensor is replaced;
# weak, so copies and pickles of a module never carry a handle over another module's tensors
_DENSE_HANDLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def dense_handle(layer: Linear):
    """The kernels' view of a Linear's weight (read in place, from huge pages; cached per module)."""

    def key():
        return layer.weight.data_ptr(), layer.weight.dtype, None if layer.bias is None else layer.bias.data_ptr()

    cached = _DENSE_HANDLES.get(layer)
    if cached is None or cached[0] != key():  # a new weight: placed once, here, off the per-call path
        place_member(layer, "weight")
        bias = None if layer.bias is None else layer.bias.detach().float()
        cached = _DENSE_HANDLES[layer] = (key(), cpu_step.dense_handle(layer.weight.detach(), bias))
    return cached[1]


def _kernel_rows(layer: Linear, x: Tensor) -> int | None:
    """The rows of x [..., K] when the kernels can run layer on it (CPU, the weight's dtype, inference), else None."""
    w, rows = layer.weight, x.numel() // max(x.shape[-1], 1)
    if not (
        x.is_cpu
        and x.dtype == w.dtype
        and w.dtype in (torch.float32, torch.bfloat16)
        and rows >= 1
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and cpu_step.available()
    ):
        return None
    return rows


class CpuStepBackend(Backend):
    """The compiled CPU step's kernels wherever they apply, the plain layers elsewhere."""

    def decoder_layers(self, model: Transformer, x: Tensor, meta: AttentionMetadata, cache) -> Tensor | None:
        # short chunks (int8-activation models: prompt chunks too), and candidate trees of any size (verifications:
        # the step's outputs are shape-invariant); a compiled step (runtime.compiled) traces the Python layers: the
        # C++ step is its own compiled path
        T = x.shape[1]
        if not (x.is_cpu and cache is not None and not torch.compiler.is_compiling()):
            return None
        if T <= cpu_step.MAX_TOKENS or meta.local_mask is not None:
            return cpu_step.decode(model, x, meta, cache)  # None where the step does not qualify (its own checks)
        limit = cpu_step.step_tokens_limit(model) if cpu_step.available() else 0
        if T <= limit:
            return cpu_step.decode(model, x, meta, cache)
        if limit <= cpu_step.MAX_TOKENS or meta.contiguous_start is None or meta.counts is not None:
            return None
        return self._prompt_in_chunks(model, x, meta.contiguous_start, limit, cache)

    @staticmethod
    def _prompt_in_chunks(model: Transformer, x: Tensor, start: int, limit: int, cache) -> Tensor | None:
        # a prompt longer than the step's chunk (int8-activation models: the Python layers would call the same
        # integer kernels with torch's ops around them) in chunks of `limit` tokens through the step; the first
        # chunk's checks are every chunk's (they read the model, the cache and the chunk's size)
        parts = []
        for i in range(0, x.shape[1], limit):
            n = min(limit, x.shape[1] - i)
            meta = AttentionMetadata.contiguous(x.shape[0], start + i, n, x.device)
            out = cpu_step.decode(model, x[:, i : i + n], meta, cache)
            if out is None:
                if i == 0:
                    return None
                raise RuntimeError(f"the CPU step took the prompt's first chunk but not the one at token {i}")
            parts.append(out)
        return torch.cat(parts, dim=1)

    def linear(self, layer: Linear, x: Tensor) -> Tensor | None:
        # up to MAX_ROWS rows (decode steps, verifications, head chunks): the kernels read the weight in place at
        # the memory bandwidth; outputs rounded to the weight's dtype, as F.linear's. Longer bf16 inputs (prompts)
        # through fp32 GEMMs where torch's bf16 GEMM has no native dot products
        rows = _kernel_rows(layer, x)
        if rows is None:
            return None
        w = layer.weight
        if rows <= cpu_step.MAX_ROWS:
            return cpu_step.linear(dense_handle(layer), x).to(w.dtype)
        if w.dtype == torch.bfloat16 and cpu_step.widens_bf16_prefill():
            return cpu_step.block_gemm(dense_handle(layer), x)
        return None

    def linear_widened(self, layer: Linear, x: Tensor) -> Tensor | None:
        # the head's logits: rounded to the weight's dtype and kept fp32 in the kernels' own pass
        rows = _kernel_rows(layer, x)
        if rows is None or rows > cpu_step.MAX_ROWS:
            return None
        return cpu_step.linear(dense_handle(layer), x, bf16_values=layer.weight.dtype == torch.bfloat16)

    def rms_norm(self, norm: RMSNorm, x: Tensor) -> Tensor | None:
        # one compiled pass per row instead of ~10 ops, at ANY row count: a row's result must not depend on how many
        # rows share the call (F.rms_norm sums in another order, so switching by size would give a verification's
        # rows other bits than a decode step's)
        if x.dtype != torch.float32 or norm.weight.dtype != torch.float32:
            return None
        if not x.is_cpu or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        return cpu_step.rms_norm(x, norm.weight, norm.eps)  # None where the extension is off

    def head_chunk_rows(self, h: Tensor) -> int | None:
        # the head in kernel-sized chunks, so every row takes Linear's row-invariant kernel path
        if not h.is_cpu or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        return cpu_step.MAX_ROWS

    def rows_independent(self, model: Transformer, tokens_per_row: int, cache) -> bool:
        # the whole step, with its row-invariant kernels, runs such a forward (its own checks, mirrored here)
        k = getattr(cache, "k", None)
        return (
            1 <= tokens_per_row <= cpu_step.MAX_TOKENS
            and k is not None
            and k.is_cpu
            and k.dtype == model.compute_dtype
            and model.fast_decode
            and not torch.is_grad_enabled()
            and cpu_step.available()
            and cpu_step.step_model(model) is not None
        )


PLAIN = Backend()
CPU_STEP = CpuStepBackend()


@contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Run the block through `backend`, then restore the one installed before."""
    previous = set_backend(backend)
    try:
        yield backend
    finally:
        set_backend(previous)
