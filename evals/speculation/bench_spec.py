"""Speculative decoding speed vs plain decoding on the default model: CPU, batch 1, greedy, 128 new tokens.

Tasks (prompts from the wiki *evaluation* split, never the Medusa training documents):
- ``rewrite``: chat prompts asking the model to repeat a wiki passage (n-gram lookup's home ground);
- ``continue``: raw wiki-text prefixes to continue (Medusa's and the drafts' test).

Every method runs on every prompt, interleaved (prompt by prompt, method order rotated), so machine load
hits all methods alike; speed is reported as a ratio against plain decoding measured in the same run.
Greedy outputs are compared token by token with plain decoding (lossless methods must match exactly).
HF transformers' ``generate`` runs on the same prompts as the peer: plain greedy and prompt lookup
(``prompt_lookup_num_tokens``), with its ratio against HF plain.

Methods: plain, hf-plain, hf-pld:k=K, and any speculate.registry method: ngram:k=K (draft length scaled by the
match length, capped at K; ngram:k=K,fixed=1 always drafts K as plain prompt lookup does), medusa:k=K (top-1
chain) or medusa:tree=N, draft:layers=L,k=K, quant-draft:bits=B,k=K, eagle:tree=N, a plug-in module:attr.

    python -m evals.speculation.bench_spec --task rewrite --methods plain ngram:k=2 ngram:k=4 hf-plain hf-pld:k=10
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.cliutil import ArgumentParser, interrupted, run
from runtime.data import wiki_split
from runtime.decoding import encode_prompt, generate
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer
from runtime.provenance import module_command, provenance
from runtime.sampling import SamplingParams
from speculate.base import SpeculatorError
from speculate.generate import add_counts, speculative_generate
from speculate.registry import BuildContext, Method, build, check_method

DEFAULT_METHODS = {
    "rewrite": ["plain", "ngram:k=8", "ngram:k=16", "ngram:k=8,fixed=1", "hf-plain", "hf-pld:k=4", "hf-pld:k=10"],
    "continue": ["plain", "medusa:k=1", "medusa:k=2", "medusa:tree=4", "draft:layers=8,k=2", "quant-draft:bits=8,k=2"],
}


class BenchError(ValueError):
    pass


@dataclass
class MethodResult:
    method: str
    seconds: float = 0.0
    tokens: int = 0
    exact_prompts: int = 0  # prompts whose output equals plain greedy decoding
    prompts: int = 0
    stats: dict = field(default_factory=dict)  # aggregated speculation statistics
    steps: int = 0
    accepted: int = 0
    row_steps: int = 0
    drafted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    proposed_at: list[int] = field(default_factory=list)

    def add(self, tokens: list[int], stats, seconds: float) -> None:
        """One prompt's generation: its time and tokens, and its speculation statistics where it has them."""
        self.seconds += seconds
        self.tokens += len(tokens)
        self.prompts += 1
        if stats is None:
            return
        add_counts(self, stats)


@dataclass
class HFStats:
    """HF generate's speculation counted from its forwards (it does not report acceptance itself)."""

    steps: int
    row_steps: int
    accepted: int
    drafted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    proposed_at: list[int] = field(default_factory=list)


HF_METHODS = ("hf-plain", "hf-pld")  # HF transformers' generate, the peer: plain greedy and prompt lookup (k=)


def parse_method(spec: str) -> tuple[str, dict]:
    """(name, options) of a method: plain, hf-plain, hf-pld[:k=K], or a speculate.registry method."""
    if spec in ("plain", "hf-plain"):
        return spec, {}
    name, _, opts = spec.partition(":")
    if name == "hf-pld":
        key, _, value = opts.partition("=")
        if opts and (key != "k" or not value.isdigit() or int(value) < 1):
            raise BenchError(f"bad option {opts!r} in method {spec!r}; hf-pld takes k= (an integer >= 1)")
        return name, {"k": int(value)} if opts else {}
    try:
        method = check_method(spec)
    except SpeculatorError as err:
        raise BenchError(str(err)) from None
    return method.name, method.options


