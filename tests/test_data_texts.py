"""The evaluation texts beyond the wiki extracts (runtime/data.py): wiki-desc and chat come from documents
< 5000 only (the calibration split starts at 5000), are deterministic, and are selectable by name."""

from __future__ import annotations

import json

import pytest

from runtime.config import ModelConfig
from runtime.data import (
    CALIB_START,
    CHAT_TEMPLATES,
    ChatSpec,
    chat_prompts,
    chat_text,
    generate_chat,
    load_text,
    mixture_counts,
    parse_mixture,
    wiki_docs,
)
from runtime.model import random_model


def test_wiki_desc_is_the_descriptions_of_each_split():
    docs = wiki_docs("en")
    assert load_text("wiki-desc", "eval").split("\n") == [d.description for d in docs[:CALIB_START] if d.description]
    assert load_text("wiki-desc", "calib").split("\n") == [d.description for d in docs[CALIB_START:] if d.description]


def test_unknown_text_name_is_a_clear_error():
    with pytest.raises(ValueError, match="neither a text name .*wiki-desc, chat.* nor a file"):
        load_text("wiki-de", "eval")


def test_chat_prompts_are_seeded_and_built_from_eval_titles_only():
    titles = {d.title for d in wiki_docs("en")[:CALIB_START]}
    prompts = chat_prompts(40, seed=0)
    assert prompts == chat_prompts(40, seed=0) and prompts != chat_prompts(40, seed=1)
    eval_prompts = {template.format(t=t) for template in CHAT_TEMPLATES for t in titles}
    assert set(prompts) <= eval_prompts  # each one a template filled with a title of a document < 5000


def test_chat_has_no_calibration_split():
    with pytest.raises(ValueError, match="only an eval split"):
        chat_text("calib")


@pytest.fixture(scope="module")
def tokenizer():
    from runtime.loader import load_tokenizer, resolve

    return load_tokenizer(str(resolve("smollm2-135m")))


def test_generated_transcripts_are_reproducible(tokenizer):
    cfg = ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        eos_token_ids=[2],
        max_position_embeddings=256,
    )
    model = random_model(cfg, seed=0)
    spec = ChatSpec(prompts=3, max_tokens=6, batch=2)
    first = generate_chat(model, tokenizer, spec)
    assert first == generate_chat(model, tokenizer, spec)
    assert [t["prompt"] for t in first] == chat_prompts(3, 0)
    assert first != generate_chat(model, tokenizer, ChatSpec(prompts=3, max_tokens=6, batch=2, seed=5))


@pytest.mark.slow  # ~0.5 min here: the default suite keeps under 15 min
def test_chat_text_renders_the_cached_transcripts_with_the_chat_template(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path))
    spec = ChatSpec()
    transcripts = [
        {"prompt": "What is X?", "reply": "X is a letter.", "finish": "eos"},
        {"prompt": "Q2", "reply": "A2"},
    ]
    spec.cache_path().parent.mkdir(parents=True)
    spec.cache_path().write_text(json.dumps({"transcripts": transcripts}))
    text = load_text("chat", "eval")
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is X?"}, {"role": "assistant", "content": "X is a letter."}], tokenize=False
    )
    assert text.startswith(first.strip() + "\n\n")
    assert text.count("<|im_start|>assistant\n") == 2 and text.endswith("A2<|im_end|>")


def test_mixture_weights_and_counts():
    assert parse_mixture("wiki:2,wiki-fr:1,wiki-es:1") == [("wiki", 0.5), ("wiki-fr", 0.25), ("wiki-es", 0.25)]
    assert mixture_counts(parse_mixture("wiki:0.5,wiki-fr:0.25,wiki-es:0.25"), 10) in ([5, 3, 2], [5, 2, 3])
    for n in range(1, 20):
        counts = mixture_counts(parse_mixture("wiki:0.6,wiki-fr:0.3,wiki-desc:0.1"), n)
        assert sum(counts) == n and all(
            abs(c - w * n) < 1 for c, (_, w) in zip(counts, parse_mixture("wiki:0.6,wiki-fr:0.3,wiki-desc:0.1"))
        )
