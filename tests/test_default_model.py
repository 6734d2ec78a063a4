"""Integration: the embedded SmolLM2-135M-Instruct against transformers on the same converted weights."""

from __future__ import annotations

import copy

import pytest
import torch

from evals.quality.perplexity import perplexity
from runtime.data import wiki_split, wiki_text
from runtime.decoding import generate
from runtime.sampling import SamplingParams

pytestmark = pytest.mark.integration
NEW_TOKENS = 64


def wiki_prompts(tokenizer, n: int = 20) -> list[list[int]]:
    """The first words of n evaluation-split documents (prompt lengths vary from 6 to ~40 tokens)."""
    docs = wiki_split("eval")[:n]
    return [
        tokenizer(" ".join(d.extract.split()[: 4 + 2 * i]), add_special_tokens=False).input_ids
        for i, d in enumerate(docs)
    ]


@pytest.fixture(scope="module")
def greedy_runs(default_model):
    """All 20 prompts greedy in one mixed-length batch (64 new tokens each)."""
    model, tokenizer, _ = default_model
    prompts = wiki_prompts(tokenizer)
    return prompts, generate(model, prompts, SamplingParams(max_tokens=NEW_TOKENS)).tokens


# transformers' own generate costs ~7 s a prompt on an AVX2 machine: the default suite runs it on the first of the
# batched run's 20 prompts (all of the batch still decodes together), `-m slow` on the other 19; every prompt is
# checked by default against transformers' teacher-forced argmax (one forward a prompt), below
HF_PROMPTS = {"first-1": slice(0, 1), "last-19": slice(1, 20)}


@torch.inference_mode()
@pytest.mark.parametrize("part", [pytest.param("first-1"), pytest.param("last-19", marks=pytest.mark.slow)])
def test_greedy_matches_transformers(default_model, hf_default_model, greedy_runs, part):
    prompts, ours = greedy_runs
    for prompt, tokens in list(zip(prompts, ours))[HF_PROMPTS[part]]:
        ref = hf_default_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
        assert tokens == ref[0, len(prompt) :].tolist()


@torch.inference_mode()
def test_every_greedy_token_is_transformers_argmax(hf_default_model, greedy_runs):
    """All 20 prompts: each of our greedy tokens is transformers' argmax given the prompt and our tokens before it
    (teacher forcing: what its greedy generate picks at every step once the prefixes agree)."""
    prompts, ours = greedy_runs
    for i, (prompt, tokens) in enumerate(zip(prompts, ours)):
        seq = torch.tensor([prompt + tokens[:-1]])
        picks = hf_default_model(seq).logits[0, len(prompt) - 1 :].argmax(-1).tolist()
        first = next((j for j, (a, b) in enumerate(zip(picks, tokens)) if a != b), None)
        assert picks == tokens, f"prompt {i}: transformers picks another token at new token {first}"


@pytest.mark.slow  # ~1 min here; tiny-model tests (test_generate.py) cover batching and full recompute by default
def test_batching_and_full_recompute_match(default_model, greedy_runs):
    """The batched run equals one prompt at a time, and the KV cache equals full recompute (the 20-prompt
    HF comparison above then covers all three; here 5 prompts of different lengths keep the suite short)."""
    model, _, _ = default_model
    prompts, batched = greedy_runs
    params = SamplingParams(max_tokens=NEW_TOKENS)
    picks = [0, 4, 9, 14, 19]
    for i in picks:
        assert generate(model, [prompts[i]], params).tokens[0] == batched[i]
    recompute = generate(model, [prompts[i] for i in picks], params, use_cache=False).tokens
    assert recompute == [batched[i] for i in picks]


