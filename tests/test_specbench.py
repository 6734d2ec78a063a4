"""evals.speculation.specbench: the offline suite's categories (translation only where the parallel summaries share a
title; the rewriting input is the extract with seeded typos), and a run of every speculator
on the tiny random model whose greedy outputs must equal plain decoding."""

from __future__ import annotations

import json

import pytest

from evals.speculation.cost_model import load_profile
from evals.speculation.specbench import main, progress_calls
from evals.speculation.specbench_suite import SMOKE_CONFIG, parse_method, run_suite, smoke_suite
from runtime.data import wiki_docs, wiki_split
from runtime.model import random_model
from runtime.prompts import CATEGORIES, SuiteError, add_typos, build_suite


def test_suite_categories_and_sources():
    suite = build_suite(per_category=3, seed=0)
    assert [s.category for s in suite] == [c for c in CATEGORIES for _ in range(3)]
    assert len({s.title for s in suite}) == len(suite)  # no document reused across categories
    eval_docs = {d.title: d for d in wiki_split("eval")}
    assert all(s.title in eval_docs for s in suite)  # never the training split
    for s in suite:
        if s.category == "translation":
            other = {d.title: d for d in wiki_docs(s.language)}
            assert s.language in ("fr", "es") and other[s.title].extract == s.reference
        if s.category == "rewriting":
            source = eval_docs[s.title].extract
            typo = add_typos(source, s.title)
            assert s.messages[0]["content"].endswith(typo) and typo != source and len(typo) == len(source)
            assert sorted(typo) == sorted(source)  # letters swapped, none added or lost
        if s.category == "chat":
            assert [m["role"] for m in s.messages] == ["user", "assistant", "user"]
    assert build_suite(per_category=3, seed=0) == suite  # fixed seed
    with pytest.raises(SuiteError, match="per_category"):
        build_suite(per_category=0)


@pytest.mark.parametrize("copy_tokens", [64, 128])
def test_copy_task_passages_outlast_the_generation(default_model, copy_tokens):
    """Rewriting and translation answers are as long as their passage: the passage (as the target tokenizes it)
    must hold the generation budget, so a fixed-length run measures the task, not text after the answer."""
    tokenizer = default_model[1]
    suite = build_suite(per_category=4, seed=1, copy_tokens=copy_tokens)
    eval_docs = {d.title: d for d in wiki_split("eval")}
    copy = [s for s in suite if s.category in ("rewriting", "translation")]
    assert len(copy) == 8
    for s in copy:
        extract = eval_docs[s.title].extract
        passage = add_typos(extract, s.title) if s.category == "rewriting" else extract
        assert len(tokenizer.encode(passage)) >= copy_tokens, (s.category, s.title)
    with pytest.raises(SuiteError, match="too few passages of >= 1792 characters"):
        build_suite(per_category=4, seed=1, copy_tokens=256)  # the eval split's longest extract: ~2.1k characters


def test_every_speculator_matches_plain_greedy():
    model = random_model(SMOKE_CONFIG, seed=0)
    prompts = [p for p in smoke_suite(1, 0, SMOKE_CONFIG.vocab_size) if p[0] in ("rewriting", "chat")]
    methods = [
        "plain",
        "ngram:k=4",
        "draft:layers=1,k=2",
        "quant-draft:bits=4,layers=1,k=2",
        "medusa:tree=4",
        "eagle:tree=4,depth=2",
    ]
    res = run_suite(
        model, prompts, methods, [1, 2], 10, {"medusa": None, "eagle": None}, smoke=True, warmup=0, log=lambda m: None
    )
    assert not res["not_identical"] and not res["skipped"]
    rows = {(r["batch"], r["category"], r["method"]): r for r in res["rows"]}
    assert len(rows) == 2 * 3 * len(methods)  # two categories + overall, at batch 1 and 2
    for (B, cat, m), r in rows.items():
        assert r["identical"], (B, cat, m)
        if m != "plain":
            assert r["tokens_per_step"] >= 1 and sum(r["fed_tokens_hist"].values()) == r["steps"]
            assert 0 <= r["draft_fraction"] <= 1 and r["speedup_vs_plain"] > 0
            # the decode phase alone: tokens after the first over the decode seconds, against plain's in the same run
            plain = rows[(B, cat, "plain")]
            assert r["decode_speedup_vs_plain"] == pytest.approx(
                r["decode_tok_per_s"] / plain["decode_tok_per_s"], rel=2e-3, abs=1e-4
            )  # the record rounds to 4 decimals: a slow method's small ratio is within 5e-5
    over = rows[(1, "overall", "ngram:k=4")]
    cats = [rows[(1, c, "ngram:k=4")] for c in ("rewriting", "chat")]
    assert over["tokens"] == sum(c["tokens"] for c in cats) and over["steps"] == sum(c["steps"] for c in cats)


