"""What every draft-head trainer shares (Medusa heads, the EAGLE head): training windows from the wiki TRAIN
split, a wall-clock budget with a warm-up + cosine learning rate, progress lines, periodic saves, and a
Ctrl-C that keeps the head trained so far.

A trainer supplies one function, ``step_fn(step) -> StepResult``, that computes the loss of one update; the
loop here does the rest, so both trainers log, schedule, save and stop the same way.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.cliutil import interrupted
from runtime.data import wiki_split
from runtime.paths import qspec_home

WARMUP_STEPS = 20


def head_dir(kind: str, model_path: Path | str) -> Path:
    """$QSPEC_HOME/<kind>/<model name>: where a trained head of this kind ("medusa", "eagle") for this model
    lives; the trainers write there by default and every user of the heads looks there."""
    return qspec_home() / kind / Path(model_path).name.removesuffix(".gguf")


def training_windows(tokenizer, seqlen: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Non-overlapping windows from the training split (documents >= 5000), shuffled with a fixed seed."""
    docs = wiki_split("train")
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    ids: list[int] = []
    for i in order:
        ids.extend(tokenizer(docs[i].extract + "\n\n", add_special_tokens=False).input_ids)
        if len(ids) >= max_tokens:
            break
    n = len(ids) // seqlen
    return [ids[j * seqlen : (j + 1) * seqlen] for j in range(n)]


@dataclass
class StepResult:
    loss: torch.Tensor  # scalar, with a graph to the trained parameters
    top1: list[float]  # the trainer's accuracies for the progress line (per head, or per pass)
    new_tokens: int  # target tokens read for this update (0 when a batch of features is reused)


@dataclass
class TrainingProgress:
    command: str
    started: float = field(default_factory=time.perf_counter)
    step: int = 0
    tokens_seen: int = 0
    history: list[dict] = field(default_factory=list)

    def record(self, final: bool) -> dict:
        """What a head's config records about its training."""
        return {
            "command": self.command,
            "steps": self.step,
            "tokens": self.tokens_seen,
            "seconds": round(time.perf_counter() - self.started, 1),
            "threads": torch.get_num_threads(),
            "history": self.history[-20:],
            "final": final,
        }


def learning_rate(base_lr: float, step: int, progress: float) -> float:
    """Linear warm-up over the first steps, then cosine decay over the wall-clock budget (progress in [0, 1])."""
    warmup = min(1.0, (step + 1) / WARMUP_STEPS)
    return base_lr * warmup * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_within_budget(
    name: str,
    step_fn: Callable[[int], StepResult],
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    progress: TrainingProgress,
    save: Callable[[bool], None],
    *,
    lr: float,
    minutes: float,
    max_steps: int,
    save_every: int,
    clip_grad_norm: float | None = None,
) -> None:
    """Run updates until the budget or max_steps; save every `save_every` steps and at the end (`save(final)`).

    Ctrl-C saves the head trained so far (not final: no held-out accuracy) and exits with one line."""
    budget = minutes * 60
    try:
        while progress.step < max_steps and time.perf_counter() - progress.started < budget:
            result = step_fn(progress.step)
            elapsed_share = (time.perf_counter() - progress.started) / budget
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(lr, progress.step, elapsed_share)
            optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            optimizer.step()
            progress.step += 1
            progress.tokens_seen += result.new_tokens
            loss = result.loss.item()
            top1 = [round(a, 3) for a in result.top1]
            progress.history.append({"step": progress.step, "loss": round(loss, 4), "top1": top1})
            if progress.step % 10 == 0 or progress.step <= 5:
                elapsed = time.perf_counter() - progress.started
                print(
                    f"[{name}] step {progress.step} loss {loss:.3f} top1 {' '.join(f'{a:.2f}' for a in top1)} "
                    f"{progress.tokens_seen / elapsed:.0f} tok/s {elapsed / 60:.1f} of {minutes:g} min",
                    file=sys.stderr,
                    flush=True,
                )
            if progress.step % save_every == 0:
                save(False)
    except KeyboardInterrupt:
        if progress.step == 0:
            interrupted("no training step finished, nothing saved")
        save(False)
        interrupted(f"{name} after {progress.step} steps ({progress.tokens_seen} tokens) saved (not final)")
    save(True)
