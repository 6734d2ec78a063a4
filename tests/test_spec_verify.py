"""The verifier alone: emitted tokens have exactly the target's distribution (chi-square), and the same
harness rejects deliberately wrong rules, so it bites.

Setup: a Markov target p(x_t | x_{t-1}) = P[x_{t-1}] and draft q(x_t | x_{t-1}) = Q[x_{t-1}] over a small
vocabulary, started from a fixed context token. Each draw runs real speculative steps (draft k tokens from
Q, verify against P at every drafted prefix) until two tokens are emitted; the first token must follow
P[s0] and the pair (x1, x2) must follow P[s0, x1] * P[x1, x2].

Significance: each chi-square test uses alpha = 1e-4. This file runs 2 tests for each of 22 correct-rule
cases (44 tests; k = 2, 3 are marked slow to keep the default suite short), so the chance that a correct
verifier fails any of them is <= 44e-4 ~ 0.5% per fresh seed; the seeds are fixed, so the outcome is
reproducible. The wrong rules' p-values are far below alpha (an impossible token or p < 1e-30).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from runtime.sampling import sample
from speculate.verify import (
    CandidateTree,
    ChainResult,
    greedy_verify,
    rejection_sample,
    tree_greedy_verify,
    tree_rejection_sample,
    typical_accept_chain,
)

ALPHA = 1e-4
DRAWS = 100_000


def random_rows(rows: int, V: int, gen: torch.Generator, sparsity: float = 0.3) -> torch.Tensor:
    """Random distributions with some exact zeros (as top-k / top-p filtering produces)."""
    logits = 2.0 * torch.randn(rows, V, generator=gen, dtype=torch.float64)
    drop = torch.rand(rows, V, generator=gen) < sparsity
    drop[torch.arange(rows), logits.argmax(-1)] = False  # keep at least one token per row
    probs = logits.softmax(-1).masked_fill(drop, 0.0)
    return (probs / probs.sum(-1, keepdim=True)).float()


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Inverse-CDF draws for the simulated draft (torch.multinomial is slow for 1e5 rows on CPU)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def make_case(case: str, V: int, seed: int):
    """(P [V+1, V], Q [V+1, V] or None, deterministic draft map [V+1] or None). Row V is the start context."""
    gen = torch.Generator().manual_seed(seed)
    P = random_rows(V + 1, V, gen)
    if case == "random":
        return P, random_rows(V + 1, V, gen), None
    if case == "q_equals_p":
        return P, P.clone(), None
    if case == "disjoint":  # p on even tokens, q on odd tokens: every draft is rejected
        even = torch.arange(V) % 2 == 0
        P = random_rows(V + 1, V, gen, sparsity=0.0).masked_fill(~even, 0.0)
        Q = random_rows(V + 1, V, gen, sparsity=0.0).masked_fill(even, 0.0)
        return P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True), None
    if case == "q_onehot":  # a deterministic draft given as explicit one-hot q
        draft_map = torch.randint(0, V, (V + 1,), generator=gen)
        return P, torch.nn.functional.one_hot(draft_map, V).float(), None
    if case == "deterministic":  # draft_probs=None path (n-gram / Medusa)
        return P, None, torch.randint(0, V, (V + 1,), generator=gen)
    raise ValueError(case)


def speculative_step(verify, P, Q, draft_map, ctx: torch.Tensor, k: int, gen: torch.Generator):
    """One speculative step for every row from context tokens ctx [n]; returns (first, second or -1)."""
    n = ctx.shape[0]
    drafts, qs, prev = [], [], ctx
    for _ in range(k):
        if draft_map is not None:
            tok = draft_map[prev]
        else:
            q = Q[prev]
            qs.append(q)
            tok = draw(q, gen)
        drafts.append(tok)
        prev = tok
    d = torch.stack(drafts, 1)  # [n, k]
    contexts = torch.cat([ctx[:, None], d], 1)  # [n, k+1]
    p = P[contexts]  # [n, k+1, V]
    q = torch.stack(qs, 1) if qs else None
    res: ChainResult = verify(d, p, q, gen)
    acc, nxt = res.num_accepted, res.next_token
    rows = torch.arange(n)
    first = torch.where(acc >= 1, d[:, 0], nxt)
    second_from_drafts = d[rows, torch.ones_like(acc)] if k >= 2 else nxt
    second = torch.where(acc >= 2, second_from_drafts, torch.where(acc == 1, nxt, torch.full_like(nxt, -1)))
    return first, second


def emit_two(verify, P, Q, draft_map, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    V = P.shape[1]
    start = torch.full((DRAWS,), V, dtype=torch.long)
    first, second = speculative_step(verify, P, Q, draft_map, start, k, gen)
    need = second < 0
    if bool(need.any()):
        again, _ = speculative_step(verify, P, Q, draft_map, first[need], k, gen)
        second[need] = again
    return first, second


def chi_square_pvalue(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square of integer samples against exact probabilities; cells expected < 5 are pooled."""
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double().flatten() * samples.numel()
    if counts[expected == 0].sum() > 0:  # a token the target never emits: impossible under a correct rule
        return 0.0
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def distribution_pvalues(verify, case: str, V: int, k: int, seed: int) -> tuple[float, float]:
    P, Q, draft_map = make_case(case, V, seed)
    first, second = emit_two(verify, P, Q, draft_map, k, seed + 1)
    start = P[V]
    joint = start[:, None] * P[:V]  # [V, V]: P(x1) P(x2 | x1)
    return chi_square_pvalue(first, start), chi_square_pvalue(first * V + second, joint)