# bf16 against fp32, teacher-forced over the 20 greedy runs (1270 positions). The bars hold on every kernel family
# a CPU may bring: measured 2026-12-01 on this repository's default path (bf16 head) with oneDNN capped at each ISA
# (ONEDNN_MAX_CPU_ISA) on one Sapphire Rapids: AMX 97.56 % agreement / worst flipped top-2 gap 0.032 / mean KL
# 6.4e-4; AVX512_CORE_BF16 (the AMD EPYC path) 97.48 % / 0.063 / 6.6e-4; AVX2 97.17 % / 0.032 / 6.7e-4. The fp32
# head (head_dtype=torch.float32): 99.13 % / 0.014 / 3.3e-4 (AMX), 98.82 % / 0.014 / 3.3e-4 (AVX512_CORE_BF16),
# 98.66 % / 0.012 / 3.4e-4 (AVX2; the 1253/1270 a fresh AMD EPYC reported against the old 99 % bar). Each bar sits
# below the worst family with a stated margin: agreement 96 % (bf16 head; 15 positions of margin) and 98 % (fp32
# head; 8 positions), flips only where fp32's top-2 probabilities are within 0.15 (2.4x the worst), mean KL under
# 2e-3 (3x the worst).
BF16_BARS = {None: (0.96, 0.15, 2e-3), torch.float32: (0.98, 0.15, 2e-3)}


@pytest.fixture(scope="module")
@torch.inference_mode()
def fp32_teacher_forced(default_model, greedy_runs) -> list[torch.Tensor]:
    """fp32 log-softmax at each generated position of the 20 greedy runs (computed once for both heads)."""
    model, _, _ = default_model
    prompts, singles = greedy_runs
    return [
        model(torch.tensor([p + new]))[0, len(p) - 1 : -1].float().log_softmax(-1) for p, new in zip(prompts, singles)
    ]


@torch.inference_mode()
# the fp32 head (~13 s on AVX2) runs under -m slow; the default path's bf16 head runs by default
@pytest.mark.parametrize(
    "head_dtype", [None, pytest.param(torch.float32, marks=pytest.mark.slow)], ids=["bf16-head", "fp32-head"]
)
def test_bf16_teacher_forced_against_fp32(default_model, greedy_runs, fp32_teacher_forced, head_dtype):
    model, _, _ = default_model
    prompts, singles = greedy_runs
    bf16 = copy.deepcopy(model).set_dtype(torch.bfloat16, head_dtype=head_dtype)  # fp32 residual stream
    min_agree, max_gap, max_kl = BF16_BARS[head_dtype]
    agree, total, max_delta, kl = 0, 0, 0.0, 0.0
    for prompt, new, ref in zip(prompts, singles, fp32_teacher_forced):
        seq = torch.tensor([prompt + new])
        got = bf16(seq)[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        max_delta = max(max_delta, float((got - ref).abs().max()))
        kl += float((ref.exp() * (ref - got)).sum())
        same = got.argmax(-1) == ref.argmax(-1)
        agree += int(same.sum())
        total += same.numel()
        top2 = ref.exp().topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1])[~same]
        assert (gaps < max_gap).all(), f"bf16 flipped a confident token: top-2 gaps {gaps.tolist()}"
    print(f"bf16 vs fp32: agreement {agree}/{total}, mean KL {kl / total:.2e}, max |d log-softmax| {max_delta:.4f}")
    assert agree / total >= min_agree
    assert kl / total <= max_kl


@torch.inference_mode()
def test_perplexity_matches_transformers(default_model, hf_default_model):
    model, tokenizer, _ = default_model
    text = wiki_text("eval")
    ours = perplexity(model, tokenizer, text, seqlen=512, max_windows=2)  # 1022 tokens; ~4-7 s a window on AVX2
    ref = perplexity(hf_default_model, tokenizer, text, seqlen=512, max_windows=2)
    assert ours.windows == 2 and ours.tokens_scored == 2 * 511
    assert abs(ours.perplexity - ref.perplexity) / ref.perplexity < 5e-5, (ours.perplexity, ref.perplexity)


def test_wiki_splits_do_not_overlap():
    eval_titles = {d.title for d in wiki_split("eval")}
    calib_titles = {d.title for d in wiki_split("calib")}
    assert len(eval_titles) == 5000 and len(calib_titles) > 4000
    assert not eval_titles & calib_titles
