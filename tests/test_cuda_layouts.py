"""The layouts CUDA produces, on CPU: SDPA and F.linear patched to return equal values in a different memory
layout (what CUDA's flash / efficient attention and some GEMM backends return), and every path must give the
same tokens as with CPU's own layouts. A `.view` that relies on CPU's layout fails here, not first on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.model import random_model
from runtime.sampling import SamplingParams
from speculate.generate import speculative_generate
from speculate.ngram import NgramSpeculator
from tests.tiny_models import TINY_CONFIGS

REAL_SDPA = F.scaled_dot_product_attention
REAL_LINEAR = F.linear


def cuda_like(t: torch.Tensor) -> torch.Tensor:
    """Equal values, dims 1 and 2 swapped in memory: CUDA SDPA's [B, H, T, D] output is stored as [B, T, H, D]."""
    if t.dim() < 3:
        return t.t().contiguous().t() if t.dim() == 2 else t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def sdpa_cuda_layout(*args, **kwargs):
    return cuda_like(REAL_SDPA(*args, **kwargs))


def linear_cuda_layout(*args, **kwargs):
    return cuda_like(REAL_LINEAR(*args, **kwargs))


@pytest.fixture
def cuda_layouts(monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa_cuda_layout)
    monkeypatch.setattr(F, "linear", linear_cuda_layout)
    monkeypatch.setenv("QSPEC_CPU_STEP", "0")  # the CPU C++ step would bypass the Python attention


def test_patch_changes_the_layout():
    """The oracle bites: the patched SDPA output of the one-token GQA shape is not viewable as [B, H, 1, D]."""
    q, k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    out = sdpa_cuda_layout(q, k, v)
    assert torch.equal(out, REAL_SDPA(q, k, v)) and not out.is_contiguous()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        out.view(2, 6, 1, 8)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    span = torch.randint(2, vocab, (6,), generator=gen).tolist()
    return [span * 3, (span * 2)[:9], torch.randint(2, vocab, (4,), generator=gen).tolist()]


@pytest.mark.parametrize(
    "name, dtype",
    [("llama", torch.float32), ("llama", torch.bfloat16), ("mistral", torch.float32), ("qwen3", torch.float32)],
)
def test_generate_and_speculation_in_cuda_layouts(name, dtype, monkeypatch):
    monkeypatch.setenv("QSPEC_CPU_STEP", "0")  # the CPU C++ step would bypass the Python attention
    cfg = TINY_CONFIGS[name]
    model = random_model(cfg, seed=0).set_dtype(dtype)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    batch = prompts(cfg.vocab_size)
    plain = generate(model, batch, params).tokens
    spec = speculative_generate(model, batch, params, NgramSpeculator(k=4)).tokens
    assert spec == plain
    with monkeypatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", sdpa_cuda_layout)
        m.setattr(F, "linear", linear_cuda_layout)
        assert generate(model, batch, params).tokens == plain
        assert speculative_generate(model, batch, params, NgramSpeculator(k=4)).tokens == plain
        single = generate(model, batch[:1], params).tokens  # batch 1: the mask-free one-token GQA branch
    assert single == generate(model, batch[:1], params).tokens


def test_engine_in_cuda_layouts(cuda_layouts):
    model = random_model(TINY_CONFIGS["llama"], seed=0)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    batch = prompts(model.config.vocab_size)
    engine = LLMEngine(model, config=EngineConfig(kv_cache_bytes=1 << 21))
    got = [o.output_ids for o in engine.generate(batch, [params] * len(batch))]
    assert got == [generate(model, [p], params).tokens[0] for p in batch]


def test_paged_auto_rule_picks_per_dtype(monkeypatch):
    """decode_kernel="auto" on CUDA follows triton_decode_wins per step: bf16 decode goes to gather + SDPA, fp32
    to the kernel (checked on CPU with a cache built for the kernel and switched to the per-shape rule)."""
    pytest.importorskip("triton")
    from runtime.kernels import paged_attention
    from runtime.paged_cache import PagedAttentionMetadata, PagedKVCache, triton_decode_wins

    calls = []
    monkeypatch.setattr(paged_attention, "paged_decode_attention", lambda q, *a, **k: calls.append(q.dtype) or q)
    cfg = TINY_CONFIGS["llama"]
    for dtype in (torch.bfloat16, torch.float32):
        cache = PagedKVCache(cfg, 8, 4, dtype=dtype, decode_kernel="triton")
        cache.per_shape = True  # what "auto" sets on CUDA
        tables = torch.tensor([[1, 2]])
        meta = PagedAttentionMetadata(
            positions=torch.tensor([[5]]), slots=torch.tensor([[9]]), mask=None, kv_len=6,
            block_tables=tables, context_lens=torch.tensor([6], dtype=torch.int32),
        )  # fmt: skip
        q = torch.randn(1, cfg.num_heads, 1, cfg.head_dim, dtype=dtype)
        kv = torch.randn(1, cfg.num_kv_heads, 1, cfg.head_dim, dtype=dtype)
        assert cache.uses_decode_kernel(q, meta) == triton_decode_wins(dtype, 1, 6)
        cache.attend(0, q, kv, kv, meta)
    assert calls == [torch.float32]  # bf16 went through gather + SDPA
