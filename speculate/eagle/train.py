"""Fit an EAGLE-style draft head on the frozen target by self-distillation (wiki TRAIN split, documents >= 5000).

Data (``--data``, as the Medusa trainer): ``answers`` (default), the target's own greedy answers to task prompts
from the training split, features taken with the whole prompt in context (``speculate.training``); or ``wiki``,
windows of raw text.

Per position t of a window of target hidden states h (final norm) and tokens x: the head's input is
fc([embed(x[t+1]); h[t]]); its output regresses h[t+1] (smooth L1) and, through the target's lm_head,
matches the target's distribution of token t+2 (KL over the union of the target's top-``candidates`` tokens,
a sampled softmax). Loss = regression + ``cls_weight`` x KL (EAGLE's 1 : 0.1).

The head attends over short causal windows (``--window`` positions, as at draft time). Two passes per step
(a short "training-time test"): pass 1 reads the target's features; pass 2 re-reads, at window positions >= 1,
the head's own pass-1 prediction of the previous feature, the inputs it sees at draft depth >= 2.

Each batch of target features (the dominant cost) serves ``--reuse`` head updates at different window
offsets. Budget: ``--minutes`` of wall clock (default 20, CPU); progress every 10 steps; saved every
``--save-every`` steps, at the end and on Ctrl-C, under $QSPEC_HOME/eagle/MODEL.

    nice -n 19 python -m speculate.eagle.train --model smollm2-135m --minutes 20
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from runtime.cliutil import ArgumentParser, run
from runtime.loader import DEFAULT_MODEL, check_model_arg
from speculate.eagle.head import EagleConfig, EagleHead
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


def windowed(x: torch.Tensor, window: int, offset: int) -> torch.Tensor:
    """[B, T, ...] -> [B * n, window, ...]: non-overlapping windows starting at offset (tail dropped)."""
    n = (x.shape[1] - offset) // window
    return x[:, offset : offset + n * window].reshape(x.shape[0] * n, window, *x.shape[2:])


@torch.no_grad()
def teacher(
    model, tokens: torch.Tensor, candidates: int, hidden: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tokens [B, T] -> (hidden [B, T, H] of the frozen target, log-probs [B, T, S] of its next token over the
    union S of its top-``candidates`` tokens (S = the vocabulary when 0), subset indices [S] or None).
    Computed once per batch and reused by ``--reuse`` head updates (the target forward is the dominant cost).
    hidden: the target's features of ``tokens`` when already computed (answers data)."""
    if hidden is None:
        hidden = model(tokens, hidden_only=True)
    logits = model.logits(hidden).float()
    subset = logits.topk(candidates, -1).indices.unique() if candidates else None
    if subset is not None:
        logits = logits[..., subset]
    return hidden, F.log_softmax(logits, -1), subset


