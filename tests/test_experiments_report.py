"""The flagship report re-rendered from recorded records: comparable quality axis, one baseline per speedup."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.report import lossless_words, main, measured_class, short_baseline, table_rows

RECORDS = Path(__file__).resolve().parent.parent / "notes" / "issue-7" / "lossless_records.jsonl"


def test_report_from_records(tmp_path):
    main([str(RECORDS), "--out", str(tmp_path)])
    records = [json.loads(line) for line in RECORDS.read_text().splitlines()]
    rows = {r["row"]: r for r in table_rows(records)}
    table = (tmp_path / "table.md").read_text()
    summary = (tmp_path / "summary.md").read_text()
    assert (tmp_path / "speedup_vs_quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.startswith("# lossless: what does each speedup cost in quality, and what does it buy?")
    for name, r in rows.items():
        line = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        if r["scored_on"] == "engine greedy outputs":  # own outputs: kept off the teacher-forced column
            assert "| n/a ¹ |" in line and f"{r['perplexity']:.3f}" not in line
        elif r["perplexity_delta"] is not None:
            assert f"{r['perplexity_delta']:+.3f} ({r['perplexity']:.3f})" in line
        if r["speedup"] is not None:  # every speedup names its own baseline
            assert f"{r['speedup']:.2f}x ({r['baseline']})" in line
    # the column is evals.speculation.lossless's class: measured for model changes, the claim marked untested for
    # speculators recorded before their distribution test ran in the config
    assert "| fp32 reference | yes (bit-identical) | baseline |" in summary
    gptq = rows["GPTQ4 g128"]
    assert (
        f"| GPTQ4 g128 | no (approximate) | {gptq['speedup']:.2f}x (bf16 model) | {gptq['perplexity_delta']:+.3f}"
        in (summary)
    )
    n_greedy = rows["spec n-gram (greedy)"]["speedup"]
    n_sampled = rows["spec n-gram (sampled)"]["speedup"]
    claimed = "yes (same distribution), claimed (untested)"
    line = f"| spec n-gram (greedy / sampled) | {claimed} | {n_greedy:.2f}x / {n_sampled:.2f}x"
    assert line in summary


def test_short_baselines():
    assert short_baseline("full recompute of the sequence every step (no cache)") == "no KV cache"
    assert short_baseline("plain decoding, batch 1, temperature 0.7") == "plain decoding, T=0.7"
    assert short_baseline(None) == ""


def test_lossless_column_is_the_measured_class():
    row = {"class": "same distribution", "verdict": None}
    assert lossless_words(row) == "yes (same distribution), claimed (untested)"
    assert lossless_words({**row, "verdict": "same distribution"}) == "yes (same distribution)"
    assert lossless_words({**row, "verdict": "not lossless"}) == "NO: not lossless (claimed same distribution)"
    assert lossless_words({**row, "verdict": "inconclusive"}) == "inconclusive (claimed same distribution)"
    assert lossless_words({"class": "same math", "verdict": "bit-identical"}) == "yes (bit-identical)"
    assert lossless_words({"class": "approximate", "verdict": "approximate"}) == "no (approximate)"
    fid = {"bit_identical": False, "max_abs_dlogprob": 0.5}
    assert measured_class("same math", {"fidelity": fid}) == "not lossless"  # a claim the logits refute
    assert measured_class("approximate", {"fidelity": fid}) == "approximate"
    assert measured_class("same distribution", {"fidelity": fid, "speculator": "ngram"}) is None
    assert measured_class("same math", {"verdict": {"verdict": "same math"}}) == "same math"


def test_a_self_timed_speculation_row_shows_its_suites_overall_speedup():
    """A specbench row has no timed section: its speedup is the suite's overall row (plain decoding of the same
    prompts, interleaved), not "baseline"."""
    suite = [
        {"category": "qa", "speedup_vs_plain": 2.4, "tok_per_s": 25.0},
        {"category": "overall", "speedup_vs_plain": 1.667, "tok_per_s": 19.5},
    ]
    record = {
        "row": {"name": "spec n-gram", "kind": "specbench", "lossless_class": "same distribution"},
        "status": "ok",
        "results": {"suite": suite, "weight_bytes": 10},
    }
    (row,) = table_rows([record])
    assert row["speedup"] == 1.667 and row["tokens_per_s"] == 19.5
    assert row["baseline"].startswith("plain decoding") and short_baseline(row["baseline"]) == "plain decoding"
    (untimed,) = table_rows([{**record, "results": {"weight_bytes": 10}}])
    assert untimed["speedup"] is None
