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

    python -m evals.verifier_check --model qwen2.5-coder-1.5b --draft int4+qwen2.5-coder-0.5b --dtype bf16 \\
        --prompts 8 --samples 20000 --out results/verifier_check.json
    python -m evals.verifier_check --smoke        # tiny random pair, seconds
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from scipy.stats import chisquare
from torch import Tensor

from evals.humaneval_problems import load_problems, prompt_ids, select
from runtime.cliutil import ArgumentParser, run
from runtime.config import DTYPES, ModelConfig
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer
from runtime.model import random_model
from runtime.paths import write_atomic
from runtime.provenance import module_command, provenance
from runtime.sampling import SamplingParams, logits_to_probs
from speculate.draft import parse_draft_spec
from speculate.verify import rejection_sample

MAX_SUPPORT = 64  # first tokens whose second-token distributions are computed (one forward each, per model)
CUT_WINDOW = 64  # a context is cut among the prompt's last positions
SHARPEN = 0.8  # the broken control reports q at this temperature


@dataclass
class ChainCase:
    """The two models' distributions at one context, over a compact vocabulary ``tokens`` (every token that has
    mass in any of them): p1, q1 [U] at the context; p2, q2 [U, U] after each first token (rows of tokens
    outside the first-token support are unused)."""

    tokens: list[int]  # compact index -> token id
    p1: Tensor
    q1: Tensor
    p2: Tensor
    q2: Tensor

    def exact_joint(self) -> Tensor:
        """[U, U] the target's p(t1) p(t2 | t1)."""
        return self.p1[:, None] * self.p2


@torch.no_grad()
def last_probs(model, contexts: list[list[int]], params: SamplingParams, chunk: int = 16) -> Tensor:
    """[n, V] the model's sampling distribution after each context (equal lengths), in chunks of rows."""
    out = []
    for i in range(0, len(contexts), chunk):
        logits = model(torch.tensor(contexts[i : i + chunk]))[:, -1]
        out.append(logits_to_probs(logits, params))
    return torch.cat(out)


def chain_case(target, draft, context: list[int], params: SamplingParams) -> ChainCase:
    p1, q1 = last_probs(target, [context], params)[0], last_probs(draft, [context], params)[0]
    firsts = torch.nonzero((p1 > 0) | (q1 > 0)).flatten().tolist()
    if len(firsts) > MAX_SUPPORT:
        raise ValueError(f"{len(firsts)} first tokens have mass at this context (at most {MAX_SUPPORT}): use top-p")
    seconds = [context + [t] for t in firsts]
    p2, q2 = last_probs(target, seconds, params), last_probs(draft, seconds, params)
    used = (p1 > 0) | (q1 > 0) | (p2 > 0).any(0) | (q2 > 0).any(0)
    tokens = torch.nonzero(used).flatten()
    index = {t: i for i, t in enumerate(tokens.tolist())}
    U = len(tokens)
    P2, Q2 = torch.zeros(U, U), torch.zeros(U, U)
    for row, t in enumerate(firsts):
        P2[index[t]], Q2[index[t]] = p2[row, tokens], q2[row, tokens]
    return ChainCase(tokens.tolist(), p1[tokens], q1[tokens], P2, Q2)


def renormalized(q: Tensor) -> Tensor:
    return q / q.sum(-1, keepdim=True)


def sharpened(q: Tensor, temperature: float = SHARPEN) -> Tensor:
    """q^(1/temperature), normalized: what a broken draft reports instead of the q it sampled from."""
    return renormalized(q.double().pow(1.0 / temperature)).float()


def identity(q: Tensor) -> Tensor:
    return q


def verify_from_p(drafts: Tensor, target: Tensor, told: Tensor, generator: torch.Generator):
    """A broken verifier: the production acceptance test, but a rejected draft's correction drawn from p instead
    of the residual max(p - q, 0) (so the rejected token can be drawn again)."""
    res = rejection_sample(drafts, target, told, generator=generator)
    k = drafts.shape[1]
    rejected = res.num_accepted < k
    rows = torch.nonzero(rejected).flatten()
    if len(rows):
        p = target[rows, res.num_accepted[rows]]
        res.next_token[rows] = torch.multinomial(p, 1, generator=generator)[:, 0]
    return res


REPORTS = {"identity": identity, "sharpened": lambda q: sharpened(q)}
CONTROLS = {  # name -> (what the draft reports, the verifier): each must be rejected
    f"q reported at T={SHARPEN}": ("sharpened", "rejection"),
    "correction drawn from p, not the residual": ("identity", "from_p"),
}


