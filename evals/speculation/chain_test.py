"""The exact two-token test of speculative sampling (library of evals.speculation.verifier_check,
evals.speculation.lossless and evals.speculation.testing): a context's exact joint p(t1) p(t2 | t1) under the target,
the production verifier run on drafts from the draft's q many times with seeded generators, a chi-square test of the
emitted pairs against the joint, and broken controls (q reported sharpened; the correction drawn from p) that a sound
test must reject. The method and its error rates are described in evals.speculation.verifier_check."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.stats import chisquare
from torch import Tensor

from runtime.sampling import SamplingParams, logits_to_probs
from speculate.verify import rejection_sample

MAX_SUPPORT = 64  # first tokens whose second-token distributions are computed (one forward each, per model)
CUT_WINDOW = 64  # a context is cut among the prompt's last positions
SHARPEN = 0.8  # the broken control reports q at this temperature


@dataclass
class ChainCase:
    """The two models' distributions at one context, over a compact vocabulary ``tokens`` (every token that has
    mass in any of them): p1, q1 [U] at the context; p2, q2 [U, U] after each first token (rows of tokens
    outside the first-token support are unused)."""

    tokens: list[int]  # compact index -> token id
    p1: Tensor
    q1: Tensor
    p2: Tensor
    q2: Tensor

    def exact_joint(self) -> Tensor:
        """[U, U] the target's p(t1) p(t2 | t1)."""
        return self.p1[:, None] * self.p2


@torch.no_grad()
def last_probs(model, contexts: list[list[int]], params: SamplingParams, chunk: int = 16) -> Tensor:
    """[n, V] the model's sampling distribution after each context (equal lengths), in chunks of rows."""
    out = []
    for i in range(0, len(contexts), chunk):
        logits = model(torch.tensor(contexts[i : i + chunk]))[:, -1]
        out.append(logits_to_probs(logits, params))
    return torch.cat(out)


def chain_case(target, draft, context: list[int], params: SamplingParams) -> ChainCase:
    p1, q1 = last_probs(target, [context], params)[0], last_probs(draft, [context], params)[0]
    firsts = torch.nonzero((p1 > 0) | (q1 > 0)).flatten().tolist()
    if len(firsts) > MAX_SUPPORT:
        raise ValueError(f"{len(firsts)} first tokens have mass at this context (at most {MAX_SUPPORT}): use top-p")
    seconds = [context + [t] for t in firsts]
    p2, q2 = last_probs(target, seconds, params), last_probs(draft, seconds, params)
    used = (p1 > 0) | (q1 > 0) | (p2 > 0).any(0) | (q2 > 0).any(0)
    tokens = torch.nonzero(used).flatten()
    index = {t: i for i, t in enumerate(tokens.tolist())}
    U = len(tokens)
    P2, Q2 = torch.zeros(U, U), torch.zeros(U, U)
    for row, t in enumerate(firsts):
        P2[index[t]], Q2[index[t]] = p2[row, tokens], q2[row, tokens]
    return ChainCase(tokens.tolist(), p1[tokens], q1[tokens], P2, Q2)


def renormalized(q: Tensor) -> Tensor:
    return q / q.sum(-1, keepdim=True)


def sharpened(q: Tensor, temperature: float = SHARPEN) -> Tensor:
    """q^(1/temperature), normalized: what a broken draft reports instead of the q it sampled from."""
    return renormalized(q.double().pow(1.0 / temperature)).float()


def identity(q: Tensor) -> Tensor:
    return q


def verify_from_p(drafts: Tensor, target: Tensor, told: Tensor, generator: torch.Generator):
    """A broken verifier: the production acceptance test, but a rejected draft's correction drawn from p instead
    of the residual max(p - q, 0) (so the rejected token can be drawn again)."""
    res = rejection_sample(drafts, target, told, generator=generator)
    k = drafts.shape[1]
    rejected = res.num_accepted < k
    rows = torch.nonzero(rejected).flatten()
    if len(rows):
        p = target[rows, res.num_accepted[rows]]
        res.next_token[rows] = torch.multinomial(p, 1, generator=generator)[:, 0]
    return res


REPORTS = {"identity": identity, "sharpened": lambda q: sharpened(q)}
CONTROLS = {  # name -> (what the draft reports, the verifier): each must be rejected
    f"q reported at T={SHARPEN}": ("sharpened", "rejection"),
    "correction drawn from p, not the residual": ("identity", "from_p"),
}


