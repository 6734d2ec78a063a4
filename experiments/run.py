"""Run an experiment config: ``python -m experiments.run configs/lossless.yaml``.

A ``table`` config runs its rows (experiments/rows.py) against the plain fp32 reference: teacher-forced
fidelity on wiki eval windows (max/mean |Δ log-prob|, KL, top-1 agreement, perplexity on those windows),
greedy match of free-running generation, lm-eval offline tasks (accuracy ± stderr), and a speed ratio
against the row's own baseline timed in the same run, interleaved. Sweep configs (``prompt_length``,
``concurrency``, ``spec_k``) measure curves. Every row appends one JSONL record (config, row, results,
seed, git sha, versions, device, command) to ``results/<name>/records.jsonl``; the run then renders
``table.md``, ``table.csv`` and PNG plots next to it (a config with a ``grid:`` also ``grid.md`` and Pareto
plots). Timed sections hold /tmp/qspec-bench.lock and use torch's default thread count; evaluations run
single-threaded so the shared machine stays usable. Rows run one after another in this process, or with
``--ray [ADDRESS]`` as tasks on a Ray cluster (experiments/cluster.py); artifacts they need (quantized
checkpoints, trained heads) are built once into ``--store`` (experiments/artifacts.py).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from evals.quality.humaneval_problems import SUBSETS, data_file
from experiments import report, sweeps
from experiments.bench import DEFAULT_THREADS, EVAL_THREADS, LOCKING, log
from experiments.config import ConfigError, ExperimentConfig, Row, load_config
from experiments.records import append_jsonl
from experiments.rows import ROWS, RowUnavailable, plan_row
from experiments.table import Context, check_claim, load_context, run_row
from runtime.cliutil import ArgumentParser, interrupted, run
from runtime.data import TEXTS
from runtime.loader import ModelSpecError, check_model_spec
from runtime.paths import qspec_home
from runtime.provenance import git_sha, module_command, provenance

__all__ = ["check_claim", "main", "run_table"]


def run_table(cfg: ExperimentConfig, ctx: Context, rows: list[Row], records_path: Path, base: dict) -> list[dict]:
    from experiments.report import render_table

    out = []
    for row in rows:
        rec = {**base, **run_row(ctx, row), **provenance(cfg.seed, base["command"], base.get("git_sha"))}
        append_jsonl(records_path, rec)
        out.append(rec)
        render_table(cfg, out, records_path.parent)  # a long run shows its table as it goes
    return out


def check_humaneval(cfg: ExperimentConfig) -> None:
    """evals.humaneval set: a known subset, a model with a tokenizer, the problems' package installed."""
    section = cfg.evals.humaneval
    if section is None:
        return
    if section.subset is not None and section.subset not in SUBSETS:
        raise ConfigError(f"evals.humaneval.subset: {section.subset!r} not in {sorted(SUBSETS)} (or null: all)")
    if cfg.model.spec == "tiny-random":
        raise ConfigError("evals.humaneval: completing code needs a model with a tokenizer, not tiny-random")
    data_file()  # a ModelSpecError naming the package to install


def plan(cfg: ExperimentConfig) -> None:
    """Every row checked before the model loads (experiments.rows.plan_row): a bad method or recipe is a ConfigError
    now, not a failure after minutes of loading; a row that cannot run here is recorded when it runs."""
    for r in cfg.rows:
        try:
            plan_row(cfg.model.spec, r)
        except RowUnavailable:
            pass
        except ValueError as err:
            raise ConfigError(str(err)) from None


def parse_args(argv: list[str] | None):
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
    ap.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run the rows as Ray tasks (table configs; needs pip install ray): without ADDRESS on a local cluster "
        "started on this machine; 'auto' joins the cluster `ray start` runs here; HOST:6379 or ray://HOST:10001 "
        "joins that one. Timed rows hold a whole node, evaluation rows pack (config section ray:)",
    )
    ap.add_argument(
        "--store",
        default=None,
        help="where artifacts (quantized checkpoints, trained heads) are built once and reused: on a cluster a path "
        "every worker reads (default $QSPEC_HOME)",
    )
    return ap.parse_args(argv)


def fail(err: Exception):
    """A config or model error: one line and exit status 2, before anything slow starts."""
    print(f"error: {err}", file=sys.stderr)
    raise SystemExit(2) from None


