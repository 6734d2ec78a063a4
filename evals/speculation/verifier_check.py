"""Is rejection-sampling verification lossless on a real target / draft pair? An exact two-token test.

On a fixed context, sampled speculative decoding must emit its first two tokens (t1, t2) with the target's own
joint p(t1) p(t2 | t1) under the request's sampling parameters (temperature, top-p), whatever the draft. This
check computes that joint exactly from the two models' real distributions (one forward per first token in the
support: top-p keeps it finite) and runs the production verifier (``speculate.verify.rejection_sample``) on
drafts sampled from the draft's distributions q, many times with seeded generators:

- step 1: drafts x1 ~ q(. | ctx), x2 ~ q(. | ctx, x1), verified against p(. | ctx), p(. | ctx, x1) (k = 2);
- a step that emitted one token t1 (x1 rejected, its correction drawn from the residual) is followed by a second
  step from (ctx, t1) with one draft x2 ~ q(. | ctx, t1), as the decoding loop does.

The emitted pairs are compared with the exact joint by a chi-square test (cells with expected count < 5
pooled into one). A *broken control* runs the same draws through the verifier with the draft's q reported
sharpened by temperature 0.8 (drafts sampled from q, the verifier told q^(1/0.8) normalized: the commonest bug
of a new draft method); it must be rejected, which shows the test has power on these distributions.

Contexts: the first ``--prompts`` HumanEval prompts, each cut where the target is least certain among its last
64 positions (largest entropy with a top-p support of at most ``MAX_SUPPORT`` tokens): a near-deterministic
context would pass any verifier. A context fails at p < alpha / prompts (Bonferroni): the probability that a
lossless verifier fails the whole check is <= alpha (1e-3 by default; the chi-square p-values are asymptotic,
and the draws are seeded, so a run is reproducible).

    python -m evals.speculation.verifier_check --model qwen2.5-coder-1.5b --draft int4+qwen2.5-coder-0.5b \\
        --dtype bf16 --prompts 8 --samples 20000 --out results/verifier_check.json
    python -m evals.speculation.verifier_check --smoke        # tiny random pair, seconds
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from evals.quality.humaneval_problems import load_problems, prompt_ids, select
from evals.speculation.chain_test import check_contexts, entropy_cut, summarize
from runtime.cliutil import ArgumentParser, run
from runtime.config import DTYPES, ModelConfig
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer
from runtime.model import random_model
from runtime.paths import write_atomic
from runtime.provenance import module_command, provenance
from runtime.sampling import SamplingParams
from speculate.draft import parse_draft_spec


def parse_args(argv):
    ap = ArgumentParser(prog="python -m evals.speculation.verifier_check", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--draft", default="int4", help="the draft: any --draft-model spec (speculate.draft)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--prompts", type=int, default=8, help="contexts: the first N HumanEval prompts")
    ap.add_argument("--samples", type=int, default=20000, help="speculative runs per context and verifier")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--alpha", type=float, default=1e-3, help="false-failure rate of the whole check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="a tiny random pair and random contexts: seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.samples < 100:
        ap.error("--prompts must be >= 1 and --samples >= 100")
    if not args.temperature > 0 or not 0 < args.top_p <= 1:
        ap.error("--temperature must be > 0 and --top-p in (0, 1]: the check is of sampling")
    if not args.smoke:
        check_model_arg(ap, args.model)
    return args


def load_pair(args):
    """(target, draft, contexts)."""
    if args.smoke:
        cfg = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_ids=[0])  # fmt: skip
        target, draft = random_model(cfg, seed=1, std=0.3), random_model(cfg, seed=2, std=0.3)
        gen = torch.Generator().manual_seed(args.seed)
        return target, draft, [torch.randint(1, 48, (12,), generator=gen).tolist() for _ in range(args.prompts)]
    target, _, path = load_model(args.model, dtype=DTYPES[args.dtype])
    draft, _ = parse_draft_spec(args.draft, target, path)
    tokenizer = load_tokenizer(str(path))
    params = sampling(args)
    prompts = [prompt_ids(tokenizer, p) for p in select(load_problems(), limit=args.prompts)]
    return target, draft, [ids[: entropy_cut(target, draft, ids, params)] for ids in prompts]


def sampling(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(f"[verifier_check] {msg}", file=sys.stderr, flush=True)

    target, draft, contexts = load_pair(args)
    rows, threshold = check_contexts(target, draft, contexts, sampling(args), args.samples, args.seed, args.alpha, log)
    verdict = summarize(rows, threshold)
    record = {**provenance(command=module_command("evals.speculation.verifier_check", argv)), "args": vars(args),
              "contexts": rows, **verdict}  # fmt: skip
    pair = "a tiny random pair" if args.smoke else f"{args.model} with draft {args.draft}"
    controls = "; ".join(
        f"{name}: {'rejected' if hit else 'NOT rejected (no power here)'}"
        for name, hit in verdict["controls_rejected"].items()
    )
    print(
        f"rejection sampling on {pair}: {'LOSSLESS (no context rejected)' if verdict['lossless'] else 'NOT LOSSLESS'}"
        f" at alpha {args.alpha} ({len(rows)} contexts x {args.samples} runs); broken controls: {controls}"
    )
    if args.out:
        write_atomic(Path(args.out), lambda tmp: tmp.write_text(json.dumps(record, indent=1)))
    if not verdict["lossless"]:
        raise SystemExit(1)
    return record


if __name__ == "__main__":
    run(main)
