"""Speedup of speculative decoding per hardware, from the command line: this machine's cost curve (``measure``),
predictions of a specbench record against its measurements (``predict``), the best draft (``choose-draft``) and the
best k per chain speculator (``choose-k``). The model itself: evals.speculation.cost_model.

    python -m evals.speculation.spec_cost measure --out results/cpu_profile.json        # this machine's curve (quiet!)
    python -m evals.speculation.spec_cost predict --suite results/specbench.json --profile results/cpu_profile.json
    python -m evals.speculation.spec_cost predict --suite results/specbench.json --profile h200
    python -m evals.speculation.spec_cost choose-k --suite results/specbench.json --profile results/cpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from evals.speculation.cost_model import (
    GPUS,
    OVERHEAD_STEPS,
    CostError,
    Profile,
    choose_draft,
    choose_k,
    load_profile,
    measure,
    parse_Ts,
    predict_suite,
    print_predictions,
    print_profile,
    profile_record,
    speculators,
)
from evals.speculation.specbench_suite import DEFAULT_METHODS, SMOKE_CONFIG, SMOKE_METHODS
from quantize.fast_copy import NAMED_COPIES, load_named_copy
from runtime.loader import DEFAULT_MODEL, load_model
from runtime.model import random_model
from runtime.provenance import module_command, provenance
from speculate.base import SpeculatorError
from speculate.draft import default_draft_file
from speculate.registry import BuildContext, check_method


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m evals.speculation.spec_cost", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="this machine's cost curve (run on a quiet machine)")
    m.add_argument("--model", default=None)
    m.add_argument("--context", type=int, default=256)
    m.add_argument("--max-T", type=int, default=32)
    m.add_argument("--Ts", default=None, help="comma list of T to time (default 1..--max-T)")
    m.add_argument(
        "--tree-Ts",
        default="",
        help="comma list of candidate-tree sizes T (nodes incl. the root) to time as tree steps (Medusa / EAGLE)",
    )
    m.add_argument(
        "--timing",
        choices=("loop", "forward"),
        default="loop",
        help="loop: c(T) timed as steps of the real loops (their host work included); forward: bare forwards "
        "plus separately measured loop overheads",
    )
    m.add_argument("--repeats", type=int, default=7)
    m.add_argument(
        "--steps",
        type=int,
        default=OVERHEAD_STEPS,
        help="tokens each timed run generates (--timing loop): as long as the suite's answers to predict them",
    )
    m.add_argument("--batch", type=int, default=1, help="rows per forward (predicts the suite's rows of this batch)")
    m.add_argument(
        "--methods", nargs="*", default=None, help="draft methods to time (evals.speculation.specbench syntax)"
    )
    m.add_argument("--smoke", action="store_true", help="tiny random model")
    m.add_argument("--threads", type=int, default=None)
    m.add_argument(
        "--dtype",
        choices=NAMED_COPIES,
        default="fp32",
        help="target weights: fp32 / bf16 dense, or a quantized copy (evals.speed.bench_decode's qspec rows: RTN "
        "int8 per-channel / int4 g64 codes with bf16 activations, w8a8 / w4a8 with int8 activations, "
        "-int8head / -w8a8head)",
    )
    m.add_argument("--out", required=True)
    c = sub.add_parser("choose-draft", help="the default draft for this model, by measured acceptance per cost")
    c.add_argument("--suite", required=True)
    c.add_argument("--profile", required=True)
    c.add_argument("--model", default=None)
    c.add_argument("--context", type=int, default=512)
    c.add_argument("--write", action="store_true", help="save it as the model's default draft ($QSPEC_HOME)")
    ck = sub.add_parser("choose-k", help="each chain speculator of a suite cut to k = 1.. its k: predicted speedups")
    ck.add_argument("--suite", required=True, help="an evals.speculation.specbench JSON record")
    ck.add_argument("--profile", required=True, help=f"a profile JSON (measured / gpu_check) or one of {list(GPUS)}")
    ck.add_argument("--model", default=None, help="model whose shapes a roofline profile uses")
    ck.add_argument("--context", type=int, default=512)
    ck.add_argument("--category", default="overall")
    ck.add_argument("--out", default=None)
    p = sub.add_parser("predict", help="predicted vs measured speedup per (batch, category, method)")
    p.add_argument("--suite", required=True, help="an evals.speculation.specbench JSON record")
    p.add_argument("--profile", required=True, help=f"a profile JSON (measured / gpu_check) or one of {list(GPUS)}")
    p.add_argument("--model", default=None, help="model whose shapes a roofline profile uses (default: the suite's)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--draft-from-suite", action="store_true", help="draft cost = the suite's measured seconds")
    p.add_argument("--out", default=None)
    return ap, ap.parse_args(argv)


def step_sizes(ap: argparse.ArgumentParser, args) -> tuple[list[int], list[int]]:
    """(chain T, tree T) to time, from --Ts / --max-T and --tree-Ts."""
    try:
        Ts = parse_Ts(args.Ts) if args.Ts else list(range(1, args.max_T + 1))
    except CostError as err:
        ap.error(f"--Ts {err}")
    try:
        tree_Ts = sorted({int(t) for t in args.tree_Ts.split(",") if t.strip()})
    except ValueError:
        ap.error(f"--tree-Ts {args.tree_Ts!r}: a comma list of tree sizes, e.g. 9,16,32")
    if tree_Ts and (tree_Ts[0] < 2 or args.timing != "loop"):
        ap.error("--tree-Ts: tree sizes >= 2, timed in the real loop (--timing loop)")
    return Ts, tree_Ts


def measured_target(args) -> tuple[object, BuildContext]:
    """The model --dtype asks for, and where its speculators' heads come from."""
    if args.smoke:
        return random_model(SMOKE_CONFIG), BuildContext(smoke=True)
    model, _, path = load_named_copy(args.model or DEFAULT_MODEL, args.dtype)
    return model, BuildContext(target_path=path)  # heads from $QSPEC_HOME/<kind>/MODEL


