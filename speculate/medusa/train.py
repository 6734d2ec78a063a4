"""Fit Medusa heads on the frozen target's hidden states with self-distilled targets.

Data (``--data``): ``answers`` (default), the base model's own greedy answers to task prompts of every
``runtime.prompts`` category built from the wiki training split (``speculate.training.load_answer_features``:
generated once, ~15 min, then cached), the full prompt in context and the heads fit on the answer positions,
i.e. on the text the heads must predict at run time; or ``wiki``, windows of the training split's raw text.
Both draw only documents >= 5000, never the evaluation documents. Targets: the base model's own next-token
distribution (self-distillation), so head k at position t learns softmax(lm_head(h[t + k])), the target's
distribution for token t + 1 + k.
Loss: KL(target || head), averaged over heads. The base model is frozen; only the residual blocks (and
the vocabulary projections when not shared) are trained.

At the end the heads' top-i accuracy against the target's argmax is measured on held-out rows of the same
data and stored in the checkpoint; ``speculate.medusa.speculator.build_tree`` builds the candidate tree from it.

    python -m speculate.medusa.train --model smollm2-135m --num-heads 3 --minutes 25
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.nn.functional as F

from runtime.cliutil import ArgumentParser, run
from runtime.loader import DEFAULT_MODEL, check_model_arg
from speculate.medusa.heads import MedusaCheckpointError, MedusaConfig, MedusaHeads, load_medusa, model_fingerprint
from speculate.training import (
    StepResult,
    Trainee,
    TrainerInputs,
    add_bf16_args,
    add_data_args,
    answer_ends,
    check_answer_args,
    load_trainer_inputs,
    predicts_answer,
    resolve_bf16,
    train_head,
)

MAX_TOP = 10  # accuracy table width: candidates per head the tree may use
MAX_PATHS = 512  # measured tree paths kept in the checkpoint (trees of up to this many candidates)


def distill_loss(
    heads: MedusaHeads, model, hidden: torch.Tensor, candidates: int = 0, ends: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[float]]:
    """hidden [B, T, H] of the frozen model -> (mean KL over heads, per-head top-1 agreement).

    ends [B] (``answer_ends``): only predictions of tokens up to each row's end-of-turn count (None: all).

    candidates > 0: a sampled softmax over S = the union of the target's top-``candidates`` tokens at every
    position of the batch (both distributions renormalised on S). The vocabulary projection of the heads
    (forward and backward) is ~80% of a full-vocabulary step's FLOPs; S is a few thousand of 49k tokens.
    Teacher mass outside S is the target's tail, which never holds an argmax the heads must rank first.
    """
    K = heads.config.num_heads
    T = hidden.shape[1]
    with torch.no_grad():
        teacher_logits = model.logits(hidden).float()  # [B, T, V]: distribution of token t + 1
        if candidates:
            subset = teacher_logits.topk(candidates, -1).indices.unique()  # [S]
            teacher_logits = teacher_logits[..., subset]
        teacher = F.log_softmax(teacher_logits, -1)
    if candidates and heads.proj is None:
        weight = model.lm_head.weight[subset]  # [S, H]
        logits = F.linear(heads.hidden(hidden), weight)  # [K, B, T, S]
    else:
        logits = heads(hidden, model.lm_head)  # [K, B, T, V]
        if candidates:
            logits = logits[..., subset]
    losses, top1 = [], []
    for k in range(1, K + 1):
        student = F.log_softmax(logits[k - 1, :, : T - k].float(), -1)  # predicts token t + 1 + k
        target = teacher[:, k:]  # target's distribution of token t + 1 + k
        kl = F.kl_div(student, target, log_target=True, reduction="none").sum(-1)  # [B, T - k]
        keep = torch.ones_like(kl, dtype=torch.bool) if ends is None else predicts_answer(ends, T - k, 1 + k)
        losses.append((kl * keep).sum() / keep.sum().clamp(min=1))
        hit = (student.argmax(-1) == target.argmax(-1)) & keep
        top1.append(float(hit.sum() / keep.sum().clamp(min=1)))
    return torch.stack(losses).mean(), top1


@torch.no_grad()
def held_out_tables(heads: MedusaHeads, model, batches) -> tuple[list[list[float]], list[list]]:
    """(accuracy, paths) of the heads on held-out (tokens [B, T], hidden states [B, T, H] of the frozen target)
    batches, counting only predictions of tokens up to each row's end of turn (``answer_ends``).

    accuracy[k][i]: fraction of positions where head k's i-th ranked token is the target's argmax.
    paths: the MAX_PATHS likeliest rank paths as [[i1, .., id], p]: p is the fraction of positions t (those where
    every head has a target) at which head j's i_j-th token is the target's token t + 1 + j for every j <= d, i.e.
    the measured probability that a tree node's whole path is accepted. Heads that are right on the same
    positions make deep paths likelier than the product of their accuracies, so a tree built from paths
    (``speculate.medusa.speculator.build_tree``) goes deeper where that pays. Sorted by p, then depth: every
    path's prefixes come before it."""
    K = heads.config.num_heads
    hits = torch.zeros(K, MAX_TOP, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.float64)
    joint: Counter = Counter()
    positions = 0
    for tokens, hidden in batches:
        hidden = hidden.to(model.norm.weight.dtype)
        target = model.logits(hidden).argmax(-1)  # [B, T]
        logits = heads(hidden, model.lm_head)
        T = hidden.shape[1]
        ends = answer_ends(tokens, model.config.eos_token_ids)
        ranks = []
        for k in range(1, K + 1):
            top = logits[k - 1, :, : T - k].topk(MAX_TOP, -1).indices  # [B, T-k, MAX_TOP]
            keep = predicts_answer(ends, T - k, 1 + k)  # [B, T-k]
            match = (top == target[:, k:, None]) & keep[..., None]
            hits[k - 1] += match.flatten(0, 1).sum(0).double()
            counts[k - 1] += keep.sum().double()
            rank = torch.where(match.any(-1), match.int().argmax(-1), MAX_TOP)  # [B, T-k]; MAX_TOP: not accepted
            ranks.append(rank[:, : T - K])  # positions where every head has a target in the window
        first = predicts_answer(ends, T - K, 2)  # positions whose next-next token is still in the answer
        rows = torch.stack(ranks, -1)[first].tolist()  # [N, K]
        positions += len(rows)
        for row in rows:
            for d in range(1, K + 1):
                if row[d - 1] >= MAX_TOP:
                    break
                joint[tuple(row[:d])] += 1
    accuracy = (hits / counts[:, None]).tolist()
    best = sorted(joint.items(), key=lambda e: (-e[1], len(e[0]), e[0]))[:MAX_PATHS]
    return accuracy, [[list(path), n / max(positions, 1)] for path, n in best]


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m speculate.medusa.train", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="base model spec (frozen)")
    ap.add_argument("--out", default=None, help="checkpoint directory (default $QSPEC_HOME/medusa/MODEL)")
    ap.add_argument("--num-heads", type=int, default=3)
    ap.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    ap.add_argument(
        "--own-projection", action="store_true", help="a vocabulary projection per head (default: share lm_head)"
    )
    add_data_args(ap)
    ap.add_argument("--seqlen", type=int, default=256, help="wiki window length")
    ap.add_argument("--batch-size", type=int, default=None, help="windows (wiki, default 2) or answers (default 4)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-clock training budget (the bar is < 30 min)")
    ap.add_argument("--train-tokens", type=int, default=1_500_000, help="wiki: tokens of the training split to draw")
    ap.add_argument("--eval-windows", type=int, default=None, help="held-out windows (wiki, 8) or answers (32)")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="no training: re-measure the tree tables (accuracy, paths) of the heads at --out on the held-out rows",
    )
    ap.add_argument(
        "--candidates",
        type=int,
        default=64,
        help="sampled softmax over the union of the target's top-N (0: full vocab)",
    )
    add_bf16_args(ap)
    return ap


