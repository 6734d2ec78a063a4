"""Per-request seeds on the default model, for every speculator the CLI offers (speculate.cli.SPECULATORS: ngram,
draft with the default int4 draft, quant-draft int8, medusa, eagle; heads random and saved, as the contract does
not depend on their quality): one seeded sampled request gives the same tokens alone, in a batch of 8 of the static
loop and in the serving engine's batch of 8. Tree speculators draw once per committed token (speculate.verify), so
their tokens are plain sampling's too.

And a draft model proposes its own forward's distribution: every q it proposes inside the loop equals an uncached
forward of the draft over the same tokens (fp32, within 1e-4: summation-order noise is ~1e-5 here)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from quantize.qlinear import QuantLinear
from runtime.decoding import encode_prompt, generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.sampling import SamplingParams, logits_to_probs
from runtime.speculation import Proposal
from speculate.cli import SPECULATORS, build_speculator
from speculate.draft import DraftModelSpeculator, quantized_draft
from speculate.eagle.head import EagleConfig, EagleHead
from speculate.generate import speculative_generate
from speculate.medusa.heads import MedusaConfig, MedusaHeads, model_fingerprint

pytestmark = pytest.mark.integration

MINE = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True)
ROW = 3  # the request's place in the batch of 8
TOPICS = ["Rome", "tea", "rivers", "the violin", "jazz", "glass", "maps", "salt"]


def randomized(module, scale: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    return module.eval()


@pytest.fixture(scope="module")
def heads(default_model, tmp_path_factory):
    """Random Medusa heads (with an accuracy table for the tree) and a random EAGLE head, saved for the model."""
    model = default_model[0]
    cfg = MedusaConfig(num_heads=3, hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size)
    cfg.base_fingerprint = model_fingerprint(model)
    cfg.accuracy = [[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05]]
    medusa = randomized(MedusaHeads(cfg), 0.02).save(tmp_path_factory.mktemp("medusa"))
    eagle = randomized(EagleHead(EagleConfig.for_model(model)), 0.05).save(tmp_path_factory.mktemp("eagle"))
    return {"medusa_heads": str(medusa), "eagle_heads": str(eagle)}


def speculator(name: str, model, heads: dict):
    """As the CLI builds it (`--speculator NAME`, defaults), with the default int4 draft named explicitly."""
    options = {"draft": {"draft_model": "int4"}, "medusa": {"tree_size": 8}}.get(name, {})
    return build_speculator(name, model, "unused", k=3, **heads, **options)


# Medusa and EAGLE take ~1 min each here (slow); their seeds rest on the tree verifier's one-draw rule, which
# tests/test_spec_verify.py checks in the default suite (test_tree_draws_do_not_depend_on_the_tree_shape). The
# quantized self-draft (~16 s on AVX2) is the draft path with another model: slow too, and the draft (~26 s),
# whose seeded draws tests/test_spec_generate.py checks on tiny models; n-gram keeps the default model's case
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("medusa", "eagle", "quant-draft", "draft") else n
        for n in SPECULATORS
    ],
)
def test_seeded_request_alone_in_a_batch_of_8_and_in_the_engine(default_model, heads, name):
    model, tokenizer, _ = default_model
    prompts = [encode_prompt(tokenizer, f"Tell me about the history of {t}.", chat=True) for t in TOPICS]
    mates = [SamplingParams(temperature=1.0, top_p=0.9, seed=10 + i, max_tokens=20 + 2 * i) for i in range(8)]
    mates[5] = SamplingParams(max_tokens=24)  # a greedy mate
    batch = mates[:ROW] + [MINE] + mates[ROW + 1 :]
    spec = speculator(name, model, heads)
    alone = speculative_generate(model, [prompts[ROW]], [MINE], spec).tokens[0]
    together = speculative_generate(model, prompts, batch, spec).tokens[ROW]
    engine = LLMEngine(model, config=EngineConfig(kv_cache_bytes=1 << 26), speculator=spec)
    served = engine.generate(prompts, batch)[ROW].output_ids
    assert len(alone) == MINE.max_tokens and len(set(alone)) > 8  # really sampled
    assert together == alone, f"{name}: batch of 8 diverges at token {first_difference(alone, together)}"
    assert served == alone, f"{name}: engine diverges at token {first_difference(alone, served)}"
    if name in ("medusa", "eagle"):  # one draw per committed token: plain sampling's tokens
        assert alone == generate(model, [prompts[ROW]], MINE).tokens[0]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def fp32_draft(model, bits: int, path: str | None = None):
    """The quant-draft copy computing in fp32: int8 on its automatic path (the CPU step kernel, fp32 activations),
    int4 on the path named (dense: dequantized once, the reference's math; cpu: qspec's CPU step kernel;
    cpu_int4: torch's packed kernel, which rounds to bf16)."""
    draft = quantized_draft(model, bits, dtype=torch.float32)
    if path is not None:
        for layer in draft.modules():
            if isinstance(layer, QuantLinear):
                layer.set_path(path)
    return draft


def recorded(spec) -> list[tuple[list[list[int]], Proposal]]:
    """Every (committed tokens, proposal) of spec's propose() calls from now on."""
    calls, real = [], spec.propose

    def propose(state):
        proposal = real(state)
        calls.append(([list(seq) for seq in state.token_ids], proposal))
        return proposal

    spec.propose = propose
    return calls


PACKED_INT4 = pytest.mark.xfail(
    strict=True,
    reason="torch's packed int4 CPU kernel (_weight_int4pack_mm_for_cpu) rounds activations and outputs to bf16 "
    "and its rounding depends on the call's row count: with the rest of the draft in fp32, q differs from the "
    "uncached forward by 4e-3 to 1.8e-2 per step (notes/issue-28.md); QuantLinear's CPU default is now qspec's "
    "step kernel (path 'cpu', the int4-step case), which holds the bar",
)


@pytest.mark.parametrize(
    "bits, path",
    [
        pytest.param(8, None, marks=pytest.mark.slow),  # the int4 cases below take the same draft paths
        (4, "dense"),
        (4, "cpu"),
        pytest.param(4, "cpu_int4", marks=[PACKED_INT4, pytest.mark.slow]),
    ],
    ids=["int8", "int4", "int4-step", "int4-packed"],
)
@pytest.mark.parametrize("batch", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_draft_proposes_its_own_uncached_distribution(default_model, bits, path, batch):
    model, tokenizer, _ = default_model
    draft = fp32_draft(model, bits, path)
    spec = DraftModelSpeculator(model, draft, k=3)
    proposals = recorded(spec)
    prompts = [encode_prompt(tokenizer, f"Tell me about the history of {t}.", chat=True) for t in TOPICS[:batch]]
    speculative_generate(model, prompts, replace(MINE, max_tokens=12), spec)
    worst = []
    with torch.no_grad():
        for seqs, proposal in proposals:
            step = 0.0
            for b, seq in enumerate(seqs):
                context = seq + proposal.tokens[b, :-1].tolist()  # the committed tokens and all drafts but the last
                logits = draft(torch.tensor([context]))[0, -spec.k :]  # [k, V]: after seq, then after each draft
                q = logits_to_probs(logits, MINE)
                step = max(step, float((q - proposal.draft_probs[b].float()).abs().max()))
            worst.append(step)
    assert len(worst) >= 3 and max(worst) <= 1e-4, [f"{w:.1e}" for w in worst]
