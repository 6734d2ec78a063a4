"""``python -m runtime.generate``: generate text for one or more prompts, plainly or with a speculator.

A thin entry point: parsing and wiring only. The decoding loop is runtime.decoding.generate; speculative
decoding is speculate.generate (built by speculate.cli).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from runtime.cliutil import ArgumentParser, UsageError, run
from runtime.compiled import COMPILE_MODES
from runtime.config import DTYPE_CHOICES, ModelConfig, cli_dtype, dtype_name
from runtime.decoding import encode_prompt, generate
from runtime.grammar import add_grammar_args, cli_grammar, report_incomplete
from runtime.kernels import cpu_step
from runtime.kv_policy import add_kv_cache_args, kv_spec_from_args
from runtime.layout import device_of
from runtime.loader import DEFAULT_MODEL, check_model_spec, load_model, load_tokenizer, resolve
from runtime.sampling import SamplingParams
from runtime.timing import timing_line
from speculate.cli import add_speculator_args, check_speculator_args, generate_speculative


def stream_printer(tokenizer, n_prompts: int) -> Callable[[int, int], None]:
    """on_token(row, token) that prints a single prompt's text as it is generated (batches print at the end)."""
    streamed: list[int] = []
    printed = 0

    def on_token(row: int, tok: int) -> None:
        nonlocal printed
        if n_prompts > 1:
            return
        streamed.append(tok)
        text = tokenizer.decode(streamed, skip_special_tokens=True)
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)

    return on_token


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m runtime.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="registry name, checkpoint dir, .gguf or hub id")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: fp32, or bf16 for a quantized checkpoint"
    )
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    ap.add_argument(
        "--compile", default="auto", choices=COMPILE_MODES, help="compiled decode step (auto: on CUDA only)"
    )
    add_speculator_args(ap)
    add_grammar_args(ap)
    add_kv_cache_args(ap)
    return ap


def check_args(ap: ArgumentParser, args) -> SamplingParams:
    """Every check that needs no model, before the tokenizer and the weights are loaded; -> the sampling params."""
    args.kv_cache = kv_spec_from_args(ap, args)
    for i, p in enumerate(args.prompt):
        if not p.strip():
            ap.error("--prompt is empty" if len(args.prompt) == 1 else f"--prompt number {i + 1} is empty")
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.speculator and args.num_speculative_tokens < 1:
        ap.error(f"--num-speculative-tokens/-k must be >= 1, got {args.num_speculative_tokens}")
    check_speculator_args(ap, args)  # an unknown speculator, a broken plug-in or a bad option
    if args.device not in (None, "cpu") and not args.device.startswith("cuda"):
        ap.error(f"--device {args.device!r}: choose cpu or cuda[:N]")
    try:
        return SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
            stop=args.stop,
        )
    except ValueError as err:
        ap.error(str(err))


def encode_prompts(args, tokenizer, config: ModelConfig) -> list[list[int]]:
    """The prompts' token ids; one that encodes to nothing or does not fit the context is a usage error."""
    prompts = [encode_prompt(tokenizer, p, args.chat) for p in args.prompt]
    for i, p in enumerate(prompts):
        which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
        if not p:
            raise UsageError(f"{which} encodes to no tokens")
        if len(p) + args.max_tokens > config.max_position_embeddings:
            raise UsageError(
                f"{which} is {len(p)} tokens; with --max-tokens {args.max_tokens} that is {len(p) + args.max_tokens}, "
                f"beyond the model's context of {config.max_position_embeddings} positions"
            )
    return prompts


def generate_plain(model, tokenizer, prompts, params, args, device: str, on_token, grammar) -> None:
    """runtime.decoding.generate, then the texts of a batch and one timing line on stderr."""
    result = generate(
        model,
        prompts,
        params,
        tokenizer=tokenizer,
        on_token=on_token,
        compile=args.compile,
        grammar=grammar,
        kv_cache=args.kv_cache,
    )
    if len(prompts) > 1:
        for i, toks in enumerate(result.tokens):
            print(f"--- [{i}] {tokenizer.decode(toks, skip_special_tokens=True)}")
    print(
        f"\n[qspec] {timing_line(result.timing)} "
        f"({dtype_name(model.compute_dtype)}, {device}, compile {result.compile}, batch {len(prompts)}, "
        f"KV {args.kv_cache.label()}, "
        f"finish: {','.join(result.finish_reasons)})",
        file=sys.stderr,
    )
    report_incomplete(result.grammar_incomplete, result.finish_reasons)


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    params = check_args(ap, args)
    check_model_spec(args.model)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve(args.model)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    tokenizer = load_tokenizer(str(path))
    prompts = encode_prompts(args, tokenizer, config)

    model, _, path = load_model(args.model, dtype=cli_dtype(args.dtype), device=device)
    if device_of(model).type == "cpu":
        cpu_step.extension()  # built (once per machine) before the clock starts, not inside the first token
    on_token = stream_printer(tokenizer, len(prompts))
    grammar = cli_grammar(ap, args, tokenizer, model.config)
    if args.speculator:
        generate_speculative(model, path, tokenizer, prompts, params, args, on_token=on_token, grammar=grammar)
    else:
        generate_plain(model, tokenizer, prompts, params, args, device, on_token, grammar)


if __name__ == "__main__":
    run(main)