def real_rule(d, p, q, gen):
    return rejection_sample(d, p, q, generator=gen)


CASES = [("random", 32), ("q_equals_p", 16), ("disjoint", 8), ("q_onehot", 16), ("deterministic", 24)]


@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize("case,V", CASES)
def test_rejection_sampling_matches_target_distribution(case, V, k):
    p_first, p_pair = distribution_pvalues(real_rule, case, V, k, seed=100 * k + V)
    assert p_first > ALPHA and p_pair > ALPHA, (p_first, p_pair)


def accept_with_q_over_p(d, p, q, gen):
    """WRONG: accepts with min(1, q/p) instead of min(1, p/q); otherwise the real residual rule."""
    B, k = d.shape
    q = q if q is not None else torch.nn.functional.one_hot(d, p.shape[-1]).float()
    p_d = p[:, :k].gather(-1, d[..., None]).squeeze(-1)
    q_d = q.gather(-1, d[..., None]).squeeze(-1)
    u = torch.rand(B, k, generator=gen)
    n = (u * p_d < q_d).long().cumprod(-1).sum(-1)
    rows = torch.arange(B)
    p_next, q_next = p[rows, n], q[rows, n.clamp(max=k - 1)]
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    dist = torch.where((n < k)[:, None], residual, p_next)
    return ChainResult(n, torch.multinomial(dist, 1, generator=gen).squeeze(-1))


def resample_from_p_on_rejection(d, p, q, gen):
    """WRONG: the real acceptance test, but a rejected position is resampled from p, not max(0, p - q)."""
    res = rejection_sample(d, p, q, generator=gen)
    p_next = p[torch.arange(d.shape[0]), res.num_accepted]
    return ChainResult(res.num_accepted, torch.multinomial(p_next, 1, generator=gen).squeeze(-1))


@pytest.mark.parametrize("wrong_rule", [accept_with_q_over_p, resample_from_p_on_rejection])
@pytest.mark.parametrize("k", [1, 3])
def test_harness_rejects_wrong_rules(wrong_rule, k):
    p_first, p_pair = distribution_pvalues(wrong_rule, "random", 32, k, seed=100 * k + 32)
    assert min(p_first, p_pair) < ALPHA, (p_first, p_pair)


