"""Weights the CPU step streams, placed in transparent huge pages.

A one-row step reads every weight once, straight from memory, so the page size shows: with 4 KiB pages each of a
core's weight streams crosses a page (and misses the TLB) every 4 KiB. In one interleaved run on an AMD Zen 4 the
0.5B's bf16 layers read ~20 % faster from 2 MiB pages (notes/issue-37.md, twenty-second session).

``huge_page_copy`` copies a tensor into a fresh anonymous mapping whose 2 MiB-aligned span is advised
MADV_HUGEPAGE before it is written, so Linux backs it with huge pages where THP is ``always`` or ``madvise`` (the
tail past the last whole huge page stays in small pages: no memory beyond the tensor's own). The step places the
weights it reads when it first builds their handles (``place_member``: dense weights, quantized codes); values,
dtype and shape are unchanged. ``QSPEC_HUGE_PAGES=0`` turns it off; elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import mmap
import os
import sys

import torch
from torch import Tensor, nn

HUGE_PAGE = 2 << 20


def enabled() -> bool:
    return sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("QSPEC_HUGE_PAGES") != "0"


def is_placed(t: Tensor) -> bool:
    """Whether t starts on a huge-page boundary (where huge_page_copy puts it; a heap tensor never does)."""
    return t.data_ptr() % HUGE_PAGE == 0


def eligible(t: Tensor) -> bool:
    """A CPU tensor worth a copy: contiguous, at least one huge page long, not placed yet."""
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.numel() * t.element_size() >= HUGE_PAGE
        and not is_placed(t)
        and enabled()
    )


def huge_page_copy(t: Tensor) -> Tensor:
    """t's values in a new tensor of t's dtype and shape that starts on a 2 MiB boundary, its whole huge pages
    advised MADV_HUGEPAGE before they are first touched."""
    nbytes = t.numel() * t.element_size()
    # private anonymous (a shared mapping is shmem, outside anonymous THP), untouched: nothing backed before the advice
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    # an inference tensor exactly when t is one, whatever the mode it is placed in (the server places normal weights
    # under inference_mode: they must stay usable outside it; a model built under inference_mode keeps its kind)
    with torch.inference_mode(t.is_inference()), torch.no_grad():
        raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
        start = -raw.data_ptr() % HUGE_PAGE
        whole = nbytes // HUGE_PAGE * HUGE_PAGE
        if whole:
            region.madvise(mmap.MADV_HUGEPAGE, start, whole)
        out = raw[start : start + nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
    return out


def place(t: Tensor) -> Tensor:
    """t itself, or its huge-page copy where it is eligible."""
    return huge_page_copy(t) if eligible(t) else t


def place_member(module: nn.Module, name: str) -> None:
    """Move a module's parameter or buffer into huge pages in place (a parameter keeps its Parameter object, so
    tied weights move together)."""
    param = module._parameters.get(name)
    if param is not None:
        if eligible(param):
            with torch.no_grad():
                param.data = huge_page_copy(param.data)
    elif module._buffers.get(name) is not None and eligible(module._buffers[name]):
        module._buffers[name] = huge_page_copy(module._buffers[name])