def rewrite_prompts(tokenizer, n: int, min_tokens: int) -> list[list[int]]:

    out = []
    for doc in wiki_split("eval"):
        passage = doc.extract.strip()
        n_tok = len(tokenizer(passage, add_special_tokens=False).input_ids)
        if min_tokens <= n_tok <= 2 * min_tokens:
            out.append(encode_prompt(tokenizer, f"Repeat the following passage exactly.\n\n{passage}", chat=True))
        if len(out) == n:
            return out
    raise BenchError(f"found only {len(out)} eval passages of {min_tokens}-{2 * min_tokens} tokens")


def continue_prompts(tokenizer, n: int, prefix_tokens: int) -> list[list[int]]:

    out = []
    for doc in wiki_split("eval"):
        ids = tokenizer(doc.extract, add_special_tokens=False).input_ids
        if len(ids) >= prefix_tokens:
            out.append(ids[:prefix_tokens])
        if len(out) == n:
            return out
    raise BenchError(f"found only {len(out)} eval documents with {prefix_tokens} tokens")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[tuple[str, dict]]]:
    """The arguments (--methods filled in with the task's defaults) and each method's (name, options)."""
    ap = ArgumentParser(prog="python -m evals.speculation.bench_spec", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--task", choices=["rewrite", "continue"], default="rewrite")
    ap.add_argument("--methods", nargs="+", default=None, help="methods to compare (default: per task)")
    ap.add_argument("--prompts", type=int, default=4, help="number of prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="passage (rewrite) / prefix (continue) length")
    ap.add_argument("--medusa-heads", default=None, help="Medusa checkpoint (default $QSPEC_HOME/medusa/MODEL)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per method")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    args.methods = args.methods or DEFAULT_METHODS[args.task]
    try:
        parsed = [parse_method(m) for m in args.methods]
    except BenchError as err:
        ap.error(str(err))
    if "plain" not in args.methods:
        ap.error("--methods must include 'plain' (the baseline every ratio is against)")
    if args.prompts < 1 or args.max_tokens < 1:
        ap.error("--prompts and --max-tokens must be >= 1")
    return args, parsed


def hf_model(path: Path):
    """HF transformers' model of the same checkpoint, and a counter of its forwards (prefill + one per
    (assisted) step: HF generate does not report its steps)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    calls = [0]
    hf.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return hf, calls


def hf_runner(hf, calls: list[int], tokenizer, name: str, kw: dict):
    """HF generate: plain greedy, or prompt lookup (hf-pld, k= tokens)."""
    extra = {"prompt_lookup_num_tokens": kw.get("k", 10)} if name == "hf-pld" else {}

    def run_hf(p, n):
        ids = torch.tensor([p])
        calls[0] = 0
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
                **extra,
            )
        new = out[0, len(p) :].tolist()
        steps = max(calls[0] - 1, 1)  # decode forwards after the prefill (which gave token 1)
        return new, HFStats(steps=steps, row_steps=steps, accepted=len(new) - 1 - steps)

    return run_hf


def build_runners(args, parsed: list[tuple[str, dict]], model, tokenizer, path: Path) -> dict:
    """Per method spec: a function (prompt ids, n) -> (n new tokens, speculation statistics or None)."""

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, seed=args.seed)

    def plain(p, n):
        return generate(model, [p], params(n), tokenizer=tokenizer).tokens[0], None

    def speculative(speculator):
        def run_spec(p, n):
            out = speculative_generate(model, [p], params(n), speculator, tokenizer=tokenizer)
            return out.tokens[0], out.stats

        return run_spec

    hf = hf_model(path) if any(name in HF_METHODS for name, _ in parsed) else None
    runners = {}
    for spec, (name, kw) in zip(args.methods, parsed):
        if name == "plain":
            runners[spec] = plain
        elif name in HF_METHODS:
            runners[spec] = hf_runner(*hf, tokenizer, name, kw)
        else:
            context = BuildContext(target_path=path, heads={"medusa": args.medusa_heads})
            runners[spec] = speculative(build(Method(name, kw), model, context))
    return runners


def run_prompts(runners: dict, prompts: list[list[int]], methods: list[str], max_tokens: int) -> dict:
    """Every method on every prompt, the order rotated per prompt; on Ctrl-C, the summary of the prompts every
    method finished."""
    results = {spec: MethodResult(spec) for spec in methods}
    start = time.perf_counter()
    finished = copy.deepcopy(results)  # the results of the prompts every method finished (kept at Ctrl-C)
    try:
        for i, p in enumerate(prompts):
            order = methods[i % len(methods) :] + methods[: i % len(methods)]  # rotate who goes first
            outputs = {}
            for spec in order:
                t0 = time.perf_counter()
                outputs[spec], stats = runners[spec](p, max_tokens)
                results[spec].add(outputs[spec], stats, time.perf_counter() - t0)
            for spec in methods:
                results[spec].exact_prompts += int(outputs[spec] == outputs["plain"])
            elapsed = time.perf_counter() - start
            eta = elapsed / (i + 1) * (len(prompts) - i - 1)
            print(
                f"[bench_spec] prompt {i + 1}/{len(prompts)} done, {elapsed:.0f} s, ETA {eta:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            finished = copy.deepcopy(results)
    except KeyboardInterrupt:
        done = finished["plain"].prompts
        if done:
            print(f"[bench_spec] partial summary: the {done} of {len(prompts)} prompts that finished", file=sys.stderr)
            print_table(summary_rows(finished, methods))
        interrupted(f"{done} of {len(prompts)} prompts had finished for every method")
    return results


def main(argv: list[str] | None = None) -> dict:
    args, parsed = parse_args(argv)
    record = provenance(command=module_command("evals.speculation.bench_spec", argv))
    model, _, path = load_model(args.model, dtype=torch.float32)
    tokenizer = load_tokenizer(str(path))
    make_prompts = rewrite_prompts if args.task == "rewrite" else continue_prompts
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_tokens)
    runners = build_runners(args, parsed, model, tokenizer, path)
    methods = args.methods
    print(
        f"[bench_spec] {args.task}: {len(prompts)} prompts x {args.max_tokens} tokens, methods {methods}",
        file=sys.stderr,
    )
    for spec in methods:  # short warm-up (first-call allocations, lazy imports)
        for _ in range(args.warmup):
            runners[spec](prompts[0], 8)
    rows = summary_rows(run_prompts(runners, prompts, methods, args.max_tokens), methods)
    record.update(task=args.task, prompts=len(prompts), max_tokens=args.max_tokens, results=rows)
    record["load_average_end"] = os.getloadavg()
    print_table(rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps(record))
    return record


def summary_rows(results: dict, methods: list[str]) -> list[dict]:
    """One row per method: speed against plain decoding, exactness, acceptance."""
    base = results["plain"]
    base_tps = base.tokens / base.seconds
    hf_base = results.get("hf-plain")
    rows = []
    for spec in methods:
        r = results[spec]
        tps = r.tokens / r.seconds
        row = {
            "method": spec,
            "tokens": r.tokens,
            "seconds": round(r.seconds, 3),
            "tok_per_s": round(tps, 2),
            "speedup_vs_plain": round(tps / base_tps, 3),
            "exact_match_prompts": f"{r.exact_prompts}/{r.prompts}",
        }
        if hf_base is not None and spec.startswith("hf-"):
            row["speedup_vs_hf_plain"] = round(tps / (hf_base.tokens / hf_base.seconds), 3)
        if r.row_steps:
            row.update(
                mean_accepted_per_step=round(r.accepted / r.row_steps, 3),
                tokens_per_step=round(1 + r.accepted / r.row_steps, 3),
                acceptance_rate=round(r.accepted / r.drafted, 3) if r.drafted else None,
                per_position_acceptance=[round(a / max(n, 1), 3) for a, n in zip(r.accepted_at, r.proposed_at)],
                target_forwards_per_token=round((r.row_steps + r.prompts) / r.tokens, 3),
            )
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'method':28s} {'tok/s':>7s} {'vs plain':>8s} {'exact':>6s} {'acc/step':>8s} {'tok/step':>8s} per-position"
    print(head, file=sys.stderr)
    for r in rows:
        print(
            f"{r['method']:28s} {r['tok_per_s']:7.2f} {r['speedup_vs_plain']:7.2f}x {r['exact_match_prompts']:>6s} "
            f"{r.get('mean_accepted_per_step', float('nan')):8.2f} {r.get('tokens_per_step', float('nan')):8.2f} "
            f"{r.get('per_position_acceptance', '')}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    run(main)