def test_greedy_is_rejection_sampling_with_onehot_target():
    gen = torch.Generator().manual_seed(0)
    B, k, V = 4000, 4, 12
    logits = torch.randn(B, k + 1, V, generator=gen)
    argmax = logits.argmax(-1)
    onehot_p = torch.nn.functional.one_hot(argmax, V).float()
    # drafts that often agree with the argmax so every prefix length occurs
    drafts = torch.where(
        torch.rand(B, k, generator=gen) < 0.7, argmax[:, :k], torch.randint(0, V, (B, k), generator=gen)
    )
    q = random_rows(B * k, V, gen).view(B, k, V)
    greedy = greedy_verify(drafts, argmax)
    for draft_probs in (None, q):
        sampled = rejection_sample(drafts, onehot_p, draft_probs, generator=gen)
        assert torch.equal(sampled.num_accepted, greedy.num_accepted)
        assert torch.equal(sampled.next_token, greedy.next_token)
    # oracle: plain loop
    for b in range(0, B, 97):
        n = 0
        while n < k and drafts[b, n] == argmax[b, n]:
            n += 1
        assert int(greedy.num_accepted[b]) == n and int(greedy.next_token[b]) == int(argmax[b, n])
    assert set(greedy.num_accepted.tolist()) == set(range(k + 1))


def test_num_drafted_limits_acceptance_and_emits_from_p():
    """Rows that drafted fewer than k tokens: positions past their drafts are never accepted and the
    emitted token there is a plain sample of p (not a residual)."""
    V, k = 6, 3
    d = torch.zeros(2, k, dtype=torch.long)
    p = torch.zeros(2, k + 1, V)
    p[:, :, 0] = 1.0  # target certain of token 0 everywhere: every real draft of 0 is accepted
    res = rejection_sample(d, p, None, num_drafted=torch.tensor([1, 0]), generator=torch.Generator().manual_seed(0))
    assert res.num_accepted.tolist() == [1, 0]
    assert res.next_token.tolist() == [0, 0]  # from p itself; a residual would have excluded token 0
    g = greedy_verify(d, torch.zeros(2, k + 1, dtype=torch.long), num_drafted=torch.tensor([2, 0]))
    assert g.num_accepted.tolist() == [2, 0]


# ---- trees --------------------------------------------------------------------------------------------

TREE = CandidateTree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])


def tree_step(P, ranked: torch.Tensor, ctx: torch.Tensor, gen: torch.Generator):
    """Deterministic candidates: the child of rank r under context c is ranked[c, r]."""
    n, N = ctx.shape[0], len(TREE)
    tokens = torch.zeros(n, N, dtype=torch.long)
    tokens[:, 0] = ctx
    for i in range(1, N):
        tokens[:, i] = ranked[tokens[:, TREE.parents[i]], TREE.choices[i][-1]]
    res = tree_rejection_sample(TREE, tokens, P[tokens], gen)
    emitted = [[int(tokens[b, i]) for i in path[1:]] + [int(res.next_token[b])] for b, path in enumerate(res.path)]
    return emitted


@pytest.mark.parametrize("case", ["random", "p_agrees_with_ranking"])
def test_tree_rejection_sampling_matches_target_distribution(case):
    V, seed = 16, 7
    gen = torch.Generator().manual_seed(seed)
    P = random_rows(V + 1, V, gen)
    if case == "random":
        ranked = torch.stack([torch.randperm(V, generator=gen) for _ in range(V + 1)])
    else:  # candidates in the target's own order: deep acceptances are common
        ranked = P.argsort(-1, descending=True)
    n = 30_000  # the tree path is per-row Python bookkeeping; 3e4 draws keep this test ~1 s
    emitted = tree_step(P, ranked, torch.full((n,), V, dtype=torch.long), gen)
    first = torch.tensor([e[0] for e in emitted])
    second = torch.tensor([e[1] if len(e) > 1 else -1 for e in emitted])
    need = second < 0
    again = tree_step(P, ranked, first[need], gen)
    second[need] = torch.tensor([e[0] for e in again])
    if case == "p_agrees_with_ranking":
        assert max(len(e) for e in emitted) == TREE.max_depth + 1  # full paths occur (bonus after a leaf)
    start = P[V]
    assert chi_square_pvalue(first, start) > ALPHA
    assert chi_square_pvalue(first * V + second, start[:, None] * P[:V]) > ALPHA


