"""The lm-eval adapter against lm-eval's own HF model on the same weights, and the offline wiki tasks."""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.api.instance import Instance

from evals.quality.lm_eval_adapter import QspecLM
from evals.quality.wiki_tasks import TASKS, build_tasks, mask_title
from runtime.loader import save_checkpoint
from runtime.model import random_model
from tests.tiny_models import tiny_model_config


@pytest.fixture(scope="module")
def tokenizer():
    from runtime.loader import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def tiny_real_vocab(tokenizer, tmp_path_factory):
    """A tiny random model over the real tokenizer's vocabulary, saved as an HF checkpoint too."""
    cfg = tiny_model_config(
        vocab_size=len(tokenizer),
        intermediate_size=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=[2],
        max_position_embeddings=256,
    )
    model = random_model(cfg, seed=0, std=0.05)
    path = save_checkpoint(model, tmp_path_factory.mktemp("tiny") / "ckpt", tokenizer_from=None)
    tokenizer.save_pretrained(path)
    return model, path


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " the city of Lyon"),  # shares its context (a multiple-choice question)
    ("Question: what is 2 + 2?\nAnswer: ", "4"),  # trailing space moves to the continuation
    ("", "A sentence scored from the prefix token alone."),
    ("Mercury is the smallest planet", " in the Solar System, and the closest to the Sun."),
]


@pytest.fixture(scope="module")
def hflm(tiny_real_vocab):
    from lm_eval.models.huggingface import HFLM

    _, path = tiny_real_vocab
    return HFLM(pretrained=str(path), device="cpu", dtype="float32", batch_size=2, max_length=256)


@pytest.mark.parametrize("score_mode", ["forward", "cache"])
def test_loglikelihood_matches_lm_eval_hf(tiny_real_vocab, tokenizer, hflm, score_mode):
    model, _ = tiny_real_vocab
    ours = QspecLM(model=model, tokenizer=tokenizer, batch_size=3, max_length=256, score_mode=score_mode)
    got = ours.loglikelihood(requests("loglikelihood", PAIRS))
    want = hflm.loglikelihood(requests("loglikelihood", PAIRS))
    for (g, g_greedy), (w, w_greedy) in zip(got, want):
        assert g == pytest.approx(w, abs=1e-3)
        assert g_greedy == w_greedy


def test_cached_scoring_of_a_mixed_bf16_model(tiny_real_vocab, tokenizer):
    """bf16 layers with an fp32 embedding / head / residual (set_dtype mixed): the cache takes the layers' dtype,
    and both scoring paths agree (the flagship's bf16 row runs tasks this way)."""
    import copy

    model, _ = tiny_real_vocab
    mixed = copy.deepcopy(model).set_dtype(torch.bfloat16, mixed=True)
    got = {
        mode: QspecLM(model=mixed, tokenizer=tokenizer, batch_size=3, max_length=256, score_mode=mode).loglikelihood(
            requests("loglikelihood", PAIRS)
        )
        for mode in ("forward", "cache")
    }
    for (f, _), (c, _) in zip(got["forward"], got["cache"]):
        assert c == pytest.approx(f, abs=0.1)


def test_loglikelihood_rolling_matches_lm_eval_hf(tiny_real_vocab, tokenizer, hflm):
    model, _ = tiny_real_vocab
    long_text = " ".join(["Wikipedia is a free online encyclopedia written by volunteers."] * 40)  # > 256 tokens
    texts = [(long_text,), ("A short document.",)]
    ours = QspecLM(model=model, tokenizer=tokenizer, batch_size=4, max_length=256)
    got = ours.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    want = hflm.loglikelihood_rolling(requests("loglikelihood_rolling", texts))
    assert got == pytest.approx(want, abs=1e-2)


