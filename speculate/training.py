"""What every draft-head trainer shares (Medusa heads, the EAGLE head): training windows from the wiki TRAIN
split (raw text, or the target's own answers to task prompts: self-distillation data), a wall-clock budget
with a warm-up + cosine learning rate, progress lines, periodic saves, and a Ctrl-C that keeps the head
trained so far.

A trainer supplies one function, ``step_fn(step) -> StepResult``, that computes the loss of one update; the
loop here does the rest, so both trainers log, schedule, save and stop the same way. Their mains share one
scaffold too: ``load_trainer_inputs`` (frozen target, tokenizer, output directory, --data) and ``train_head`` (the
optimizer, the progress line, saves with the final held-out measurement, the closing line).
"""

from __future__ import annotations

import json
import math
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from runtime.cliutil import interrupted
from runtime.data import wiki_split
from runtime.decoding import generate
from runtime.kernels.cpu_step import isa_supported
from runtime.loader import load_model, load_tokenizer
from runtime.paths import qspec_home, write_atomic
from runtime.prompts import CATEGORIES, build_suite, encode_messages
from runtime.sampling import SamplingParams

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


# ---- self-distillation data: the target's own answers --------------------------------------------------

ANSWERS_VERSION = 1  # bump when the prompts or the generation change: the cache key changes with it


@dataclass(frozen=True)
class AnswerSpec:
    """What the self-distillation data is: greedy answers of ``max_tokens`` tokens (end-of-turn ignored, as the
    suite generates) to ``runtime.prompts`` task prompts of every category from the wiki TRAIN split."""

    per_category: int = 320
    max_tokens: int = 128
    seed: int = 0
    batch: int = 32

    def cache_path(self, model_name: str) -> Path:
        name = f"answers-v{ANSWERS_VERSION}-{model_name}-n{self.per_category}-t{self.max_tokens}-s{self.seed}.json"
        return qspec_home() / "data" / name


def training_prompts(tokenizer, spec: AnswerSpec) -> list[list[int]]:
    """Chat-templated task prompts from the TRAIN split (documents >= 5000, never the suite's). Translation gets
    its own draw: the split's few long passages with a French/Spanish counterpart would otherwise go to rewriting."""
    others = tuple(c for c in CATEGORIES if c != "translation")
    prompts = build_suite(
        spec.per_category, spec.seed, copy_tokens=spec.max_tokens, split="train", strict=False, categories=others
    )
    prompts += build_suite(
        spec.per_category,
        spec.seed,
        copy_tokens=spec.max_tokens,
        split="train",
        strict=False,
        categories=("translation",),
    )
    return [encode_messages(tokenizer, p.messages) for p in prompts]


@torch.inference_mode()
def target_answers(model, tokenizer, spec: AnswerSpec, model_name: str, log=None) -> list[list[int]]:
    """prompt + answer token ids per training prompt, the answers greedy from ``model``; cached per model and
    spec in $QSPEC_HOME/data (generated once in bf16 for the default 1.5k prompts: ~15 min on a 2-core CPU with
    avx512_bf16; ~50-90 min on an AVX2-only one, 41-88 s a batch of 32, notes/issue-39.md)."""
    path = spec.cache_path(model_name)
    if path.is_file():
        return json.loads(path.read_text())["sequences"]
    prompts = training_prompts(tokenizer, spec)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a prefill
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    sequences: list[list[int]] = [[] for _ in prompts]
    if log is not None:
        log(f"generating the target's answers to {len(prompts)} training prompts -> {path} (once)")
    for i in tqdm(range(0, len(order), spec.batch), desc="answers", unit="batch", file=sys.stderr):
        rows = order[i : i + spec.batch]
        out = generate(model, [prompts[r] for r in rows], params, compile="off")
        for r, toks in zip(rows, out.tokens):
            sequences[r] = prompts[r] + toks
    record = {"spec": asdict(spec), "version": ANSWERS_VERSION, "model": model_name, "sequences": sequences}
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(record)))
    return sequences


