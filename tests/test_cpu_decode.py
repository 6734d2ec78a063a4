"""The compiled one-token CPU decode step (runtime.kernels.cpu_decode) against HF transformers and the
Python layers."""

from __future__ import annotations

import pytest
import torch
from test_model import hf_twin

from runtime.decoding import generate
from runtime.kernels import cpu_decode
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata, random_model
from runtime.sampling import SamplingParams

pytestmark = pytest.mark.skipif(cpu_decode.extension() is None, reason="the C++ decode step could not be built here")


def spy_on_fast_path(monkeypatch) -> list[bool]:
    """Record, per one-token forward, whether the compiled step ran it."""
    taken: list[bool] = []
    original = cpu_decode.decode

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(cpu_decode, "decode", spy)
    return taken


@torch.inference_mode()
@pytest.mark.parametrize(
    "batch,prefix,chunk",
    [(1, 40, 1), (2, 290, 1), (2, 40, 3)],  # 2 x 290 keys: the threaded attention branch; 3: chain verification
)
def test_decode_steps_match_transformers(tiny_config, tmp_path, monkeypatch, batch, prefix, chunk):
    ours = random_model(tiny_config, seed=3)
    hf = hf_twin(ours, tmp_path)
    steps = 6
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tiny_config.vocab_size, (batch, prefix + steps), generator=gen)
    ref = hf(tokens).logits  # the oracle: one full causal forward
    cache = KVCache(tiny_config, batch, prefix + steps)
    ours(tokens[:, :prefix], AttentionMetadata.contiguous(batch, 0, prefix, "cpu"), cache)  # Python prefill
    taken = spy_on_fast_path(monkeypatch)
    for i in range(prefix, prefix + steps, chunk):
        got = ours(tokens[:, i : i + chunk], AttentionMetadata.contiguous(batch, i, chunk, "cpu"), cache)
        torch.testing.assert_close(got, ref[:, i : i + chunk], atol=2e-5, rtol=1e-4)
    # every layer it implements runs compiled; q/k-norm models (Qwen3) keep the Python layers
    assert taken == [tiny_config.qk_norm is False] * (steps // chunk)


@torch.inference_mode()
def test_short_prefill_matches_transformers(tmp_path):
    from tests.tiny_models import TINY_CONFIGS

    ours = random_model(TINY_CONFIGS["llama"], seed=5)
    hf = hf_twin(ours, tmp_path)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    cache = KVCache(ours.config, 2, 16)
    got = ours(tokens, AttentionMetadata.contiguous(2, 0, 12, "cpu"), cache)  # 12 <= MAX_TOKENS: compiled
    torch.testing.assert_close(got, hf(tokens).logits, atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_fast_and_python_decode_agree_token_for_token(tiny_llama, monkeypatch):
    prompts = [[5, 9, 2, 7, 7, 3, 11, 4], [8, 1, 6, 2, 9, 9, 10, 5]]  # equal lengths: one position per step
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    taken = spy_on_fast_path(monkeypatch)
    fast = generate(tiny_llama, prompts, params)
    assert taken and all(taken)
    tiny_llama.fast_decode = False
    slow = generate(tiny_llama, prompts, params)
    assert fast.tokens == slow.tokens


@torch.inference_mode()
def test_ineligible_steps_fall_back(tiny_llama):
    x = torch.zeros(1, 1, tiny_llama.config.hidden_size)
    meta = AttentionMetadata.contiguous(1, 3, 1, "cpu")
    cache = KVCache(tiny_llama.config, 1, 8)
    assert cpu_decode.decode(tiny_llama, x, meta, cache) is not None
    assert cpu_decode.decode(tiny_llama, x.bfloat16(), meta, cache) is None  # fp32 only
    assert cpu_decode.decode(tiny_llama, x, AttentionMetadata.causal(torch.tensor([[3]]), kv_len=4), cache) is None
    with pytest.raises(ValueError, match="KV cache holds 8 positions, 9 requested"):
        cpu_decode.decode(tiny_llama, x, AttentionMetadata.contiguous(1, 8, 1, "cpu"), cache)


@torch.inference_mode()
def test_bf16_mixed_steps_stay_within_bf16_noise(monkeypatch):
    """bf16 layers (fp32 residual): the compiled step differs from the Python bf16 layers by less than
    those differ from fp32 (its reductions run in another order, each rounding step is the same)."""
    from tests.tiny_models import TINY_CONFIGS

    cfg, prefix, steps = TINY_CONFIGS["llama"], 40, 6  # a prefix over MAX_TOKENS: prefilled by Python
    fp32 = random_model(cfg, seed=4)
    bf16 = random_model(cfg, seed=4).set_dtype(torch.bfloat16, mixed=True)
    tokens = torch.randint(0, cfg.vocab_size, (1, prefix + steps), generator=torch.Generator().manual_seed(1))
    ref = fp32(tokens)
    caches = {fast: KVCache(cfg, 1, prefix + steps, torch.bfloat16) for fast in (True, False)}
    taken = spy_on_fast_path(monkeypatch)
    for fast, cache in caches.items():
        bf16.fast_decode = fast
        bf16(tokens[:, :prefix], AttentionMetadata.contiguous(1, 0, prefix, "cpu"), cache)
    fast_vs_python, python_vs_fp32 = 0.0, 0.0
    for i in range(prefix, prefix + steps):
        meta = AttentionMetadata.contiguous(1, i, 1, "cpu")
        bf16.fast_decode = True
        fast = bf16(tokens[:, i : i + 1], meta, caches[True])[:, 0]
        bf16.fast_decode = False
        python = bf16(tokens[:, i : i + 1], meta, caches[False])[:, 0]
        fast_vs_python = max(fast_vs_python, float((fast - python).abs().max()))
        python_vs_fp32 = max(python_vs_fp32, float((python - ref[:, i]).abs().max()))
    assert taken == [True, False] * steps  # bf16 (mixed) steps take it unless the model turns it off
    assert fast_vs_python < python_vs_fp32, (fast_vs_python, python_vs_fp32)


@torch.inference_mode()
def test_prefill_rms_norm_matches_functional():
    x = torch.randn(3, 70, 96, generator=torch.Generator().manual_seed(6)) * 3
    weight = torch.rand(96, generator=torch.Generator().manual_seed(7)) + 0.5
    got = cpu_decode.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (96,), weight, 1e-5), atol=1e-6, rtol=1e-5)
