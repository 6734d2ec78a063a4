"""The Spec-Bench-style suite as a library: its methods (plain and every speculate.registry method), the timed
run of each over the prompts at each batch size, and the per-cell summaries and tables. evals.speculation.specbench is
the command (its docstring describes the categories and what is recorded).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from evals.quality.humaneval_problems import load_problems, prompt_ids, select
from runtime.config import ModelConfig
from runtime.decoding import generate
from runtime.prompts import CATEGORIES, SuiteError
from runtime.sampling import SamplingParams
from speculate.base import Proposal, SpecState, Speculator, SpeculatorError
from speculate.generate import add_counts, speculative_generate
from speculate.registry import BuildContext, Method, build, check_method

WORKLOADS = (*CATEGORIES, "humaneval")  # the six Spec-Bench categories, and HumanEval's code prompts

DEFAULT_METHODS = [
    "plain",
    "ngram:k=8",
    "draft:layers=8,k=3",
    "quant-draft:bits=4,k=3",
    "quant-draft:bits=4,layers=15,k=3",
    "medusa:tree=8",
    "eagle:tree=8",
]
SMOKE_METHODS = [
    "plain",
    "ngram:k=4",
    "draft:layers=1,k=2",
    "quant-draft:bits=4,k=2",
    "quant-draft:bits=4,layers=1,k=2",
    "medusa:tree=4",
    "eagle:tree=4,depth=2",
]
SMOKE_CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=128,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    eos_token_ids=[1],
)


def smoke_suite(per_category: int, seed: int, vocab: int) -> list[tuple[str, list[int]]]:
    """Token-id prompts for the tiny random model: each category a different amount of repetition."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c, cat in enumerate(CATEGORIES):
        for i in range(per_category):
            span = torch.randint(2, vocab, (4 + c + i,), generator=gen).tolist()
            out.append((cat, (span * (1 + (c + i) % 3))[: 6 + 2 * c + i]))
    return out


# ---- methods -------------------------------------------------------------------------------------------


def parse_method(spec: str) -> tuple[str, dict]:
    """(name, given options) of a method: "plain" (the baseline) or a speculate.registry method."""
    if spec == "plain":
        return "plain", {}
    try:
        method = check_method(spec)
    except SpeculatorError as err:
        raise SuiteError(str(err)) from None
    return method.name, method.options


def humaneval_prompts(tokenizer, n: int) -> list[tuple[str, list[int]]]:
    """(task id, raw prompt ids) of the first n HumanEval problems, as evals.quality.humaneval completes them."""
    return [(p.task_id, prompt_ids(tokenizer, p)) for p in select(load_problems(), limit=n)]


def plain_decode(model, prompts: list[list[int]], params: SamplingParams, tokenizer=None):
    """(plain generate's output, its decode seconds): first token -> last token, whole steps (runtime.timing), the
    same clock as the speculative loop's decode phase."""
    out = generate(model, prompts, params, tokenizer=tokenizer)
    return out, out.timing.decode_s


class TimedSpeculator(Speculator):
    """Wraps a speculator: times propose() (the draft cost) and counts the tokens each step feeds the target."""

    def __init__(self, inner: Speculator):
        self.inner = inner
        self.name, self.acceptance = inner.name, inner.acceptance
        self.draft_s = 0.0  # propose() seconds (inside the decode loop's time)
        self.fed: Counter = Counter()  # tokens fed to the target per step (T) -> steps
        self._sources_from = inner.sources()

    def max_tokens_per_step(self) -> int:
        return self.inner.max_tokens_per_step()

    def prefill(self, state: SpecState) -> None:  # a draft model's prompt KV: the prefill phase, not a step
        self.inner.prefill(state)

    def release(self, ids) -> None:
        self.inner.release(ids)

    def propose(self, state: SpecState) -> Proposal:
        t0 = time.perf_counter()
        p = self.inner.propose(state)
        self.draft_s += time.perf_counter() - t0
        self.fed[max(p.fed())] += 1  # the verification forward is as wide as its widest row
        return p

    def describe(self) -> dict:
        return self.inner.describe()

    def sources(self) -> dict[str, int]:
        """The inner speculator's proposals by source while this wrapper ran (a composite's parts)."""
        return {k: n - self._sources_from.get(k, 0) for k, n in self.inner.sources().items()}


def build_method(name: str, kw: dict, model, heads_dir: dict[str, Path | None], smoke: bool) -> Speculator:
    """A speculator for a parsed method (speculate.registry); SpeculatorError (skipped, recorded) when its heads
    are missing."""
    return build(Method(name, kw), model, BuildContext(heads=heads_dir, smoke=smoke))


