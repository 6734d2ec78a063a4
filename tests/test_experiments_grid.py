"""Grids (axes -> rows with stable names), the Pareto front, and artifacts built once (keyed by recipe and model
files, a lock between concurrent builders, nothing left behind by a failed build). No Ray here."""

from __future__ import annotations

import dataclasses
import itertools
import random
import shutil
import threading
from pathlib import Path

import pytest
import yaml

from experiments.artifacts import MARKER, BuildError, builds, ensure_built, model_files_hash
from experiments.config import ConfigError, Row, load_config
from experiments.records import read_jsonl
from experiments.report import main as report_main
from experiments.report import pareto_front, render_grid
from experiments.rows import RowSkipped, quantized_artifact, row_artifacts
from runtime.loader import load_model
from speculate.medusa.heads import load_medusa
from tests.serve_helpers import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def grid_config(tmp_path, grid, rows=None) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["rows"] = rows or []
    cfg["grid"] = grid
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))  # the axes' order is the rows' order
    return path


def test_quant_grid_covers_every_recipe_once():
    cfg = load_config(ROOT / "configs" / "quant_grid.yaml")
    grid_rows = [r for r in cfg.rows if r.grid]
    expected = {("rtn", b, g, None) for b, g in itertools.product([3, 4], [32, 64, 128])}
    calib = ["wiki", "wiki:0.5,wiki-es:0.25,wiki-fr:0.25"]
    for method in ("gptq", "awq"):
        expected |= set(itertools.product([method], [3, 4], [32, 64, 128], calib))
    got = [(r.params["method"], r.params["bits"], r.params["group_size"], r.params.get("calib")) for r in grid_rows]
    assert sorted(got, key=str) == sorted(expected, key=str) and len(got) == len(set(got))
    assert len({r.name for r in cfg.rows}) == len(cfg.rows) == 1 + 6 + 24
    assert cfg.evals.texts == ["wiki", "wiki-es", "wiki-fr", "wiki-desc", "chat"]
    spec = load_config(ROOT / "configs" / "spec_grid.yaml")
    batches = {tuple(r.params["batch_sizes"]) for r in spec.rows}
    assert batches == {(1,), (4,)} and len(spec.rows) == 5 * 3 * 2


def test_grid_names_are_stable_when_an_axis_grows(tmp_path):
    block = {"name": "RTN{bits} g{group_size}", "kind": "dtype", "axes": {"bits": [3, 4], "group_size": [32]}}
    before = load_config(grid_config(tmp_path, [block]))
    block["axes"]["group_size"] = [16, 32, 64]
    after = load_config(grid_config(tmp_path, [block], rows=[{"name": "ref", "kind": "reference"}]))
    old = {r.name: r for r in before.rows}
    new = {r.name: r for r in after.rows}
    assert list(old) == ["RTN3 g32", "RTN4 g32"]
    assert len(new) == 1 + 2 * 3 and all(new[name] == row for name, row in old.items())
    assert new["RTN4 g64"].params == {"bits": 4, "group_size": 64} and new["RTN4 g64"].grid == {
        "bits": "4",
        "group_size": "64",
    }


def test_mapping_axes_name_their_values(tmp_path):
    block = {"name": "{calib}", "kind": "quantized", "params": {"method": "gptq"},
             "axes": {"calib": {"wiki": "wiki", "mixed": "wiki:0.5,wiki-fr:0.5"}}}  # fmt: skip
    rows = load_config(grid_config(tmp_path, [block])).rows
    assert [(r.name, r.params["calib"], r.grid) for r in rows] == [
        ("wiki", "wiki", {"calib": "wiki"}),
        ("mixed", "wiki:0.5,wiki-fr:0.5", {"calib": "mixed"}),
    ]


@pytest.mark.parametrize(
    "block, message",
    [
        ({"name": "g{group_size}", "axes": {"bits": [3, 4], "group_size": [32]}}, "leaves out axes ['bits']"),
        ({"name": "{bitz}", "axes": {"bits": [3]}}, "names ['bitz'], which are not axes"),
        ({"name": "{bits}", "axes": {"bits": []}}, "grid[0].axes.bits: no values"),
        ({"name": "{bits}", "axes": {"bits": 4}}, "grid[0].axes.bits: expected a list or a mapping"),
        ({"name": "{bits}", "axes": {"bits": [4]}, "params": {"bits": 3}}, "also fixed in grid[0].params"),
        ({"name": "{bits}", "axes": {"bits": [4]}, "colour": 1}, "grid[0]: unknown key(s) ['colour']"),
    ],
)
def test_bad_grids_name_the_problem(tmp_path, block, message):
    with pytest.raises(ConfigError) as err:
        load_config(grid_config(tmp_path, [{"kind": "dtype", **block}]))
    assert message in str(err.value)


