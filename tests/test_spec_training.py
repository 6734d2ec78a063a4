"""The draft-head trainers (Medusa, EAGLE) share one budgeted loop: schedule, saves, Ctrl-C. Both run end to end
here on a tiny model with the real tokenizer, and the loop's pieces are checked against their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.cliutil import EXIT_INTERRUPTED
from runtime.data import wiki_split
from runtime.kernels import cpu_step
from runtime.kernels.cpu_step import FAMILY_FLAGS
from runtime.loader import load_model, load_tokenizer, resolve
from runtime.model import random_model
from runtime.prompts import CATEGORIES
from speculate.eagle import train as eagle_train
from speculate.eagle.head import load_eagle
from speculate.medusa import train as medusa_train
from speculate.medusa.heads import load_medusa
from speculate.training import (
    WARMUP_STEPS,
    AnswerSpec,
    StepResult,
    TrainingProgress,
    answer_features,
    bf16_autocast_pays,
    head_dir,
    learning_rate,
    target_answers,
    train_within_budget,
    training_prompts,
)
from tests.serve_helpers import save_tiny_checkpoint
from tests.tiny_models import tiny_model_config

COMMON = ["--data", "wiki", "--seqlen", "32", "--train-tokens", "3000", "--eval-windows", "2", "--batch-size", "2"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_learning_rate_warms_up_then_follows_the_cosine():
    assert learning_rate(1.0, 0, 0.0) == pytest.approx(1 / WARMUP_STEPS)
    assert learning_rate(1.0, WARMUP_STEPS - 1, 0.0) == pytest.approx(1.0)
    assert learning_rate(2.0, 100, 0.5) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert learning_rate(1.0, 100, 1.7) == pytest.approx(0.0)  # past the budget: clamped at the end of the cosine


def test_loop_updates_saves_and_keeps_the_head_on_ctrl_c():
    weight = torch.nn.Parameter(torch.tensor([3.0]))
    opt = torch.optim.SGD([weight], lr=0.1)
    saves: list[tuple[int, bool]] = []
    progress = TrainingProgress("cmd")

    def step_fn(step: int) -> StepResult:
        if step == 5:
            raise KeyboardInterrupt
        return StepResult((weight**2).sum(), [0.5], new_tokens=7)

    with pytest.raises(SystemExit) as stop:
        train_within_budget(
            "t", step_fn, [weight], opt, progress, lambda final: saves.append((progress.step, final)),
            lr=0.1, minutes=1.0, max_steps=100, save_every=2,
        )  # fmt: skip
    assert stop.value.code == EXIT_INTERRUPTED
    assert saves == [(2, False), (4, False), (5, False)]  # every 2 steps, then the head at the interrupt
    assert progress.step == 5 and progress.tokens_seen == 35 and len(progress.history) == 5
    assert weight.item() < 3.0  # the updates were applied
    record = progress.record(final=False)
    assert record["steps"] == 5 and record["tokens"] == 35 and record["final"] is False and record["command"] == "cmd"


def test_interrupt_before_any_step_saves_nothing():
    weight = torch.nn.Parameter(torch.zeros(1))
    saves = []

    def step_fn(step):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit):
        train_within_budget(
            "t", step_fn, [weight], torch.optim.SGD([weight], lr=0.1), TrainingProgress("c"), saves.append,
            lr=0.1, minutes=1.0, max_steps=10, save_every=1,
        )  # fmt: skip
    assert saves == []


@pytest.mark.parametrize(
    "trainer, loader, extra",
    [
        (medusa_train, load_medusa, ["--num-heads", "2"]),
        (eagle_train, load_eagle, ["--window", "3", "--reuse", "2", "--candidates", "8"]),
    ],
    ids=["medusa", "eagle"],
)
def test_trainer_runs_three_steps_and_saves_a_loadable_head(tiny_ckpt, tmp_path, trainer, loader, extra):
    out = tmp_path / "head"
    trainer.main(["--model", str(tiny_ckpt), *COMMON, *extra, "--max-steps", "3", "--minutes", "5", "--out", str(out)])
    model, _, _ = load_model(str(tiny_ckpt), dtype=torch.float32)
    head = loader(out, model)  # refuses another model's head: the fingerprint matched
    record = head.config.training
    assert record["steps"] == 3 and record["final"] is True and len(record["history"]) == 3
    assert record["tokens"] > 0 and all(math.isfinite(h["loss"]) for h in record["history"])
    assert head.config.accuracy  # the held-out table of a final save


def test_heads_live_under_one_directory_per_kind_and_model(monkeypatch, tmp_path):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    assert head_dir("medusa", "/x/models/smollm2-135m") == tmp_path / "medusa" / "smollm2-135m"
    assert head_dir("eagle", "./SmolLM2.Q4_1.gguf") == tmp_path / "eagle" / "SmolLM2.Q4_1"


@pytest.mark.parametrize(
    "trainer, loader, extra",
    [(medusa_train, load_medusa, ["--num-heads", "2"]), (eagle_train, load_eagle, ["--window", "3", "--reuse", "1"])],
    ids=["medusa", "eagle"],
)
# bf16 autocast: ~2 min on an AVX2 CPU (emulated bf16 GEMMs), so -m slow
@pytest.mark.parametrize("precision", ["--no-bf16", pytest.param("--bf16", marks=pytest.mark.slow)])
def test_trainer_on_the_targets_own_answers(tmp_path, monkeypatch, trainer, loader, extra, precision):
    """--data answers: the target answers training-split prompts (cached under $QSPEC_HOME), the heads fit on
    the answer positions, and the held-out table comes from held-out answers; under bf16 autocast and in fp32
    (the cached bf16 features widened for training and held-out rows alike), whatever this CPU's default."""
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", max_len=1024)  # whole prompts: passages of up to ~600 tokens
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    data = ["--data", "answers", "--answers-per-category", "1", "--answer-tokens", "6", "--eval-windows", "2"]
    out = tmp_path / "head"
    args = ["--model", str(ckpt), *data, "--batch-size", "2", *extra, precision, "--max-steps", "2", "--minutes", "5"]
    trainer.main([*args, "--out", str(out)])
    cached = list((tmp_path / "home" / "data").glob("answers-*"))
    assert len(cached) == 2  # the answers and their features, shared by the next trainer
    model, _, _ = load_model(str(ckpt), dtype=torch.float32)
    head = loader(out, model)
    assert head.config.training["steps"] == 2 and head.config.training["tokens"] == 2 * 2 * 7
    assert head.config.accuracy