def eagle_loss(
    head: EagleHead,
    model,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    teacher_logp: torch.Tensor,
    subset: torch.Tensor | None,
    window: int,
    offset: int,
    cls_weight: float = 0.1,
    ends: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """tokens [B, T], hidden [B, T, H] and teacher_logp [B, T, S] of the frozen target -> (loss, top-1 agreement
    of pass 1 and pass 2). Position t: input fc([embed(x[t+1]); h[t]]), targets h[t+1] and p(x[t+2]).
    ends [B] (``answer_ends``): only positions whose x[t+2] is inside the answer count (None: all)."""
    B, T = tokens.shape
    inside = predicts_answer(torch.full((B,), T, device=tokens.device) if ends is None else ends, T - 2, 2)
    keep = windowed(inside, window, offset)  # [N, window]
    kept = keep.sum().clamp(min=1)
    feat_in = windowed(hidden[:, :-2], window, offset)  # h[t]
    emb = windowed(model.embed_tokens(tokens[:, 1:-1]), window, offset)  # embed(x[t+1])
    feat_out = windowed(hidden[:, 1:-1], window, offset)  # h[t+1]: regression target
    target = windowed(teacher_logp[:, 1:-1], window, offset)  # target's log-probs of x[t+2]
    weight = model.lm_head.weight if subset is None else model.lm_head.weight[subset]
    losses, top1 = [], []
    out1 = head(head.inputs(emb, feat_in))
    # pass 2: window positions >= 1 read the head's previous prediction instead of the target's feature
    feat2 = torch.cat([feat_in[:, :1], out1[:, :-1]], 1)
    out2 = head(head.inputs(emb, feat2))
    for out in (out1, out2):
        student = F.log_softmax(F.linear(out.to(weight.dtype), weight).float(), -1)
        kl = (F.kl_div(student, target, log_target=True, reduction="none").sum(-1) * keep).sum() / kept
        reg = (F.smooth_l1_loss(out.float(), feat_out.float(), reduction="none").mean(-1) * keep).sum() / kept
        losses.append(reg + cls_weight * kl)
        top1.append(float(((student.argmax(-1) == target.argmax(-1)) & keep).sum() / kept))
    return torch.stack(losses).mean(), top1


@torch.no_grad()
def draft_accuracy(head: EagleHead, model, batches, depth: int) -> list[float]:
    """Held-out: P(the head's greedy draft at depth d equals the target's greedy token | depths < d matched),
    drafting from the head's own features as at run time (acc[d-1] for d = 1..depth). batches: (tokens [1, T],
    hidden [1, T, H] of the frozen target) pairs, one row each; drafts of tokens past the row's end of turn
    (``answer_ends``) are not counted."""
    hits, counts = [0] * depth, [0] * depth
    for toks, hidden in batches:
        hidden = hidden[0].to(model.norm.weight.dtype)  # [T, H]
        target = model.logits(hidden).argmax(-1)  # [T]: target's greedy token after each position
        T = toks.shape[1]
        end = answer_ends(toks, model.config.eos_token_ids)[0]
        starts = torch.arange(0, T - depth - 2, device=toks.device)  # root at position s: feature h[s], token x[s+1]
        feats = hidden[starts]  # [S, H]
        embeds = model.embed_tokens(toks[0, starts + 1])
        alive = torch.ones(len(starts), dtype=torch.bool, device=toks.device)
        xs = []
        for d in range(depth):
            xs.append(head.inputs(embeds, feats))
            out = head(torch.stack(xs, 1))[:, -1]
            draft = model.logits(out).argmax(-1)
            truth = target[starts + 1 + d]  # target's token at position s + 2 + d
            hit = (draft == truth) & alive
            inside = starts + 2 + d <= end
            hits[d] += int((hit & inside).sum())
            counts[d] += int((alive & inside).sum())
            alive = hit
            feats, embeds = out, model.embed_tokens(truth)
    return [h / max(c, 1) for h, c in zip(hits, counts)]


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m speculate.eagle.train", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="base model spec (frozen)")
    ap.add_argument("--out", default=None, help="checkpoint directory (default $QSPEC_HOME/eagle/MODEL)")
    add_data_args(ap)
    ap.add_argument("--seqlen", type=int, default=256, help="wiki window length")
    ap.add_argument("--window", type=int, default=6, help="causal window (longest draft path) the head is fit on")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--cls-weight", type=float, default=0.1)
    ap.add_argument("--candidates", type=int, default=64, help="sampled softmax over the target's top-N union")
    ap.add_argument("--reuse", type=int, default=3, help="head updates per batch of target features")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    ap.add_argument("--train-tokens", type=int, default=1_500_000, help="wiki: tokens of the training split to draw")
    ap.add_argument("--eval-windows", type=int, default=None, help="held-out windows (wiki, 4) or answers (16)")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="default: cuda if present")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    add_bf16_args(ap)
    return ap


def check_args(ap: ArgumentParser, args) -> None:
    """Every check that needs no model, and the defaults that depend on --data."""
    if args.minutes <= 0 or args.window < 2 or args.batch_size < 1 or args.reuse < 1:
        ap.error("--minutes must be > 0, --window >= 2, --batch-size >= 1, --reuse >= 1")
    check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    args.eval_windows = args.eval_windows or (16 if args.data == "answers" else 4)
    check_answer_args(ap, args)


def eagle_trainee(args, inputs: TrainerInputs, device: torch.device) -> Trainee:
    """A new head and its step: a new batch of target features every --reuse updates, each update on windows at a
    random offset."""
    model, data = inputs.model, inputs.data
    config = EagleConfig.for_model(model, args.model, args.window)
    head = EagleHead(config).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    features: list = []  # [batch, hidden, teacher_logp, subset] of the current batch, reused for --reuse updates

    def step_fn(step: int) -> StepResult:
        new_tokens = 0
        if step % args.reuse == 0:  # a new batch of target features every --reuse updates
            batch, hidden = data.batch((step // args.reuse) * args.batch_size, args.batch_size)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                features[:] = [batch, *teacher(model, batch, args.candidates, hidden)]
            new_tokens = batch.numel()
        offset = int(torch.randint(0, args.window, (1,), generator=gen))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            ends = answer_ends(features[0], model.config.eos_token_ids)
            loss, top1 = eagle_loss(head, model, *features, args.window, offset, args.cls_weight, ends)
        return StepResult(loss, top1, new_tokens)

    def measure() -> None:
        acc = draft_accuracy(head, model, data.held_out(1), args.window - 1)
        config.accuracy = {"greedy_draft_at_depth": [round(a, 4) for a in acc]}

    def summary() -> str:
        return f"greedy draft acceptance per depth {config.accuracy['greedy_draft_at_depth']}"

    params = list(head.parameters())
    return Trainee(head, params, step_fn, measure, f"window {args.window}", summary, clip_grad_norm=1.0)


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    resolve_bf16(args, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    inputs = load_trainer_inputs(ap, args, "eagle", log=_log, device=device)
    train_head("eagle", eagle_trainee(args, inputs, device), inputs, args, argv)


def _log(msg: str) -> None:
    print(f"[eagle] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run(main)