@pytest.mark.parametrize("maximize", [(False, False), (True, True), (False, True)])
def test_pareto_front_matches_brute_force(maximize):
    rng = random.Random(0)
    sign = [-1 if m else 1 for m in maximize]

    def beats(a, b):  # a at least as good everywhere and strictly better somewhere
        sa, sb = [s * v for s, v in zip(sign, a)], [s * v for s, v in zip(sign, b)]
        return all(x <= y for x, y in zip(sa, sb)) and sa != sb

    for _ in range(50):
        points = [(rng.choice([0.5, 1, 2, 4]), rng.random()) for _ in range(rng.randint(1, 12))]
        front = pareto_front(points, maximize)
        undominated = {i for i, p in enumerate(points) if not any(beats(q, p) for q in points)}
        # every front point is undominated, and every undominated point is on it or a duplicate of one on it
        assert set(front) <= undominated
        assert {points[i] for i in undominated} == {points[i] for i in front}
        assert [points[i][0] for i in front] == sorted(points[i][0] for i in front)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("model"))


def test_artifact_key_follows_recipe_and_model_files(tmp_path, tiny_model):
    rtn = {"method": "rtn", "bits": 4, "group_size": 32}
    key = quantized_artifact(str(tiny_model), rtn).key()
    copy = shutil.copytree(tiny_model, tmp_path / "elsewhere")
    assert quantized_artifact(str(copy), rtn).key() == key  # same files under another path
    assert quantized_artifact(str(tiny_model), {**rtn, "bits": 3}).key() != key
    assert quantized_artifact(str(tiny_model), {**rtn, "args": ["--sym"]}).key() != key
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert model_files_hash(str(copy)) != model_files_hash(str(tiny_model))
    assert quantized_artifact(str(copy), rtn).key() != key
    with pytest.raises(RowSkipped, match="in_features 96 is not a multiple of group size 64"):
        quantized_artifact(str(tiny_model), {**rtn, "group_size": 64})
    with pytest.raises(ValueError, match="rtn takes no calibration data"):
        quantized_artifact(str(tiny_model), {**rtn, "calib": "wiki"})