def simulate(case: ChainCase, n: int, seed: int, report=identity, verify=None) -> Tensor:
    """[U, U] counts of the first two tokens emitted by n seeded speculative runs (module docstring); ``report``
    maps the q a draft was sampled from to the q the verifier is told (identity: a correct draft); ``verify``:
    the verifier (default the production rejection_sample)."""
    verify = verify or (lambda d, t, q, generator: rejection_sample(d, t, q, generator=generator))
    gen = torch.Generator().manual_seed(seed)
    U = len(case.tokens)
    x1 = torch.multinomial(case.q1.expand(n, U), 1, replacement=True, generator=gen)[:, 0]
    x2 = torch.multinomial(renormalized(case.q2[x1]), 1, generator=gen)[:, 0]
    uniform = torch.full((n, U), 1.0 / U)  # the bonus after two accepted drafts: not one of the two tokens
    target = torch.stack([case.p1.expand(n, U), case.p2[x1], uniform], 1)  # [n, 3, U]
    told = torch.stack([report(case.q1).expand(n, U), report(case.q2[x1])], 1)  # [n, 2, U]
    first = verify(torch.stack([x1, x2], 1), target, told, gen)
    accepted, nxt = first.num_accepted, first.next_token
    t1 = torch.where(accepted >= 1, x1, nxt)
    t2 = torch.where(accepted >= 2, x2, nxt)
    alone = accepted == 0  # one token emitted: a second step from (ctx, t1) with one draft
    if alone.any():
        c = t1[alone]
        m = len(c)
        y = torch.multinomial(renormalized(case.q2[c]), 1, generator=gen)[:, 0]
        second = verify(y[:, None], torch.stack([case.p2[c], uniform[:m]], 1), report(case.q2[c])[:, None], gen)
        t2[alone] = torch.where(second.num_accepted >= 1, y, second.next_token)
    return torch.bincount(t1 * U + t2, minlength=U * U).reshape(U, U).double()


def chi_square_pvalue(counts: Tensor, probs: Tensor) -> float:
    """Counts against exact cell probabilities; cells expected < 5 pooled into one."""
    counts, expected = counts.flatten(), probs.double().flatten() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        return 1.0  # one cell: nothing to test (a deterministic context)
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def entropy_cut(target, draft, ids: list[int], params: SamplingParams) -> int:
    """The context length (among the last CUT_WINDOW positions of ids) where the target's sampling distribution
    has the most entropy while the first tokens either model gives mass number at most MAX_SUPPORT."""
    with torch.no_grad():
        probs = logits_to_probs(target(torch.tensor([ids]))[0], params)  # [T, V]
        draft_probs = logits_to_probs(draft(torch.tensor([ids]))[0], params)
    best, best_h = len(ids), -1.0
    for pos in range(max(0, len(ids) - CUT_WINDOW), len(ids)):
        p = probs[pos]
        support = int(((p > 0) | (draft_probs[pos] > 0)).sum())
        h = float(-(p[p > 0] * p[p > 0].log()).sum())
        if support <= MAX_SUPPORT and h > best_h:
            best, best_h = pos + 1, h
    return best


def check_contexts(target, draft, contexts: list[list[int]], params, samples: int, seed: int, alpha: float, log):
    """Per context: the exact test of the verifier and of the broken control. Returns the record's rows."""
    rows = []
    for i, ctx in enumerate(contexts):
        case = chain_case(target, draft, ctx, params)
        joint = case.exact_joint()
        good = chi_square_pvalue(simulate(case, samples, seed + i), joint)
        broken = {
            name: chi_square_pvalue(
                simulate(case, samples, seed + i, REPORTS[report], None if verify == "rejection" else verify_from_p),
                joint,
            )
            for name, (report, verify) in CONTROLS.items()
        }
        overlap = float(torch.minimum(case.p1, case.q1).sum())  # the first draft's acceptance probability
        rows.append({"context_tokens": len(ctx), "vocabulary": len(case.tokens), "first_draft_acceptance": overlap,
                     "p_value": good, "p_value_controls": broken})  # fmt: skip
        controls = ", ".join(f"{name}: p = {v:.3g}" for name, v in broken.items())
        log(f"context {i}: {len(case.tokens)} tokens in play, acceptance {overlap:.3f}, p = {good:.3g} "
            f"(broken controls: {controls})")  # fmt: skip
    threshold = alpha / max(1, len(contexts))
    return rows, threshold


def summarize(rows: list[dict], threshold: float) -> dict:
    lossless = all(r["p_value"] >= threshold for r in rows)
    rejected = {name: any(r["p_value_controls"][name] < threshold for r in rows) for name in CONTROLS}
    return {"threshold": threshold, "lossless": lossless, "controls_rejected": rejected}
