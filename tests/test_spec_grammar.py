"""Constrained speculative sampling has exactly the distribution of constrained plain sampling: the chi-square
harness of test_spec_verify.py under a grammar, and the same harness failing when the draft's side of the
masking is wrong.

Setup (as in test_spec_verify.py): a Markov target P[prev] and draft Q[prev] over a small vocabulary, started
from a fixed context. Here the vocabulary is 8 letters plus EOS and the grammar is the regex
``([a-d][e-h]|[e-h][a-c])+`` compiled by xgrammar; which tokens may come next depends on the whole prefix
(its parity and its last letter), not on the last token alone. Each speculative step drafts k tokens from Q
under the grammar's mask at each drafted prefix (xgrammar's matcher advanced through the drafts), masks the
target's distributions at every position with runtime.grammar.chain_masks (which advances the matcher through
the drafts and rolls it back), and verifies with the one verifier. The emitted first token must follow
norm(P[s0] * m()) and the pair (x1, x2) norm(P[s0] * m()) * norm(P[x1] * m(x1)), with the masks m from an
independent hand-written automaton of the regex.

Masks are computed once per distinct prefix (there are at most a few thousand among the 1e5 draws), through
one matcher per context that chain_masks must leave where it found it: a rollback bug shows up as a wrong
distribution.
"""

from __future__ import annotations

import pytest
import torch

from runtime.grammar import Grammar, GrammarSpec, chain_masks
from runtime.sampling import SamplingParams, logits_to_probs
from speculate.verify import rejection_sample
from tests.test_spec_verify import ALPHA, DRAWS, chi_square_pvalue, draw, random_rows

LETTERS = list("abcdefgh")
VOCAB = LETTERS + ["<eos>"]
V, EOS, START = 9, 8, 9  # token ids; START is the context row of P and Q
REGEX = "([a-d][e-h]|[e-h][a-c])+"
SAMPLED = SamplingParams(temperature=1.0)


def oracle_allowed(prefix: tuple[int, ...]) -> set[int]:
    """The regex's allowed next tokens, by hand: pairs of (a-d then e-h) or (e-h then a-c), EOS between pairs."""
    if len(prefix) % 2 == 0:
        return set(range(8)) | ({EOS} if prefix else set())
    return set(range(4, 8)) if prefix[-1] < 4 else set(range(3))


def oracle_mask(prefix: tuple[int, ...]) -> torch.Tensor:
    m = torch.zeros(V, dtype=torch.bool)
    m[sorted(oracle_allowed(prefix))] = True
    return m


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many small ops: one thread (two collapse on a busy 2-core machine), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def grammar() -> Grammar:
    return Grammar(GrammarSpec("regex", REGEX), VOCAB, V, [EOS])


def test_matcher_masks_match_the_automaton_with_rollback(grammar):
    """Every prefix of length <= 3 through one reused matcher (accept, mask, roll back), against the automaton."""
    c = grammar.matcher()
    prefixes = [()]
    for _ in range(3):
        prefixes += [p + (t,) for p in prefixes if len(p) == len(prefixes[-1]) for t in oracle_allowed(p) - {EOS}]
    for prefix in prefixes:
        assert all(c.accept(t) for t in prefix)
        assert torch.equal(c.mask(), oracle_mask(prefix)), prefix
        assert c.complete == (len(prefix) > 0 and len(prefix) % 2 == 0)
        c.rollback(len(prefix))
    masks, usable = chain_masks(c, [0, 5, 1, 6], deterministic=False)  # a e b f: all allowed
    assert usable == 4 and all(torch.equal(masks[j], oracle_mask((0, 5, 1, 6)[:j])) for j in range(5))
    masks, usable = chain_masks(c, [0, 1, 2], deterministic=True)  # "ab": b is refused after a
    assert usable == 1 and torch.equal(masks[1], oracle_mask((0,))) and bool(masks[2].all())
    assert torch.equal(c.mask(), oracle_mask(()))  # rolled back to where it started


