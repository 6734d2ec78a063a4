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
from runtime.sampling import SamplingParams, logits_to_probs, make_generator, process_logits, sample_rows
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
    max_new = max(p.max_tokens for p in row_params)
    total = int(lengths.max()) + max_new
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt + max_tokens = {total} exceeds the model's {cfg.max_position_embeddings} positions")
    generators = [make_generator(p.seed, device) for p in row_params]
    stops = [StopChecker(p, cfg.eos_token_ids, tokenizer) for p in row_params]
    constraints = row_constraints(grammar, row_params, cfg.vocab_size)
    adjusted = any(c is not None for c in constraints) or any(p.adjusts_logits for p in row_params)
    stop_ids = [sorted(s.stop_ids) if p.min_tokens else [] for s, p in zip(stops, row_params)]

    tokens = torch.zeros(B, total, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
    kv = kv_cache or KVCacheSpec()
    backend = resolve_compile(compile, device) if use_cache and kv.compilable else "off"
    decoder = compiled_decoder(model, B, total, backend, kv) if backend != "off" else None
    if decoder is not None:
        cache = decoder.cache  # the same storage the compiled step reads; the prefill writes it eagerly
    else:
        cache = kv.build(model, B, total) if use_cache else None
    all_greedy = all(p.greedy for p in row_params)

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
            next_tokens = _next_tokens(
                logits, adjusted, all_greedy, row_params, generators, prompts, out.tokens, stop_ids, constraints
            )
            next_list = next_tokens.tolist()  # one device sync per step, not one per row
        emitted = []
        for b in range(B):
            if done[b]:
                continue
            tok = next_list[b]
            out.tokens[b].append(tok)
            emitted.append(b)
            if constraints[b] is not None and not constraints[b].accept(tok):
                raise RuntimeError(f"row {b}: sampled token {tok} that its grammar does not allow")
            if on_token is not None:
                on_token(b, tok)
            reason = stops[b].check(out.tokens[b])
            if reason is not None:
                done[b], out.finish_reasons[b] = True, reason
        now = clock.mark()  # the step's tokens are out: everything before this belongs to it
        for b in emitted:
            token_times[b].append(now)
        if all(done):
            break
        with phase("forward"):
            tokens[torch.arange(B, device=device), positions] = next_tokens
            if decoder is not None:
                last = decoder(next_tokens[:, None], positions[:, None])[:, 0]
            elif use_cache:
                hidden = model(next_tokens[:, None], decode_meta(positions), cache, hidden_only=True)
                last = hidden[:, 0]
            else:  # full recompute: the reference the cache is tested against
                L = int(positions.max()) + 1
                pos = torch.arange(L, device=device).expand(B, -1)
                hidden = model(tokens[:, :L], AttentionMetadata.causal(pos), hidden_only=True)
                last = hidden[torch.arange(B, device=device), positions]
        positions += 1
    out.grammar_incomplete = [c is not None and not c.complete for c in constraints]
    out.timing = LoopTiming.from_clock(clock, token_times)
    out.timing.phase_s = dict(phase.seconds)
    return out


def _next_tokens(logits, adjusted, all_greedy, row_params, generators, prompts, generated, stop_ids, constraints):
    """[B, V] raw logits -> [B] next tokens under each row's SamplingParams, penalties and grammar."""
    B = logits.shape[0]
    if adjusted:  # per-row sequence-dependent adjustments (penalties, logit_bias, min_tokens), then grammars
        logits = torch.stack(
            [
                mask_logits(
                    process_logits(logits[b], p, prompts[b], generated[b], stop_ids[b]),
                    None if c is None else c.mask(),
                )
                for b, (p, c) in enumerate(zip(row_params, constraints))
            ]
        )
    if all_greedy:  # the argmax sample_rows takes of one-hot rows, without B small ops per step
        return logits.argmax(-1)
    probs = torch.stack([logits_to_probs(logits[b], row_params[b]) for b in range(B)])
    return sample_rows(probs, row_params, generators)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=False).input_ids
