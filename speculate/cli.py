"""Speculator construction by name, the --speculator options, and ``python -m runtime.generate --speculator ...``
(the runtime CLI dispatches here; ``python -m runtime.server --speculator ...`` builds through here too).

    python -m runtime.generate --speculator ngram -k 4 --prompt "..."
    python -m runtime.generate --speculator draft --draft-model layers:8 -k 3 --prompt "..."
    python -m runtime.generate --speculator medusa --medusa-heads DIR --tree-size 8 --prompt "..."
    python -m runtime.generate --speculator quant-draft --quant-bits 8 -k 3 --prompt "..."
    python -m runtime.generate --speculator eagle --tree-size 8 --prompt "..."  # after python -m speculate.eagle.train
    python -m runtime.server --speculator draft --draft-model layers:8 -k 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from quantize.qlinear import FAST_CPU_BITS
from runtime.grammar import report_incomplete
from runtime.speculation import CandidateTree
from runtime.timing import timing_line
from speculate.base import Speculator, SpeculatorError, check_k
from speculate.draft import DraftModelSpeculator, parse_draft_spec, quantized_draft
from speculate.eagle.head import load_eagle
from speculate.eagle.speculator import EagleSpeculator
from speculate.generate import speculative_generate
from speculate.medusa.heads import load_medusa
from speculate.medusa.speculator import MedusaSpeculator, build_tree
from speculate.ngram import NgramSpeculator
from speculate.training import head_dir

SPECULATORS = ("ngram", "draft", "medusa", "quant-draft", "eagle")
EAGLE_TREE_SIZE = 8  # nodes of EAGLE's dynamic tree when --tree-size is not given (evals.specbench's default)


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
) -> Speculator:
    """A speculator by name; every argument error is a SpeculatorError naming the problem."""
    if name not in SPECULATORS:
        raise SpeculatorError(f"unknown speculator {name!r}; choose from {', '.join(SPECULATORS)}")
    if name != "medusa" and acceptance != "rejection":
        raise SpeculatorError(f"typical acceptance is a Medusa mode; {name} verifies losslessly only")
    if name == "ngram":
        return NgramSpeculator(k=k, scaled=not ngram_fixed)
    if name == "draft":
        check_k(k)
        draft, label = parse_draft_spec(draft_model, model, model_path)
        return DraftModelSpeculator(model, draft, k=k, name=f"draft({label})")
    if name == "quant-draft":
        check_k(k)
        if quant_bits not in FAST_CPU_BITS:  # a draft must be cheaper than the target: fast kernels only
            raise SpeculatorError(f"quant-draft supports {' or '.join(map(str, FAST_CPU_BITS))} bits, got {quant_bits}")
        return DraftModelSpeculator(
            model, quantized_draft(model, quant_bits, quant_group_size), k=k, name=f"quant-draft(int{quant_bits})"
        )

    if name == "eagle":
        head = load_eagle(eagle_heads or head_dir("eagle", model_path), model)
        return EagleSpeculator(model, head, tree_size=EAGLE_TREE_SIZE if tree_size is None else tree_size)

    heads = load_medusa(medusa_heads or head_dir("medusa", model_path), model)
    if tree_size is None:  # a chain of the heads' top-1 candidates, k long
        tree = CandidateTree.chain(min(check_k(k), heads.config.num_heads))
    elif not heads.config.accuracy:
        raise SpeculatorError("the Medusa checkpoint has no accuracy table to build a tree from; retrain it")
    else:
        tree = build_tree(heads.config.accuracy, tree_size, paths=heads.config.paths)
    return MedusaSpeculator(model, heads, tree, acceptance=acceptance)


def add_speculator_args(ap: argparse.ArgumentParser) -> None:
    """The --speculator options, shared by ``python -m runtime.generate`` and ``python -m runtime.server``."""
    ap.add_argument("--speculator", default=None, choices=SPECULATORS, help="speculative decoding (see speculate/)")
    ap.add_argument("--num-speculative-tokens", "-k", type=int, default=4, help="k: drafts per sequence and step")
    ap.add_argument(
        "--draft-model",
        default=None,
        help="draft for --speculator draft: a model spec, layers:N, int4, int8 or int4+layers:N (default: the draft "
        "measured best for this model by evals.spec_cost choose-draft, else int4)",
    )
    ap.add_argument("--medusa-heads", default=None, help="trained Medusa heads for --speculator medusa")
    ap.add_argument("--eagle-heads", default=None, help="a trained EAGLE head for --speculator eagle")
    ap.add_argument(
        "--tree-size",
        type=int,
        default=None,
        help=f"candidate-tree nodes: Medusa (default: a top-1 chain of -k) and EAGLE (default {EAGLE_TREE_SIZE})",
    )
    ap.add_argument("--typical-acceptance", action="store_true", help="Medusa typical acceptance (APPROXIMATE)")
    ap.add_argument("--quant-bits", type=int, default=8, help="weight bits of the --speculator quant-draft copy")
    ap.add_argument(
        "--ngram-fixed", action="store_true", help="n-gram: always draft k tokens (default: up to 2**match length)"
    )


def speculator_from_args(model, path, args) -> Speculator:
    """The speculator that add_speculator_args' options describe; a bad option exits with one clear line."""
    try:
        return build_speculator(
            args.speculator,
            model,
            path,
            k=args.num_speculative_tokens,
            draft_model=getattr(args, "draft_model", None),
            medusa_heads=getattr(args, "medusa_heads", None),
            tree_size=getattr(args, "tree_size", None),
            eagle_heads=getattr(args, "eagle_heads", None),
            acceptance="typical" if getattr(args, "typical_acceptance", False) else "rejection",
            quant_bits=getattr(args, "quant_bits", 8),
            ngram_fixed=getattr(args, "ngram_fixed", False),
        )
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
