"""Batched generation with a static (contiguous) KV cache: the plain decoding loop every other loop is
tested against.

Prompts of different lengths share one prefill: rows are right-padded, every row uses positions 0..T-1
and attention is causal by position, so padding only ever writes cache slots that the row's own later
tokens overwrite before anything reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runtime.compiled import compiled_decoder, resolve_compile
from runtime.grammar import Grammar, mask_logits, row_constraints
from runtime.kv_policy import KVCacheSpec, chunked_prefill
from runtime.layout import device_of
from runtime.model import AttentionMetadata, Transformer, decode_meta
from runtime.sampling import SamplingParams, argmax, logits_to_probs, make_generator, process_logits, sample_rows
from runtime.stopping import StopChecker
from runtime.timing import LoopClock, LoopTiming, PhaseTimer


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per prompt (stop token included when it ended the row)
    finish_reasons: list[str]  # "eos" | "stop" | "length"
    timing: LoopTiming = field(default_factory=LoopTiming)  # TTFT, whole-step times, token arrivals (runtime.timing)
    compile: str = "off"  # what ran the decode steps: off (eager) | inductor | cudagraphs (runtime.compiled)
    # per row: constrained by a grammar and stopped (max_tokens, a stop string) before its text was complete
    grammar_incomplete: list[bool] = field(default_factory=list)


@dataclass
class RowSampling:
    """How each row of a batch draws and stops: its SamplingParams, generator, stop checker and grammar."""

    params: list[SamplingParams]
    generators: list
    stops: list[StopChecker]
    constraints: list  # per row: a grammar's constraint or None
    stop_ids: list[list[int]]  # per row: the stop ids min_tokens holds back
    adjusted: bool  # some row adjusts its logits (penalties, logit_bias, min_tokens, a grammar)
    all_greedy: bool

    @staticmethod
    def build(params: list[SamplingParams], cfg, tokenizer, grammar, device) -> RowSampling:
        stops = [StopChecker(p, cfg.eos_token_ids, tokenizer) for p in params]
        constraints = row_constraints(grammar, params, cfg.vocab_size)
        return RowSampling(
            params=params,
            generators=[make_generator(p.seed, device) for p in params],
            stops=stops,
            constraints=constraints,
            stop_ids=[sorted(s.stop_ids) if p.min_tokens else [] for s, p in zip(stops, params)],
            adjusted=any(c is not None for c in constraints) or any(p.adjusts_logits for p in params),
            all_greedy=all(p.greedy for p in params),
        )

    def next_tokens(self, logits: torch.Tensor, prompts: list[list[int]], generated: list[list[int]]) -> torch.Tensor:
        """[B, V] raw logits -> [B] next tokens under each row's SamplingParams, penalties and grammar."""
        B = logits.shape[0]
        if self.adjusted:  # per-row sequence-dependent adjustments (penalties, logit_bias, min_tokens), then grammars
            logits = torch.stack(
                [
                    mask_logits(
                        process_logits(logits[b], p, prompts[b], generated[b], self.stop_ids[b]),
                        None if c is None else c.mask(),
                    )
                    for b, (p, c) in enumerate(zip(self.params, self.constraints))
                ]
            )
        if self.all_greedy:  # the argmax sample_rows takes of one-hot rows, without B small ops per step
            return argmax(logits)
        probs = torch.stack([logits_to_probs(logits[b], self.params[b]) for b in range(B)])
        return sample_rows(probs, self.params, self.generators)

    def emit(self, next_list: list[int], out: GenerationOutput, done: list[bool], on_token) -> list[int]:
        """Append each live row's new token, stream it, stop rows that are finished; -> the rows that emitted."""
        emitted = []
        for b, tok in enumerate(next_list):
            if done[b]:
                continue
            out.tokens[b].append(tok)
            emitted.append(b)
            if self.constraints[b] is not None and not self.constraints[b].accept(tok):
                raise RuntimeError(f"row {b}: sampled token {tok} that its grammar does not allow")
            if on_token is not None:
                on_token(b, tok)
            reason = self.stops[b].check(out.tokens[b])
            if reason is not None:
                done[b], out.finish_reasons[b] = True, reason
        return emitted


