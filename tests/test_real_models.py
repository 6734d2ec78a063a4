"""The real pair (Qwen2.5-Coder 1.5B / 0.5B Instruct, registry models fetched on first use) against transformers.

Slow: the first run downloads ~1.6 GB and converts both files (~3 min); each test then takes minutes on the 2-core
machine. `pytest -m slow tests/test_real_models.py`. The oracle is transformers reading the GGUF file itself (not
qspec's converted copy), in fp32."""

from __future__ import annotations

import pytest
import torch

from evals.quality.humaneval_problems import load_problems
from runtime.decoding import generate
from runtime.loader import REGISTRY, load_model, load_tokenizer
from runtime.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.integration]
NEW_TOKENS = 64
PROMPTS = 10


def hf_from_gguf(name: str):
    """transformers' own reading of the registry model's GGUF, fp32 (independent of qspec's conversion)."""
    from transformers import AutoModelForCausalLM

    gguf = REGISTRY[name].gguf_path()
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
@torch.inference_mode()
def test_fp32_greedy_equals_transformers_on_humaneval_prompts(name):
    """10 HumanEval prompts x 64 greedy tokens, in one mixed-length batch on qspec's side, one by one on HF's."""
    model, _, path = load_model(name, dtype=torch.float32)
    tokenizer = load_tokenizer(str(path))
    prompts = [tokenizer(p.prompt).input_ids for p in load_problems()[:PROMPTS]]
    ours = generate(model, prompts, SamplingParams(max_tokens=NEW_TOKENS)).tokens
    del model
    hf = hf_from_gguf(name)
    for i, (prompt, tokens) in enumerate(zip(prompts, ours)):
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pad_token_id=tokenizer.eos_token_id,
        )[0, len(prompt) :].tolist()
        assert tokens == ref[: len(tokens)], f"prompt {i}: first difference at token {first_difference(tokens, ref)}"
        assert len(tokens) == len(ref) or tokens[-1] == tokenizer.eos_token_id


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_the_pair_shares_one_tokenizer():
    """The draft must tokenize as the target does: same vocabulary, merges and special ids."""
    big = load_tokenizer("qwen2.5-coder-1.5b")
    small = load_tokenizer("qwen2.5-coder-0.5b")
    assert big.get_vocab() == small.get_vocab()
    assert big.all_special_ids == small.all_special_ids
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # héllo 世界"
    assert big(text).input_ids == small(text).input_ids
