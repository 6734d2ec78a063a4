"""Prompt lookup again, as a plug-in: draft the k tokens that followed the latest earlier occurrence of the last
n committed tokens (longest n first). Deterministic drafts, so q is one-hot and the verifier needs no draft_probs.

    python -m runtime.generate --speculator qspec_plugin_example.lookup:PromptLookup -k 4 --prompt "..."
"""

from __future__ import annotations

import torch

from speculate.base import Proposal, SpecState, Speculator, check_k


def follow(seq: list[int], k: int, max_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of seq's last n tokens (n = max_ngram .. 1)."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # latest earlier occurrence first
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


class PromptLookup(Speculator):
    name = "prompt-lookup"

    def __init__(self, target, k: int = 4, max_ngram: int = 3):
        self.k, self.max_ngram = check_k(k), max_ngram

    def max_tokens_per_step(self) -> int:
        return self.k + 1  # the last committed token and k drafts

    def propose(self, state: SpecState) -> Proposal:
        drafts = torch.zeros(len(state.ids), self.k, dtype=torch.long)  # [B, k]
        num = torch.zeros(len(state.ids), dtype=torch.long)  # [B] valid drafts per row
        for b, seq in enumerate(state.token_ids):
            found = follow(list(seq), self.k, self.max_ngram)
            drafts[b, : len(found)] = torch.tensor(found, dtype=torch.long)
            num[b] = len(found)
        return Proposal(tokens=drafts.to(state.device), num_drafted=num.to(state.device))

    def describe(self) -> dict:
        return {**super().describe(), "k": self.k, "max_ngram": self.max_ngram}
