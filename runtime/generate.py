"""``python -m runtime.generate``: generate text for one or more prompts, plainly or with a speculator.

A thin entry point: parsing and wiring only. The decoding loop is runtime.decoding.generate; speculative
decoding is speculate.generate (built by speculate.cli).
"""

from __future__ import annotations

import argparse
import sys

import torch

from runtime.compiled import COMPILE_MODES
from runtime.config import DTYPES
from runtime.decoding import encode_prompt, generate
from runtime.kernels import cpu_decode
from runtime.layout import device_of
from runtime.loader import DEFAULT_MODEL, load_model, load_tokenizer
from runtime.sampling import SamplingParams
from speculate.cli import add_speculator_args, generate_speculative


def main(argv: list[str] | None = None) -> None:
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
        "--compile", default="auto", choices=COMPILE_MODES, help="compiled decode step (auto: on CUDA only)"
    )
    add_speculator_args(ap)
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
    if device_of(model).type == "cpu":
        cpu_decode.extension()  # built (once per machine) before the clock starts, not inside the first token
    tokenizer = load_tokenizer(str(path))
    prompts = [encode_prompt(tokenizer, p, args.chat) for p in args.prompt]

    if args.speculator:
        generate_speculative(model, path, tokenizer, prompts, params, args)
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

    result = generate(model, prompts, params, tokenizer=tokenizer, on_token=on_token, compile=args.compile)
    if len(prompts) > 1:
        for i, toks in enumerate(result.tokens):
            print(f"--- [{i}] {tokenizer.decode(toks, skip_special_tokens=True)}")
    n_new = sum(len(t) for t in result.tokens)
    decode_time = sum(result.step_times_s)
    print(
        f"\n[qspec] {n_new} tokens, TTFT {result.ttft_s * 1e3:.1f} ms, TPOT {result.tpot_s * 1e3:.1f} ms, "
        f"decode {len(result.step_times_s) * len(prompts) / max(decode_time, 1e-9):.1f} tok/s "
        f"({args.dtype}, {args.device}, compile {result.compile}, batch {len(prompts)}, "
        f"finish: {','.join(result.finish_reasons)})",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
