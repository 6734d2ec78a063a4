"""``python -m evals.speed.gpu_check --smoke``: the GPU check on tiny shapes on CPU, so it cannot rot between GPU runs.

Its timings mean nothing here; what is checked is that every section runs, that the exactness checks hold
(fp32 greedy identical to HF transformers, speculation and engine identical to plain decoding) and that the
record carries provenance and every bar with a status. A subprocess: the paged section's Triton kernel needs
TRITON_INTERPRET=1 set before triton is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = "bandwidth,exactness,decode,quant,speculation,engine,paths,paged"


def run_smoke(tmp_path: Path, sections: str | None) -> dict:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "evals.speed.gpu_check", "--smoke", "--device", "cpu", "--out", str(out)]
    if sections:
        cmd += ["--sections", sections]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| bar (issue 13) |" in proc.stdout
    return json.loads(out.read_text())


def check_record(record: dict, sections: list[str]) -> None:
    failed = {k: v.get("error") for k, v in record["sections"].items() if v["status"] != "ok"}
    assert not failed, failed
    assert sorted(record["sections"]) == sorted(sections)
    assert record["smoke"] is True and record["command"].startswith("python -m evals.speed.gpu_check")
    assert record["git_sha"] and "torch" in record["versions"]
    assert len(record["bars"]) == 8 and all(b["status"] for b in record["bars"])


def test_gpu_check_smoke_core(tmp_path):
    record = run_smoke(tmp_path, CORE)
    check_record(record, CORE.split(","))
    exact = record["sections"]["exactness"]
    assert exact["llama-1b_fp32_greedy_identical_eager"] and exact["llama-1b_fp32_greedy_identical_compiled"]
    assert exact["smollm2-135m_fp32_greedy_identical_eager"]
    assert record["every_path_runs"] is True
    assert {"graph_ms", "head_argmax_ms", "loop_ms"} <= set(record["sections"]["decode"]["llama-1b_b1"])
    spec = record["sections"]["speculation"]
    assert spec["ngram"]["identical"] and spec["ngram_copying"]["identical"]
    assert spec["ngram_copying"]["acceptance_rate"] > 0.9
    assert record["sections"]["paged"]["all_correct"]
    statuses = {b["bar"]: b["status"] for b in record["bars"]}
    assert all("smoke" in s or s == "unmeasured" for s in statuses.values())


@pytest.mark.slow
def test_gpu_check_smoke_all_sections(tmp_path):
    from evals.speed.gpu_check import SECTIONS

    record = run_smoke(tmp_path, None)
    check_record(record, [name for name, *_ in SECTIONS])
    more = record["sections"]["speculation_more"]
    assert more["draft"]["identical"] and more["quant-draft"]["identical"]
    assert set(more["verify_cost"]) == {"1", "2", "4", "8", "16", "32"} or len(more["verify_cost"]) == 6


def test_bad_arguments_are_named(capsys):
    from evals.speed.gpu_check import main

    with pytest.raises(SystemExit):
        main(["--smoke", "--sections", "decode,warp-drive"])
    assert "unknown sections: ['warp-drive']" in capsys.readouterr().err


def test_copying_weights_make_greedy_repeat_the_last_token_and_restore_exactly():
    """The speculation bar's copying weights: inside the block greedy decoding repeats the prompt's last token (so
    a copying speculator's drafts match); after it, every weight is back bit for bit."""
    import torch

    from evals.speed.gpu_check import SMOKE_SHAPES, copying_weights, random_model_on
    from runtime.decoding import generate
    from runtime.sampling import SamplingParams

    model = random_model_on(SMOKE_SHAPES["llama-1b"], torch.device("cpu"), torch.float32, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(40.0)  # layers that change the residual stream: plain greedy no longer repeats a token
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompt, params = [[5, 9, 11, 7, 3, 8]], SamplingParams(max_tokens=12, ignore_eos=True)
    plain = generate(model, prompt, params).tokens[0]
    assert len(set(plain)) > 1, plain  # the precondition: without the block the output is not one token repeated
    with copying_weights(model):
        assert generate(model, prompt, params).tokens[0] == [8] * 12
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert generate(model, prompt, params).tokens[0] == plain