def check_args(ap: ArgumentParser, args) -> None:
    """Every check that needs no model, and the defaults that depend on --data."""
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    if args.num_heads < 1:
        ap.error(f"--num-heads must be >= 1, got {args.num_heads}")
    if args.minutes <= 0:
        ap.error(f"--minutes must be > 0, got {args.minutes}")
    answers = args.data == "answers"
    check_answer_args(ap, args)
    args.batch_size = args.batch_size or (4 if answers else 2)
    args.eval_windows = args.eval_windows or (32 if answers else 8)
    for name in ("seqlen", "batch_size", "max_steps", "save_every", "eval_windows", "train_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def calibrate(ap: ArgumentParser, args, inputs: TrainerInputs) -> None:
    """--calibrate: re-measure the tree tables of the heads at --out, no training."""
    try:
        heads = load_medusa(inputs.out, inputs.model)
    except MedusaCheckpointError as err:
        ap.error(str(err))
    data = inputs.data
    heads.config.accuracy, heads.config.paths = held_out_tables(heads, inputs.model, data.held_out(args.batch_size))
    heads.save(inputs.out)
    _log(f"re-measured tree tables on {data.n_held_out} held-out {data.unit} -> {inputs.out}")


def medusa_trainee(args, inputs: TrainerInputs) -> Trainee:
    """New heads (own projections start as copies of the base lm_head) and their distillation step."""
    model, cfg, data = inputs.model, inputs.model_config, inputs.data
    config = MedusaConfig(
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        share_lm_head=not args.own_projection,
        base_model=args.model,
        base_fingerprint=model_fingerprint(model),
    )
    heads = MedusaHeads(config)
    if config.share_lm_head is False:
        for proj in heads.proj:
            proj.weight.data.copy_(model.lm_head.weight.data)

    def step_fn(step: int) -> StepResult:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            tokens, hidden = data.batch(step * args.batch_size, args.batch_size)
            loss, top1 = distill_loss(heads, model, hidden, args.candidates, answer_ends(tokens, cfg.eos_token_ids))
        return StepResult(loss, top1, hidden.shape[0] * hidden.shape[1])

    def measure() -> None:
        config.accuracy, config.paths = held_out_tables(heads, model, data.held_out(args.batch_size))

    def summary() -> str:
        acc = config.accuracy
        return f"top-1 per head {[round(a[0], 3) for a in acc]}, top-5 {[round(sum(a[:5]), 3) for a in acc]}"

    params = [p for p in heads.parameters() if p.requires_grad]
    return Trainee(heads, params, step_fn, measure, f"{config.num_heads} heads", summary)


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    resolve_bf16(args, "cpu")
    inputs = load_trainer_inputs(ap, args, "medusa", log=_log)
    if args.calibrate:
        calibrate(ap, args, inputs)
        return
    train_head("medusa", medusa_trainee(args, inputs), inputs, args, argv)


def _log(msg: str) -> None:
    print(f"[medusa] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run(main)