# ---- running -------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One (batch size, category, method) accumulator."""

    seconds: float = 0.0
    tokens: int = 0
    rows: int = 0
    exact_rows: int = 0
    draft_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    row_steps: int = 0
    accepted: int = 0
    drafted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    proposed_at: list[int] = field(default_factory=list)
    fed: dict = field(default_factory=dict)
    sources: Counter = field(default_factory=Counter)  # a composite speculator's proposals by source

    def add_stats(self, stats, draft_s: float, fed: Counter, sources: dict | None = None) -> None:
        add_counts(self, stats)
        self.draft_s += draft_s
        for t, c in fed.items():
            self.fed[int(t)] = self.fed.get(int(t), 0) + c
        self.sources.update(sources or {})


def summarize(cell: Cell, base: Cell | None, lossless: bool) -> dict:
    tps = cell.tokens / max(cell.seconds, 1e-12)
    row = {
        "tokens": cell.tokens,
        "seconds": round(cell.seconds, 4),
        "tok_per_s": round(tps, 3),
        "exact_rows": f"{cell.exact_rows}/{cell.rows}",
        "identical": cell.exact_rows == cell.rows,
        "lossless": lossless,
    }
    # decode phase (after the first token): what speculation changes, and what evals.speculation.spec_cost predicts;
    # end to end the prefill (the same for every method, plus a draft model's own) is counted too
    decode_tps = (cell.tokens - cell.rows) / max(cell.decode_s, 1e-12)
    row["decode_tok_per_s"] = round(decode_tps, 3)
    if base is not None:
        row["speedup_vs_plain"] = round(tps / (base.tokens / max(base.seconds, 1e-12)), 4)
        row["decode_speedup_vs_plain"] = round(decode_tps / ((base.tokens - base.rows) / max(base.decode_s, 1e-12)), 4)
    if cell.row_steps:
        steps = max(cell.steps, 1)
        row.update(
            tokens_per_step=round(1 + cell.accepted / cell.row_steps, 4),
            acceptance_rate=round(cell.accepted / cell.drafted, 4) if cell.drafted else None,
            per_position_acceptance=[round(a / max(n, 1), 4) for a, n in zip(cell.accepted_at, cell.proposed_at)],
            target_forwards_per_token=round((cell.row_steps + cell.rows) / max(cell.tokens, 1), 4),
            steps=cell.steps,
            fed_tokens_hist=dict(sorted(cell.fed.items())),
            mean_fed_tokens=round(sum(t * c for t, c in cell.fed.items()) / max(sum(cell.fed.values()), 1), 3),
            draft_s_per_step=round(cell.draft_s / steps, 6),
            verify_s_per_step=round((cell.decode_s - cell.draft_s) / steps, 6),
            draft_fraction=round(cell.draft_s / max(cell.decode_s, 1e-12), 4),
        )
        if cell.sources:
            row["draft_sources"] = dict(cell.sources)
    return row


def merge(cells: list[Cell]) -> Cell:
    total = Cell()
    for c in cells:
        for f in (
            "seconds",
            "tokens",
            "rows",
            "exact_rows",
            "draft_s",
            "decode_s",
            "steps",
            "row_steps",
            "accepted",
            "drafted",
        ):
            setattr(total, f, getattr(total, f) + getattr(c, f))
        for j, (a, n) in enumerate(zip(c.accepted_at, c.proposed_at)):
            if j >= len(total.accepted_at):
                total.accepted_at.append(0)
                total.proposed_at.append(0)
            total.accepted_at[j] += a
            total.proposed_at[j] += n
        for t, n in c.fed.items():
            total.fed[t] = total.fed.get(t, 0) + n
        total.sources.update(c.sources)
    return total


