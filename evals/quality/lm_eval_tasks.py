"""lm-eval tasks on an in-memory model (evals.quality.lm_eval_adapter.QspecLM): the offline wiki tasks built once, the
run, and its summary as {task: {metric: value, stderr}}. evals.quality.tasks is the command.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from evals.quality.wiki_tasks import GROUP, TASKS, build_tasks
from runtime.paths import qspec_home


def tasks_dir_default() -> Path:

    return qspec_home() / "tasks"


def expand(tasks: list[str]) -> list[str]:
    out = []
    for t in tasks:
        out += list(TASKS) if t == GROUP else [t]
    return out


def run_tasks(
    lm,
    tasks: list[str],
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    tasks_dir: str | Path | None = None,
    n_docs: int = 500,
    data_seed: int = 0,
    bootstrap_iters: int = 1000,
    seed: int = 0,
) -> dict:
    """Evaluate an lm-eval LM (e.g. evals.quality.lm_eval_adapter.QspecLM) and return
    {task: {metric: {"value": v, "stderr": s}}} plus lm-eval's own "n-samples" and "configs"."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    include = build_tasks(tasks_dir or tasks_dir_default(), seed=data_seed, n=n_docs)
    names = expand(tasks)
    # indexing lm-eval's thousands of bundled YAMLs takes minutes on this CPU: skip it for offline-only runs
    manager = TaskManager(include_path=str(include), include_defaults=not set(names) <= set(TASKS))
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; offline tasks here: {GROUP}, {', '.join(TASKS)}")
    raw = simple_evaluate(
        model=lm,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        bootstrap_iters=bootstrap_iters,
        log_samples=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    return summarize(raw)


def summarize(raw: dict) -> dict:
    out: dict = {"results": {}, "n_samples": raw.get("n-samples", {})}
    for task, metrics in raw["results"].items():
        row = {}
        for key, value in metrics.items():
            if "," not in key or key.startswith("alias") or "_stderr" in key:
                continue
            name, filt = key.split(",", 1)
            stderr = metrics.get(f"{name}_stderr,{filt}")
            row[name] = {
                "value": float(value),
                "stderr": None if stderr in (None, "N/A") or not isinstance(stderr, int | float) else float(stderr),
            }
        out["results"][task] = row
    return out


def render(summary: dict) -> str:
    lines = ["| task | metric | value | ± stderr | n |", "|---|---|---:|---:|---:|"]
    for task, metrics in summary["results"].items():
        n = summary["n_samples"].get(task, {}).get("effective", "")
        for name, v in metrics.items():
            err = "" if v["stderr"] is None or math.isnan(v["stderr"]) else f"{v['stderr']:.4f}"
            lines.append(f"| {task} | {name} | {v['value']:.4f} | {err} | {n} |")
    return "\n".join(lines)