def test_loglikelihood_against_direct_sum(tiny_real_vocab, tokenizer):
    """Independent of lm-eval: log p(continuation | context) summed by hand from one forward."""
    model, _ = tiny_real_vocab
    ctx = tokenizer("The capital of France is", add_special_tokens=False).input_ids
    cont = tokenizer(" Paris, a city", add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont]))[0].log_softmax(-1)
    want = sum(float(logits[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
    ours = QspecLM(model=model, tokenizer=tokenizer)
    ((got, _),) = ours.loglikelihood(requests("loglikelihood", [("The capital of France is", " Paris, a city")]))
    assert got == pytest.approx(want, abs=1e-4)


def test_generate_until_stops_and_matches_runtime(tiny_real_vocab, tokenizer):
    from runtime.decoding import generate
    from runtime.sampling import SamplingParams

    model, _ = tiny_real_vocab
    ours = QspecLM(model=model, tokenizer=tokenizer, batch_size=2)
    prompts = ["Once upon a time", "The answer is"]
    args = [(p, {"until": ["\n\n"], "max_gen_toks": 8}) for p in prompts]
    out = ours.generate_until(requests("generate_until", args))
    for p, text in zip(prompts, out):
        ids = tokenizer(p, add_special_tokens=False).input_ids
        ref = generate(model, [ids], SamplingParams(max_tokens=8, stop=["\n\n"]), tokenizer=tokenizer).tokens[0]
        assert text == tokenizer.decode(ref, skip_special_tokens=True).split("\n\n")[0]


def test_offline_tasks_are_reproducible_and_from_eval_split(tmp_path):
    from runtime.data import CALIB_START, wiki_docs

    a = build_tasks(tmp_path / "a", seed=0, n=50)
    b = build_tasks(tmp_path / "b", seed=0, n=50)
    c = build_tasks(tmp_path / "c", seed=1, n=50)
    for task in TASKS:
        assert (a / f"{task}.jsonl").read_bytes() == (b / f"{task}.jsonl").read_bytes()
        assert (a / f"{task}.yaml").is_file()
    assert (a / "qspec_wiki_title.jsonl").read_bytes() != (c / "qspec_wiki_title.jsonl").read_bytes()
    calib_titles = {d.title for d in wiki_docs("en")[CALIB_START:]}
    eval_titles = {d.title for d in wiki_docs("en")[:CALIB_START]}
    for task in TASKS:
        rows = [json.loads(line) for line in (a / f"{task}.jsonl").read_text().splitlines()]
        assert len(rows) == 50
        assert all(r["title"] in eval_titles for r in rows)
        assert not {r["title"] for r in rows} & (calib_titles - eval_titles)
    title_rows = [json.loads(line) for line in (a / "qspec_wiki_title.jsonl").read_text().splitlines()]
    for r in title_rows:
        assert len(r["choices"]) == 4 and r["choices"][r["label"]] == r["title"] and len(set(r["choices"])) == 4
    topic_rows = [json.loads(line) for line in (a / "qspec_wiki_topic.jsonl").read_text().splitlines()]
    assert len(topic_rows[0]["choices"]) == len({d.topic for d in wiki_docs("en")[:CALIB_START] if d.topic})
    assert mask_title("Mercury is a planet. Mercury is small.", "Mercury (planet)") == "___ is a planet. ___ is small."


def test_run_tasks_on_tiny_model_with_stderr(tiny_real_vocab, tokenizer, tmp_path):
    from evals.quality.lm_eval_tasks import run_tasks

    model, _ = tiny_real_vocab
    lm = QspecLM(model=model, tokenizer=tokenizer, batch_size=8, max_length=256)
    out = run_tasks(lm, ["qspec_wiki"], limit=6, tasks_dir=tmp_path, n_docs=20, bootstrap_iters=10)
    res = out["results"]
    assert set(TASKS) <= set(res)
    for task in ("qspec_wiki_topic", "qspec_wiki_title", "qspec_wiki_lastword"):
        assert 0 <= res[task]["acc"]["value"] <= 1 and res[task]["acc"]["stderr"] is not None
    assert res["qspec_wiki_ppl"]["word_perplexity"]["value"] > 1


def test_cli_rejects_bad_model_and_unknown_task(tmp_path, capsys, monkeypatch):
    from evals.quality import tasks

    with pytest.raises(SystemExit) as exit_:
        tasks.main(["--model", str(tmp_path / "nope"), "--tasks", "qspec_wiki_topic"])
    assert exit_.value.code == 2 and "nope" in capsys.readouterr().err


@pytest.mark.slow  # an unknown name makes lm-eval index its thousands of bundled task YAMLs (minutes here)
def test_unknown_task_is_named(tmp_path):
    from evals.quality import lm_eval_tasks

    class FakeLM:  # never reached: the task name is checked before any scoring
        pass

    with pytest.raises(ValueError, match="no_such_task"):
        lm_eval_tasks.run_tasks(FakeLM(), ["no_such_task"], tasks_dir=tmp_path, n_docs=5)


def test_verdict_task_delta_is_the_difference_of_two_task_runs(tiny_real_vocab, tokenizer):
    """evals.speculation.lossless's task delta (an approximate verdict's figure) against lm-eval run on each model."""
    import copy

    from evals.quality.lm_eval_tasks import run_tasks
    from evals.speculation.lossless import TaskProbe, task_delta

    model, _ = tiny_real_vocab
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    probe = TaskProbe(tokenizer, name="qspec_wiki_title", limit=12)
    figures = task_delta(model, other, probe)

    def acc(m):
        lm = QspecLM(model=m, tokenizer=tokenizer)
        return run_tasks(lm, ["qspec_wiki_title"], limit=12, bootstrap_iters=10)["results"]["qspec_wiki_title"]["acc"]

    assert figures["task_acc_baseline"] == acc(model)["value"]
    assert figures["task_acc_candidate"] == acc(other)["value"]
    assert figures["task_delta"] == figures["task_acc_candidate"] - figures["task_acc_baseline"]
