"""experiments.run --ray on one local Ray cluster shared by the module (2 CPUs, a small object store): the tiny
config gives the serial run's records; a worker killed mid-row is retried once, twice is a failed row; a row that
raises fails alone; two rows that need one quantized checkpoint build it once, and a later run reuses it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import yaml

from experiments.artifacts import builds
from experiments.cluster import connect
from experiments.config import load_config
from experiments.records import read_jsonl
from experiments.run import main
from tests.serve_helpers import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
EXAMPLES = ROOT / "examples"  # qspec_plugin_example: a speculator and a quantizer outside the qspec packages
TIMINGS = {"speed", "row_seconds"}  # results that are wall times
RUN_IDENTITY = {"run_id", "time_utc", "command", "cluster"}  # which run, when, how it was launched, where


@pytest.fixture(scope="module", autouse=True)
def local_cluster():
    import psutil  # a dependency of ray

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # the worked plug-in package importable by the workers, as an installed package of the user's would be
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLES), saved) if p)
    try:
        assert connect("local", num_cpus=2, object_store_bytes=80 * 1024**2)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    yield
    ray.shutdown()
    # Ray's processes stop after shutdown returns; wait for them, so that the next tests (latency measurements
    # among them) do not share the 2 cores with a cluster going down
    mine = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    psutil.wait_procs(mine, timeout=30)


def comparable(record: dict) -> dict:
    """A record without its timings and what identifies the run (the machine's load and threads included)."""
    out = {k: v for k, v in record.items() if k not in RUN_IDENTITY}
    out["results"] = {k: v for k, v in record["results"].items() if k not in TIMINGS}
    out["device"] = {k: v for k, v in record["device"].items() if k not in ("loadavg_1m", "torch_threads")}
    return out


@pytest.mark.slow  # ~27 s on AVX2; test_outside_plugins_run_as_rows_on_ray_workers keeps Ray rows in the default suite
def test_tiny_config_on_ray_gives_the_serial_records(tmp_path):
    main([str(TINY), "--results-dir", str(tmp_path / "serial")])
    main([str(TINY), "--results-dir", str(tmp_path / "ray"), "--ray"])
    serial = {r["row"]["name"]: r for r in read_jsonl(tmp_path / "serial" / "tiny" / "records.jsonl")}
    on_ray = {r["row"]["name"]: r for r in read_jsonl(tmp_path / "ray" / "tiny" / "records.jsonl")}
    assert set(on_ray) == set(serial) == {r.name for r in load_config(TINY).rows}
    for name, r in on_ray.items():
        assert set(r) - set(serial[name]) == {"cluster"}, name
        assert comparable(r) == comparable(serial[name]), name
        assert "--ray" in r["command"] and r["cluster"]["attempts"] == 1
        timed = r["row"]["run_bench"]  # every tiny row that is not timed packs on one CPU
        assert r["cluster"]["exclusive_node"] == timed
        assert r["cluster"]["cpus"] == (2 if timed else 1), name
        assert ("speed" in r["results"]) == timed
    assert (tmp_path / "ray" / "tiny" / "speedup_vs_quality.png").is_file()


def worker_pids(title: str) -> list[int]:
    """Processes whose title (Ray names a worker after the task it runs) starts with `title`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith(title):
                found.append(int(entry))
    return found


def kill_workers(kills: dict[str, int], stop: threading.Event, killed: dict[str, list[int]]) -> None:
    """SIGKILL the worker running row NAME, kills[NAME] times (each time a new worker: the retry's)."""
    while not stop.is_set():
        for name, times in kills.items():
            for pid in worker_pids(f"ray::row: {name}"):
                if len(killed[name]) < times and pid not in killed[name]:
                    os.kill(pid, signal.SIGKILL)
                    killed[name].append(pid)
        time.sleep(0.01)


@pytest.mark.slow  # ~25 s (a worker killed mid-row, Ray's retry); the serial-records test covers the runner by default
def test_killed_worker_is_retried_once_and_a_failing_row_fails_alone(tmp_path):
    cfg = yaml.safe_load(TINY.read_text())
    cfg["name"] = "faults"
    cfg["rows"] = [
        {"name": "killed once", "kind": "kv_cache", "lossless_class": "same math"},
        {"name": "killed twice", "kind": "attention", "lossless_class": "same math"},
        {"name": "raises", "kind": "dtype", "params": {"dtype": "fp7"}, "run_bench": False},
        {"name": "fp32 reference", "kind": "reference", "lossless_class": "exact", "run_bench": False},
    ]
    path = tmp_path / "faults.yaml"
    path.write_text(yaml.safe_dump(cfg))
    killed: dict[str, list[int]] = {"killed once": [], "killed twice": []}
    stop = threading.Event()
    killer = threading.Thread(target=kill_workers, args=({"killed once": 1, "killed twice": 2}, stop, killed))
    killer.start()
    try:
        main([str(path), "--results-dir", str(tmp_path), "--ray"])
    finally:
        stop.set()
        killer.join()
    assert [len(pids) for pids in killed.values()] == [1, 2]
    records = {r["row"]["name"]: r for r in read_jsonl(tmp_path / "faults" / "records.jsonl")}
    assert len(records) == 4
    once = records["killed once"]
    assert once["status"] == "ok" and once["cluster"]["attempts"] == 2
    assert once["cluster"]["earlier_attempts"][0].startswith("WorkerCrashedError")
    assert once["results"]["fidelity"]["max_abs_dlogprob"] < 1e-4 and once["results"]["speed"]["speedup"] > 0
    twice = records["killed twice"]
    assert twice["status"] == "failed" and twice["cluster"]["attempts"] == 2
    assert twice["reason"].startswith("WorkerCrashedError") and twice["results"] == {}
    raises = records["raises"]
    assert raises["status"] == "failed" and raises["cluster"]["attempts"] == 1
    assert raises["reason"].startswith("ValueError: rows.params.dtype: 'fp7'") and "traceback" in raises
    assert records["fp32 reference"]["status"] == "ok"
    table = (tmp_path / "faults" / "table.md").read_text()
    assert "| killed twice |" in table and "failed: WorkerCrashedError" in table


@pytest.mark.slow  # ~22 s; the store's build-once logic is covered by test_experiments_grid's concurrent builders
def test_two_rows_needing_one_checkpoint_build_it_once(tmp_path):
    model = save_tiny_checkpoint(tmp_path / "model")
    store = tmp_path / "store"
    cfg = yaml.safe_load(TINY.read_text())
    cfg.update(name="artifacts", model={"spec": str(model)})
    cfg["evals"].update(fidelity_sequences=2, fidelity_seqlen=32, greedy_prompts=2, greedy_tokens=4)
    rtn = {"kind": "quantized", "run_bench": False, "params": {"method": "rtn", "bits": 4, "group_size": 32}}
    cfg["rows"] = [{"name": "RTN4 g32", **rtn}, {"name": "RTN4 g32 again", **rtn, "run_evals": False}]
    # 64 does not divide the tiny model's MLP width (96): no checkpoint format holds it, so the row is skipped
    cfg["grid"] = [{"name": "RTN4 g{group_size}", "kind": "quantized", "run_bench": False,
                    "params": {"method": "rtn", "bits": 4}, "axes": {"group_size": [64]}}]  # fmt: skip
    path = tmp_path / "artifacts.yaml"
    path.write_text(yaml.safe_dump(cfg))
    main([str(path), "--results-dir", str(tmp_path / "ray"), "--ray", "--store", str(store)])
    records = {r["row"]["name"]: r for r in read_jsonl(tmp_path / "ray" / "artifacts" / "records.jsonl")}
    done = builds(store)
    assert len(done) == 1 and done[0]["module"] == "quantize.rtn"
    checkpoint = done[0]["path"]
    for name in ("RTN4 g32", "RTN4 g32 again"):
        assert records[name]["status"] == "ok" and records[name]["results"]["checkpoint"] == checkpoint, name
    res = records["RTN4 g32"]["results"]
    assert 0 < res["fidelity"]["max_abs_dlogprob"] and res["bytes_per_weight"] < 1  # 4-bit codes + group scales
    skipped = records["RTN4 g64"]
    assert skipped["status"] == "skipped" and "not a multiple of group size 64" in skipped["reason"]
    assert skipped["row"]["grid"] == {"group_size": "64"}
    # a later run (serial here) finds the checkpoint in the store and builds nothing
    main([str(path), "--results-dir", str(tmp_path / "serial"), "--store", str(store), "--rows", "RTN4 g32"])
    again = read_jsonl(tmp_path / "serial" / "artifacts" / "records.jsonl")
    assert len(builds(store)) == 1 and again[0]["results"]["checkpoint"] == checkpoint
    assert again[0]["results"]["fidelity"] == res["fidelity"]


@pytest.mark.slow  # ~30 s (Ray start-up); outside plugins run serially by default (test_plugin_outside)
def test_outside_plugins_run_as_rows_on_ray_workers(tmp_path, monkeypatch):
    """A speculator and a quantizer from a package outside qspec, named module:attr in a config, run as rows on
    the cluster's workers: the quantizer's checkpoint is built through quantize.plugin and scored, the speculator
    drafts, its greedy output equals plain decoding and its verdict is not a failure."""
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the driver checks the names before any row is sent
    model = save_tiny_checkpoint(tmp_path / "model")
    cfg = yaml.safe_load(TINY.read_text())
    cfg.update(name="plugins", model={"spec": str(model)})
    cfg["evals"].update(fidelity_sequences=2, fidelity_seqlen=32, greedy_prompts=2, greedy_tokens=8)
    cfg["rows"] = [
        {"name": "absmax4 g32", "kind": "quantized", "run_bench": False,
         "params": {"method": "qspec_plugin_example.absmax:Absmax", "bits": 4, "group_size": 32}},
        {"name": "prompt lookup", "kind": "speculative", "lossless_class": "same distribution", "run_bench": False,
         "params": {"speculator": "qspec_plugin_example.lookup:PromptLookup", "k": 3}},
    ]  # fmt: skip
    path = tmp_path / "plugins.yaml"
    path.write_text(yaml.safe_dump(cfg))
    main([str(path), "--results-dir", str(tmp_path / "ray"), "--ray", "--store", str(tmp_path / "store")])
    records = {r["row"]["name"]: r for r in read_jsonl(tmp_path / "ray" / "plugins" / "records.jsonl")}
    assert {name: r["status"] for name, r in records.items()} == {"absmax4 g32": "ok", "prompt lookup": "ok"}
    built = builds(tmp_path / "store")
    assert len(built) == 1 and built[0]["module"] == "quantize.plugin"
    assert records["absmax4 g32"]["results"]["fidelity"]["max_abs_dlogprob"] > 0
    lookup = records["prompt lookup"]["results"]
    assert lookup["speculator"] == "prompt-lookup" and lookup["greedy"]["identical_sequences"] == 2
    assert lookup["speculation"]["drafted"] > 0 and lookup["verdict"]["verdict"] != "not lossless"


def test_a_task_no_node_can_hold_is_an_error_not_a_hang(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(TINY), "--results-dir", str(tmp_path), "--ray", "--set", "ray.memory_gb=100000"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: ray.memory_gb: 100000 is more than any node of the cluster has" in err