def measure_command(ap: argparse.ArgumentParser, args, argv: list[str] | None) -> None:
    """``measure``: this machine's cost curve, written to --out."""
    methods = args.methods if args.methods is not None else (SMOKE_METHODS if args.smoke else DEFAULT_METHODS)
    try:  # before the model loads: a bad method, T list or run length is one line
        [check_method(spec) for spec in methods if spec != "plain"]
    except SpeculatorError as err:
        ap.error(str(err))
    Ts, tree_Ts = step_sizes(ap, args)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, context = measured_target(args)
    sps = speculators(methods, model, context)
    in_loop = args.timing == "loop"
    prof = measure(
        model, sps, args.context, Ts, args.repeats, args.batch, in_loop=in_loop, tree_Ts=tree_Ts, steps=args.steps
    )
    record = {
        **provenance(command=module_command("evals.speculation.spec_cost", argv)),
        **profile_record(prof),
        "dtype": args.dtype,
        "timing": args.timing,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print_profile(prof)


def choose_draft_command(ap: argparse.ArgumentParser, args) -> None:
    """``choose-draft``: the method with the best predicted speedup; --write keeps it as the model's default."""
    suite = json.loads(Path(args.suite).read_text())
    model, cfg, _ = load_model(args.model or DEFAULT_MODEL, dtype=torch.float32)
    try:
        choice, rows = choose_draft(suite, load_profile(args.profile, cfg, args.context), cfg, args.context)
    except CostError as err:
        ap.error(str(err))
    for r in rows:
        print(
            f"{r['method']:40s} {r['tokens_per_step']:6.2f} tok/step  predicted {r['predicted_speedup']:.3f}x",
            file=sys.stderr,
        )
    print(json.dumps(choice))
    if args.write:
        path = default_draft_file(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**choice, "evidence": rows, "suite": args.suite}, indent=2))
        print(f"[spec_cost] default draft for this model -> {path}", file=sys.stderr)


def suite_rows(ap: argparse.ArgumentParser, args, rows_of) -> tuple[Profile, list[dict]]:
    """The profile of a ``predict`` / ``choose-k`` call and rows_of(suite, profile, cfg) on its suite record (a
    CostError is the command's one-line error)."""
    suite = json.loads(Path(args.suite).read_text())
    cfg = load_model(args.model or DEFAULT_MODEL, dtype=torch.float32)[1] if args.profile in GPUS else None
    try:
        profile = load_profile(args.profile, cfg, args.context)
        return profile, rows_of(suite, profile, cfg)
    except CostError as err:
        ap.error(str(err))


def save_rows(args, profile: Profile, rows: list[dict], **extra) -> None:
    if args.out:
        record = {**provenance(), "suite": args.suite, "profile": profile.name, "kind": profile.kind, **extra}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**record, "rows": rows}, indent=2))


def choose_k_command(ap: argparse.ArgumentParser, args) -> None:
    """``choose-k``: per chain speculator of the suite, the predicted speedup at each k and the best one."""
    profile, rows = suite_rows(ap, args, lambda s, p, cfg: choose_k(s, p, cfg, args.context, args.category))
    for r in rows:
        curve = " ".join(f"k={c['k']}:{c['predicted_speedup']:.2f}x" for c in r["curve"])
        measured = "" if r["measured_speedup"] is None else f", measured {r['measured_speedup']:.2f}x at k={r['k_run']}"
        print(f"{r['method']}: best k = {r['best_k']} ({r['best_predicted_speedup']:.2f}x{measured}); {curve}")
    save_rows(args, profile, rows, category=args.category)


def predict_command(ap: argparse.ArgumentParser, args) -> None:
    """``predict``: predicted against measured speedup per (batch, category, method) of a suite record."""
    profile, rows = suite_rows(
        ap, args, lambda s, p, cfg: predict_suite(s, p, cfg, args.context, args.draft_from_suite)
    )
    print_predictions(rows)
    save_rows(args, profile, rows)


def main(argv: list[str] | None = None) -> None:
    ap, args = parse_args(argv)
    if args.cmd == "measure":
        measure_command(ap, args, argv)
    elif args.cmd == "choose-draft":
        choose_draft_command(ap, args)
    elif args.cmd == "choose-k":
        choose_k_command(ap, args)
    else:
        predict_command(ap, args)


if __name__ == "__main__":
    main()
