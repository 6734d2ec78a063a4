"""Fit Medusa heads on the frozen target's hidden states with self-distilled targets.

Data: windows of the wiki training split (``runtime.data.wiki_split("train")``, documents >= 5000, never
the evaluation documents). Targets: the base model's own next-token distribution (self-distillation), so
head k at position t learns softmax(lm_head(h[t + k])), the target's distribution for token t + 1 + k.
Loss: KL(target || head), averaged over heads. The base model is frozen; only the residual blocks (and
the vocabulary projections when not shared) are trained.

At the end the heads' top-i accuracy against the target's argmax is measured on held-out training-split
windows and stored in the checkpoint; ``speculate.medusa.tree`` builds the candidate tree from it.

    python -m speculate.medusa.train --model smollm2-135m --num-heads 3 --minutes 25
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.cliutil import ArgumentParser, run
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer
from speculate.medusa.heads import MedusaConfig, MedusaHeads, model_fingerprint
from speculate.training import StepResult, TrainingProgress, head_dir, train_within_budget, training_windows

MAX_TOP = 10  # accuracy table width: candidates per head the tree may use


def distill_loss(
    heads: MedusaHeads, model, hidden: torch.Tensor, candidates: int = 0
) -> tuple[torch.Tensor, list[float]]:
    """hidden [B, T, H] of the frozen model -> (mean KL over heads, per-head top-1 agreement).

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
        losses.append(F.kl_div(student.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean"))
        top1.append(float((student.argmax(-1) == target.argmax(-1)).float().mean()))
    return torch.stack(losses).mean(), top1


@torch.no_grad()
def topk_accuracy(heads: MedusaHeads, model, windows: list[list[int]], batch_size: int) -> list[list[float]]:
    """accuracy[k][i]: fraction of positions where head k's i-th ranked token is the target's argmax."""
    K = heads.config.num_heads
    hits = torch.zeros(K, MAX_TOP, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.float64)
    for i in range(0, len(windows), batch_size):
        batch = torch.tensor(windows[i : i + batch_size])
        hidden = model(batch, hidden_only=True)
        target = model.logits(hidden).argmax(-1)  # [B, T]
        logits = heads(hidden, model.lm_head)
        T = batch.shape[1]
        for k in range(1, K + 1):
            top = logits[k - 1, :, : T - k].topk(MAX_TOP, -1).indices  # [B, T-k, MAX_TOP]
            hits[k - 1] += (top == target[:, k:, None]).flatten(0, 1).sum(0).double()
            counts[k - 1] += top.shape[0] * top.shape[1]
    return (hits / counts[:, None]).tolist()


def main(argv: list[str] | None = None) -> None:

    ap = ArgumentParser(prog="python -m speculate.medusa.train", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="base model spec (frozen)")
    ap.add_argument("--out", default=None, help="checkpoint directory (default $QSPEC_HOME/medusa/MODEL)")
    ap.add_argument("--num-heads", type=int, default=3)
    ap.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    ap.add_argument(
        "--own-projection", action="store_true", help="a vocabulary projection per head (default: share lm_head)"
    )
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-clock training budget (the bar is < 30 min)")
    ap.add_argument("--train-tokens", type=int, default=1_500_000, help="tokens of the training split to draw from")
    ap.add_argument("--eval-windows", type=int, default=8, help="held-out windows for the accuracy table")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--candidates",
        type=int,
        default=64,
        help="sampled softmax over the union of the target's top-N (0: full vocab)",
    )
    ap.add_argument(
        "--no-bf16", dest="bf16", action="store_false", help="train in fp32 (default: bf16 autocast, ~2x on CPU)"
    )
    args = ap.parse_args(argv)
    if args.model:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    if args.num_heads < 1:
        ap.error(f"--num-heads must be >= 1, got {args.num_heads}")
    if args.minutes <= 0:
        ap.error(f"--minutes must be > 0, got {args.minutes}")
    for name in ("seqlen", "batch_size", "max_steps", "save_every", "eval_windows", "train_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    torch.manual_seed(args.seed)
    model, cfg, path = load_model(args.model, dtype=torch.float32)
    model.requires_grad_(False)
    tokenizer = load_tokenizer(str(path))
    out = Path(args.out) if args.out else head_dir("medusa", path)
    print(f"[medusa] tokenizing up to {args.train_tokens:,} tokens of the training split", file=sys.stderr, flush=True)
    windows = training_windows(tokenizer, args.seqlen, args.train_tokens, args.seed)
    if len(windows) <= args.eval_windows:
        ap.error(f"only {len(windows)} windows of {args.seqlen} tokens; raise --train-tokens")
    eval_windows, train_windows = windows[: args.eval_windows], windows[args.eval_windows :]
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
    if config.share_lm_head is False:  # own projections start as copies of the base lm_head
        for proj in heads.proj:
            proj.weight.data.copy_(model.lm_head.weight.data)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    command = "python -m speculate.medusa.train " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(
        f"[medusa] {len(train_windows)} train windows x {args.seqlen} tokens, {config.num_heads} heads, "
        f"{sum(p.numel() for p in params) / 1e6:.2f}M trainable params, budget {args.minutes} min -> {out}",
        file=sys.stderr,
    )

    progress = TrainingProgress(command)

    def save(final: bool) -> None:
        heads.eval()
        config.training = progress.record(final)
        if final:
            config.accuracy = topk_accuracy(heads, model, eval_windows, args.batch_size)
        heads.save(out)
        heads.train()

    def step_fn(step: int) -> StepResult:
        n = len(train_windows)
        batch = torch.tensor([train_windows[(step * args.batch_size + j) % n] for j in range(args.batch_size)])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            with torch.no_grad():
                hidden = model(batch, hidden_only=True)
            loss, top1 = distill_loss(heads, model, hidden, args.candidates)
        return StepResult(loss, top1, batch.numel())

    heads.train()
    train_within_budget(
        "medusa",
        step_fn,
        params,
        opt,
        progress,
        save,
        lr=args.lr,
        minutes=args.minutes,
        max_steps=args.max_steps,
        save_every=args.save_every,
    )
    acc = config.accuracy
    print(
        f"[medusa] done: {progress.step} steps, {progress.tokens_seen} tokens, "
        f"{(time.perf_counter() - progress.started) / 60:.1f} min; held-out "
        f"top-1 per head {[round(a[0], 3) for a in acc]}, top-5 {[round(sum(a[:5]), 3) for a in acc]} -> {out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    run(main)
