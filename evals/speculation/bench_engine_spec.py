"""Speculation in the serving engine: C concurrent requests with and without a draft, same requests, wall clock.

Each concurrency level submits the first C HumanEval prompts (raw code prompts) to a fresh ``LLMEngine`` at once
(continuous batching, ``max_num_seqs`` = C) and runs them to completion: once plainly, once with the speculator,
alternated for ``--rounds`` rounds (the machine's load hits both alike). Reported per level: output tokens per
second of the whole batch, the ratio with the draft against plain batching, tokens per verify step, and whether
every request's greedy tokens equal its tokens decoded alone (batch 1, plain; the first ``--check-alone``
requests): a request's output must not depend on the batch it shares, nor on speculation.

    python -m evals.speculation.bench_engine_spec --model qwen2.5-coder-1.5b --dtype bf16 \\
        --draft int4+qwen2.5-coder-0.5b,k=8,conf=0.4 --concurrency 1 8 --max-tokens 128 --out results/engine.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from evals.quality.humaneval_eval import draft_method, draft_speculator
from evals.quality.humaneval_problems import load_problems, prompt_ids, select
from runtime.cliutil import ArgumentParser, run
from runtime.config import DTYPES
from runtime.engine import EngineConfig, LLMEngine
from runtime.loader import check_model_arg, load_model, load_tokenizer
from runtime.paths import write_atomic
from runtime.provenance import module_command, provenance
from runtime.sampling import SamplingParams


def run_batch(model, tokenizer, prompts: list[list[int]], params: SamplingParams, speculator=None, spec_max_batch=None):
    """(tokens per request, wall seconds, engine) for the prompts submitted together to a fresh engine. The token
    budget fits every row's verification in one step (C x (k + 1) tokens)."""
    per_row = 1 if speculator is None else speculator.max_tokens_per_step()
    budget = max(512, len(prompts) * per_row)
    config = EngineConfig(
        max_num_seqs=len(prompts), max_num_batched_tokens=budget, kv_cache_bytes=2 << 30, spec_max_batch=spec_max_batch
    )
    engine = LLMEngine(model, tokenizer, config, speculator=speculator)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    if speculator is not None:
        speculator.release([o.request_id for o in outs])
    return [o.output_ids for o in outs], seconds, engine


def measure_level(model, tokenizer, prompts, params, speculator, alone, rounds: int, log, spec_max_batch=None) -> dict:
    plain_s = spec_s = 0.0
    tokens = 0
    same_plain = same_spec = True
    steps = proposed = accepted = plain_steps = 0
    for r in range(rounds):
        order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
        for mode in order:
            spec = speculator if mode == "spec" else None
            toks, seconds, engine = run_batch(model, tokenizer, prompts, params, spec, spec_max_batch)
            if mode == "plain":
                plain_s += seconds
                tokens += sum(map(len, toks))
                same_plain &= toks[: len(alone)] == alone
            else:
                spec_s += seconds
                same_spec &= toks[: len(alone)] == alone
                steps += engine.num_steps
                plain_steps += engine.num_plain_steps
                proposed, accepted = proposed + engine.num_spec_proposed, accepted + engine.num_spec_accepted
        log(f"concurrency {len(prompts)} round {r + 1}/{rounds}: plain {plain_s:.1f} s, draft {spec_s:.1f} s")
    return {
        "concurrency": len(prompts),
        "output_tokens_per_round": tokens // rounds,
        "plain_tok_per_s": tokens / plain_s,
        "draft_tok_per_s": tokens / spec_s,
        "ratio": plain_s / spec_s,
        "acceptance": accepted / proposed if proposed else None,
        "spec_steps_decoded_plainly": plain_steps / steps if steps else 0.0,  # above --spec-max-batch
        "compared_alone": len(alone),
        "plain_equals_alone": same_plain,
        "draft_equals_alone": same_spec,
    }


def parse_args(argv):
    ap = ArgumentParser(prog="python -m evals.speculation.bench_engine_spec", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--draft", default="int4+qwen2.5-coder-0.5b,k=8,conf=0.4", help="SPEC[,k=K][,conf=C][,vocab=N]")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--check-alone", type=int, default=8, help="requests whose tokens are compared with the same "
                    "request decoded alone (the first N; each costs one batch-1 decode)")  # fmt: skip
    ap.add_argument("--spec-max-batch", type=int, default=None, metavar="N",
                    help="the engine's spec_max_batch: speculate only while at most N requests are in it")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.spec_max_batch is not None and args.spec_max_batch < 1:
        ap.error("--spec-max-batch must be >= 1")
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.rounds < 1:
        ap.error("--concurrency, --max-tokens and --rounds must be >= 1")
    try:
        draft_method(args.draft)
    except ValueError as err:
        ap.error(str(err))
    check_model_arg(ap, args.model)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(f"[bench_engine_spec] {msg}", file=sys.stderr, flush=True)

    model, _, path = load_model(args.model, dtype=DTYPES[args.dtype])
    tokenizer = load_tokenizer(str(path))
    speculator = draft_speculator(model, args.draft, path)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)  # stops at EOS
    problems = select(load_problems(), limit=max(args.concurrency))
    prompts = [prompt_ids(tokenizer, p) for p in problems]
    alone = [run_batch(model, tokenizer, [p], params)[0][0] for p in prompts[: args.check_alone]]  # the reference
    # one-time costs (the draft's weight packing, first calls) out of the timed runs: ~10 s of an int4 draft's first
    # prefill on an AVX2 CPU, which the first timed run with the draft paid before this
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for spec in (None, speculator):
        run_batch(model, tokenizer, prompts[:2], warm, spec)
    levels = [
        measure_level(
            model, tokenizer, prompts[:c], params, speculator, alone[:c], args.rounds, log, args.spec_max_batch
        )
        for c in args.concurrency
    ]
    record = {**provenance(command=module_command("evals.speculation.bench_engine_spec", argv)), "args": vars(args),
              "levels": levels}  # fmt: skip
    print(f"engine, {args.model} {args.dtype}, draft {args.draft}, greedy, up to {args.max_tokens} tokens")
    print("| concurrent | plain tok/s | draft tok/s | ratio | acceptance | steps decoded plainly | plain = alone | "
          "draft = alone |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---|---|")
    for lv in levels:
        acc = "-" if lv["acceptance"] is None else f"{lv['acceptance']:.2f}"
        print(f"| {lv['concurrency']} | {lv['plain_tok_per_s']:.1f} | {lv['draft_tok_per_s']:.1f} | "
              f"{lv['ratio']:.2f}x | {acc} | {lv['spec_steps_decoded_plainly']:.0%} | {lv['plain_equals_alone']} | "
              f"{lv['draft_equals_alone']} |")  # fmt: skip
    if args.out:
        write_atomic(Path(args.out), lambda tmp: tmp.write_text(json.dumps(record, indent=1)))
    return record


if __name__ == "__main__":
    run(main)