def run_suite(
    model,
    prompts: list[tuple[str, list[int]]],
    methods: list[str],
    batch_sizes: list[int],
    max_tokens: int,
    heads_dir: dict[str, Path | None],
    smoke: bool = False,
    tokenizer=None,
    seed: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    warmup: int = 1,
    log=print,
    on_progress=None,
    stop_at_eos: bool = False,
    target_path: Path | str | None = None,
) -> dict:
    """Every method on every prompt. stop_at_eos: an answer ends at the model's end of turn (Spec-Bench's
    protocol; answers differ in length); otherwise every answer is max_tokens long, EOS ignored, and whatever the
    model writes after its end of turn is measured too. target_path: the target's checkpoint (a separate draft's
    tokenizer must equal its own)."""
    parsed = [parse_method(m) for m in methods]
    if "plain" not in methods:
        raise SuiteError("methods must include 'plain' (the baseline every ratio is against)")
    context = BuildContext(target_path=target_path, heads=heads_dir, smoke=smoke)
    speculators, skipped = {}, {}
    for spec, (name, kw) in zip(methods, parsed):
        if name == "plain":
            continue
        try:
            speculators[spec] = build(Method(name, kw), model, context)
        except SpeculatorError as err:
            skipped[spec] = str(err)
            log(f"[specbench] skipping {spec}: {err}")
    active = [m for m in methods if m not in skipped]

    def sampling(n: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=n, seed=seed, ignore_eos=not stop_at_eos)

    params = sampling(max_tokens)

    def run(spec: str, batch: list[list[int]], n: int = max_tokens):
        p = sampling(n)
        if spec == "plain":
            out, decode_s = plain_decode(model, batch, p, tokenizer)
            return out.tokens, decode_s, None
        timed = TimedSpeculator(speculators[spec])
        out = speculative_generate(model, batch, p, timed, tokenizer=tokenizer)
        return out.tokens, out.timing.decode_s, (out.stats, timed.draft_s, timed.fed, timed.sources())

    for spec in active:  # untimed warm-up (first-call allocations, kernel choice, compiled steps)
        for _ in range(warmup):
            run(spec, [prompts[0][1]], 8)
    cells: dict[tuple[int, str, str], Cell] = {}
    flagged = []
    order_cats = list(dict.fromkeys(c for c, _ in prompts))

    for B in batch_sizes:
        for cat in dict.fromkeys(c for c, _ in prompts):
            cat_prompts = [p for c, p in prompts if c == cat]
            for i in range(0, len(cat_prompts), B):
                batch = cat_prompts[i : i + B]
                r = i // B
                order = active[r % len(active) :] + active[: r % len(active)]
                outputs = {}
                for spec in order:
                    t0 = time.perf_counter()
                    toks, decode_s, extra = run(spec, batch)
                    dt = time.perf_counter() - t0
                    cell = cells.setdefault((B, cat, spec), Cell())
                    cell.seconds += dt
                    cell.decode_s += decode_s
                    cell.tokens += sum(len(t) for t in toks)
                    cell.rows += len(batch)
                    outputs[spec] = toks
                    if extra is not None:
                        cell.add_stats(*extra)
                for spec in active:
                    same = sum(a == b for a, b in zip(outputs[spec], outputs["plain"]))
                    cells[(B, cat, spec)].exact_rows += same
                    if same < len(batch) and params.greedy and (spec == "plain" or speculators[spec].lossless):
                        flagged.append({"batch": B, "category": cat, "method": spec, "prompts": f"{i}..{i + B - 1}"})
                log(f"[specbench] batch {B} {cat} prompts {i + 1}-{i + len(batch)}/{len(cat_prompts)} done")
                if on_progress is not None:  # partial tables: a long run killed midway keeps what it measured
                    on_progress(tabulate(cells, active, speculators, skipped, flagged, batch_sizes, order_cats))
    return tabulate(cells, active, speculators, skipped, flagged, batch_sizes, [c for c, _ in prompts])


def tabulate(cells, active, speculators, skipped, flagged, batch_sizes, categories) -> dict:
    """Rows per (batch, category, method) and per batch overall, from the (batch, category) pairs done so far."""
    rows = []
    for B in batch_sizes:
        cats = [c for c in dict.fromkeys(categories) if all((B, c, m) in cells for m in active)]
        for cat in [*cats, "overall"] if cats else []:
            for spec in active:
                pick = cats if cat == "overall" else [cat]
                cell = merge([cells[(B, c, spec)] for c in pick])
                base = merge([cells[(B, c, "plain")] for c in pick])
                lossless = spec == "plain" or speculators[spec].lossless
                rows.append({"batch": B, "category": cat, "method": spec, **summarize(cell, base, lossless)})
    return {
        "rows": rows,
        "skipped": skipped,
        "not_identical": flagged,
        "speculators": {s: sp.describe() for s, sp in speculators.items()},
    }


def print_tables(result: dict, out=sys.stderr) -> None:
    head = (
        f"{'batch':>5s} {'category':14s} {'method':34s} {'tok/s':>8s} {'vs plain':>8s} {'decode':>7s} {'tok/step':>8s} "
        f"{'draft%':>6s} {'same':>6s} per-position acceptance"
    )
    print(head, file=out)
    for r in result["rows"]:
        print(
            f"{r['batch']:5d} {r['category']:14s} {r['method']:34s} {r['tok_per_s']:8.2f} "
            f"{r.get('speedup_vs_plain', float('nan')):7.2f}x {r.get('decode_speedup_vs_plain', float('nan')):6.2f}x "
            f"{r.get('tokens_per_step', 1.0):8.2f} "
            f"{100 * r.get('draft_fraction', 0.0):5.1f}% {r['exact_rows']:>6s} {r.get('per_position_acceptance', '')}",
            file=out,
        )
    if result["not_identical"]:
        print(f"FLAGGED: greedy output differs from plain decoding: {result['not_identical']}", file=out)
