"""pytest helpers for a speculator of your own: ``assert_lossless`` and ``assert_same_distribution`` run the
verdict's statistics (evals.speculation.lossless) on a tiny seeded random model in seconds. And the broken control the
tests must reject: ``sharpened_draft``, a draft model that samples its drafts from q but tells the verifier q sharpened
by temperature 0.8 (the commonest real bug of a new draft method).

    from evals.speculation.testing import assert_lossless
    from speculate.registry import BuildContext, build

    def test_my_speculator_is_lossless():
        assert_lossless(lambda target: build("my_pkg.mod:MySpeculator:k=3", target, BuildContext(smoke=True)))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from evals.speculation.chain_test import sharpened
from evals.speculation.lossless import (
    ALPHA,
    MIN_DRAFT_RATE,
    TwoTokenTest,
    choose_context,
    greedy_match,
    run_tokens,
    two_token_test,
)
from runtime.config import ModelConfig
from runtime.model import Transformer, random_model
from speculate.base import Proposal, SpecState, Speculator
from speculate.registry import BuildContext, build

# a small vocabulary keeps every two-token cell populated; std 0.3 makes the distributions peaked enough for that
TINY = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position_embeddings=256, eos_token_ids=[0])  # fmt: skip
TINY_SAMPLES = 4000


def tiny_target(seed: int = 1) -> Transformer:
    return random_model(TINY, seed=seed, std=0.3)


def tiny_prompts(n: int = 4, length: int = 12, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, TINY.vocab_size, (length,), generator=gen).tolist() for _ in range(n)]


def assert_same_distribution(
    speculator_factory: Callable[[Transformer], Speculator],
    target: Transformer | None = None,
    samples: int = TINY_SAMPLES,
    alpha: float = ALPHA,
    seed: int = 0,
) -> dict:
    """Sampled speculative output (temperature 1, top-p 1) has the target's exact two-token distribution.

    speculator_factory(target) builds the speculator (default target: ``tiny_target()``, 48 tokens, 2 layers).
    ``samples`` seeded runs of one context (the prompt prefix where the target is least certain) are compared with
    p(t1) p(t2 | t1) by chi-square. False-failure rate: at most ``alpha`` (1e-3 by default; asymptotic chi-square)
    for a lossless speculator over fresh seeds; with the seed fixed, the outcome is reproducible. Power: the
    returned figures state it against a draft equal to the target reporting q at temperature 0.8 (the broken
    control ``sharpened_draft`` is rejected on the tiny target at the default budget: tests/test_plugin_example.py).
    Returns the figures; raises AssertionError naming the p-value when the test rejects, and when the speculator
    proposed fewer than MIN_DRAFT_RATE drafts per run (inconclusive: the context is chosen among the prompts'
    prefixes, most uncertain first, where a probe of the speculator drafts)."""
    target = target if target is not None else tiny_target()
    speculator = speculator_factory(target)
    test = TwoTokenTest(
        samples, alpha, temperature=1.0, top_k=0, top_p=1.0, seed=seed, max_tokens=run_tokens(speculator)
    )
    context = choose_context(target, tiny_prompts(), test.params(0), speculator, test)
    figures = two_token_test(target, speculator, context, test)
    assert figures["passed"], (
        f"speculative output is not distributed as the target's: chi-square p = {figures['p_value']:.3g} < alpha "
        f"{alpha} over {samples} runs (empirical TV {figures['empirical_tv']:.4f}, "
        f"{figures['impossible_pairs']} impossible pairs)"
    )
    assert figures["drafted"] >= MIN_DRAFT_RATE * samples, (
        f"inconclusive: the speculator proposed {figures['drafted']} drafts in {samples} runs at the most uncertain "
        "context where it drafts at all, so the test only saw plain decoding"
    )
    return figures


def assert_lossless(
    speculator_factory: Callable[[Transformer], Speculator],
    target: Transformer | None = None,
    samples: int = TINY_SAMPLES,
    alpha: float = ALPHA,
    seed: int = 0,
) -> dict:
    """Greedy speculative output equals plain greedy decoding token for token on four seeded prompts (exact: a tiny
    fp32 model has no near-ties at these prompts), and ``assert_same_distribution`` passes. False-failure rate:
    that of assert_same_distribution, at most ``alpha``."""
    target = target if target is not None else tiny_target()
    greedy = greedy_match(target, speculator_factory(target), tiny_prompts(), max_tokens=16)
    assert greedy["greedy_identical_sequences"] == greedy["greedy_sequences"], (
        f"greedy speculative output differs from plain greedy decoding: token agreement "
        f"{greedy['greedy_token_agreement']:.3f}"
    )
    return {**greedy, **assert_same_distribution(speculator_factory, target, samples, alpha, seed)}


# ---- the broken control --------------------------------------------------------------------------------------


class SharpenedReport(Speculator):
    """Wraps a sampling speculator: its drafts are drawn from q, the verifier is told q^(1/T) normalized. It still
    claims to be lossless, which is the bug the verdict must catch."""

    def __init__(self, inner: Speculator, temperature: float = 0.8):
        self.inner, self.temperature = inner, temperature
        self.name = f"sharpened-report({inner.name}, T={temperature})"

    def max_tokens_per_step(self) -> int:
        return self.inner.max_tokens_per_step()

    def prefill(self, state: SpecState) -> None:
        self.inner.prefill(state)

    def release(self, ids) -> None:
        self.inner.release(ids)

    def propose(self, state: SpecState) -> Proposal:
        proposal = self.inner.propose(state)
        if proposal.draft_probs is None:
            return proposal  # deterministic drafts: nothing to misreport
        return replace(proposal, draft_probs=sharpened(proposal.draft_probs, self.temperature))

    def describe(self) -> dict:
        return {**self.inner.describe(), "name": self.name, "reported_q_temperature": self.temperature}


def sharpened_draft(
    target,
    context: BuildContext,
    *,
    k: int = 4,
    layers: int | None = None,
    model: str | None = None,
    temperature: float = 0.8,
) -> Speculator:
    """The broken control as a speculator plug-in, around the built-in draft speculator: model= any --draft-model
    spec (``evals.speculation.testing:sharpened_draft:model=int4``), or layers= a layer-skip draft (default: half the
    layers)."""
    draft = f"model={model}" if model else f"layers={layers or max(1, target.config.num_layers // 2)}"
    return SharpenedReport(build(f"draft:k={k},{draft}", target, context), temperature)
