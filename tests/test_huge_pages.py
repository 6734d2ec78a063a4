"""runtime.kernels.huge_pages: weights the CPU step streams are copied into transparent huge pages, values
unchanged, tied parameters moved together, and (where Linux's THP allows it) the copy is backed by huge pages."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from runtime import backends
from runtime.kernels import cpu_step, huge_pages
from runtime.model import Linear

pytestmark = pytest.mark.skipif(not huge_pages.enabled(), reason="huge pages are placed on Linux only")


def thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    found = re.search(r"\[(\w+)\]", path.read_text()) if path.exists() else None
    return found.group(1) if found else "never"


def anon_huge_kb() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_copy_keeps_values_and_starts_on_a_huge_page(dtype):
    src = (torch.randn(1500, 1000) * 50).to(dtype)  # 1.5-6 MB: whole huge pages and a tail
    out = huge_pages.huge_page_copy(src)
    assert out.dtype == src.dtype and out.shape == src.shape and out.is_contiguous()
    assert out.data_ptr() % huge_pages.HUGE_PAGE == 0 and huge_pages.is_placed(out)
    assert torch.equal(out, src)
    del src
    assert out.sum().isfinite()  # the mapping lives as long as the tensor, not its source


@pytest.mark.skipif(thp_mode() == "never" or sys.platform != "linux", reason="THP is off on this machine")
def test_copy_is_backed_by_huge_pages():
    before = anon_huge_kb()
    out = huge_pages.huge_page_copy(torch.ones(16 << 20, dtype=torch.uint8))  # 16 MiB: 8 whole huge pages
    assert anon_huge_kb() - before >= 8 << 10, "the copy's whole huge pages are not backed by 2 MiB pages"
    del out


def test_place_member_moves_tied_parameters_together_and_skips_small_ones(monkeypatch):
    embed = nn.Embedding(1024, 1024)  # 4 MiB fp32
    head = Linear(1024, 1024, bias=False)
    head.weight = embed.weight  # tied, as SmolLM2's head
    small = Linear(64, 64)
    before, small_ptr = embed.weight.detach().clone(), small.weight.data_ptr()
    huge_pages.place_member(head, "weight")
    huge_pages.place_member(small, "weight")
    assert head.weight is embed.weight and huge_pages.is_placed(embed.weight)
    assert torch.equal(embed.weight, before) and isinstance(head.weight, nn.Parameter)
    assert small.weight.data_ptr() == small_ptr  # under one huge page: left where it is
    ptr = embed.weight.data_ptr()
    huge_pages.place_member(head, "weight")
    assert embed.weight.data_ptr() == ptr  # placed once
    off = Linear(1024, 1024, bias=False)
    monkeypatch.setenv("QSPEC_HUGE_PAGES", "0")
    huge_pages.place_member(off, "weight")
    assert not huge_pages.is_placed(off.weight)


@pytest.mark.skipif(not cpu_step.available(), reason="the CPU step cannot be built here")
def test_the_steps_dense_handle_places_the_weight_it_reads():
    layer = Linear(2048, 1024, bias=False).to(torch.bfloat16)  # 4 MiB
    x = torch.randn(3, 2048, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), layer.weight.float())
    handle = backends.dense_handle(layer)
    assert huge_pages.is_placed(layer.weight)
    y = cpu_step.linear(handle, x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


def test_a_weight_placed_under_inference_mode_stays_usable_outside_it():
    """The server places weights inside torch.inference_mode; later autograd-tracked use of the weight (a trainer,
    a logit bias through autograd) must not meet an inference tensor."""
    layer = Linear(1024, 1024, bias=False)  # 4 MiB fp32
    with torch.inference_mode():
        huge_pages.place_member(layer, "weight")
    assert huge_pages.is_placed(layer.weight) and not layer.weight.is_inference()
    x = torch.randn(2, 1024, requires_grad=True)
    layer(x).sum().backward()  # saves the weight for backward
    assert x.grad is not None
    with torch.inference_mode():  # and a model built under inference_mode keeps inference tensors
        built = Linear(1024, 1024, bias=False)
        huge_pages.place_member(built, "weight")
        assert huge_pages.is_placed(built.weight) and built.weight.is_inference()
        assert torch.nn.functional.embedding(torch.tensor([3]), built.weight).shape == (1, 1024)