def decode_cache(model: Transformer, B: int, total: int, compile: str, use_cache: bool, kv: KVCacheSpec):
    """-> (what runs the decode steps: off | inductor | cudagraphs, the compiled decoder or None, the cache or None)."""
    backend = resolve_compile(compile, device_of(model)) if use_cache and kv.compilable else "off"
    decoder = compiled_decoder(model, B, total, backend, kv) if backend != "off" else None
    if decoder is not None:
        return backend, decoder, decoder.cache  # the same storage the compiled step reads; the prefill writes it
    return backend, None, kv.build(model, B, total) if use_cache else None


def decode_forward(model, tokens, next_tokens, positions, decoder, cache, use_cache: bool) -> torch.Tensor:
    """Write next_tokens [B] at positions [B] and run one decode step -> the last hidden states [B, H]."""
    B, device = tokens.shape[0], tokens.device
    tokens[torch.arange(B, device=device), positions] = next_tokens
    if decoder is not None:
        return decoder(next_tokens[:, None], positions[:, None])[:, 0]
    if use_cache:
        return model(next_tokens[:, None], decode_meta(positions), cache, hidden_only=True)[:, 0]
    # full recompute: the reference the cache is tested against
    L = int(positions.max()) + 1
    pos = torch.arange(L, device=device).expand(B, -1)
    hidden = model(tokens[:, :L], AttentionMetadata.causal(pos), hidden_only=True)
    return hidden[torch.arange(B, device=device), positions]


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    tokenizer=None,
    use_cache: bool = True,
    on_token: Callable[[int, int], None] | None = None,
    compile: str = "auto",
    grammar: Grammar | list[Grammar | None] | None = None,
    profile: bool = False,
    kv_cache: KVCacheSpec | None = None,
) -> GenerationOutput:
    """Generate for a batch of token-id prompts; on_token(row, token) streams each new token. grammar (one
    for the batch or one per row): every token is drawn under its mask (runtime.grammar).

    compile: "off" | "auto" | "on" (runtime.compiled): decode steps through a compiled step over a static cache.
    kv_cache: the cache's format and policy (runtime.kv_policy; default full precision, keep everything); int4
    and sink-window caches run eager. The clock covers the whole call (runtime.timing); profile=True also splits
    it into forward, lm_head and sampling seconds (``out.timing.phase_s``; CUDA is synchronized at each
    boundary, so only when asked)."""
    clock = LoopClock()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    B = len(prompts)
    row_params = params if isinstance(params, list) else [params] * B
    device = device_of(model)
    cfg = model.config
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    total = int(lengths.max()) + max(p.max_tokens for p in row_params)
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt + max_tokens = {total} exceeds the model's {cfg.max_position_embeddings} positions")
    rows = RowSampling.build(row_params, cfg, tokenizer, grammar, device)

    tokens = torch.zeros(B, total, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
    backend, decoder, cache = decode_cache(model, B, total, compile, use_cache, kv_cache or KVCacheSpec())

    out = GenerationOutput(tokens=[[] for _ in range(B)], finish_reasons=[""] * B, compile=backend)
    token_times: list[list[float]] = [[] for _ in range(B)]
    phase = PhaseTimer(profile, device)
    done = [False] * B
    T = int(lengths.max())
    with phase("forward"):
        if use_cache:
            hidden = chunked_prefill(model, tokens[:, :T], cache)  # one forward unless the cache is bounded
        else:
            hidden = model(tokens[:, :T], hidden_only=True)
        last = hidden[torch.arange(B, device=device), lengths - 1]  # [B, H]
    positions = lengths.clone()  # where each row's next token goes
    while True:
        with phase("lm_head"):
            logits = model.logits(last)
        with phase("sampling"):
            next_tokens = rows.next_tokens(logits, prompts, out.tokens)
            next_list = next_tokens.tolist()  # one device sync per step, not one per row
        emitted = rows.emit(next_list, out, done, on_token)
        now = clock.mark()  # the step's tokens are out: everything before this belongs to it
        for b in emitted:
            token_times[b].append(now)
        if all(done):
            break
        with phase("forward"):
            last = decode_forward(model, tokens, next_tokens, positions, decoder, cache, use_cache)
        positions += 1
    out.grammar_incomplete = [c is not None and not c.complete for c in rows.constraints]
    out.timing = LoopTiming.from_clock(clock, token_times)
    out.timing.phase_s = dict(phase.seconds)
    return out


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=False).input_ids
