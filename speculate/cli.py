"""Speculator construction by name, the --speculator options, and ``python -m runtime.generate --speculator ...``
(the runtime CLI dispatches here; ``python -m runtime.server --speculator ...`` builds through here too).

    python -m runtime.generate --speculator ngram -k 4 --prompt "..."
    python -m runtime.generate --speculator draft --draft-model layers:8 -k 3 --prompt "..."
    python -m runtime.generate --speculator medusa --medusa-heads DIR --tree-size 8 --prompt "..."
    python -m runtime.generate --speculator quant-draft --quant-bits 8 -k 3 --prompt "..."
    python -m runtime.generate --speculator eagle --tree-size 8 --prompt "..."  # after python -m speculate.eagle.train
    python -m runtime.server --speculator draft --draft-model layers:8 -k 3
    python -m runtime.generate --speculator my_pkg.lookahead:LookaheadSpeculator -k 4 --prompt "..."  # a plug-in

The names and their builders live in speculate.registry; the flags here translate to its options.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.grammar import report_incomplete
from runtime.timing import timing_line
from speculate.base import Speculator, SpeculatorError
from speculate.generate import speculative_generate
from speculate.registry import SPECULATORS, TREE_SIZE, BuildContext, Method, build, check_method, options_of


def cli_method(
    name: str,
    k: int = 4,
    draft_model: str | None = None,
    tree_size: int | None = None,
    acceptance: str = "rejection",
    quant_bits: int = 8,
    quant_group_size: int | None = None,
    ngram_fixed: bool = False,
    lookup: int | None = None,
) -> Method:
    """The registry method the CLI's flags describe: each flag is the option of that name for the speculators
    that take it, ignored by the others (a plug-in that takes any option gets -k)."""
    takes = options_of(name)
    if acceptance != "rejection" and "acceptance" not in (takes or {}):
        raise SpeculatorError(f"typical acceptance is a Medusa mode; {name} verifies losslessly only")
    flags = {
        "k": k,
        "model": draft_model,
        "tree": tree_size,
        "acceptance": acceptance,
        "bits": quant_bits,
        "group": quant_group_size,
        "fixed": ngram_fixed,
        "lookup": lookup,
    }
    wanted = {"k"} if takes is None else takes
    return check_method(Method(name, {key: v for key, v in flags.items() if key in wanted and v is not None}))


def build_speculator(
    name: str,
    model,
    model_path: Path | str = "",
    k: int = 4,
    draft_model: str | None = None,
    medusa_heads: str | None = None,
    tree_size: int | None = None,
    eagle_heads: str | None = None,
    acceptance: str = "rejection",
    quant_bits: int = 8,
    quant_group_size: int | None = None,
    ngram_fixed: bool = False,
    lookup: int | None = None,
) -> Speculator:
    """A speculator by name (speculate.registry) from the CLI's settings; every argument error is a
    SpeculatorError naming the problem."""
    method = cli_method(name, k, draft_model, tree_size, acceptance, quant_bits, quant_group_size, ngram_fixed, lookup)
    context = BuildContext(target_path=model_path, heads={"medusa": medusa_heads, "eagle": eagle_heads})
    return build(method, model, context)


def add_speculator_args(ap: argparse.ArgumentParser) -> None:
    """The --speculator options, shared by ``python -m runtime.generate`` and ``python -m runtime.server``."""
    ap.add_argument(
        "--speculator",
        default=None,
        help=f"speculative decoding: {', '.join(SPECULATORS)}, an installed plug-in's name (entry points "
        "qspec.speculators) or a plug-in module:attr (see docs/extending.md)",
    )
    ap.add_argument("--num-speculative-tokens", "-k", type=int, default=4, help="k: drafts per sequence and step")
    ap.add_argument(
        "--draft-model",
        default=None,
        help="draft for --speculator draft: a model spec, layers:N, int4, int8, w4a8, w8a8 (int8 activations) or "
        "int4+layers:N / int4+SPEC (default: the draft measured best for this model by evals.speculation.spec_cost "
        "choose-draft, else int4)",
    )
    ap.add_argument("--medusa-heads", default=None, help="trained Medusa heads for --speculator medusa")
    ap.add_argument("--eagle-heads", default=None, help="a trained EAGLE head for --speculator eagle")
    ap.add_argument(
        "--tree-size",
        type=int,
        default=None,
        help=f"candidate-tree nodes: Medusa (default: a top-1 chain of -k) and EAGLE (default {TREE_SIZE})",
    )
    ap.add_argument("--typical-acceptance", action="store_true", help="Medusa typical acceptance (APPROXIMATE)")
    ap.add_argument("--quant-bits", type=int, default=8, help="weight bits of the --speculator quant-draft copy")
    ap.add_argument(
        "--ngram-fixed", action="store_true", help="n-gram: always draft k tokens (default: up to 2**match length)"
    )
    ap.add_argument(
        "--lookup-first",
        type=int,
        default=None,
        metavar="N",
        help="draft / quant-draft: prompt lookup first; a sequence whose last N tokens occurred before drafts what "
        "followed them, the draft model drafts the others (lossless either way)",
    )


def args_method(args) -> Method:
    """The method that add_speculator_args' options describe."""
    return cli_method(
        args.speculator,
        k=args.num_speculative_tokens,
        draft_model=getattr(args, "draft_model", None),
        tree_size=getattr(args, "tree_size", None),
        acceptance="typical" if getattr(args, "typical_acceptance", False) else "rejection",
        quant_bits=getattr(args, "quant_bits", 8),
        ngram_fixed=getattr(args, "ngram_fixed", False),
        lookup=getattr(args, "lookup_first", None),
    )


