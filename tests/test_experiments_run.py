"""The experiment runner end to end on a tiny random model, config validation, and the claim checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

import experiments
from experiments.config import ConfigError, load_config
from experiments.records import read_jsonl
from experiments.run import check_claim, main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    main([str(TINY), "--results-dir", str(out)])
    return out / "tiny"


def test_tiny_run_writes_records_table_and_plot(tiny_run):
    records = read_jsonl(tiny_run / "records.jsonl")
    cfg = load_config(TINY)
    assert [r["row"]["name"] for r in records] == [r.name for r in cfg.rows]
    for r in records:
        for key in ("config", "seed", "git_sha", "versions", "device", "command", "results", "status"):
            assert key in r, key
        assert r["config"]["name"] == "tiny" and r["seed"] == 0
        assert "experiments.run" in r["command"] and "torch" in r["versions"]
    ok = {r["row"]["name"]: r for r in records if r["status"] == "ok"}
    assert set(ok) >= {"fp32 reference", "KV cache", "batching", "SDPA vs naive attention", "bf16", "paged KV"}
    ref = ok["fp32 reference"]["results"]
    assert ref["fidelity"]["bit_identical"] and ref["greedy"]["match_rate"] == 1.0
    # same-math paths agree to float noise with the reference; bf16 really differs
    for name in ("KV cache", "batching", "SDPA vs naive attention", "paged KV"):
        res = ok[name]["results"]
        assert res["fidelity"]["max_abs_dlogprob"] < 1e-4 and res["greedy"]["match_rate"] == 1.0, name
        assert res["speed"]["speedup"] > 0
    assert ok["bf16"]["results"]["fidelity"]["max_abs_dlogprob"] > 1e-4
    kv = ok["KV int8"]["results"]  # a quantized KV cache: approximate, and what it buys
    assert 1e-4 < kv["fidelity"]["max_abs_dlogprob"] < 0.5 and kv["claim_check"] == "changes the model"
    assert kv["kv_memory"]["kv_memory_vs_bf16"] > 1.5 and kv["kv_memory"]["engine_sequences"]["this"] > 0
    assert ok["bf16"]["results"]["weight_bytes"] < ref["weight_bytes"]
    spec = next(r for r in records if r["row"]["kind"] == "speculative")
    assert spec["status"] in ("ok", "wired, not run")
    # the "lossless?" column is evals.speculation.lossless's measured class: logits for model changes, the two-token
    # distribution test for the speculator (prompt lookup may propose nothing on random text: inconclusive)
    assert ref["verdict"]["verdict"] == "bit-identical" and kv["verdict"]["verdict"] == "approximate"
    if spec["status"] == "ok":
        verdict = spec["results"]["verdict"]
        assert verdict["samples"] == 300 and verdict["verdict"] in ("same distribution", "inconclusive"), verdict
    table = (tiny_run / "table.md").read_text()
    for r in cfg.rows:
        assert f"| {r.name} |" in table
    assert "greedy match %" in table and "speedup" in table
    assert "KV cache rows (all approximate)" in table and "| KV int8 |" in table
    header = (tiny_run / "table.csv").read_text().splitlines()[0]
    assert "greedy_match_pct" in header and "max_abs_dlogprob" in header
    w, h = png_size(tiny_run / "speedup_vs_quality.png")
    assert w > 500 and h > 300


def test_records_append_across_runs(tmp_path):
    cfg = yaml.safe_load(TINY.read_text())
    cfg["rows"] = cfg["rows"][:2]
    cfg["bench"]["repeats"] = 1
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(cfg))
    main([str(path), "--results-dir", str(tmp_path), "--no-bench"])
    main([str(path), "--results-dir", str(tmp_path), "--no-bench", "--rows", "KV cache"])
    records = read_jsonl(tmp_path / "tiny" / "records.jsonl")
    assert [r["row"]["name"] for r in records] == ["fp32 reference", "KV cache", "KV cache"]
    assert all("speed" not in r["results"] for r in records)


def write(tmp_path, data) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.update(colour="red"), "unknown key(s) ['colour']"),
        (lambda c: c["evals"].update(fidelity_seqlenn=3), "evals: unknown key(s) ['fidelity_seqlenn']"),
        (lambda c: c["rows"][0].update(lossless_class="lossless"), "lossless_class"),
        (lambda c: c["bench"].update(repeats="three"), "bench.repeats: expected int"),
        (lambda c: c.update(kind="histogram"), "kind: 'histogram'"),
        (lambda c: c["rows"].append(dict(c["rows"][0])), "duplicate row names"),
        (lambda c: c["rows"][1].pop("kind"), "missing required key 'kind'"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, mutate, message):
    cfg = yaml.safe_load(TINY.read_text())
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, cfg))
    assert message in str(err.value)


def test_cli_errors_are_one_line(tmp_path, capsys):
    cfg = yaml.safe_load(TINY.read_text())
    cfg["rows"][1]["kind"] = "warp_drive"
    cases = [
        ([str(tmp_path / "missing.yaml")], "config file not found"),
        ([str(write(tmp_path, cfg))], "rows[KV cache].kind: 'warp_drive'"),
        ([str(TINY), "--rows", "nope"], "--rows: ['nope']"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "configs/lossless.yaml" in capsys.readouterr().out


def test_overrides_are_validated(tmp_path):
    cfg = load_config(TINY, ["evals.greedy_tokens=5", "bench.repeats=1"])
    assert cfg.evals.greedy_tokens == 5 and cfg.bench.repeats == 1
    with pytest.raises(ConfigError, match="evals: unknown key"):
        load_config(TINY, ["evals.greedy_tokenz=5"])
    with pytest.raises(ConfigError, match="bench.repeats: expected int"):
        load_config(TINY, ["bench.repeats=many"])


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.name


def test_check_claim():
    ident = {"bit_identical": True, "max_abs_dlogprob": 0.0, "top1_agreement": 1.0}
    noisy = {"bit_identical": False, "max_abs_dlogprob": 2e-6, "top1_agreement": 1.0}
    changed = {"bit_identical": False, "max_abs_dlogprob": 0.3, "top1_agreement": 0.97}
    full, partial = {"match_rate": 1.0}, {"match_rate": 0.8}
    assert check_claim("exact", ident, full).startswith("verified")
    assert check_claim("exact", noisy, full).startswith("REFUTED")
    assert check_claim("same math", noisy, full).startswith("consistent")
    assert check_claim("same math", changed, partial).startswith("CHECK")
    assert check_claim("same distribution", noisy, partial).startswith("REFUTED")
    assert check_claim("same distribution", noisy, full) == "greedy identical"


def sweep_config(tmp_path, kind: str, values, series) -> Path:
    cfg = yaml.safe_load(TINY.read_text())
    cfg.update(kind=kind, rows=[], sweep={"values": values, "series": series, "new_tokens": 6, "repeats": 2})
    cfg["name"] = f"tiny-{kind}"
    return write(tmp_path, cfg)


@pytest.mark.parametrize(
    "kind, values, series, png",
    [
        ("prompt_length", [16, 64], [{"name": "fp32"}, {"name": "bf16", "dtype": "bf16"}], "prompt_length.png"),
        pytest.param(
            "concurrency",
            [1, 3],
            [{"name": "continuous"}, {"name": "static", "policy": "static"}],
            "concurrency.png",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_sweeps_on_tiny_model(tmp_path, kind, values, series, png):
    main([str(sweep_config(tmp_path, kind, values, series)), "--results-dir", str(tmp_path)])
    out = tmp_path / f"tiny-{kind}"
    records = read_jsonl(out / "records.jsonl")
    assert len(records) == len(values) * len(series) and all(r["status"] == "ok" for r in records)
    for r in records:
        assert all(v > 0 for k, v in r["results"].items() if k.endswith(("_p50", "_per_s")))
    png_size(out / png)
    assert json.loads(json.dumps(records[0]["results"]))


def test_ray_flag_needs_ray_and_a_table_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "experiments.cluster", None)  # as if Ray were not installed
    monkeypatch.delattr(experiments, "cluster", raising=False)  # (a test that ran a cluster imported it)
    with pytest.raises(SystemExit) as exit_:
        main([str(TINY), "--ray"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--ray needs Ray" in err and "pip install 'ray>=2.60'" in err
    sweep = sweep_config(tmp_path, "prompt_length", [16], [{"name": "fp32"}])
    with pytest.raises(SystemExit):
        main([str(sweep), "--ray"])
    assert "--ray runs table configs" in capsys.readouterr().err


def test_every_record_names_the_tree_the_run_started_from(tmp_path, monkeypatch):
    """The run takes git_sha once, as it starts: a run writing into tracked result files (notes/...) must not mark
    its later rows "-dirty" with its own output. Here the tree 'changes' after every call to git_sha."""
    import experiments.run as run_module

    provenance_module = sys.modules["runtime.provenance"]  # the package's `provenance` attribute is the function
    calls = iter(range(1000))

    def moving(repo=None):
        return f"sha-{next(calls)}"

    monkeypatch.setattr(provenance_module, "git_sha", moving)
    monkeypatch.setattr(run_module, "git_sha", moving)
    main([str(TINY), "--results-dir", str(tmp_path), "--rows", "fp32 reference,KV cache", "--no-evals"])
    records = read_jsonl(tmp_path / "tiny" / "records.jsonl")
    assert len(records) == 2 and {r["git_sha"] for r in records} == {"sha-0"}