def test_concurrent_builders_build_once(tmp_path, tiny_model):
    artifact = quantized_artifact(str(tiny_model), {"method": "rtn", "bits": 4, "group_size": 32})
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_built(artifact, tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(built for _, built in results) == [False, True]
    assert results[0][0] == results[1][0] == artifact.path(tmp_path) and (artifact.path(tmp_path) / MARKER).is_file()
    assert [b["key"] for b in builds(tmp_path)] == [artifact.key()]
    assert ensure_built(artifact, tmp_path) == (artifact.path(tmp_path), False)


def test_failed_build_leaves_nothing(tmp_path, tiny_model):
    artifact = quantized_artifact(str(tiny_model), {"method": "rtn", "bits": 4, "group_size": 32, "args": ["--nope"]})
    with pytest.raises(BuildError, match=r"quantize.rtn failed \(exit 2\)"):
        ensure_built(artifact, tmp_path)
    assert [p.name for p in (tmp_path / "quantized").iterdir() if not p.name.endswith(".lock")] == []
    assert builds(tmp_path) == []


# 22-45 s; resuming an interrupted GPTQ run stays in the default suite (test_cli_newcomer's Ctrl-C case)
@pytest.mark.slow
def test_an_interrupted_calibration_build_resumes_to_the_same_checkpoint(tmp_path, tiny_model, monkeypatch):
    from quantize import gptq

    recipe = {"method": "gptq", "bits": 4, "group_size": 32, "args": ["--nsamples", "4", "--seqlen", "32"]}
    artifact = quantized_artifact(str(tiny_model), recipe)
    reference, built = ensure_built(artifact, tmp_path / "fresh")
    assert built

    # the same build stopped by Ctrl-C in layer 1: layer 0 stays in OUT.layers.partial beside the partial output
    store = tmp_path / "stopped"
    partial = artifact.path(store).with_name(artifact.path(store).name + ".building")
    quantize_stage = gptq.GPTQ.quantize_stage

    def stop_in_layer_1(self, stage):
        if stage.layer_idx == 1:
            raise KeyboardInterrupt
        quantize_stage(self, stage)

    monkeypatch.setattr(gptq.GPTQ, "quantize_stage", stop_in_layer_1)
    with pytest.raises(SystemExit):
        gptq.main(["--model", str(tiny_model), *artifact.args, "--out", str(partial)])
    monkeypatch.setattr(gptq.GPTQ, "quantize_stage", quantize_stage)
    assert not partial.exists() and len(list(store.glob("quantized/*.layers.partial/layer_*.pt"))) == 1

    logged = []
    path, built = ensure_built(artifact, store, log=logged.append)
    assert built and any("kept 1 finished layers; resuming" in m for m in logged), logged
    assert list(store.glob("quantized/*.layers.partial")) == []  # the finished checkpoint replaces the kept layers
    assert (path / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


GRID_RECORDS = ROOT / "notes" / "issue-31" / "quant_grid_small_records.jsonl"


def test_grid_report_marks_the_pareto_front(tmp_path):
    report_main([str(GRID_RECORDS), "--out", str(tmp_path)])
    records = read_jsonl(GRID_RECORDS)
    lines = {line.split(" | ")[0].removeprefix("| "): line for line in (tmp_path / "grid.md").read_text().splitlines()}
    ok = [r for r in records if r["status"] == "ok"]
    assert len([r for r in ok if r["row"]["grid"]]) >= 12
    for text in ("wiki", "wiki-fr", "wiki-desc"):
        size = {r["row"]["name"]: r["results"]["bytes_per_weight"] for r in ok}
        ppl = {r["row"]["name"]: r["results"]["texts"][text]["test_perplexity"] for r in ok}
        # oracle: a row is on the front unless another is no larger and no worse, and better in one
        front = {
            a for a in size
            if not any(size[b] <= size[a] and ppl[b] <= ppl[a] and (size[b], ppl[b]) != (size[a], ppl[a]) for b in size)
        }  # fmt: skip
        for name in size:
            assert (text in lines[name].rsplit(" | ", 1)[1]) == (name in front), (text, name)
    for r in records:
        if r["status"] == "skipped":
            assert "| skipped: no checkpoint can hold this recipe" in lines[r["row"]["name"]]
    assert (tmp_path / "quality_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draft_heads_are_an_artifact_of_their_recipe(tmp_path, tiny_model):
    recipe = ["--data", "wiki", "--max-steps", "2", "--train-tokens", "20000", "--eval-windows", "2", "--seqlen", "64"]
    row = Row("Medusa tree=4", "specbench", params={"method": "medusa:tree=4", "head_recipe": recipe})
    (artifact,) = row_artifacts(str(tiny_model), row)
    assert artifact.module == "speculate.medusa.train" and artifact.path(tmp_path).parent == tmp_path / "medusa"
    path, built = ensure_built(artifact, tmp_path)
    assert built and ensure_built(artifact, tmp_path) == (path, False)
    model, _, _ = load_model(str(tiny_model))
    assert load_medusa(path, model).config.num_heads == 3
    other = Row("EAGLE", "specbench", params={"method": "eagle:tree=4", "head_recipe": recipe})
    assert row_artifacts(str(tiny_model), other)[0].key() != artifact.key()
    with pytest.raises(ValueError, match="'ngram' has no heads to train"):
        row_artifacts(str(tiny_model), Row("n", "specbench", params={"method": "ngram", "head_recipe": []}))


def test_speculation_grid_report_marks_the_fastest_front(tmp_path):
    cfg = load_config(ROOT / "configs" / "spec_grid.yaml")
    rng = random.Random(1)
    records = []
    for row in cfg.rows:  # suite results as specbench rows record them, drawn at random
        overall = {
            "batch": row.params["batch_sizes"][0],
            "category": "overall",
            "method": row.params["method"],
            "tokens_per_step": round(1 + 3 * rng.random(), 3),
            "speedup_vs_plain": round(0.3 + rng.random(), 3),
        }
        res = {"weight_bytes": 538_000_000, "bytes_per_weight": 4.0, "suite": [overall]}
        records.append({"row": dataclasses.asdict(row), "status": "ok", "results": res})
    paths = render_grid(cfg, records, tmp_path)
    assert [p.name for p in paths] == ["grid.md", "speedup_vs_acceptance.png"]
    lines = {line.split(" | ")[0].removeprefix("| "): line for line in paths[0].read_text().splitlines()}
    suites = {r["row"]["name"]: r["results"]["suite"][0] for r in records}
    point = {name: (s["tokens_per_step"], s["speedup_vs_plain"]) for name, s in suites.items()}
    for name, (x, y) in point.items():
        beaten = any(a >= x and b >= y and (a, b) != (x, y) for a, b in point.values())
        assert lines[name].endswith("| speedup |") == (not beaten), name
        assert f"| {x:.2f} | {y:.2f}x |" in lines[name]