def check_speculator_args(ap: argparse.ArgumentParser, args) -> None:
    """Before any model loads: an unknown speculator, a plug-in that breaks the contract or a bad option is one
    error line (exit 2)."""
    if args.speculator:
        try:
            args_method(args)
        except SpeculatorError as err:
            ap.error(str(err))


def speculator_from_args(model, path, args) -> Speculator:
    """The speculator that add_speculator_args' options describe; a bad option exits with one clear line."""
    heads = {"medusa": getattr(args, "medusa_heads", None), "eagle": getattr(args, "eagle_heads", None)}
    try:
        return build(args_method(args), model, BuildContext(target_path=path, heads=heads))
    except (SpeculatorError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def generate_speculative(model, path, tokenizer, prompts: list[list[int]], params, args, on_token=None, grammar=None):
    """Entry point of ``python -m runtime.generate --speculator NAME``: build, generate (streaming through
    on_token(row, token) like plain generation), print, return."""
    spec = speculator_from_args(model, path, args)
    out = speculative_generate(
        model,
        prompts,
        params,
        spec,
        tokenizer=tokenizer,
        compile=getattr(args, "compile", "auto"),
        on_token=on_token,
        grammar=grammar,
        kv_cache=getattr(args, "kv_cache", None),  # --kv-cache-dtype / --kv-policy (runtime.kv_policy)
    )
    for i, toks in enumerate(out.tokens):
        text = tokenizer.decode(toks, skip_special_tokens=True)
        if on_token is None or len(prompts) > 1:  # a single prompt was streamed already
            print(text if len(prompts) == 1 else f"--- [{i}] {text}")
    mode = "lossless" if spec.lossless else "APPROXIMATE (typical acceptance)"
    print(
        f"\n[qspec] {spec.name}, {mode}: {timing_line(out.timing)} (batch {len(prompts)}, compile {out.compile}, "
        f"finish: {','.join(out.finish_reasons)})\n[qspec] {out.stats.summary()}",
        file=sys.stderr,
    )
    report_incomplete(out.grammar_incomplete, out.finish_reasons)
    return out
