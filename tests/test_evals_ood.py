"""evals.quality.ood: recipe files merge per text, and the table's gap closed is (RTN - x) / (RTN - fp32) on the
windows every recipe has."""

from __future__ import annotations

import json
import math

from evals.quality.ood import gap_closed, load_results, main, ppl_of


def write(path, **texts):
    """One record per call: texts name -> list of per-window summed NLLs."""
    rec = {"perplexity": {t: ppl_of(n) for t, n in texts.items()}, "window_nlls": texts}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def test_gap_closed_and_table(tmp_path, capsys):
    nll = lambda ppl: math.log(ppl) * 511  # noqa: E731  a window whose perplexity is ppl
    write(tmp_path / "fp32.jsonl", wiki=[nll(10)] * 2, **{"wiki-fr": [nll(20)] * 2})
    write(tmp_path / "fp32.jsonl", chat=[nll(4)] * 2)  # a later record adds a text
    write(tmp_path / "rtn.jsonl", wiki=[nll(14)] * 2, **{"wiki-fr": [nll(30)] * 2}, chat=[nll(6)] * 2)
    write(tmp_path / "gptq.jsonl", wiki=[nll(12)] * 3, **{"wiki-fr": [nll(27.5)] * 2}, chat=[nll(5)] * 2)
    assert set(load_results(tmp_path / "fp32.jsonl")) == {"wiki", "wiki-fr", "chat"}
    assert math.isclose(gap_closed(12, 14, 10), 50.0)
    main(["table", "--dir", str(tmp_path), "--rtn", "rtn", "--held-out", "chat"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| gptq"))
    # wiki: cut to the 2 windows every recipe has; wiki-fr: (30 - 27.5) / (30 - 20) = 25 %; chat held out of the mean
    assert row == "| gptq | 12.000 (+50.0 %) | 27.500 (+25.0 %) | 5.000 (+50.0 %) | +25.0 % |"
    assert "| wiki (2w) | wiki-fr (2w) | chat (2w) |" in out
