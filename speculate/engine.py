"""Speculation inside the serving engine (runtime.engine.LLMEngine): prompt-lookup drafts per sequence,
decided by the one verifier (speculate.verify.rejection_sample with q = one-hot).

The engine owns scheduling, KV blocks and the target forward; this adapter only proposes from each
sequence's own token ids and turns the target's probabilities into the tokens to append. Each sequence's
draws come from its own seeded generator, so a request's tokens do not depend on its batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculate.base import check_k
from speculate.ngram import lookup
from speculate.verify import rejection_sample


class EngineNgramSpeculator:
    """runtime.engine.Speculator over prompt lookup: up to k drafts per sequence (see speculate.ngram)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, scaled: bool = True):
        self.max_ngram, self.min_ngram, self.scaled = max_ngram, min_ngram, scaled

    def propose(self, seqs, k: int) -> list[list[int]]:
        check_k(k)
        return [
            lookup(torch.tensor(s.token_ids), k, self.max_ngram, self.min_ngram, self.scaled).tolist() for s in seqs
        ]

    def verify(self, seqs, drafts: list[list[int]], target_probs: Tensor) -> list[list[int]]:
        """target_probs [B, 1 + max k, V] -> accepted drafts + one corrected or bonus token per sequence."""
        out = []
        for b, (seq, draft) in enumerate(zip(seqs, drafts)):
            k = len(draft)
            tokens = torch.tensor([draft], dtype=torch.long, device=target_probs.device)  # [1, k]
            res = rejection_sample(tokens, target_probs[b : b + 1, : k + 1], generator=seq.generator)
            n = int(res.num_accepted[0])
            out.append(draft[:n] + [int(res.next_token[0])])
        return out