def test_tree_draws_do_not_depend_on_the_tree_shape():
    """One draw of the row's generator per committed token, whatever the tree: 60 tokens of a Markov target
    drawn through trees of three shapes (candidates that often match) equal plain sampling from the same seed,
    token for token. Fails for the sequential-residual form, whose number of draws depends on the siblings."""
    V = 12
    gen = torch.Generator().manual_seed(3)
    P = random_rows(V + 1, V, gen)
    ranked = P.argsort(-1, descending=True)
    wide = CandidateTree.from_choices([(r,) for r in range(4)] + [(0, r) for r in range(3)] + [(1, 0)])
    shapes = {"tree": TREE, "chain": CandidateTree.chain(3), "wide": wide}

    def plain(n: int) -> list[int]:
        g, out, prev = torch.Generator().manual_seed(11), [], V
        while len(out) < n:
            prev = int(sample(P[prev][None], g)[0])
            out.append(prev)
        return out

    def speculative(tree: CandidateTree, n: int) -> tuple[list[int], int]:
        g, out, prev, accepted = torch.Generator().manual_seed(11), [], V, 0
        while len(out) < n:
            tokens = torch.zeros(1, len(tree), dtype=torch.long)
            tokens[0, 0] = prev
            for i in range(1, len(tree)):
                tokens[0, i] = ranked[tokens[0, tree.parents[i]], tree.choices[i][-1]]
            res = tree_rejection_sample(tree, tokens, P[tokens], g)
            new = tokens[0, res.path[0][1:]].tolist() + [int(res.next_token[0])]
            accepted += len(new) - 1
            out += new
            prev = new[-1]
        return out[:n], accepted

    want = plain(60)
    for name, tree in shapes.items():
        got, accepted = speculative(tree, 60)
        assert got == want, name
        assert accepted > 10, name  # the trees really were walked


def test_tree_greedy_follows_target_argmax():
    V = 10
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        tokens = torch.randint(0, V, (1, len(TREE)), generator=gen)
        argmax = torch.randint(0, V, (1, len(TREE)), generator=gen)
        tokens[0, 1] = argmax[0, 0]  # often descend at least once
        res = tree_greedy_verify(TREE, tokens, argmax)
        path = res.path[0]
        for parent, child in zip(path, path[1:]):  # each step took a child equal to the parent's argmax
            assert TREE.parents[child] == parent and int(tokens[0, child]) == int(argmax[0, parent])
        last = path[-1]
        assert all(int(tokens[0, c]) != int(argmax[0, last]) for c in TREE.children[last])
        assert int(res.next_token[0]) == int(argmax[0, last])
        # the same result as rejection sampling with one-hot targets
        onehot = torch.nn.functional.one_hot(argmax, V).float()
        sampled = tree_rejection_sample(TREE, tokens, onehot, gen)
        assert sampled.path == res.path and torch.equal(sampled.next_token, res.next_token)


def test_tree_structure_and_bad_trees():
    assert TREE.depth == [0, 1, 1, 1, 2, 2, 2, 3, 3]
    mask = TREE.ancestor_mask()
    assert mask[7].nonzero().flatten().tolist() == [0, 1, 4, 7]  # (0,0,0): root, (0,), (0,0), itself
    assert not mask[4, 5] and not mask[2, 1]
    with pytest.raises(ValueError, match="no parent"):
        CandidateTree.from_choices([(0,), (1, 1)])
    assert CandidateTree.chain(3).parents == [-1, 0, 1, 2]


def test_typical_acceptance_is_labelled_and_thresholded():
    """Approximate rule: a draft is kept iff p(x) > min(eps, delta * exp(-H(p))) — not lossless."""
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.05, 0.9, 0.05], [1 / 3, 1 / 3, 1 / 3]]])
    # thresholds: row 0 min(0.25, 0.3 * exp(-1.030)) = 0.107; row 1 min(0.25, 0.3 * exp(-0.394)) = 0.202
    res = typical_accept_chain(torch.tensor([[2, 1]]), p, epsilon=0.25, delta=0.3)
    assert int(res.num_accepted[0]) == 2  # 0.2 > 0.107, 0.9 > 0.202
    res = typical_accept_chain(torch.tensor([[2, 0]]), p, epsilon=0.25, delta=0.3)
    assert int(res.num_accepted[0]) == 1  # 0.05 < 0.202
    res = typical_accept_chain(torch.tensor([[2, 1]]), p, epsilon=0.1, delta=10.0)
    assert int(res.num_accepted[0]) == 2 and int(res.next_token[0]) in (0, 1, 2)
    assert "APPROXIMATE" in typical_accept_chain.__doc__
