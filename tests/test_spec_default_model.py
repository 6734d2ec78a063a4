"""Greedy exactness on the default model (fp32): every lossless speculator reproduces plain greedy decoding
token for token, at batch 1 and batch 4, in both speculative loops (speculate.generate and the serving
engine). The full bar (20 prompts x 128 tokens) is a slow test; the default suite runs a small slice of it."""

from __future__ import annotations

import pytest
import torch

from runtime.decoding import encode_prompt, generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.sampling import SamplingParams
from speculate.draft import DraftModelSpeculator, layer_skip_draft, quantized_draft
from speculate.generate import speculative_generate
from speculate.medusa.heads import MedusaConfig, MedusaHeads
from speculate.medusa.speculator import MedusaSpeculator, build_tree
from speculate.ngram import NgramSpeculator

pytestmark = pytest.mark.integration


def wiki_prompts(tokenizer, n: int) -> list[list[int]]:
    """Half 'repeat this passage' chat prompts, half raw continuations, from the wiki eval split."""
    from runtime.data import wiki_split

    docs = [d for d in wiki_split("eval") if 40 <= len(d.extract) <= 600][:n]
    out = []
    for i, d in enumerate(docs):
        if i % 2 == 0:
            out.append(encode_prompt(tokenizer, f"Repeat the following passage exactly.\n\n{d.extract}", chat=True))
        else:
            out.append(tokenizer(d.extract, add_special_tokens=False).input_ids[:48])
    return out


def untrained_heads(model, seed: int = 0) -> MedusaHeads:
    """Random residual blocks (not trained): exactness must not depend on the heads' quality."""
    cfg = MedusaConfig(num_heads=3, hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size)
    heads = MedusaHeads(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return heads.eval()


def make(name: str, model):
    if name == "ngram":
        return NgramSpeculator(k=4)
    if name == "draft":
        return DraftModelSpeculator(model, layer_skip_draft(model, 8), k=3)
    if name == "medusa":
        return MedusaSpeculator(model, untrained_heads(model), build_tree([[0.5, 0.2], [0.3, 0.1], [0.2, 0.1]], 6))
    if name == "quant-draft":
        return DraftModelSpeculator(model, quantized_draft(model, bits=8), k=3, name="quant-draft")
    raise ValueError(name)


PLAIN_OUTPUTS: dict[tuple[int, int], list[list[int]]] = {}  # the oracle, computed once per size for all cases


def check_exact(default_model, names, n_prompts: int, max_tokens: int, batch: int, loop: str = "generate") -> None:
    model, tokenizer, _ = default_model
    prompts = wiki_prompts(tokenizer, n_prompts)
    params = SamplingParams(max_tokens=max_tokens)
    if (n_prompts, max_tokens) not in PLAIN_OUTPUTS:
        PLAIN_OUTPUTS[n_prompts, max_tokens] = [
            generate(model, prompts[i : i + 1], params).tokens[0] for i in range(len(prompts))
        ]
    plain = PLAIN_OUTPUTS[n_prompts, max_tokens]
    for name in names:
        spec = make(name, model)
        for i in range(0, len(prompts), batch):
            if loop == "generate":
                tokens = speculative_generate(model, prompts[i : i + batch], params, spec).tokens
            else:
                engine = LLMEngine(model, config=EngineConfig(kv_cache_bytes=1 << 26), speculator=spec)
                tokens = [o.output_ids for o in engine.generate(prompts[i : i + batch], params)]
            for j, toks in enumerate(tokens):
                assert toks == plain[i + j], f"{name} {loop} batch {batch}: prompt {i + j} diverges from plain greedy"


@pytest.mark.parametrize("loop", ["generate", "engine"])
def test_default_model_greedy_exact_small(default_model, loop):
    """A batch of 2 prompts of different lengths (a chat prompt and a raw continuation), 10 tokens each;
    batch 1 is covered by the tiny-model tests and the slow full-size test."""
    check_exact(default_model, ["ngram", "draft", "medusa"], n_prompts=2, max_tokens=10, batch=2, loop=loop)


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["generate", "engine"])
@pytest.mark.parametrize("name", ["ngram", "draft", "medusa", "quant-draft"])
@pytest.mark.parametrize("batch", [1, 4])
def test_default_model_greedy_exact_full(default_model, name, batch, loop):
    check_exact(default_model, [name], n_prompts=20, max_tokens=128, batch=batch, loop=loop)
