"""Run lm-eval tasks on our runtime: ``python -m evals.quality.tasks --model SPEC --tasks qspec_wiki,arc_easy``.

Any lm-eval task runs by name where its data is reachable (the hub is not, on offline machines: such tasks
fail with lm-eval's own error). The offline wiki tasks (``qspec_wiki`` = topic, title, lastword, ppl; see
evals/quality/wiki_tasks.py) are generated once under ``$QSPEC_HOME/tasks`` (or ``--tasks-dir``).
``evals.quality.lm_eval_tasks.run_tasks`` is the same run for an in-memory model (a quantized copy, a bf16 cast).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from evals.quality.lm_eval_tasks import render, run_tasks
from evals.quality.wiki_tasks import GROUP
from runtime.cliutil import ArgumentParser, run
from runtime.config import DTYPES
from runtime.loader import DEFAULT_MODEL, ModelSpecError, check_model_arg
from runtime.provenance import module_command, provenance


def main(argv: list[str] | None = None) -> None:

    ap = ArgumentParser(prog="python -m evals.quality.tasks", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model spec: registry name, checkpoint dir, .gguf")
    ap.add_argument("--tasks", required=True, help=f"comma-separated lm-eval task names; {GROUP} = all offline")
    ap.add_argument("--limit", type=float, default=None, help="documents per task (for quick runs)")
    ap.add_argument("--num-fewshot", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--score-mode", default="forward", choices=["forward", "cache"])
    ap.add_argument("--tasks-dir", default=None, help="where offline task data goes (default $QSPEC_HOME/tasks)")
    ap.add_argument("--n-docs", type=int, default=500, help="documents generated per offline task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    if args.limit is not None and args.limit <= 0:
        ap.error(f"--limit must be > 0 (a count, or a fraction below 1), got {args.limit:g}")
    if args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if not [t for t in args.tasks.split(",") if t.strip()]:
        ap.error("--tasks is empty")
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)

    from evals.quality.lm_eval_adapter import QspecLM

    start = time.time()
    try:
        lm = QspecLM(model=args.model, dtype=args.dtype, batch_size=args.batch_size, score_mode=args.score_mode)
        summary = run_tasks(
            lm,
            [t.strip() for t in args.tasks.split(",") if t.strip()],
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            tasks_dir=args.tasks_dir,
            n_docs=args.n_docs,
            seed=args.seed,
        )
    except (ValueError, ModelSpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(render(summary))
    record = {
        "config": vars(args),
        **summary,
        "seconds": time.time() - start,
        **provenance(args.seed, module_command("evals.quality.tasks", argv)),
    }
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=2, default=str))
        print(f"[qspec] record written to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    run(main)
