"""KV-cache generation against full recompute, batching against one-at-a-time, and the sampler's math."""

from __future__ import annotations

import pytest
import torch

from runtime.decoding import generate
from runtime.sampling import SamplingParams, logits_to_probs, make_generator, sample_rows


def prompts_of_mixed_lengths(vocab: int, n: int = 5, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, vocab, (int(torch.randint(1, 17, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def test_cache_equals_full_recompute(tiny_llama):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = prompts_of_mixed_lengths(96)
    cached = generate(tiny_llama, prompts, params)
    recomputed = generate(tiny_llama, prompts, params, use_cache=False)
    assert cached.tokens == recomputed.tokens


def test_batched_equals_one_at_a_time(tiny_llama):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = prompts_of_mixed_lengths(96, n=6, seed=3)
    batched = generate(tiny_llama, prompts, params)
    for i, p in enumerate(prompts):
        assert generate(tiny_llama, [p], params).tokens[0] == batched.tokens[i]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    prompts = prompts_of_mixed_lengths(96, n=3, seed=5)
    a = generate(tiny_llama, prompts, params)
    b = generate(tiny_llama, prompts[1:2], params)
    assert a.tokens[1] == b.tokens[0]
    other = generate(tiny_llama, prompts[1:2], SamplingParams(**{**params.__dict__, "seed": 8}))
    assert other.tokens[0] != b.tokens[0]


def test_stop_conditions(tiny_llama):
    prompts = [[5, 6, 7]]
    free = generate(tiny_llama, prompts, SamplingParams(max_tokens=12, ignore_eos=True)).tokens[0]
    stop_tok = free[4]
    first = free.index(stop_tok)
    out = generate(tiny_llama, prompts, SamplingParams(max_tokens=12, stop_token_ids=[stop_tok]))
    assert out.tokens[0] == free[: first + 1] and out.finish_reasons == ["stop"]
    out = generate(tiny_llama, prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out.tokens[0]) == 5 and out.finish_reasons == ["length"]


def brute_force_probs(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """Independent oracle: the same filters written as plain loops over sorted tokens (ties in index order)."""
    probs = torch.softmax(logits.double() / t, -1)
    values, masses = logits.tolist(), probs.tolist()
    order = sorted(range(len(values)), key=lambda i: -values[i])
    keep = set(order[:k]) if k else set(order)
    if k:  # ties with the k-th logit are kept
        keep |= {i for i in order if values[i] == values[order[k - 1]]}
    kept_mass = sum(masses[i] for i in keep)
    mass = 0.0
    final = set()
    for i in order:
        if i not in keep:
            continue
        if mass >= p - 1e-12:
            break
        final.add(i)
        mass += masses[i] / kept_mass
    out = torch.zeros_like(probs)
    for i in final:
        out[i] = probs[i]
    return out / out.sum()


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.6), (2.0, 3, 0.99)])
def test_logits_to_probs_exact(t, k, p):
    gen = torch.Generator().manual_seed(11)
    for _ in range(5):
        logits = torch.randn(20, generator=gen) * 3
        got = logits_to_probs(logits, SamplingParams(temperature=t, top_k=k, top_p=p))
        torch.testing.assert_close(got.double(), brute_force_probs(logits, t, k, p), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "scale,t,p",
    [
        (4.0, 0.7, 0.95),  # peaked: the nucleus within the first candidates
        (2.0, 1.0, 0.6),  # ~1-2k tokens: the candidates grow once
        (1.5, 1.0, 0.5),  # several thousand: twice
    ],
)
def test_top_p_on_a_real_vocabulary_is_the_sorted_nucleus(scale, t, p):
    """top_p_filter searches a few hundred candidates first and widens them until the nucleus ends inside: on
    Qwen2.5's vocabulary size it equals the oracle's full sort, also where the nucleus is far wider than the first
    candidates (a search that stopped early would cut it short) and for a batch mixing both."""
    from runtime.sampling import TOP_P_CANDIDATES

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 151936, generator=gen) * torch.tensor([[scale], [4.0]])
    got = logits_to_probs(logits, SamplingParams(temperature=t, top_p=p))
    for row in range(2):
        want = brute_force_probs(logits[row], t, 0, p)
        assert torch.equal(got[row] > 0, want > 0)
        torch.testing.assert_close(got[row].double(), want, atol=1e-7, rtol=1e-4)
    if scale < 4.0:
        assert int((got[0] > 0).sum()) > TOP_P_CANDIDATES  # the case exercises the widening


def test_top_p_breaks_ties_at_the_nucleus_edge_by_index():
    """Logits on a 3-value grid tie about a thousand tokens each; the nucleus ends inside a tie block and keeps
    its lowest token indices, as the oracle's stable sort does (some tokens of the block in, some out). A token
    holds ~1e-3 of the mass here, far above fp32's cumsum error, so the edge is the same in fp32 and float64."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randint(0, 3, (3000,), generator=gen).float()
    got = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.77))
    want = brute_force_probs(logits, 1.0, 0, 0.77)
    assert torch.equal(got > 0, want > 0)
    block = logits == logits[want > 0].min()
    assert 0 < int((want[block] > 0).sum()) < int(block.sum())  # the edge cuts a tie block
    torch.testing.assert_close(got.double(), want, atol=1e-9, rtol=1e-4)


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 5.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_sampler_frequencies_match_probs():
    """Chi-square of 20k seeded draws against the exact distribution. With a fixed seed the outcome is
    deterministic; at significance 1e-3 a correct sampler fails for 0.1% of seeds."""
    from scipy.stats import chisquare

    probs = logits_to_probs(torch.tensor([1.0, 0.5, -0.2, 2.0, 0.0, -1.0]), SamplingParams(temperature=1.0))
    params, gens = [SamplingParams(temperature=1.0)], [make_generator(0)]
    counts = torch.zeros(6)
    for _ in range(20000):
        counts[sample_rows(probs[None], params, gens)[0]] += 1
    assert chisquare(counts.numpy(), (probs * 20000).numpy()).pvalue > 1e-3


def test_sample_draws_a_real_vocabulary_exactly():
    """The inverse-CDF sampler on Qwen2.5's vocabulary size: a few likely tokens, zeros between them and a long
    tail. Chi-square of 10k draws (one call of 10k rows, one generator) over the likely tokens and the tail
    lumped into one bin, significance 1e-3 (a correct sampler fails for 0.1 % of seeds); zero-probability
    tokens are never drawn; an unnormalized row is its normalized distribution; a row without mass is refused."""
    from scipy.stats import chisquare

    from runtime.sampling import sample

    V = 151936
    probs = torch.zeros(V)
    probs[torch.arange(1, V, 2)] = 0.3 / (V // 2)  # the tail on odd tokens, the even ones impossible
    likely = torch.tensor([0, 4096, 77778, V - 1 - (V % 2 == 0)])
    probs[likely] = torch.tensor([0.35, 0.2, 0.1, 0.05])
    draws = sample((probs * 7.0).expand(10000, V), make_generator(3))  # unnormalized rows
    assert not bool((probs[draws] == 0).any())
    hits = torch.stack([(draws == t).sum() for t in likely]).double()
    observed = torch.cat([hits, (10000 - hits.sum()).reshape(1)])
    expected = torch.cat([probs[likely].double(), torch.tensor([0.3], dtype=torch.float64)]) * 10000
    assert chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue > 1e-3
    with pytest.raises(ValueError, match="mass"):
        sample(torch.zeros(2, 10))


@pytest.mark.parametrize(
    "bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(max_tokens=0)]
)
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_bf16_mixed_generation_runs_and_matches_its_forward(tiny_llama):
    """The KV cache takes the decoder's compute dtype (bf16) while embeddings/logits stay fp32."""
    model = tiny_llama.set_dtype(torch.bfloat16)
    prompt = [3, 4, 5, 6]
    out = generate(model, [prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    with torch.inference_mode():
        first = int(model(torch.tensor([prompt]))[0, -1].argmax())
    assert out.tokens[0][0] == first and len(out.tokens[0]) == 3


def test_bf16_single_row_fast_path_matches_linear():
    """The mv decode path computes the same product as F.linear (bf16 rounding of the output aside)."""
    from runtime.model import Linear

    layer = Linear(48, 40, bias=False).to(torch.bfloat16)
    x = torch.randn(1, 1, 48, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), layer.weight.float())
    got = layer(x)
    assert got.shape == (1, 1, 40)
    torch.testing.assert_close(got.float(), ref, atol=0.05, rtol=0.02)
