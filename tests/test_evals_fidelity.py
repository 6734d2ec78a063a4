"""Fidelity metrics on hand-computed cases, and the code paths they compare on tiny random models."""

from __future__ import annotations

import math

import pytest
import torch

from evals.quality.fidelity import (
    batched_scorer,
    cached_scorer,
    compare_teacher_forced,
    greedy_outputs,
    model_scorer,
    token_match,
)
from runtime.model import Attention, random_model
from runtime.reference.naive_attention import NaiveAttention, naive_attention, naive_sdpa
from tests.tiny_models import TINY_CONFIGS


def fixed_scorer(per_position: list[list[float]]):
    """Logits that depend only on the position: [T, V] broadcast over the batch."""
    table = torch.tensor(per_position)

    def score(tokens):
        return table[: tokens.shape[1]].expand(tokens.shape[0], -1, -1)

    return score


def test_hand_computed_two_token_vocab():
    # position 0: ref p = (1/2, 1/2), test q = (3/4, 1/4); position 1: ref (e/(1+e), 1/(1+e)), test swapped
    ref = fixed_scorer([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    test = fixed_scorer([[math.log(3), 0.0], [0.0, 1.0], [0.0, 0.0]])
    seq = [[0, 1, 0]]  # observed next tokens: 1 at position 0, 0 at position 1
    s = compare_teacher_forced(ref, test, seq)
    assert s.positions == 2
    d0 = abs(math.log(0.5) - math.log(0.25))
    pe = math.e / (1 + math.e)
    d1 = abs(math.log(pe) - math.log(1 - pe))  # = 1
    assert s.max_abs_dlogprob == pytest.approx(max(d0, d1), abs=1e-6)
    assert s.mean_abs_dlogprob == pytest.approx((d0 + d1) / 2, abs=1e-6)
    kl0 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    kl1 = pe * math.log(pe / (1 - pe)) + (1 - pe) * math.log((1 - pe) / pe)
    assert s.mean_kl == pytest.approx((kl0 + kl1) / 2, abs=1e-6)
    assert s.max_kl == pytest.approx(max(kl0, kl1), abs=1e-6)
    # position 0: both argmax 0 (ref ties resolve to index 0); position 1: 0 vs 1 disagree
    assert s.top1_agreement == 0.5 and s.disagreements == 1
    assert s.mean_top2_gap_at_disagreement == pytest.approx(1.0, abs=1e-6)  # ref margin log(e)
    assert s.ref_nll == pytest.approx(-(math.log(0.5) + math.log(pe)) / 2, abs=1e-6)
    assert s.test_nll == pytest.approx(-(math.log(0.25) + math.log(1 - pe)) / 2, abs=1e-6)
    assert not s.bit_identical


def test_identical_scorers_report_zero():
    model = random_model(TINY_CONFIGS["llama"], seed=1)
    seqs = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()
    s = compare_teacher_forced(model_scorer(model), model_scorer(model), seqs)
    assert s.bit_identical and s.max_abs_dlogprob == 0 and s.mean_kl == 0 and s.top1_agreement == 1
    assert s.mean_top2_gap_at_disagreement is None


def test_different_models_are_detected():
    a, b = random_model(TINY_CONFIGS["llama"], seed=1), random_model(TINY_CONFIGS["llama"], seed=2)
    seqs = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0)).tolist()
    s = compare_teacher_forced(model_scorer(a), model_scorer(b), seqs)
    assert s.max_abs_dlogprob > 0.1 and s.mean_kl > 0.01 and s.top1_agreement < 0.9


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama-tied-mha"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_cached_scorer_matches_full_forward(name, chunk):
    model = random_model(TINY_CONFIGS[name], seed=3)
    V = TINY_CONFIGS[name].vocab_size
    seqs = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1)).tolist()
    s = compare_teacher_forced(model_scorer(model), cached_scorer(model, prefill=5, chunk=chunk), seqs)
    assert s.positions == 2 * 19
    assert s.max_abs_dlogprob_vocab < 1e-4 and s.top1_agreement == 1.0


def test_batched_scorer_matches_alone():
    model = random_model(TINY_CONFIGS["llama"], seed=4)
    g = torch.Generator().manual_seed(2)
    seqs = torch.randint(0, 96, (2, 15), generator=g).tolist()
    companions = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 22, 15)]
    s = compare_teacher_forced(model_scorer(model), batched_scorer(model, companions), seqs)
    assert s.max_abs_dlogprob_vocab < 1e-4 and s.top1_agreement == 1.0


def test_naive_attention_is_same_math_and_restores():
    model = random_model(TINY_CONFIGS["qwen3"], seed=5)
    seqs = torch.randint(0, 96, (2, 18), generator=torch.Generator().manual_seed(3)).tolist()
    ref = model_scorer(model)(torch.tensor(seqs)).clone()
    with naive_attention(model):
        assert all(type(layer.self_attn) is NaiveAttention for layer in model.layers)
        naive = model_scorer(model)(torch.tensor(seqs))
    assert all(type(layer.self_attn) is Attention for layer in model.layers)
    assert torch.allclose(ref, naive, atol=1e-5)
    # the naive product itself against an explicit loop over heads and queries
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.tensor([[True] * 3 + [False] * 2, [True] * 4 + [False], [True] * 5])[None, None]
    out = naive_sdpa(q, k, v, mask)
    for h in range(4):
        for t in range(3):
            n = 3 + t
            w = torch.softmax(q[0, h, t] @ k[0, h // 2, :n].T / math.sqrt(8), -1)
            assert torch.allclose(out[0, h, t], w @ v[0, h // 2, :n], atol=1e-6)


def test_token_match_hand_cases():
    m = token_match([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert m.tokens_matched == 2 + 4 and m.tokens_compared == 8 and m.identical_sequences == 1
    assert m.match_rate == 6 / 8
    with pytest.raises(ValueError):
        token_match([[1]], [[1], [2]])


def test_greedy_outputs_cache_vs_recompute():
    model = random_model(TINY_CONFIGS["llama"], seed=6)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11], [2]]
    a = greedy_outputs(model, prompts, 12, batch_size=1, use_cache=True)
    b = greedy_outputs(model, prompts, 12, batch_size=3, use_cache=False)
    assert all(len(x) == 12 for x in a)
    assert token_match(a, b).match_rate == 1.0