@pytest.mark.parametrize("dtype", ["fp32", "w4a8-int8head"])
def test_cli_smoke(tmp_path, dtype):
    """A target in any named copy (a quantized one: lossless = equal to plain decoding of that copy)."""
    out = tmp_path / "s.json"
    main(
        [
            "--smoke",
            "--dtype",
            dtype,
            "--per-category",
            "1",
            "--batch-sizes",
            "1",
            "--max-tokens",
            "6",
            "--warmup",
            "0",
            "--categories",
            "qa",
            "--methods",
            "plain",
            "ngram:k=2",
            "draft:layers=1,k=2",
            "--strict",
            "--out",
            str(out),
        ]
    )
    rec = json.loads(out.read_text())
    assert rec["complete"] and {r["category"] for r in rec["rows"]} == {"qa", "overall"}
    assert rec["dtype"] == dtype and all(r["identical"] for r in rec["rows"]) and not rec["not_identical"]
    with pytest.raises(SuiteError, match="unknown speculator 'lookahead'"):
        parse_method("lookahead")
    with pytest.raises(SystemExit):
        main(["--smoke", "--methods", "ngram:k=2"])  # no plain baseline


def test_cost_curve_timed_in_the_same_process_predicts_every_row(tmp_path):
    """--cost-Ts: the curve and the drafts' propose() timed after the suite on its model; each batch-1 row's
    prediction is the cost model's formula on that curve (by hand here) beside the row's measured decode speedup."""
    out = tmp_path / "s.json"
    argv = ["--smoke", "--per-category", "1", "--batch-sizes", "1", "--max-tokens", "6", "--warmup", "0"]
    argv += ["--categories", "qa", "chat", "--methods", "plain", "ngram:k=2", "draft:layers=1,k=2"]
    main([*argv, "--cost-Ts", "3,1,2", "--cost-repeats", "1", "--out", str(out)])
    rec = json.loads(out.read_text())
    prof = rec["cost_profile"]
    c = {int(t): s for t, s in prof["verify_s"].items()}
    assert sorted(c) == [1, 2, 3] and set(prof["draft_s"]) == {"ngram:k=2", "draft:layers=1,k=2"}
    rows = {(r["category"], r["method"]): r for r in rec["rows"] if r["method"] != "plain"}
    preds = {(p["category"], p["method"]): p for p in rec["cost_predictions"]}
    assert set(preds) == set(rows) and len(rows) == 6  # qa, chat, overall x two methods
    for key, p in preds.items():
        row = rows[key]
        hist = {int(t): n for t, n in row["fed_tokens_hist"].items()}
        step = sum(n * (prof["empty_step_s"] if t == 1 else c[t]) for t, n in hist.items()) / sum(hist.values())
        expected = row["tokens_per_step"] * c[1] / (prof["draft_s"][key[1]] + step)
        assert p["predicted_speedup"] == pytest.approx(expected, rel=1e-3, abs=1e-4)
        assert p["measured_speedup"] == row["decode_speedup_vs_plain"]
    assert "median of 1 rounds" in prof["notes"]  # the timed round ran between the prompt batches (and a warm-up)
    assert "runs of 6 tokens" in prof["notes"]  # as long as the suite's answers (--max-tokens) by default
    assert progress_calls([("a", [1])] * 3 + [("b", [2])], [1, 2]) == (3 + 1) + (2 + 1)  # batches per size, category
    assert load_profile(str(out)).verify_s == c  # the record serves as spec_cost predict's --profile
    with pytest.raises(SystemExit):
        main([*argv, "--cost-Ts", "2,3"])  # no plain step in the curve
    with pytest.raises(SystemExit):
        main([*argv, "--cost-Ts", "1,2", "--cost-repeats", "0"])  # no timed round: refused before the suite runs
    with pytest.raises(SystemExit):
        main([*argv, "--cost-Ts", "1,2", "--cost-steps", "0"])


def test_a_composite_draft_row_counts_its_proposals_by_source(tmp_path):
    """Prompt lookup first: the row records how many steps the lookup answered and how many the draft model did, with
    the tokens the model drafted (the cost model prices the two apart); each batch-1 step is one row, by one source."""
    out = tmp_path / "s.json"
    main(["--smoke", "--per-category", "2", "--batch-sizes", "1", "--max-tokens", "12", "--warmup", "0",
          "--categories", "qa", "--methods", "plain", "draft:layers=1,k=2,lookup=2", "--out", str(out)])  # fmt: skip
    (row,) = [r for r in json.loads(out.read_text())["rows"] if r["method"] != "plain" and r["category"] == "overall"]
    src = row["draft_sources"]
    assert src["lookup_rows"] + src["model_rows"] == row["steps"]
    assert src["model_rows"] <= src["model_drafted"] <= 2 * src["model_rows"]
