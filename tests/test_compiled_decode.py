"""The compiled decode path (runtime.compiled) against the eager path, token for token: plain decoding of a batch
of mixed prompt lengths and n-gram speculation whose chain verifications land in different buckets.

backend "eager" traces with dynamo (static cache, bucketing, padding: everything but the compiler) and runs in
the default suite; "inductor" compiles for real and is slow on 2 cores."""

from __future__ import annotations

import pytest
import torch

from runtime.compiled import BUCKETS, bucket, compiled_decoder, resolve_compile
from runtime.decoding import generate
from runtime.model import random_model
from runtime.sampling import SamplingParams
from speculate.generate import speculative_generate
from speculate.ngram import NgramSpeculator
from tests.tiny_models import TINY_CONFIGS


@pytest.fixture(autouse=True)
def python_layers(monkeypatch):
    monkeypatch.setenv("QSPEC_CPU_STEP", "0")  # the eager reference runs the same Python layers


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    span = torch.randint(2, vocab, (5,), generator=gen).tolist()
    return [span * 4, torch.randint(2, vocab, (7,), generator=gen).tolist()]


def test_resolve_and_buckets():
    assert resolve_compile("auto", "cpu") == "off" and resolve_compile("on", "cpu") == "inductor"
    assert resolve_compile("auto", "cuda") == "cudagraphs" and resolve_compile("off", "cuda") == "off"
    with pytest.raises(ValueError, match="compile must be one of"):
        resolve_compile("fast", "cpu")
    assert [bucket(t) for t in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32] and bucket(33) is None
    assert BUCKETS[-1] == 32


def check_against_eager(backend: str, dtype: torch.dtype) -> None:
    cfg = TINY_CONFIGS["llama"]
    model = random_model(cfg, seed=0).set_dtype(dtype)
    batch = prompts(cfg.vocab_size)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    eager = generate(model, batch, params, compile="off")
    got = generate(model, batch, params, compile=backend)
    assert got.compile == backend and eager.compile == "off"
    assert got.tokens == eager.tokens
    # n-gram drafts of up to 16 tokens: verifications of 1..17 tokens, padded to buckets 1..32
    spec_eager = speculative_generate(model, batch, params, NgramSpeculator(k=16), compile="off")
    spec = speculative_generate(model, batch, params, NgramSpeculator(k=16), compile=backend)
    assert spec.compile == backend
    assert spec.tokens == spec_eager.tokens == eager.tokens
    assert spec.stats.accepted > 0  # the repeated span was drafted and accepted: multi-token buckets ran


def test_compiled_step_traced_equals_eager():
    check_against_eager("eager", torch.float32)


def test_static_cache_pads_and_reuses_decoders():
    model = random_model(TINY_CONFIGS["llama"], seed=0)
    dec = compiled_decoder(model, 2, 40, "eager")
    assert dec.capacity >= 40 + BUCKETS[-1] and compiled_decoder(model, 2, 60, "eager") is dec
    with pytest.raises(ValueError, match="longer than the largest compiled bucket"):
        dec(torch.zeros(2, 33, dtype=torch.long), torch.arange(33).expand(2, -1))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_step_inductor_equals_eager(dtype):
    check_against_eager("inductor", dtype)
