"""The one sampler: logits -> probabilities under SamplingParams, and seeded draws from them.

Plain decoding, the draft model and the speculative verifier all call ``logits_to_probs`` so that "the
target distribution" means one thing. Greedy (temperature 0) is the one-hot distribution on the argmax.
``process_logits`` applies the request-level adjustments that depend on the sequence so far (logit_bias,
min_tokens, repetition / presence / frequency penalties) before ``logits_to_probs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from runtime.kernels import cpu_step


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
    # sequence-dependent logit adjustments (process_logits), vLLM's meanings
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens were generated
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL-style: divides positive / multiplies negative logits of seen tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # report the sampled token's log-prob and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (echo)

    def __post_init__(self):
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.01 <= self.repetition_penalty <= 100:  # bounded so logits stay finite
            raise ValueError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")
        if any(not math.isfinite(b) or abs(b) > 100 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value}")

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature can overflow fp32 (inf - inf = NaN in softmax) while the
        # distribution is already one-hot up to ties closer than 1e-5 * a logit difference: its limit
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        """True when process_logits changes anything for this request."""
        return bool(
            self.min_tokens or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
            or self.logit_bias
        )  # fmt: skip


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM uses the same epsilon)


def process_logits(
    logits: Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], stop_ids: list[int]
) -> Tensor:
    """[V] logits of the next token after prompt_ids + output_ids -> adjusted fp32 logits: min_tokens bans
    stop_ids (EOS and stop_token_ids) while fewer than min_tokens were generated, then logit_bias is added,
    then the repetition penalty (tokens seen in prompt or output) and presence / frequency penalties
    (tokens in the output). Returns the input unchanged when the request adjusts nothing."""
    if not params.adjusts_logits:
        return logits
    logits = logits.float().clone()
    V = logits.shape[-1]
    if len(output_ids) < params.min_tokens and stop_ids:
        logits[torch.tensor(stop_ids, device=logits.device)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), device=logits.device))
    if params.repetition_penalty != 1 and (prompt_ids or output_ids):
        seen = torch.tensor(prompt_ids + output_ids, device=logits.device).unique()
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=V)[:V].float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


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
        return torch.zeros_like(logits).scatter_(-1, argmax(logits)[..., None], 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        probs = top_p_filter(probs, params.top_p)
    return probs


# top_p_filter's first candidate count; it grows 8x until the nucleus ends inside it
TOP_P_CANDIDATES = 256


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """[..., V] probabilities with the tokens outside the top-p nucleus zeroed, renormalized.

    In descending order of probability (ties by token index), a token is kept when the mass before it is below
    top_p (the token that crosses p is kept; the most likely always is). The nucleus is found among the
    TOP_P_CANDIDATES largest probabilities, 8x more while it does not end inside them: a sort of the whole
    vocabulary (151936 tokens for Qwen2.5) cost ~12 ms a row on CPU and ran for every draft and verified position.
    """
    V = probs.shape[-1]
    width = min(V, TOP_P_CANDIDATES)
    while True:
        values = probs.topk(width, dim=-1).values  # [..., width], descending
        mass_before = values.cumsum(-1) - values
        if width == V or bool((mass_before[..., -1] >= top_p).all()):
            break
        width = min(V, width * 8)
    kept = (mass_before < top_p).sum(-1, keepdim=True).clamp_(min=1)  # [..., 1] nucleus sizes
    last = values.gather(-1, kept - 1)  # the smallest kept probability
    keep = probs >= last
    surplus = keep.sum(-1, keepdim=True) - kept  # tokens tied with `last` past the nucleus
    if bool((surplus > 0).any()):  # keep the tied ones with the lowest indices
        tied = probs == last
        keep = (probs > last) | (tied & (tied.cumsum(-1) <= tied.sum(-1, keepdim=True) - surplus))
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


SAMPLE_BLOCK_ELEMENTS = 1 << 17  # sample's CPU block: 1 MB of float64 cdf


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row of [..., V] probabilities (unnormalized are fine; one-hot rows give their argmax).

    Inverse CDF in float64: u ~ U[0, 1) per row from `generator`, the token is the first whose cumulative mass
    exceeds u times the row's total, so a zero-probability token is never drawn. torch.multinomial drew the same
    distribution at ~3 ms a row over Qwen2.5's 151936 tokens on CPU; this takes ~0.2 ms."""
    flat = probs.reshape(-1, probs.shape[-1])
    u = torch.rand(flat.shape[0], 1, dtype=torch.float64, generator=generator, device=flat.device)
    # on CPU in blocks of rows whose float64 cdfs stay in cache (one row of a real vocabulary, thousands of a tiny
    # one); elsewhere in one call (one host sync)
    rows, V = flat.shape
    step = max(1, SAMPLE_BLOCK_ELEMENTS // V) if flat.device.type == "cpu" else max(rows, 1)
    out = []
    for a, b in ((a, min(a + step, rows)) for a in range(0, rows, step)):
        cdf = flat[a:b].double().cumsum(-1)
        total = cdf[:, -1:]
        if not bool((torch.isfinite(total) & (total > 0)).all()):
            raise ValueError(f"cannot sample from a distribution whose mass is {total.min().item()}")
        out.append(torch.searchsorted(cdf, u[a:b] * total, right=True).clamp_(max=V - 1))
    return (torch.cat(out) if out else flat.new_empty(0, dtype=torch.long)).reshape(probs.shape[:-1])


def argmax(logits: Tensor) -> Tensor:
    """logits.argmax(-1) (the first maximum; a NaN counts as the largest): greedy's token at every position. fp32
    CPU logits go through the CPU step's kernel: torch's reduction reads a row one element at a time (~70 us for
    49k tokens, ~0.3 ms for an 8-row verification), a cost plain and speculative steps paid on every token."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.numel() > 0:
        out = cpu_step.argmax_rows(logits)
        if out is not None:
            return out
    return logits.argmax(-1)


def sample_rows(probs: Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> Tensor:
    """[B, V] -> [B]: each row drawn with its own generator, so a sequence's draws do not depend on
    which other sequences share its batch; greedy rows take the argmax."""
    if not len(params) == len(generators) == probs.shape[0]:
        raise ValueError(f"{probs.shape[0]} rows, {len(params)} params, {len(generators)} generators")
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for b, (p, gen) in enumerate(zip(params, generators)):  # an argmax over 151936 tokens is ~0.2 ms: greedy rows
        out[b] = argmax(probs[b]) if p.greedy else sample(probs[b], gen)
    return out


@dataclass
class TokenLogprob:
    """One generated (or prompt) token's log-probability under the model, and the top alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-prob), most likely first


def token_logprobs(logits: Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """[N, V] raw model logits and the N tokens chosen after them -> each token's log-softmax value and
    the top_n alternatives: the model's own distribution (before temperature, penalties or bias), as
    vLLM reports by default, so speculative and plain decoding report the same numbers."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if top_n:
        vals, ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]