class PrefixMasks:
    """Masks of the production matcher after each prefix, one matcher shared by all prefixes."""

    def __init__(self, grammar: Grammar):
        self.c, self.memo = grammar.matcher(), {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.memo:
            n = 0
            while n < len(prefix) and self.c.accept(prefix[n]):
                n += 1
            self.memo[prefix] = self.c.mask() if n == len(prefix) else torch.ones(V, dtype=torch.bool)
            self.c.rollback(n)
        return self.memo[prefix]


def grouped(rows: torch.Tensor, fn) -> torch.Tensor:
    """fn(tuple(row)) for each distinct row of [n, L], stacked back to [n, ...] (fn(()) when L = 0)."""
    if rows.shape[1] == 0:
        return fn(())[None].expand(rows.shape[0], *fn(()).shape)
    uniq, inverse = torch.unique(rows, dim=0, return_inverse=True)
    return torch.stack([fn(tuple(u)) for u in uniq.tolist()])[inverse]


def speculative_step(grammar, P, Q, ctx: torch.Tensor, k: int, gen, variant: str):
    """One constrained speculative step for every row from its committed tokens ctx [n, L] (L = 0 or 1)."""
    n = ctx.shape[0]
    prefix_masks = PrefixMasks(grammar)
    logQ, logP = Q.clamp(min=1e-30).log(), P.clamp(min=1e-30).log()
    drafts, qs = [], []
    for _ in range(k):
        seen = torch.cat([ctx] + [d[:, None] for d in drafts], 1)
        prev = seen[:, -1] if seen.shape[1] else torch.full((n,), START)
        mask = grouped(seen, prefix_masks)
        q_masked = logits_to_probs(logQ[prev], SAMPLED, mask)
        q_plain = logits_to_probs(logQ[prev], SAMPLED)
        sample_from = q_plain if variant in ("unmasked_draft", "unmasked_draft_cut") else q_masked
        reported = q_masked if variant in ("correct", "unmasked_target") else q_plain
        drafts.append(draw(sample_from, gen))
        qs.append(reported)
    d = torch.stack(drafts, 1)  # [n, k]
    # the target's masks: chain_masks from one matcher per committed context, reused (and so rolled back) by
    # every distinct drafted chain from that context
    L = ctx.shape[1]
    uniq, inverse = torch.unique(torch.cat([ctx, d], 1), dim=0, return_inverse=True)
    at_context, masks_u, usable_u = {}, [], []
    for row in uniq.tolist():
        context = tuple(row[:L])
        if context not in at_context:
            at_context[context] = grammar.matcher()
            ok = all(at_context[context].accept(t) for t in context)
            assert ok or variant == "unmasked_target"  # that variant emits tokens the grammar refuses
        m, u = chain_masks(at_context[context], row[L:], deterministic=variant == "unmasked_draft_cut")
        masks_u.append(m)
        usable_u.append(u)
    masks, usable = torch.stack(masks_u)[inverse], torch.tensor(usable_u)[inverse]
    prev = torch.cat([ctx[:, -1:] if ctx.shape[1] else torch.full((n, 1), START), d], 1)  # [n, k+1] contexts
    p = logits_to_probs(logP[prev], SAMPLED, None if variant == "unmasked_target" else masks)
    res = rejection_sample(d, p, torch.stack(qs, 1), num_drafted=usable, generator=gen)
    acc, nxt = res.num_accepted, res.next_token
    rows = torch.arange(n)
    first = torch.where(acc >= 1, d[:, 0], nxt)
    second_from_drafts = d[rows, torch.ones_like(acc)] if k >= 2 else nxt
    second = torch.where(acc >= 2, second_from_drafts, torch.where(acc == 1, nxt, torch.full_like(nxt, -1)))
    return first, second, float(acc.float().mean())


def constrained_pvalues(grammar, k: int, seed: int, variant: str = "correct") -> tuple[float, float, float]:
    gen = torch.Generator().manual_seed(seed)
    P = random_rows(V + 1, V, gen, sparsity=0.0)  # real logits are finite: no exact zeros before the mask
    Q = random_rows(V + 1, V, gen, sparsity=0.0)
    start = torch.zeros(DRAWS, 0, dtype=torch.long)
    first, second, accepted = speculative_step(grammar, P, Q, start, k, gen, variant)
    need = second < 0
    if bool(need.any()):
        again, _, _ = speculative_step(grammar, P, Q, first[need][:, None], k, gen, variant)
        second[need] = again
    # exact constrained target from the automaton
    p1 = P[START] * oracle_mask(())
    p1 = p1 / p1.sum()
    rows = torch.stack([P[x] * oracle_mask((x,)) for x in range(V)])
    rows = rows / rows.sum(-1, keepdim=True).clamp(min=1e-30)
    joint = p1[:, None] * rows  # [V, V]
    return chi_square_pvalue(first, p1), chi_square_pvalue(first * V + second, joint), accepted


@pytest.mark.parametrize("k", [1, 3])
def test_constrained_speculative_sampling_matches_constrained_target(grammar, k):
    p_first, p_pair, _ = constrained_pvalues(grammar, k, seed=10 + k)
    assert p_first > ALPHA and p_pair > ALPHA, (p_first, p_pair)


def test_fails_when_the_mask_is_dropped_from_the_draft_side(grammar):
    """The draft samples under the grammar but hands the verifier its unmasked q: acceptance min(1, p/q) and
    the residual max(0, p - q) use the wrong q, and the harness sees it."""
    p_first, p_pair, _ = constrained_pvalues(grammar, 3, seed=13, variant="unmasked_q")
    assert min(p_first, p_pair) < ALPHA, (p_first, p_pair)


def test_fails_when_the_mask_is_dropped_from_the_target_side(grammar):
    p_first, p_pair, _ = constrained_pvalues(grammar, 3, seed=13, variant="unmasked_target")
    assert min(p_first, p_pair) < ALPHA, (p_first, p_pair)


@pytest.mark.slow
def test_unmasked_draft_stays_lossless_unless_cut_but_accepts_less(grammar):
    """A draft that ignores the grammar altogether (samples and reports unmasked q) is still exact: rejection
    sampling is lossless for any q, and chain_masks keeps a sampled draft the grammar refuses (p = 0 there, so
    it is rejected). Cutting such a chain at the refused draft, as is lossless for one-hot drafts, is biased."""
    p_first, p_pair, acc_unmasked = constrained_pvalues(grammar, 3, seed=13, variant="unmasked_draft")
    assert p_first > ALPHA and p_pair > ALPHA, (p_first, p_pair)
    _, _, acc_masked = constrained_pvalues(grammar, 3, seed=13)
    assert acc_masked > acc_unmasked + 0.02, (acc_masked, acc_unmasked)  # accepted per step; sd ~0.003
    p_first, p_pair, _ = constrained_pvalues(grammar, 3, seed=13, variant="unmasked_draft_cut")
    assert min(p_first, p_pair) < ALPHA, (p_first, p_pair)
