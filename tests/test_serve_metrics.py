"""evals.serving.metrics against numpy and hand-computed definitions; CLI argument errors of the serving tools."""

from __future__ import annotations

import importlib
import math
import random

import numpy as np
import pytest

from evals.serving.metrics import SLO, RequestRecord, distribution, format_summary, percentile, summarize


def test_percentile_matches_numpy_linear():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 100):
            assert math.isclose(percentile(xs, p), float(np.percentile(xs, p)), rel_tol=1e-12)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_request_latencies_follow_the_definitions():
    r = RequestRecord(send_time=10.0, token_times=[10.5, 10.7, 11.0, 11.1], end_time=11.2, prompt_tokens=5,
                      output_tokens=4)  # fmt: skip
    assert math.isclose(r.ttft, 0.5)
    assert math.isclose(r.tpot, (11.2 - 10.5) / 3)  # (E2E - TTFT) / (n - 1): the first token excluded
    assert [round(x, 9) for x in r.itls] == [0.2, 0.3, 0.1]
    assert math.isclose(r.e2e, 1.2)
    single = RequestRecord(send_time=0.0, token_times=[0.3], end_time=0.3, output_tokens=1)
    assert single.tpot is None and single.itls == []


def test_summary_throughput_and_goodput():
    fast = RequestRecord(0.0, [0.1, 0.2, 0.3], 0.3, prompt_tokens=10, output_tokens=3)
    slow = RequestRecord(0.0, [2.0, 2.5, 3.0], 3.0, prompt_tokens=10, output_tokens=3)
    failed = RequestRecord(0.0, [], 1.0, ok=False, error="HTTP 400")
    s = summarize([fast, slow, failed], duration_s=4.0, slo=SLO(ttft_s=1.0))
    assert s["completed"] == 2 and s["failed"] == 1
    assert math.isclose(s["output_token_throughput"], 6 / 4) and math.isclose(s["total_token_throughput"], 26 / 4)
    assert math.isclose(s["goodput"], 1 / 4) and math.isclose(s["slo_attainment"], 1 / 3)
    assert s["ttft_s"] == distribution([0.1, 2.0])
    for no_slo in (None, SLO()):  # no limit given: no goodput, and no goodput line
        plain = summarize([fast, slow, failed], duration_s=4.0, slo=no_slo)
        assert "goodput" not in plain and "goodput" not in format_summary(plain)
    assert "goodput 0.25 req/s" in format_summary(s)
    assert math.isclose(s["tpot_s"]["mean"], (0.1 + 0.5) / 2)


@pytest.mark.parametrize(
    "module,args,needle",
    [
        ("evals.serving.loadgen", ["--arrival", "poisson"], "--rate > 0"),
        ("evals.serving.loadgen", ["--num-requests", "0"], "--num-requests must be >= 1"),
        ("evals.serving.loadgen", ["--min-output-tokens", "50", "--max-output-tokens", "10"], "--min-output-tokens"),
        ("evals.serving.bench_serving", ["--concurrency", "0"], "--concurrency values must be >= 1"),
        ("runtime.server", ["--port", "0"], "--port must be >= 1"),
        ("runtime.server", ["--kv-cache-gb", "-1"], "--kv-cache-gb must be > 0"),
    ],
)
def test_cli_rejects_bad_arguments_with_a_clear_error(module, args, needle, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main(args)  # argparse errors come before any model is loaded
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err