def test_training_prompts_cover_every_category_from_the_training_split_only():
    tokenizer = load_tokenizer(str(resolve("smollm2-135m")))
    spec = AnswerSpec(per_category=2, max_tokens=16)
    prompts = training_prompts(tokenizer, spec)
    assert len(prompts) == 2 * len(CATEGORIES)
    text = [tokenizer.decode(p) for p in prompts]
    eval_titles = {d.title for d in wiki_split("eval")}
    train_titles = {d.title for d in wiki_split("train")}
    assert all(any(t in x for t in train_titles) for x in text)
    assert not any(f"Tell me about {t}." in x for x in text for t in eval_titles)  # chat turns name their document


@pytest.mark.slow  # 0.5-1.5 min here: the default suite keeps under 15 min
def test_answers_are_greedy_and_features_equal_each_sequence_alone(tmp_path, monkeypatch):
    """Oracles: each answer is the argmax continuation by full forwards (no cache, one row); each row's features
    are the hidden states of its own unpadded forward, cut to the answer span, whatever its batch mates."""
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    tokenizer = load_tokenizer(str(resolve("smollm2-135m")))
    cfg = tiny_model_config(vocab_size=len(tokenizer), max_position_embeddings=1024)
    model = random_model(cfg, seed=1)
    spec = AnswerSpec(per_category=1, max_tokens=3, batch=4)
    sequences = target_answers(model, tokenizer, spec, "tiny")
    assert spec.cache_path("tiny").is_file() and target_answers(None, tokenizer, spec, "tiny") == sequences
    prompts = training_prompts(tokenizer, spec)
    for prompt, seq in list(zip(prompts, sequences))[:2]:
        ids = list(prompt)
        for _ in range(spec.max_tokens):
            ids.append(int(model.logits(model(torch.tensor([ids]), hidden_only=True))[0, -1].argmax()))
        assert seq == ids
    span = spec.max_tokens + 1
    feats = answer_features(model, sequences, span, seed=0, batch=3, bf16=False)
    assert feats.tokens.shape == (len(sequences), span)
    assert feats.hidden.shape == (len(sequences), span, cfg.hidden_size)
    for row in range(len(feats)):
        seq = next(s for s in sequences if s[-span:] == feats.tokens[row].tolist())
        alone = model(torch.tensor([seq]), hidden_only=True)[0, -span:]
        torch.testing.assert_close(feats.hidden[row].float(), alone, atol=2e-2, rtol=2e-2)  # kept in bf16


def test_distill_loss_counts_only_predictions_inside_the_answer():
    """Head k at position t predicts token t + 1 + k; with row ends [T, 4] row 1's predictions of tokens past
    index 4 drop out. Oracle: KL(teacher || head) summed by hand over the kept positions."""
    from speculate.medusa.heads import MedusaConfig, MedusaHeads
    from speculate.medusa.train import distill_loss

    cfg = tiny_model_config()
    model = random_model(cfg, seed=0)
    heads = MedusaHeads(MedusaConfig(num_heads=2, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    full, _ = distill_loss(heads, model, hidden)
    assert distill_loss(heads, model, hidden, ends=torch.tensor([8, 8]))[0].item() == pytest.approx(full.item())
    loss, _ = distill_loss(heads, model, hidden, ends=torch.tensor([8, 4]))
    with torch.no_grad():
        teacher = torch.log_softmax(model.logits(hidden), -1)
        student = torch.log_softmax(heads(hidden, model.lm_head), -1)  # [K, B, T, V]
    expected = []
    for k in (1, 2):
        kept = [(b, t) for b in range(2) for t in range(8 - k) if t + 1 + k <= (8, 4)[b]]
        kl = [(teacher[b, t + k].exp() * (teacher[b, t + k] - student[k - 1, b, t])).sum() for b, t in kept]
        expected.append(torch.stack(kl).mean())
    assert loss.item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-5)


@pytest.mark.parametrize("flags", [{"avx2", "fma", "f16c"}, FAMILY_FLAGS["avx512"], FAMILY_FLAGS["avx512bf16"]])
def test_bf16_autocast_only_where_the_cpu_has_bf16_dot_products(monkeypatch, flags):
    """The trainers' default: bf16 autocast on a GPU and on CPUs with avx512_bf16, fp32 where bf16 GEMMs are
    emulated (AVX2, plain AVX-512: 6-7x slower than fp32 there); --bf16 / --no-bf16 override it."""
    monkeypatch.setattr(cpu_step, "cpu_flags", lambda: set(flags))
    native = "avx512_bf16" in flags
    assert bf16_autocast_pays("cpu") is native and bf16_autocast_pays("cuda") is True
    for trainer in (medusa_train, eagle_train):
        ap = trainer.build_parser()
        assert ap.parse_args([]).bf16 is None  # resolved by bf16_autocast_pays in main
        assert ap.parse_args(["--bf16"]).bf16 is True and ap.parse_args(["--no-bf16"]).bf16 is False
