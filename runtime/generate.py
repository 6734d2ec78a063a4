"""Batched generation with a static KV cache, and the ``python -m runtime.generate`` CLI.

Prompts of different lengths share one prefill: rows are right-padded, every row uses positions 0..T-1
and attention is causal by position, so padding only ever writes cache slots that the row's own later
tokens overwrite before anything reads them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from runtime.grammar import Grammar, GrammarError, GrammarSpec, row_masks
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata, Transformer
from runtime.sampling import SamplingParams, logits_to_probs, make_generator, sample_rows


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per prompt (stop token included when it ended the row)
    finish_reasons: list[str]  # "eos" | "stop" | "length"
    ttft_s: float = 0.0  # time to first token (prefill + first sample)
    step_times_s: list[float] = field(default_factory=list)  # wall time of each decode step
    # per row: constrained by a grammar and stopped (max_tokens, a stop string) before its text was complete
    grammar_incomplete: list[bool] = field(default_factory=list)

    @property
    def tpot_s(self) -> float:
        return sum(self.step_times_s) / max(len(self.step_times_s), 1)


def decode_meta(positions: Tensor) -> AttentionMetadata:
    """Metadata for one new token per row at the given positions [B]."""
    if bool((positions == positions[0]).all()):
        return AttentionMetadata.contiguous(positions.shape[0], int(positions[0]), 1, positions.device)
    return AttentionMetadata.causal(positions[:, None], kv_len=int(positions.max()) + 1)


def prefill_meta(batch: int, length: int, device) -> AttentionMetadata:
    return AttentionMetadata.contiguous(batch, 0, length, device)


class StopChecker:
    """Per-row stop conditions: EOS ids, extra stop ids, stop strings, max_tokens."""

    def __init__(self, params: SamplingParams, eos_ids: list[int], tokenizer=None):
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output")
        self.tokenizer = tokenizer

    def check(self, new_tokens: list[int]) -> str | None:
        if new_tokens and new_tokens[-1] in self.stop_ids:
            return "eos" if new_tokens[-1] not in self.params.stop_token_ids else "stop"
        if self.params.stop:
            text = self.tokenizer.decode(new_tokens[-16:])  # a stop string ends in the last few tokens
            if any(s in text for s in self.params.stop):
                return "stop"
        if len(new_tokens) >= self.params.max_tokens:
            return "length"
        return None


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    tokenizer=None,
    use_cache: bool = True,
    on_token: Callable[[int, int], None] | None = None,
    grammar: Grammar | list[Grammar | None] | None = None,
) -> GenerationOutput:
    """Generate for a batch of token-id prompts; on_token(row, token) streams each new token. grammar (one
    for the batch or one per row): every token is sampled under its mask (runtime.grammar)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    B = len(prompts)
    row_params = params if isinstance(params, list) else [params] * B
    device = model.norm.weight.device  # not embed_tokens: a quantized one dequantizes its whole table for .weight
    dtype = model.compute_dtype
    cfg = model.config
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    max_new = max(p.max_tokens for p in row_params)
    total = int(lengths.max()) + max_new
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt + max_tokens = {total} exceeds the model's {cfg.max_position_embeddings} positions")
    generators = [make_generator(p.seed, device) for p in row_params]
    stops = [StopChecker(p, cfg.eos_token_ids, tokenizer) for p in row_params]
    constraints = row_constraints(grammar, B, cfg.vocab_size, row_params)

    tokens = torch.zeros(B, total, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
    cache = KVCache(cfg, B, total, dtype, device) if use_cache else None

    out = GenerationOutput(tokens=[[] for _ in range(B)], finish_reasons=[""] * B)
    done = [False] * B
    t0 = time.perf_counter()
    T = int(lengths.max())
    if use_cache:
        hidden = model(tokens[:, :T], prefill_meta(B, T, device), cache, hidden_only=True)
    else:
        hidden = model(tokens[:, :T], hidden_only=True)
    last = hidden[torch.arange(B, device=device), lengths - 1]  # [B, H]
    positions = lengths.clone()  # where each row's next token goes
    step = 0
    while True:
        logits = model.logits(last)
        masks = row_masks(constraints, cfg.vocab_size, device)
        probs = torch.stack(
            [logits_to_probs(logits[b], row_params[b], None if masks is None else masks[b]) for b in range(B)]
        )
        next_tokens = sample_rows(probs, row_params, generators)
        if step == 0:
            out.ttft_s = time.perf_counter() - t0
        for b in range(B):
            if done[b]:
                continue
            tok = int(next_tokens[b])
            out.tokens[b].append(tok)
            if constraints[b] is not None and not constraints[b].accept(tok):
                raise RuntimeError(f"row {b}: sampled token {tok} that its grammar does not allow")
            if on_token is not None:
                on_token(b, tok)
            reason = stops[b].check(out.tokens[b])
            if reason is not None:
                done[b], out.finish_reasons[b] = True, reason
        if all(done):
            break
        tokens[torch.arange(B, device=device), positions] = next_tokens
        t_step = time.perf_counter()
        if use_cache:
            hidden = model(next_tokens[:, None], decode_meta(positions), cache, hidden_only=True)
            last = hidden[:, 0]
        else:  # full recompute: the reference the cache is tested against
            L = int(positions.max()) + 1
            pos = torch.arange(L, device=device).expand(B, -1)
            hidden = model(tokens[:, :L], AttentionMetadata.causal(pos), hidden_only=True)
            last = hidden[torch.arange(B, device=device), positions]
        positions += 1
        step += 1
        out.step_times_s.append(time.perf_counter() - t_step)
    out.grammar_incomplete = [c is not None and not c.complete for c in constraints]
    return out


def row_constraints(
    grammar: Grammar | list[Grammar | None] | None, B: int, vocab_size: int, params: list[SamplingParams]
) -> list:
    """One fresh grammar matcher per row (None for unconstrained rows)."""
    grammars = grammar if isinstance(grammar, list) else [grammar] * B
    if len(grammars) != B:
        raise ValueError(f"{len(grammars)} grammars for {B} prompts")
    for g, p in zip(grammars, params):
        if g is not None and g.vocab_size != vocab_size:
            raise ValueError(f"the grammar was compiled for {g.vocab_size} tokens, the model has {vocab_size}")
        if g is not None and p.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar: the grammar ends the output with EOS")
    return [None if g is None else g.matcher() for g in grammars]


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=False).input_ids


DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def main(argv: list[str] | None = None) -> None:
    from runtime.loader import DEFAULT_MODEL, load_model, load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m runtime.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="registry name, checkpoint dir, .gguf or hub id")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--speculator", default=None, choices=["ngram", "draft", "medusa", "quant-draft"], help="see speculate/"
    )
    ap.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    ap.add_argument("--draft-model", default=None, help="draft model spec for --speculator draft")
    ap.add_argument("--medusa-heads", default=None, help="trained Medusa heads for --speculator medusa")
    ap.add_argument("--tree-size", type=int, default=None, help="Medusa candidate-tree nodes (default: top-1 chain)")
    ap.add_argument("--typical-acceptance", action="store_true", help="Medusa typical acceptance (APPROXIMATE)")
    ap.add_argument("--quant-bits", type=int, default=8, help="weight bits of the --speculator quant-draft copy")
    ap.add_argument(
        "--ngram-fixed", action="store_true", help="n-gram: always draft k tokens (default: up to 2**match length)"
    )
    constrain = ap.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON matching this schema")
    constrain.add_argument("--json-object", action="store_true", help="constrain the output to any JSON object")
    constrain.add_argument("--regex", metavar="PATTERN", help="constrain the output to this regular expression")
    constrain.add_argument("--grammar", metavar="FILE", help="constrain the output to this EBNF grammar (root ::= ...)")
    args = ap.parse_args(argv)

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
            stop=args.stop,
        )
    except ValueError as err:
        ap.error(str(err))
    model, _, path = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device)
    if model.norm.weight.is_cpu:
        from runtime.kernels import cpu_decode

        cpu_decode.extension()  # built (once per machine) before the clock starts, not inside the first token
    tokenizer = load_tokenizer(str(path))
    prompts = [encode_prompt(tokenizer, p, args.chat) for p in args.prompt]
    grammar = cli_grammar(ap, args, tokenizer, model.config)

    if args.speculator:
        from speculate.cli import generate_speculative  # speculative decoding lives in speculate/

        generate_speculative(model, path, tokenizer, prompts, params, args, grammar=grammar)
        return

    streamed: list[list[int]] = [[] for _ in prompts]
    printed = [0] * len(prompts)

    def on_token(row: int, tok: int) -> None:
        if len(prompts) > 1:
            return
        streamed[row].append(tok)
        text = tokenizer.decode(streamed[row], skip_special_tokens=True)
        sys.stdout.write(text[printed[row] :])
        sys.stdout.flush()
        printed[row] = len(text)

    result = generate(model, prompts, params, tokenizer=tokenizer, on_token=on_token, grammar=grammar)
    if len(prompts) > 1:
        for i, toks in enumerate(result.tokens):
            print(f"--- [{i}] {tokenizer.decode(toks, skip_special_tokens=True)}")
    n_new = sum(len(t) for t in result.tokens)
    decode_time = sum(result.step_times_s)
    print(
        f"\n[qspec] {n_new} tokens, TTFT {result.ttft_s * 1e3:.1f} ms, TPOT {result.tpot_s * 1e3:.1f} ms, "
        f"decode {len(result.step_times_s) * len(prompts) / max(decode_time, 1e-9):.1f} tok/s "
        f"({args.dtype}, {args.device}, batch {len(prompts)}, finish: {','.join(result.finish_reasons)})",
        file=sys.stderr,
    )
    report_incomplete(result.grammar_incomplete, result.finish_reasons)


def cli_grammar(ap: argparse.ArgumentParser, args, tokenizer, config) -> Grammar | None:
    """The grammar of --json-schema / --json-object / --regex / --grammar, or None; bad input is an argparse error."""
    try:
        if args.json_schema:
            spec = GrammarSpec("json_schema", Path(args.json_schema).read_text())
        elif args.grammar:
            spec = GrammarSpec("ebnf", Path(args.grammar).read_text())
        elif args.regex:
            spec = GrammarSpec("regex", args.regex)
        elif args.json_object:
            spec = GrammarSpec("json_object")
        else:
            return None
        return Grammar(spec, tokenizer, config.vocab_size, config.eos_token_ids)
    except OSError as err:
        ap.error(f"cannot read the grammar file: {err}")
    except GrammarError as err:
        ap.error(str(err))


def report_incomplete(incomplete: list[bool], finish_reasons: list[str]) -> None:
    for i, (bad, reason) in enumerate(zip(incomplete, finish_reasons)):
        if bad:
            print(
                f"[qspec] output {i} is INCOMPLETE: it stopped ({reason}) before the grammar was satisfied, so it is "
                "not valid under the grammar",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
