"""Prompt lookup first, a draft model otherwise: each row, each step, proposes what followed the latest earlier
occurrence of its last n >= min_ngram tokens (speculate.ngram's prompt lookup) when there is one, and asks the wrapped
chain speculator (a draft model) only when there is none.

Why: on the 1.5B Qwen target the 0.5B draft and prompt lookup win in different places (notes/issue-37.md:
lookup 3.3x on qa and 2.7x on rewriting, where the answer copies the prompt; the draft 1.3x on translation and
chat, where lookup finds nothing). A lookup draft costs no draft forward at all, so a row that copies skips the
draft model's k forwards; the draft model catches up on the tokens it skipped at its next proposal (it feeds
every committed token after its last written KV, speculate.draft).

Lossless: the choice is a function of the row's committed tokens only, so each step's proposal is a fixed
distribution given the context (one-hot for a lookup, the draft's q otherwise), which is all rejection sampling
needs. Under a grammar the lookup is not tried (the draft masks its own proposals)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

import torch

from speculate.base import Proposal, SpecState, Speculator, SpeculatorError
from speculate.ngram import NgramSpeculator


class LookupFirstSpeculator(Speculator):
    def __init__(self, inner: Speculator, min_ngram: int = 2, max_ngram: int = 4):
        if inner.proposes_trees:
            raise SpeculatorError(f"prompt lookup first wraps a chain speculator, not {inner.name}'s trees")
        self.inner = inner
        # the lookup itself: up to min(k, 2**n) drafts on an n-token match, n >= min_ngram
        self.ngram = NgramSpeculator(inner.draft_depth(), max(max_ngram, min_ngram), min_ngram, scaled=True)
        self.name = f"{inner.name}+lookup:{min_ngram}"
        self.acceptance = inner.acceptance
        # rows answered by the lookup, rows asked of the draft model and the tokens it drafted for them: a lookup
        # costs no draft forward, so the cost model prices the two apart (evals.speculation.cost_model)
        self.counts = Counter(lookup_rows=0, model_rows=0, model_drafted=0)

    def max_tokens_per_step(self) -> int:
        return self.inner.max_tokens_per_step()

    def prefill(self, state: SpecState) -> None:
        self.inner.prefill(state)

    def release(self, ids: list[Hashable]) -> None:
        self.inner.release(ids)

    def propose(self, state: SpecState) -> Proposal:
        if state.constraints is not None and any(c is not None for c in state.constraints):
            return self.inner.propose(state)
        found = self.ngram.propose(state)  # num_drafted 0: no match
        lengths = found.drafted()
        asked = [b for b, n in enumerate(lengths) if n == 0]
        self.counts["lookup_rows"] += len(lengths) - len(asked)
        if len(asked) == len(lengths):
            return self._asked(self.inner.propose(state))
        if not asked:
            return found
        tokens, num = found.tokens.clone(), found.num_drafted.clone()
        sub = self._asked(self.inner.propose(state.select(asked)))
        at = torch.tensor(asked, device=state.device)
        tokens[at] = sub.tokens
        num[at] = torch.tensor(sub.drafted(), dtype=torch.long, device=state.device)
        probs = None
        if sub.draft_probs is not None:  # a lookup's q is one-hot at its drafts (positions past them: never read)
            B, k, V = len(lengths), tokens.shape[1], sub.draft_probs.shape[-1]
            probs = torch.zeros(B, k, V, dtype=sub.draft_probs.dtype, device=state.device)
            probs[at] = sub.draft_probs
            for b, n in enumerate(lengths):
                probs[b, torch.arange(n), tokens[b, :n]] = 1.0
        return Proposal(tokens=tokens, num_drafted=num, draft_probs=probs)

    def _asked(self, sub: Proposal) -> Proposal:
        drafted = sub.drafted()
        self.counts["model_rows"] += len(drafted)
        self.counts["model_drafted"] += sum(drafted)
        return sub

    def sources(self) -> dict[str, int]:
        return dict(self.counts)

    def describe(self) -> dict:
        return {**self.inner.describe(), "name": self.name, "lookup_min_ngram": self.ngram.min_ngram}