@dataclass
class AnswerFeatures:
    """The frozen target over each full prompt + answer, kept for the answer: tokens [N, span] and final-norm
    hidden states [N, span, H] of each sequence's last ``span`` positions (its last prompt token, whose hidden
    state predicts the first answer token, and the answer)."""

    tokens: torch.Tensor
    hidden: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index], self.hidden[index]

    def split(self, held_out: int) -> tuple[AnswerFeatures, AnswerFeatures]:
        """(first held_out rows, the rest): the heads' validation rows and their training rows."""
        return (
            AnswerFeatures(self.tokens[:held_out], self.hidden[:held_out]),
            AnswerFeatures(self.tokens[held_out:], self.hidden[held_out:]),
        )


@torch.no_grad()
def bf16_autocast_pays(device: torch.device | str) -> bool:
    """Whether bf16 autocast speeds up training here: on a GPU, and on CPUs with native bf16 dot products
    (avx512_bf16 / AMX). Elsewhere (AVX2, plain AVX-512) ATen's bf16 GEMMs are emulated: a 135M forward of 2 x 256
    tokens took 6.3-6.7 s under bf16 autocast against 0.9-1.0 s in fp32 on an AVX2 EPYC (notes/issue-37.md)."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and isa_supported("avx512bf16")


def resolve_bf16(args, device: torch.device | str) -> None:
    """args.bf16 as --bf16 / --no-bf16 set it, or where neither was given, whether bf16 autocast pays on ``device``."""
    if args.bf16 is None:
        args.bf16 = bf16_autocast_pays(device)


def add_bf16_args(ap) -> None:
    """--bf16 / --no-bf16 (one spelling for both trainers); neither: bf16_autocast_pays decides."""
    where = "a GPU, or a CPU with avx512_bf16"
    ap.add_argument("--bf16", dest="bf16", action="store_const", const=True, default=None,
                    help=f"train under bf16 autocast (default: where it pays: {where})")  # fmt: skip
    ap.add_argument("--no-bf16", dest="bf16", action="store_const", const=False, help="train in fp32")


def answer_features(
    model, sequences: list[list[int]], span: int, seed: int, batch: int = 8, bf16: bool | None = None
) -> AnswerFeatures:
    """Target features of the answers, the whole prompt in context (a window cut from the prompt would change
    every hidden state of a copying answer). Rows shuffled with a fixed seed; hidden kept in bf16 (half the
    memory; fp32 training widens the rows it reads: ``widened``). Sequences are right-padded per batch: attention
    is causal, so padding after a row's end never reaches its positions."""
    if any(len(s) <= span for s in sequences):
        raise ValueError(f"every sequence needs more than {span} tokens (the answer span and a prompt)")
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    device = model.embed_tokens.weight.device
    bf16 = bf16_autocast_pays(device) if bf16 is None else bf16
    by_length = sorted(order, key=lambda i: len(sequences[i]))  # little padding per batch
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in tqdm(range(0, len(by_length), batch), desc="answer features", unit="batch", file=sys.stderr):
        chunk = by_length[i : i + batch]
        T = max(len(sequences[r]) for r in chunk)
        ids = torch.tensor([sequences[r] + [0] * (T - len(sequences[r])) for r in chunk], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            h = model(ids, hidden_only=True)
        for j, r in enumerate(chunk):
            end = len(sequences[r])
            rows[r] = (ids[j, end - span : end].cpu().clone(), h[j, end - span : end].to(torch.bfloat16).cpu().clone())
    tokens = torch.stack([rows[r][0] for r in order])
    hidden = torch.stack([rows[r][1] for r in order])
    return AnswerFeatures(tokens.to(device), hidden.to(device))


def add_data_args(ap) -> None:
    """The trainers' --data options (one spelling for Medusa and EAGLE)."""
    ap.add_argument(
        "--data",
        choices=("answers", "wiki"),
        default="answers",
        help="answers: the target's own greedy answers to training-split task prompts (self-distillation, "
        "generated once and cached); wiki: windows of the training split's raw text",
    )
    spec = AnswerSpec()
    ap.add_argument(
        "--answers-per-category", type=int, default=spec.per_category, help="answers: task prompts per category"
    )
    ap.add_argument("--answer-tokens", type=int, default=spec.max_tokens, help="answers: tokens per answer")


def answer_spec(args) -> AnswerSpec:
    if args.answers_per_category < 1 or args.answer_tokens < 2:
        raise ValueError("--answers-per-category must be >= 1 and --answer-tokens >= 2")
    return AnswerSpec(per_category=args.answers_per_category, max_tokens=args.answer_tokens)


def load_answer_features(
    model, tokenizer, model_spec: str, model_name: str, spec: AnswerSpec, seed: int, log=None
) -> AnswerFeatures:
    """The self-distillation training data of a trainer: the target's answers (generated once with a bf16
    copy of the target, cached) through the frozen target (cached beside them: the trainers share it)."""
    path = spec.cache_path(model_name).with_suffix(f".features-s{seed}.pt")
    if path.is_file():
        saved = torch.load(path)
        device = model.embed_tokens.weight.device
        return AnswerFeatures(saved["tokens"].to(device), saved["hidden"].to(device))
    generator = None if spec.cache_path(model_name).is_file() else load_model(model_spec, dtype=torch.bfloat16)[0]
    sequences = target_answers(generator, tokenizer, spec, model_name, log)
    features = answer_features(model, sequences, spec.max_tokens + 1, seed)
    write_atomic(path, lambda tmp: torch.save({"tokens": features.tokens.cpu(), "hidden": features.hidden.cpu()}, tmp))
    return features


def answer_ends(tokens: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """tokens [B, T] -> [B] index of each row's first end-of-turn token after position 0, T where there is none:
    the tokens after it are what the model writes past its answer, which generation never reaches."""
    T = tokens.shape[1]
    is_eos = torch.isin(tokens, torch.tensor(eos_ids, device=tokens.device))
    is_eos[:, 0] = False
    index = torch.arange(T, device=tokens.device).expand_as(tokens)
    return torch.where(is_eos, index, T).min(-1).values


def predicts_answer(ends: torch.Tensor, positions: int, ahead: int) -> torch.Tensor:
    """[B, positions]: whether position t's prediction of token t + ``ahead`` lies inside row b's answer
    (t + ahead <= ends[b], ``answer_ends``): the positions a head's loss and held-out tables count."""
    t = torch.arange(positions, device=ends.device)
    return t[None] + ahead <= ends[:, None]


@dataclass
class TrainingData:
    """What a head trainer reads: rows of tokens [n, T] with the frozen target's hidden states [n, T, H], split
    into training rows and held-out rows (the accuracy table of a final save)."""

    train_rows: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]
    held_out_rows: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]
    n_train: int
    n_held_out: int
    unit: str  # what a row is, for the progress line

    def batch(self, first: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` training rows from row ``first`` on, wrapping around (epochs)."""
        return self.train_rows([(first + j) % self.n_train for j in range(size)])

    def held_out(self, size: int):
        """The held-out rows in batches of ``size``."""
        for i in range(0, self.n_held_out, size):
            yield self.held_out_rows(list(range(i, min(i + size, self.n_held_out))))


def widened(rows: Callable, bf16: bool) -> Callable:
    """Answer rows as a trainer computes: the cached bf16 features as they are under bf16 autocast, widened to
    fp32 for fp32 training (training and held-out rows alike)."""
    if bf16:
        return rows

    def fp32_rows(index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, hidden = rows(index)
        return tokens, hidden.float()

    return fp32_rows


def training_data(model, tokenizer, args, model_name: str, log=None) -> TrainingData:
    """The trainer's --data: ``answers`` (the target's own answers, features cached) or ``wiki`` windows (features
    computed per batch). args: --data, --answers-per-category, --answer-tokens, --model, --seed, --seqlen,
    --train-tokens, --eval-windows (held-out rows) and bf16 (resolved: ``resolve_bf16``). A split too small for its
    held-out rows: ValueError."""
    if args.data == "answers":
        data = load_answer_features(model, tokenizer, args.model, model_name, answer_spec(args), args.seed, log)
        if len(data) <= args.eval_windows:
            raise ValueError(f"only {len(data)} answers for {args.eval_windows} held-out rows; lower --eval-windows")
        held_out, train = data.split(args.eval_windows)
        unit = f"answers x {data.tokens.shape[1]} positions"
        train_rows, held_out_rows = widened(train.rows, args.bf16), widened(held_out.rows, args.bf16)
        return TrainingData(train_rows, held_out_rows, len(train), len(held_out), unit)
    if log is not None:
        log(f"tokenizing up to {args.train_tokens:,} tokens of the training split")
    windows = training_windows(tokenizer, args.seqlen, args.train_tokens, args.seed)
    if len(windows) <= args.eval_windows:
        raise ValueError(f"only {len(windows)} windows of {args.seqlen} tokens; raise --train-tokens")
    device = model.embed_tokens.weight.device

    def features(pool: list[list[int]]):
        @torch.no_grad()
        def rows(index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.tensor([pool[i] for i in index], device=device)
            return tokens, model(tokens, hidden_only=True)

        return rows

    held_out, train = windows[: args.eval_windows], windows[args.eval_windows :]
    unit = f"windows x {args.seqlen} tokens"
    return TrainingData(features(train), features(held_out), len(train), len(held_out), unit)


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


# ---- the trainers' main scaffold -------------------------------------------------------------------------------


def check_answer_args(ap, args) -> None:
    """A bad --answers-* value: one line before anything loads."""
    try:
        answer_spec(args)
    except ValueError as err:
        ap.error(str(err))


@dataclass
class TrainerInputs:
    model: torch.nn.Module  # the frozen target (fp32, no grad)
    model_config: object  # its runtime.config.ModelConfig
    path: Path  # its checkpoint directory
    tokenizer: object
    out: Path  # where the head is saved
    data: TrainingData


def load_trainer_inputs(ap, args, kind: str, log, device: torch.device | None = None) -> TrainerInputs:
    """Seed, load the frozen target (on ``device``; default the loader's), its tokenizer and the --data rows; the
    head goes to --out or $QSPEC_HOME/<kind>/MODEL. A split too small for its held-out rows is a usage error."""
    torch.manual_seed(args.seed)
    model, cfg, path = load_model(args.model, dtype=torch.float32, **({} if device is None else {"device": device}))
    model.requires_grad_(False)
    tokenizer = load_tokenizer(str(path))
    out = Path(args.out) if args.out else head_dir(kind, path)
    try:
        data = training_data(model, tokenizer, args, Path(path).name, log=log)
    except ValueError as err:
        ap.error(str(err))
    return TrainerInputs(model, cfg, path, tokenizer, out, data)


@dataclass
class Trainee:
    """What one trainer fits and how it differs from the others; train_head does the rest."""

    module: torch.nn.Module  # the head(s): .config (with .training), .save(out), train() / eval()
    params: list[torch.nn.Parameter]  # the trained parameters
    step_fn: Callable[[int], StepResult]
    measure: Callable[[], None]  # the final held-out measurement, written into module.config
    describe: str  # the start line's shape of the head ("3 heads", "window 6")
    summary: Callable[[], str]  # the closing line's held-out result
    clip_grad_norm: float | None = None


def train_head(kind: str, trainee: Trainee, inputs: TrainerInputs, args, argv: list[str] | None) -> None:
    """AdamW within the wall-clock budget (train_within_budget), saving to inputs.out every --save-every steps and
    at the end, the final save with the held-out measurement; a start line and a closing line on stderr."""
    module, params, out, data = trainee.module, trainee.params, inputs.out, inputs.data
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    command = f"python -m speculate.{kind}.train " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(
        f"[{kind}] {data.n_train} {data.unit}, {trainee.describe}, "
        f"{sum(p.numel() for p in params) / 1e6:.2f}M trainable params, budget {args.minutes} min -> {out}",
        file=sys.stderr,
    )
    progress = TrainingProgress(command)

    def save(final: bool) -> None:
        module.eval()
        module.config.training = progress.record(final)
        if final:
            trainee.measure()
        module.save(out)
        module.train()

    module.train()
    train_within_budget(
        kind,
        trainee.step_fn,
        params,
        opt,
        progress,
        save,
        lr=args.lr,
        minutes=args.minutes,
        max_steps=args.max_steps,
        save_every=args.save_every,
        clip_grad_norm=trainee.clip_grad_norm,
    )
    print(
        f"[{kind}] done: {progress.step} steps, {progress.tokens_seen} tokens, "
        f"{(time.perf_counter() - progress.started) / 60:.1f} min; held-out {trainee.summary()} -> {out}",
        file=sys.stderr,
    )