def checked_config(args) -> tuple[ExperimentConfig, object | None]:
    """The config with --set applied, checked as far as it can be before the model loads (ConfigError), and the
    Ray cluster module when --ray asks for one."""
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
    check_humaneval(cfg)
    unknown_texts = sorted(set(cfg.evals.texts) - set(TEXTS))
    if unknown_texts:
        raise ConfigError(f"evals.texts: {unknown_texts} not in {list(TEXTS)}")
    if cfg.evals.texts and cfg.model.spec == "tiny-random":
        raise ConfigError("evals.texts: scoring texts needs a model with a tokenizer, not tiny-random")
    if cfg.model.spec != "tiny-random":
        check_model_spec(cfg.model.spec)  # before anything loads
    plan(cfg)
    if args.ray is None:
        return cfg, None
    if cfg.kind != "table":
        raise ConfigError(f"--ray runs table configs (rows, grids); a {cfg.kind} sweep runs without it")
    try:
        from experiments import cluster  # optional dependency: Ray
    except ImportError as err:
        raise ConfigError(f"--ray needs Ray ({err}): pip install 'ray>=2.60' (or pip install -e '.[ray]')") from None
    return cfg, cluster


def run_config(args, cfg: ExperimentConfig, cluster, ctx, store: Path, out_dir: Path, base: dict) -> tuple:
    """The table's rows (here, or as Ray tasks) or the sweep's series -> (records, rendered paths)."""
    records_path = out_dir / "records.jsonl"
    try:
        if cfg.kind != "table":
            series = [s for s in cfg.sweep.series if not args.rows or s.get("name") in args.rows.split(",")]
            records = sweeps.run_sweep(cfg, ctx, series, records_path, base)
            return records, report.render_sweep(cfg, records, out_dir)
        rows = [r for r in cfg.rows if not args.rows or r.name in args.rows.split(",")]
        for r in rows:
            r.run_bench &= not args.no_bench
            r.run_evals &= not args.no_evals
        if cluster:
            try:
                records = cluster.run_table_ray(cfg, rows, records_path, base, store, args.ray)
            except ConfigError as err:  # the cluster cannot hold what the config asks for
                fail(err)
        else:
            ctx.store = store
            records = run_table(cfg, ctx, rows, records_path, base)
        return records, report.render_table(cfg, records, out_dir) + report.render_grid(cfg, records, out_dir)
    except KeyboardInterrupt:
        interrupted(
            f"the finished rows' records are in {records_path} (appended as each row ends); "
            f"render them with python -m experiments.report {records_path}"
        )


def report_time(cfg: ExperimentConfig, records: list, out_dir: Path, minutes: float) -> None:
    budget = cfg.time_budget_minutes
    log(
        f"{cfg.name}: {len(records)} records in {minutes:.1f} min"
        + ("" if budget is None else f" (budget {budget:g} min: {'met' if minutes <= budget else 'EXCEEDED'})")
    )
    if budget is not None and not math.isnan(minutes):
        (out_dir / "wall_time.txt").write_text(f"{minutes:.2f} minutes (budget {budget:g})\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        cfg, cluster = checked_config(args)
    except (ConfigError, ModelSpecError) as err:
        fail(err)
    store = Path(args.store).expanduser().resolve() if args.store else qspec_home()
    EVAL_THREADS["n"] = cfg.evals.threads or DEFAULT_THREADS
    torch.set_num_threads(EVAL_THREADS["n"])
    LOCKING["enabled"] = cfg.bench.lock
    out_dir = Path(args.results_dir or cfg.results_dir) / cfg.name
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    base = {
        "config": dataclasses.asdict(cfg),
        "run_id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
        "command": module_command("experiments.run", argv),
        # the tree the run starts from, taken once: the run's own records and tables, when they are tracked files,
        # would otherwise mark every later row "-dirty"
        "git_sha": git_sha(),
    }
    try:
        ctx = None if cluster else load_context(cfg)  # on a cluster each worker loads it
    except ConfigError as err:
        fail(err)
    records, paths = run_config(args, cfg, cluster, ctx, store, out_dir, base)
    minutes = (time.time() - started) / 60
    report_time(cfg, records, out_dir, minutes)
    for p in paths:
        print(p)


if __name__ == "__main__":
    run(main)
