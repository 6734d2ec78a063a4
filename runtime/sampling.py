"""The one sampler: logits -> probabilities under SamplingParams, and seeded draws from them.

Plain decoding, the draft model and the speculative verifier all call ``logits_to_probs`` so that "the
target distribution" means one thing. Greedy (temperature 0) is the one-hot distribution on the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)  # stop strings (checked on decoded text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids besides the model's EOS
    ignore_eos: bool = False

    def __post_init__(self):
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: Tensor, params: SamplingParams, mask: Tensor | None = None) -> Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k and top-p.

    top-k keeps the k largest logits (ties at the boundary kept); top-p keeps the smallest set of
    highest-probability tokens whose mass reaches p (the token that crosses p is kept).
    mask: bool [..., V], True where a token is allowed (a grammar's, runtime.grammar); the others get
    probability 0 before everything else (greedy: the argmax among the allowed). Each row needs one allowed.
    """
    logits = logits.float()
    if mask is not None:
        logits = logits.masked_fill(~mask.to(logits.device), float("-inf"))
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row of [..., V] probabilities (one-hot rows give their argmax, no randomness)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample_rows(probs: Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> Tensor:
    """[B, V] -> [B]: each row drawn with its own generator, so a sequence's draws do not depend on
    which other sequences share its batch; greedy rows take the argmax."""
    out = probs.argmax(-1)
    for b, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            out[b] = torch.multinomial(probs[b], 1, generator=gen)[0]
    return out
