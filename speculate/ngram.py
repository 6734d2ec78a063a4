"""Prompt lookup (n-gram) speculation: match the last n tokens in the prompt and the output so far, and
propose the tokens that followed the most recent earlier occurrence. Deterministic drafts (q = one-hot);
no model, no training. Tries n = max_ngram down to min_ngram; a row with no match drafts nothing that step.

Draft length: plain prompt lookup (``scaled=False``, as HF's ``prompt_lookup_num_tokens``) always drafts k
tokens. With ``scaled=True`` a match of n tokens drafts at most 2**n (capped at k): a one-token match is
weak evidence of a copy, a four-token match strong evidence. That matters on CPU, where verifying T
tokens costs ~1 + 0.15 (T - 1) decode steps (fp32, SmolLM2-135M, 2 cores: small-M GEMMs are compute-bound),
so long drafts from weak matches cost more than their accepted tokens buy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculate.base import Proposal, SpecState, Speculator, SpeculatorError, check_k


def lookup(seq: Tensor, k: int, max_ngram: int, min_ngram: int, scaled: bool = False) -> Tensor:
    """seq [L] -> up to k tokens (up to min(k, 2**n) if scaled) that followed the latest earlier occurrence
    of seq's last n tokens, for the longest n in [min_ngram, max_ngram] that occurs."""
    L = seq.numel()
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        windows = seq[: L - 1].unfold(0, n, 1)  # [L-n, n]: every earlier n-gram with a following token
        hits = torch.nonzero((windows == seq[L - n :]).all(-1)).flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return seq[start : start + (min(k, 2**n) if scaled else k)]
    return seq[:0]


class NgramSpeculator(Speculator):
    name = "ngram"

    def __init__(self, k: int = 4, max_ngram: int = 4, min_ngram: int = 1, scaled: bool = True):
        self.k = check_k(k)
        if not 1 <= min_ngram <= max_ngram:
            raise SpeculatorError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.scaled = max_ngram, min_ngram, scaled

    def max_tokens_per_step(self) -> int:
        return self.k + 1

    def propose(self, state: SpecState) -> Proposal:
        B = state.tokens.shape[0]
        # lookups on a CPU copy: on a GPU each lookup op would be a launch and a sync, per row, per n
        tokens = state.tokens.cpu()
        lengths, active = state.lengths.tolist(), state.active.tolist()
        drafts = torch.zeros(B, self.k, dtype=torch.long)
        num = torch.zeros(B, dtype=torch.long)
        for b in range(B):
            if not active[b]:
                continue
            found = lookup(tokens[b, : lengths[b]], self.k, self.max_ngram, self.min_ngram, self.scaled)
            drafts[b, : found.numel()] = found
            num[b] = found.numel()
        device = state.tokens.device
        return Proposal(tokens=drafts.to(device), num_drafted=num.to(device))

    def describe(self) -> dict:
        return {
            **super().describe(),
            "k": self.k,
            "max_ngram": self.max_ngram,
            "min_ngram": self.min_ngram,
            "scaled": self.scaled,
        }