def simulate(case: ChainCase, n: int, seed: int, report=identity, verify=None) -> Tensor:
    """[U, U] counts of the first two tokens emitted by n seeded speculative runs (module docstring); ``report``
    maps the q a draft was sampled from to the q the verifier is told (identity: a correct draft); ``verify``:
    the verifier (default the production rejection_sample)."""
    verify = verify or (lambda d, t, q, generator: rejection_sample(d, t, q, generator=generator))
    gen = torch.Generator().manual_seed(seed)
    U = len(case.tokens)
    x1 = torch.multinomial(case.q1.expand(n, U), 1, replacement=True, generator=gen)[:, 0]
    x2 = torch.multinomial(renormalized(case.q2[x1]), 1, generator=gen)[:, 0]
    uniform = torch.full((n, U), 1.0 / U)  # the bonus after two accepted drafts: not one of the two tokens
    target = torch.stack([case.p1.expand(n, U), case.p2[x1], uniform], 1)  # [n, 3, U]
    told = torch.stack([report(case.q1).expand(n, U), report(case.q2[x1])], 1)  # [n, 2, U]
    first = verify(torch.stack([x1, x2], 1), target, told, gen)
    accepted, nxt = first.num_accepted, first.next_token
    t1 = torch.where(accepted >= 1, x1, nxt)
    t2 = torch.where(accepted >= 2, x2, nxt)
    alone = accepted == 0  # one token emitted: a second step from (ctx, t1) with one draft
    if alone.any():
        c = t1[alone]
        m = len(c)
        y = torch.multinomial(renormalized(case.q2[c]), 1, generator=gen)[:, 0]
        second = verify(y[:, None], torch.stack([case.p2[c], uniform[:m]], 1), report(case.q2[c])[:, None], gen)
        t2[alone] = torch.where(second.num_accepted >= 1, y, second.next_token)
    return torch.bincount(t1 * U + t2, minlength=U * U).reshape(U, U).double()


def chi_square_pvalue(counts: Tensor, probs: Tensor) -> float:
    """Counts against exact cell probabilities; cells expected < 5 pooled into one."""
    counts, expected = counts.flatten(), probs.double().flatten() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        return 1.0  # one cell: nothing to test (a deterministic context)
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def entropy_cut(target, draft, ids: list[int], params: SamplingParams) -> int:
    """The context length (among the last CUT_WINDOW positions of ids) where the target's sampling distribution
    has the most entropy while the first tokens either model gives mass number at most MAX_SUPPORT."""
    with torch.no_grad():
        probs = logits_to_probs(target(torch.tensor([ids]))[0], params)  # [T, V]
        draft_probs = logits_to_probs(draft(torch.tensor([ids]))[0], params)
    best, best_h = len(ids), -1.0
    for pos in range(max(0, len(ids) - CUT_WINDOW), len(ids)):
        p = probs[pos]
        support = int(((p > 0) | (draft_probs[pos] > 0)).sum())
        h = float(-(p[p > 0] * p[p > 0].log()).sum())
        if support <= MAX_SUPPORT and h > best_h:
            best, best_h = pos + 1, h
    return best


def check_contexts(target, draft, contexts: list[list[int]], params, samples: int, seed: int, alpha: float, log):
    """Per context: the exact test of the verifier and of the broken control. Returns the record's rows."""
    rows = []
    for i, ctx in enumerate(contexts):
        case = chain_case(target, draft, ctx, params)
        joint = case.exact_joint()
        good = chi_square_pvalue(simulate(case, samples, seed + i), joint)
        broken = {
            name: chi_square_pvalue(
                simulate(case, samples, seed + i, REPORTS[report], None if verify == "rejection" else verify_from_p),
                joint,
            )
            for name, (report, verify) in CONTROLS.items()
        }
        overlap = float(torch.minimum(case.p1, case.q1).sum())  # the first draft's acceptance probability
        rows.append({"context_tokens": len(ctx), "vocabulary": len(case.tokens), "first_draft_acceptance": overlap,
                     "p_value": good, "p_value_controls": broken})  # fmt: skip
        controls = ", ".join(f"{name}: p = {v:.3g}" for name, v in broken.items())
        log(f"context {i}: {len(case.tokens)} tokens in play, acceptance {overlap:.3f}, p = {good:.3g} "
            f"(broken controls: {controls})")  # fmt: skip
    threshold = alpha / max(1, len(contexts))
    return rows, threshold


def summarize(rows: list[dict], threshold: float) -> dict:
    lossless = all(r["p_value"] >= threshold for r in rows)
    rejected = {name: any(r["p_value_controls"][name] < threshold for r in rows) for name in CONTROLS}
    return {"threshold": threshold, "lossless": lossless, "controls_rejected": rejected}


def parse_args(argv):
    ap = ArgumentParser(prog="python -m evals.verifier_check", description=__doc__.splitlines()[0])
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
    record = {**provenance(command=module_command("evals.verifier_check", argv)), "args": vars(args),
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
