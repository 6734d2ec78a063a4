"""Run an experiment config: ``python -m experiments.run configs/lossless.yaml``.

A ``table`` config runs its rows (experiments/rows.py) against the plain fp32 reference: teacher-forced
fidelity on wiki eval windows (max/mean |Δ log-prob|, KL, top-1 agreement, perplexity on those windows),
greedy match of free-running generation, lm-eval offline tasks (accuracy ± stderr), and a speed ratio
against the row's own baseline timed in the same run, interleaved. Sweep configs (``prompt_length``,
``concurrency``, ``spec_k``) measure curves. Every row appends one JSONL record (config, row, results,
seed, git sha, versions, device, command) to ``results/<name>/records.jsonl``; the run then renders
``table.md``, ``table.csv`` and PNG plots next to it. Timed sections hold /tmp/qspec-bench.lock and use
torch's default thread count; evaluations run single-threaded so the shared machine stays usable.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from evals.fidelity import FidelityAccumulator, compare_teacher_forced, model_scorer, token_match
from evals.tasks import run_tasks
from experiments import report, sweeps
from experiments.bench import DEFAULT_THREADS, EVAL_THREADS, LOCKING, bench_section, log
from experiments.config import ConfigError, ExperimentConfig, Row, load_config
from experiments.records import append_jsonl
from experiments.rows import ROWS, RowUnavailable, Variant, plain_generate, weight_bytes
from runtime.cliutil import ArgumentParser, interrupted, run
from runtime.config import DTYPES, ModelConfig
from runtime.data import token_windows, wiki_split, wiki_text
from runtime.loader import ModelSpecError, check_model_spec, load_model, load_tokenizer
from runtime.model import random_model
from runtime.provenance import module_command, provenance


@dataclass
class Context:
    cfg: ExperimentConfig
    model: object
    tokenizer: object | None
    path: Path | None
    fidelity_seqs: list[list[int]]
    greedy_prompts: list[list[int]]
    bench_prompts: list[list[int]]
    cache: dict = field(default_factory=dict)  # lazily computed reference results
    spec_stats: dict | None = None

    def ref_greedy(self) -> list[list[int]]:
        if "greedy" not in self.cache:
            self.cache["greedy"] = plain_generate(self.model)(self.greedy_prompts, self.cfg.evals.greedy_tokens)
        return self.cache["greedy"]


def load_context(cfg: ExperimentConfig) -> Context:
    torch.manual_seed(cfg.seed)
    if cfg.model.spec == "tiny-random":
        try:
            mcfg = ModelConfig(**cfg.model.tiny)
        except TypeError as err:
            raise ConfigError(f"model.tiny: {err}") from err
        model, tokenizer, path = random_model(mcfg, seed=cfg.seed), None, None
        gen = torch.Generator().manual_seed(cfg.seed)

        def windows(n, length):
            return torch.randint(2, mcfg.vocab_size, (n, length), generator=gen).tolist()

        ev, bench = cfg.evals, cfg.bench
        fidelity = windows(ev.fidelity_sequences, ev.fidelity_seqlen)
        greedy = [
            w[: max(2, ev.greedy_prompt_tokens - 3 * i)]
            for i, w in enumerate(windows(ev.greedy_prompts, ev.greedy_prompt_tokens))
        ]
        prompts = windows(max(bench.prompts, 16), bench.prompt_tokens)
        return Context(cfg, model, tokenizer, path, fidelity, greedy, prompts)

    if cfg.kind == "concurrency" and cfg.sweep.series and all(s.get("url") for s in cfg.sweep.series):
        # every series is an external server: the spec only supplies the tokenizer that builds the prompts
        return Context(cfg, None, load_tokenizer(cfg.model.spec), None, [], [], [])
    if cfg.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype: {cfg.model.dtype!r} not in {sorted(DTYPES)}")
    model, _, path = load_model(cfg.model.spec, DTYPES[cfg.model.dtype])
    tokenizer = load_tokenizer(str(path))
    ev, bench = cfg.evals, cfg.bench
    text = wiki_text("eval")
    fidelity = token_windows(tokenizer, text, ev.fidelity_seqlen, ev.fidelity_sequences)
    # greedy prompts: openings of eval documents (natural, varied lengths); bench prompts: later windows
    docs = wiki_split("eval")[1000 : 1000 + ev.greedy_prompts]
    greedy = [tokenizer(d.extract, add_special_tokens=False).input_ids[: ev.greedy_prompt_tokens] for d in docs]
    n_bench = max(bench.prompts, 16)
    later = token_windows(tokenizer, text, bench.prompt_tokens, n_bench + 200)[-n_bench:]
    return Context(cfg, model, tokenizer, path, fidelity, greedy, later)


def engine_fidelity(ctx: Context, variant: Variant) -> tuple[dict, list[list[int]]]:
    """Teacher-forced stats along the engine's own greedy outputs: its sampled-from logits vs the reference
    forward over prompt + output."""
    outputs, logits = variant.engine_logits(ctx.greedy_prompts, ctx.cfg.evals.greedy_tokens)
    acc = FidelityAccumulator()
    with torch.inference_mode():
        for prompt, out, test in zip(ctx.greedy_prompts, outputs, logits):
            seq = torch.tensor([prompt + out[:-1]])
            ref = ctx.model(seq)[0, len(prompt) - 1 :]
            acc.add(ref, test[: ref.shape[0]], torch.tensor(out[: ref.shape[0]]))
    return acc.result().to_dict(), outputs


def time_pair(ctx: Context, variant: Variant) -> dict:
    """Median wall time of baseline and variant over the bench prompts, alternating order each repeat."""
    b = ctx.cfg.bench
    prompts = ctx.bench_prompts[: max(b.prompts, variant.bench_batch)]
    base = variant.baseline_timed or plain_generate(ctx.model)
    times: dict[str, list[float]] = {"baseline": [], "variant": []}
    with bench_section():
        for _ in range(b.warmup):
            base(prompts[: variant.bench_batch], 2)
            variant.timed(prompts[: variant.bench_batch], 2)
        for r in range(b.repeats):
            order = [("baseline", base), ("variant", variant.timed)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                fn(prompts, b.new_tokens)
                times[name].append(time.perf_counter() - t0)
    tokens = len(prompts) * b.new_tokens
    base_s, var_s = statistics.median(times["baseline"]), statistics.median(times["variant"])
    return {
        "baseline": variant.baseline_name,
        "baseline_s": base_s,
        "variant_s": var_s,
        "speedup": base_s / var_s,
        "baseline_tokens_per_s": tokens / base_s,
        "variant_tokens_per_s": tokens / var_s,
        "prompts": len(prompts),
        "prompt_tokens": b.prompt_tokens,
        "new_tokens": b.new_tokens,
        "repeats": b.repeats,
        "times_s": times,
        "threads": DEFAULT_THREADS,
    }


def check_claim(claim: str, fid: dict | None, greedy: dict | None) -> str:
    """Whether the measurements are consistent with the claimed lossless class (a claim that fails shows)."""
    if fid is None or greedy is None:
        return "not measured"
    ident, match = fid["bit_identical"], greedy["match_rate"]
    if claim == "exact":
        return "verified: bit-identical logits" if ident and match == 1 else "REFUTED: logits differ"
    if claim == "same math":
        if ident:
            return "bit-identical here (exact)"
        ok = fid["max_abs_dlogprob"] < 1e-3 and fid["top1_agreement"] >= 0.999
        return "consistent: float-order noise" if ok else "CHECK: differences exceed float noise"
    if claim == "same distribution":
        return "greedy identical" if match == 1 else "REFUTED: greedy outputs differ"
    return "changes the model"


def run_row(ctx: Context, row: Row) -> dict:
    cfg = ctx.cfg
    started = time.time()
    record = {"row": dataclasses.asdict(row), "status": "ok", "results": {}}
    log(f"row {row.name} ({row.kind})")
    try:
        variant = ROWS[row.kind](ctx, row.params)
    except RowUnavailable as err:
        log(f"row {row.name}: wired, not run: {err}")
        return {**record, "status": "wired, not run", "reason": str(err)}
    res = record["results"]
    res["weight_bytes"] = weight_bytes(variant.model)
    res.update(variant.extra)
    fid = greedy = None
    if row.run_evals:
        if variant.scorer is not None:
            fid = compare_teacher_forced(model_scorer(ctx.model), variant.scorer, ctx.fidelity_seqs).to_dict()
            outputs = variant.greedy(ctx.greedy_prompts, cfg.evals.greedy_tokens)
        else:
            fid, outputs = engine_fidelity(ctx, variant)
        fid["sequences"] = "wiki eval windows" if variant.scorer is not None else "engine greedy outputs"
        greedy = token_match(ctx.ref_greedy(), outputs).to_dict()
        if ctx.spec_stats:
            res["speculation"] = ctx.spec_stats
            ctx.spec_stats = None
        res["fidelity"], res["greedy"] = fid, greedy
        if cfg.evals.tasks and variant.lm_factory is not None and ctx.tokenizer is not None:
            log(f"row {row.name}: tasks {cfg.evals.tasks}")
            res["tasks"] = run_tasks(
                variant.lm_factory(),
                cfg.evals.tasks,
                limit=cfg.evals.task_limit,
                n_docs=cfg.evals.task_docs,
                bootstrap_iters=cfg.evals.bootstrap_iters,
                seed=cfg.seed,
            )["results"]
    if row.run_bench:
        log(f"row {row.name}: timing against {variant.baseline_name}")
        res["speed"] = time_pair(ctx, variant)
        if ctx.spec_stats:  # acceptance at the timed temperature
            res["speculation_timed"] = ctx.spec_stats
            ctx.spec_stats = None
    res["claim_check"] = check_claim(row.lossless_class, fid, greedy)
    res["row_seconds"] = time.time() - started
    return record


def run_table(cfg: ExperimentConfig, ctx: Context, rows: list[Row], records_path: Path, base: dict) -> list[dict]:
    from experiments.report import render_table

    out = []
    for row in rows:
        rec = {**base, **run_row(ctx, row), **provenance(cfg.seed, base["command"])}
        append_jsonl(records_path, rec)
        out.append(rec)
        render_table(cfg, out, records_path.parent)  # a long run shows its table as it goes
    return out


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(
        prog="python -m experiments.run",
        description="Run an experiment config (YAML): rows or sweeps -> JSONL records, Markdown/CSV table, PNG plots.",
    )
    ap.add_argument("config", help="path to a YAML config, e.g. configs/lossless.yaml")
    ap.add_argument("--rows", default=None, help="comma-separated row (or series) names to run (default: all)")
    ap.add_argument("--results-dir", default=None, help="override the config's results_dir")
    ap.add_argument("--no-bench", action="store_true", help="skip the timed sections")
    ap.add_argument("--no-evals", action="store_true", help="skip fidelity and tasks")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set evals.task_limit=20 --set bench.repeats=2 (kept in the records)",
    )
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        if args.rows:
            wanted = [r.strip() for r in args.rows.split(",")]
            known = [r.name for r in cfg.rows] + [s.get("name") for s in cfg.sweep.series]
            missing = [w for w in wanted if w not in known]
            if missing:
                raise ConfigError(f"--rows: {missing} not in the config's rows/series {known}")
        for r in cfg.rows:
            if r.kind not in ROWS:
                raise ConfigError(f"rows[{r.name}].kind: {r.kind!r} not in {sorted(ROWS)}")
        if cfg.model.spec != "tiny-random":
            check_model_spec(cfg.model.spec)  # before anything loads
    except (ConfigError, ModelSpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    EVAL_THREADS["n"] = cfg.evals.threads or DEFAULT_THREADS
    torch.set_num_threads(EVAL_THREADS["n"])
    LOCKING["enabled"] = cfg.bench.lock
    out_dir = Path(args.results_dir or cfg.results_dir) / cfg.name
    out_dir.mkdir(parents=True, exist_ok=True)
    records_path = out_dir / "records.jsonl"
    started = time.time()
    base = {
        "config": dataclasses.asdict(cfg),
        "run_id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
        "command": module_command("experiments.run", argv),
    }
    try:
        ctx = load_context(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None

    try:
        if cfg.kind == "table":
            rows = [r for r in cfg.rows if not args.rows or r.name in args.rows.split(",")]
            for r in rows:
                r.run_bench &= not args.no_bench
                r.run_evals &= not args.no_evals
            records = run_table(cfg, ctx, rows, records_path, base)
            paths = report.render_table(cfg, records, out_dir)
        else:
            series = [s for s in cfg.sweep.series if not args.rows or s.get("name") in args.rows.split(",")]
            records = sweeps.run_sweep(cfg, ctx, series, records_path, base)
            paths = report.render_sweep(cfg, records, out_dir)
    except KeyboardInterrupt:
        interrupted(
            f"the finished rows' records are in {records_path} (appended as each row ends); "
            f"render them with python -m experiments.report {records_path} --config {args.config}"
        )
    minutes = (time.time() - started) / 60
    budget = cfg.time_budget_minutes
    log(
        f"{cfg.name}: {len(records)} records in {minutes:.1f} min"
        + ("" if budget is None else f" (budget {budget:g} min: {'met' if minutes <= budget else 'EXCEEDED'})")
    )
    for p in paths:
        print(p)
    if budget is not None and not math.isnan(minutes):
        (out_dir / "wall_time.txt").write_text(f"{minutes:.2f} minutes (budget {budget:g})\n")


if __name__ == "__main__":
    run(main)
