"""Fidelity of one model/configuration against a reference on the same token sequences.

Teacher-forced: both sides score the same sequences; per predicted position we compare the full next-token
log-probability vectors (max/mean |Δ log-prob| on the observed tokens and over the vocabulary, KL(ref || test),
top-1 agreement, and the reference's top-1 vs top-2 margin where the argmaxes disagree: disagreements at
near-ties are float noise, at large margins they are real changes). Free-running: greedy outputs compared
token by token (the match rate counts tokens before the first divergence; after it the sequences are
unrelated). A "scorer" is any function [B, T] token ids -> [B, T, V] logits, so the same metrics compare two
models, a model with itself through another code path (KV cache, batching, attention implementation), or a
quantized copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from runtime.decoding import generate
from runtime.kv_policy import KVCacheSpec, chunked_prefill
from runtime.model import AttentionMetadata, decode_meta
from runtime.sampling import SamplingParams

Scorer = Callable[[Tensor], Tensor]


@dataclass
class TeacherForcedStats:
    positions: int  # predicted positions compared
    max_abs_dlogprob: float  # over the observed next tokens
    mean_abs_dlogprob: float  # over the observed next tokens
    max_abs_dlogprob_vocab: float  # over every vocabulary entry of every position
    mean_kl: float  # KL(ref || test) in nats per position
    max_kl: float
    top1_agreement: float  # fraction of positions with the same argmax
    disagreements: int
    mean_top2_gap_at_disagreement: float | None  # reference log p(top1) - log p(top2) where argmaxes differ
    max_top2_gap_at_disagreement: float | None
    ref_nll: float  # mean NLL of the observed tokens, reference
    test_nll: float  # mean NLL of the observed tokens, test
    bit_identical: bool  # every logit equal bit for bit

    @property
    def ref_perplexity(self) -> float:
        return math.exp(self.ref_nll)

    @property
    def test_perplexity(self) -> float:
        return math.exp(self.test_nll)

    def to_dict(self) -> dict:
        return {**asdict(self), "ref_perplexity": self.ref_perplexity, "test_perplexity": self.test_perplexity}


def model_scorer(model) -> Scorer:
    """The plain forward: one causal sequence per row from position 0, no cache."""

    def score(tokens: Tensor) -> Tensor:
        out = model(tokens)
        return out.logits if hasattr(out, "logits") else out

    return score


def cached_scorer(model, prefill: int | None = None, chunk: int = 1, kv: KVCacheSpec | None = None) -> Scorer:
    """Logits through the KV cache: prefill the first `prefill` tokens (default: half), then feed the rest
    `chunk` tokens per forward (chunk=1 is plain decoding; larger chunks are speculative verification).
    kv: the cache's format and policy (runtime.kv_policy; default full precision)."""

    @torch.inference_mode()
    def score(tokens: Tensor) -> Tensor:
        B, T = tokens.shape
        cache = (kv or KVCacheSpec()).build(model, B, T)
        p = max(1, min(T, T // 2 if prefill is None else prefill))
        outs = [model.logits(chunked_prefill(model, tokens[:, :p], cache))]
        pos = p
        while pos < T:
            n = min(chunk, T - pos)
            positions = torch.arange(pos, pos + n, device=tokens.device).expand(B, -1)
            if n == 1:
                meta = decode_meta(positions[:, 0])
            else:
                meta = AttentionMetadata.causal(positions, kv_len=pos + n)
            outs.append(model(tokens[:, pos : pos + n], meta, cache))
            pos += n
        return torch.cat(outs, dim=1)

    return score


def batched_scorer(model, companions: Sequence[Sequence[int]]) -> Scorer:
    """Each sequence scored inside a batch with other (right-padded, different-length) sequences: what a
    serving batch does to its numerics. Returns the logits of the scored rows only."""

    @torch.inference_mode()
    def score(tokens: Tensor) -> Tensor:
        B, T = tokens.shape
        others = [list(c)[:T] for c in companions]
        width = max([T] + [len(o) for o in others])
        batch = torch.zeros(B + len(others), width, dtype=torch.long, device=tokens.device)
        batch[:B, :T] = tokens
        for i, o in enumerate(others):
            batch[B + i, : len(o)] = torch.tensor(o, device=tokens.device)
        return model(batch)[:B, :T]

    return score


class FidelityAccumulator:
    """Running aggregate of reference vs test logits at predicted positions (see TeacherForcedStats)."""

    def __init__(self):
        self.n = self.agree = 0
        self.sum_abs = self.sum_kl = self.sum_ref_nll = self.sum_test_nll = 0.0
        self.max_abs = self.max_abs_vocab = self.max_kl = 0.0
        self.gaps: list[float] = []
        self.identical = True

    @torch.inference_mode()
    def add(self, ref_logits: Tensor, test_logits: Tensor, targets: Tensor) -> None:
        """ref/test logits [..., V] predicting targets [...] (the observed next tokens)."""
        ref_logits, test_logits = ref_logits.float(), test_logits.float()
        self.identical &= torch.equal(ref_logits, test_logits)
        lp_ref, lp_test = ref_logits.log_softmax(-1), test_logits.log_softmax(-1)
        target = targets[..., None]
        obs_ref, obs_test = lp_ref.gather(-1, target)[..., 0], lp_test.gather(-1, target)[..., 0]
        d_obs = (obs_ref - obs_test).abs()
        kl = (lp_ref.exp() * (lp_ref - lp_test)).sum(-1).clamp_min(0)
        self.n += d_obs.numel()
        self.sum_abs += float(d_obs.double().sum())
        self.max_abs = max(self.max_abs, float(d_obs.max()))
        self.max_abs_vocab = max(self.max_abs_vocab, float((lp_ref - lp_test).abs().max()))
        self.sum_kl += float(kl.double().sum())
        self.max_kl = max(self.max_kl, float(kl.max()))
        self.sum_ref_nll -= float(obs_ref.double().sum())
        self.sum_test_nll -= float(obs_test.double().sum())
        same = lp_ref.argmax(-1) == lp_test.argmax(-1)
        self.agree += int(same.sum())
        if not bool(same.all()):
            top2 = lp_ref.topk(2, dim=-1).values
            self.gaps += (top2[..., 0] - top2[..., 1])[~same].tolist()

    def result(self) -> TeacherForcedStats:
        if self.n == 0:
            raise ValueError("no positions compared")
        n, gaps = self.n, self.gaps
        return TeacherForcedStats(
            positions=n,
            max_abs_dlogprob=self.max_abs,
            mean_abs_dlogprob=self.sum_abs / n,
            max_abs_dlogprob_vocab=self.max_abs_vocab,
            mean_kl=self.sum_kl / n,
            max_kl=self.max_kl,
            top1_agreement=self.agree / n,
            disagreements=n - self.agree,
            mean_top2_gap_at_disagreement=sum(gaps) / len(gaps) if gaps else None,
            max_top2_gap_at_disagreement=max(gaps) if gaps else None,
            ref_nll=self.sum_ref_nll / n,
            test_nll=self.sum_test_nll / n,
            bit_identical=bool(self.identical),
        )


@torch.inference_mode()
def compare_teacher_forced(
    ref: Scorer, test: Scorer, sequences: Sequence[Sequence[int]], batch_size: int = 4
) -> TeacherForcedStats:
    """Score every sequence with both scorers (batches of equal-length sequences) and aggregate."""
    if not sequences or any(len(s) < 2 for s in sequences):
        raise ValueError("need at least one sequence of at least 2 tokens")
    acc = FidelityAccumulator()
    by_len: dict[int, list[Sequence[int]]] = {}
    for s in sequences:
        by_len.setdefault(len(s), []).append(s)
    for group in by_len.values():
        for i in range(0, len(group), batch_size):
            tokens = torch.tensor([list(s) for s in group[i : i + batch_size]])
            acc.add(ref(tokens)[:, :-1], test(tokens)[:, :-1], tokens[:, 1:])
    return acc.result()


@dataclass
class GreedyMatch:
    sequences: int
    tokens_compared: int  # reference tokens
    tokens_matched: int  # tokens equal before each sequence's first divergence
    identical_sequences: int

    @property
    def match_rate(self) -> float:
        return self.tokens_matched / max(self.tokens_compared, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "match_rate": self.match_rate}


def token_match(reference: Sequence[Sequence[int]], test: Sequence[Sequence[int]]) -> GreedyMatch:
    """Compare two sets of free-running outputs for the same prompts, token by token up to divergence."""
    if len(reference) != len(test):
        raise ValueError(f"{len(reference)} reference outputs vs {len(test)} test outputs")
    matched = compared = identical = 0
    for r, t in zip(reference, test):
        k = 0
        while k < min(len(r), len(t)) and r[k] == t[k]:
            k += 1
        matched += k
        compared += len(r)
        identical += list(r) == list(t)
    return GreedyMatch(len(reference), compared, matched, identical)


def greedy_outputs(
    model, prompts: Sequence[Sequence[int]], max_tokens: int, batch_size: int = 1, use_cache: bool = True
) -> list[list[int]]:
    """Greedy continuations (EOS ignored so every prompt yields max_tokens), `batch_size` prompts per call."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[i : i + batch_size]]
        out += generate(model, chunk, params, use_cache=use_cache).tokens
    return out


@torch.inference_mode()
def engine_greedy_logits(engine, prompts: Sequence[Sequence[int]], max_tokens: int, concurrent: bool):
    """Greedy outputs from a serving engine (runtime.engine.LLMEngine) plus, per request, the logits [steps, V] its
    sampler saw (captured at the model's logits() call; a step's rows are in the order of the outputs it returns).
    concurrent: every prompt submitted at once (the engine batches them); else one request at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    model, captured = engine.model, []
    original = model.logits

    def capture(hidden):
        out = original(hidden)
        captured.append(out.detach().float())
        return out

    model.logits = capture
    final: dict[str, list[int]] = {}
    logits_by_id: dict[str, list[Tensor]] = {}
    ids: list[str] = []
    try:
        for batch in [prompts] if concurrent else [[p] for p in prompts]:
            ids += [engine.add_request(list(p), params) for p in batch]
            while engine.has_unfinished():
                captured.clear()
                outs = engine.step()
                rows = torch.cat(captured) if captured else torch.empty(0)
                sampled = [o for o in outs if o.new_token_ids]
                if len(sampled) != rows.shape[0]:
                    raise RuntimeError("engine step: sampled rows and outputs do not line up")
                for o, row in zip(sampled, rows):
                    logits_by_id.setdefault(o.request_id, []).append(row)
                final.update({o.request_id: o.output_ids for o in outs if o.finished})
    finally:
        del model.logits  # back to the class method
    return [final[i] for i in ids], [torch.stack(logits_by_id[i]) for i in ids]
