"""``python -m experiments.run CONFIG --ray [ADDRESS]``: a table config's rows (a grid's points) as Ray tasks.

Each row is one task that runs experiments.table.run_row, as the serial runner does, on a context (reference
model, prompts) its worker process loads once. An evaluation row packs: it asks for ``ray.cpus`` CPUs (its
torch threads), ``ray.gpus`` GPUs and ``ray.memory_gb`` of memory. A timed row (run_bench, or a kind that times
itself) holds a whole node: all its CPUs and GPUs, so no other task of the sweep shares them while it measures;
its record says so under ``cluster``. An artifact (quantized checkpoint, trained heads) is built first by one
task per distinct recipe into the store every worker reads, and its rows start when it is built.

Faults: a task whose worker dies (killed, out of memory, its node lost) runs once more, then its row is recorded
as failed with the error; a row that raises is recorded as failed at once; the other rows go on. Only this
driver writes records, atomically, one JSONL per config. Ctrl-C cancels the tasks in flight; the records
written so far stay. Progress: rows done / running / failed / waiting, and an ETA, on every change.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from experiments.artifacts import Artifact, BuildError, ensure_built, is_built
from experiments.bench import EVAL_THREADS, LOCKING, TIMED_THREADS, log
from experiments.config import ConfigError, ExperimentConfig, Row, from_dict
from experiments.records import append_jsonl
from experiments.report import render_table
from experiments.rows import RowSkipped, RowUnavailable, is_timed, row_artifacts
from experiments.table import Context, load_context, run_row
from runtime.data import load_text
from runtime.provenance import git_sha, provenance

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3
ATTEMPTS = 2  # a task whose worker dies runs once more
LOCAL_OBJECT_STORE = 256 * 1024**2  # records are small; artifacts travel through the store path, not Ray
PROGRESS_EVERY_S = 30.0


def connect(address: str, num_cpus: int | None = None, object_store_bytes: int = LOCAL_OBJECT_STORE) -> bool:
    """Start a local cluster (address "local"; num_cpus default every core) or join one ("auto": the cluster
    ``ray start`` runs on this machine; "HOST:PORT" or "ray://HOST:10001": a remote one). A Ray already connected
    in this process (a test fixture, a notebook) is used as it is. Returns whether this call connected (then the
    caller disconnects)."""
    if ray.is_initialized():
        return False
    env_vars = {k: os.environ[k] for k in ("QSPEC_HOME",) if k in os.environ}
    if address == "local":  # this checkout's code on this machine's workers
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        runtime_env = {"env_vars": {**env_vars, "PYTHONPATH": path}}
        ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            object_store_memory=object_store_bytes,
            include_dashboard=False,
            runtime_env=runtime_env,
        )
    else:  # other machines get this checkout's code shipped as the job's working directory
        excludes = [".git", "results", "notes", "*.egg-info", "__pycache__"]
        runtime_env = {"working_dir": str(ROOT), "excludes": excludes, "env_vars": env_vars}
        ray.init(address=address, runtime_env=runtime_env)
    return True


def alive_nodes() -> list[dict]:
    return [
        {
            "id": n["NodeID"],
            "ip": n["NodeManagerAddress"],
            "cpus": int(n["Resources"].get("CPU", 0)),
            "gpus": int(n["Resources"].get("GPU", 0)),
            "memory_gb": n["Resources"].get("memory", 0) / GiB,
        }
        for n in ray.nodes()
        if n["Alive"]
    ]


def check_fits(cfg: ExperimentConfig, nodes: list[dict]) -> None:
    """A task no node can hold would wait forever: say which setting to lower instead."""
    r = cfg.ray
    asks = {
        "ray.cpus": (r.cpus, "cpus"),
        "ray.gpus": (r.gpus, "gpus"),
        "ray.memory_gb": (r.memory_gb, "memory_gb"),
        "ray.build_cpus": (r.build_cpus, "cpus"),
        "ray.build_memory_gb": (r.build_memory_gb, "memory_gb"),
    }
    for setting, (value, resource) in asks.items():
        largest = max((n[resource] for n in nodes), default=0)
        if value > largest:
            raise ConfigError(f"{setting}: {value:g} is more than any node of the cluster has ({largest:.3g})")


def whole_node_options(nodes: list[dict], needs_gpu: bool, index: int) -> dict:
    """Ray options that give a timed row every CPU and GPU of one node. Nodes of one shape: ask for that shape
    and let Ray pick a free node; mixed shapes: the index-th eligible node, pinned."""
    eligible = [n for n in nodes if n["cpus"] > 0 and (n["gpus"] > 0 or not needs_gpu)]
    if not eligible:
        raise RuntimeError(f"no node of the cluster can run a timed row (needs a GPU: {needs_gpu}): {nodes}")
    shapes = {(n["cpus"], n["gpus"]) for n in eligible}
    node = eligible[index % len(eligible)]
    options = {"num_cpus": node["cpus"], "num_gpus": node["gpus"]}
    if len(shapes) > 1:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node["id"], soft=False)
    return options


# ---- what runs on the workers -----------------------------------------------------------------------------

_CONTEXTS: dict[str, Context] = {}  # per worker process: one context per (model, evals, bench, seed, store)


def worker_context(cfg: ExperimentConfig, store: Path) -> Context:
    key = json.dumps([dataclasses.asdict(s) for s in (cfg.model, cfg.evals, cfg.bench)] + [cfg.seed, str(store)])
    if key not in _CONTEXTS:
        _CONTEXTS[key] = load_context(cfg)
        _CONTEXTS[key].store = store
    ctx = _CONTEXTS[key]
    ctx.cfg = cfg
    return ctx


def placement() -> dict:
    """Where this task runs and what Ray gave it."""
    runtime = ray.get_runtime_context()
    assigned = runtime.get_assigned_resources()
    return {
        "node": ray.util.get_node_ip_address(),
        "node_id": runtime.get_node_id()[:12],
        "pid": os.getpid(),
        "cpus": assigned.get("CPU", 0.0),
        "gpus": assigned.get("GPU", 0.0),
    }


@ray.remote(max_retries=0, num_returns="streaming")
def row_task(cfg_data: dict, row_data: dict, store: str, command: str, sha: str, timed: bool):
    """Yields where it runs, then the row's record (run_row's, with the provenance of the node it ran on)."""
    where = placement()
    yield {"event": "started", **where}
    cfg = from_dict(ExperimentConfig, cfg_data)
    cpus = max(1, int(where["cpus"]))
    TIMED_THREADS["n"] = cpus
    # a timed row holds its node: it evaluates as the serial runner would on it; a packed row on its own CPUs
    EVAL_THREADS["n"] = (cfg.evals.threads or cpus) if timed else cpus
    torch.set_num_threads(EVAL_THREADS["n"])
    LOCKING["enabled"] = cfg.bench.lock
    record = run_row(worker_context(cfg, Path(store)), Row(**row_data))
    yield {**record, **provenance(cfg.seed, command, sha)}


@ray.remote(max_retries=0, num_returns="streaming")
def build_task(artifact: Artifact, store: str):
    """Yields where it runs, then {path, built} or the build's error (killed: its CLI died of a signal)."""
    yield {"event": "started", **placement()}
    try:
        path, built = ensure_built(artifact, Path(store))
        yield {"ok": True, "path": str(path), "built": built}
    except BuildError as err:
        yield {"ok": False, "error": str(err), "killed": err.returncode < 0}


# ---- the driver -------------------------------------------------------------------------------------------


@dataclass
class Task:
    """A row or an artifact build, and what the driver knows of it."""

    name: str
    submit: Callable  # () -> the task's ObjectRefGenerator
    row: Row | None = None
    artifact: Artifact | None = None
    waits_for: set[str] = field(default_factory=set)  # keys of artifacts not built yet
    attempts: int = 0
    errors: list[str] = field(default_factory=list)  # why earlier attempts ended
    started: float | None = None  # when its current attempt reported that it runs
    where: dict | None = None


@dataclass
class Progress:
    rows: int
    done: int = 0
    failed: int = 0
    running: int = 0
    seconds: list[float] = field(default_factory=list)  # wall time of each finished row
    began: float = field(default_factory=time.time)

    def line(self, builds: str) -> str:
        left = self.rows - self.done - self.failed
        waiting = left - self.running
        eta = ""
        if self.seconds and left:
            per_row = sum(self.seconds) / len(self.seconds)
            eta = f"; ETA ~{left * per_row / max(1, self.running) / 60:.1f} min"
        elapsed = (time.time() - self.began) / 60
        return (
            f"sweep: {self.done}/{self.rows} rows done, {self.running} running, {self.failed} failed, "
            f"{waiting} waiting{builds}; {elapsed:.1f} min{eta}"
        )


def crash_text(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def traceback_tail(err: RayTaskError, lines: int = 12) -> str:
    return "\n".join(str(err).strip().splitlines()[-lines:])


def run_table_ray(
    cfg: ExperimentConfig, rows: list[Row], records_path: Path, base: dict, store: Path, address: str
) -> list[dict]:
    """Run the rows on a Ray cluster; returns their records in the order they finished."""
    connected = connect(address)
    try:
        return Sweep(cfg, rows, records_path, base, store).run()
    finally:
        if connected:
            ray.shutdown()


class Sweep:
    def __init__(self, cfg: ExperimentConfig, rows: list[Row], records_path: Path, base: dict, store: Path):
        self.cfg, self.records_path, self.base, self.store = cfg, records_path, base, store
        self.cfg_data = dataclasses.asdict(cfg)
        self.sha = base.get("git_sha") or git_sha()
        self.nodes = alive_nodes()
        check_fits(cfg, self.nodes)
        self.records: list[dict] = []
        self.pending: dict = {}  # ObjectRefGenerator -> Task
        self.builds: dict[str, Task] = {}  # artifact key -> its build
        self.built: dict[str, dict] = {}  # artifact key -> the build's result
        self.rows: list[Task] = []
        self.progress = Progress(len(rows))
        log(
            f"Ray cluster: {len(self.nodes)} node(s), "
            + ", ".join(f"{n['ip']} {n['cpus']} CPUs {n['gpus']} GPUs" for n in self.nodes)
            + f"; store {store}"
        )
        timed_index = 0
        for row in rows:
            try:
                needs = row_artifacts(cfg.model.spec, row)
            except Exception as err:  # what the row itself would say (bad params, no checkpoint can hold it)
                self.finish_row(Task(row.name, None, row=row), self.unrun(row, err))
                continue
            task = Task(row.name, self.row_submitter(row, timed_index), row=row)
            timed_index += is_timed(row)
            for artifact in needs:
                key = artifact.key()
                if is_built(artifact.path(store)):  # a earlier run's: nothing to wait for
                    continue
                task.waits_for.add(key)
                if key not in self.builds:
                    self.builds[key] = Task(f"build {artifact.path(store).name}", None, artifact=artifact)
                    self.builds[key].submit = self.build_submitter(artifact)
            self.rows.append(task)

    def row_submitter(self, row: Row, timed_index: int):
        timed = is_timed(row)
        r = self.cfg.ray
        if timed:
            options = whole_node_options(self.nodes, r.gpus > 0 or self.cfg.model.device != "cpu", timed_index)
        else:
            options = {"num_cpus": r.cpus, "num_gpus": r.gpus}
        options.update(memory=int(r.memory_gb * GiB), name=f"row: {row.name}")
        row_data = dataclasses.asdict(row)
        return lambda: row_task.options(**options).remote(
            self.cfg_data, row_data, str(self.store), self.base["command"], self.sha, timed
        )

    def build_submitter(self, artifact: Artifact):
        r = self.cfg.ray
        options = {"num_cpus": r.build_cpus, "memory": int(r.build_memory_gb * GiB), "name": f"build: {artifact.label}"}
        return lambda: build_task.options(**options).remote(artifact, str(self.store))

    def submit(self, task: Task) -> None:
        task.attempts += 1
        task.started = None
        self.pending[task.submit()] = task

    def stopped(self, task: Task) -> None:
        """The task's current attempt ended: it no longer counts as running."""
        if task.row is not None and task.started is not None:
            self.progress.running -= 1
            self.progress.seconds.append(time.time() - task.started)
        task.started = None

    def run(self) -> list[dict]:
        for text in self.cfg.evals.texts:  # generated texts (chat) once here, not once per worker (shared $QSPEC_HOME)
            load_text(text, "eval")
        for task in self.builds.values():
            self.submit(task)
        for task in self.rows:
            if not task.waits_for:
                self.submit(task)
        self.report()
        try:
            while self.pending:
                ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=PROGRESS_EVERY_S)
                if not ready:
                    self.report()
                    continue
                gen = ready[0]
                task = self.pending.pop(gen)
                self.receive(gen, task)
        except KeyboardInterrupt:
            for gen in self.pending:
                ray.cancel(gen, force=True)
            log(f"cancelled {len(self.pending)} task(s) in flight")
            raise
        return self.records

    def receive(self, gen, task: Task) -> None:
        try:
            message = ray.get(next(gen))
        except StopIteration:  # a task ends with its result, so this is not reached
            return
        except RayTaskError as err:  # the row (or build) raised: recorded at once, no second attempt
            self.end(task, None, crash_text(err.cause if err.cause is not None else err), traceback_tail(err))
            return
        except RayError as err:  # its worker died: killed, out of memory, node lost
            self.crashed(task, crash_text(err))
            return
        if message.get("event") == "started":
            task.started, task.where = time.time(), {k: v for k, v in message.items() if k != "event"}
            if task.row is not None:
                self.progress.running += 1
                self.report()
            self.pending[gen] = task
            return
        if task.artifact is not None and not message["ok"] and message["killed"]:
            self.crashed(task, message["error"])
            return
        self.end(task, message, None)

    def crashed(self, task: Task, why: str) -> None:
        self.stopped(task)
        task.errors.append(why)
        if task.attempts < ATTEMPTS:
            log(f"{task.name}: its worker died ({why}); running it again")
            self.submit(task)
            return
        self.end(task, None, why)

    def end(self, task: Task, message: dict | None, error: str | None, detail: str | None = None) -> None:
        if task.artifact is not None:
            self.build_done(task, message if message is not None else {"ok": False, "error": error})
            return
        self.stopped(task)
        if message is None:
            record = {"row": dataclasses.asdict(task.row), "status": "failed", "results": {}, "reason": error}
            if detail:
                record["traceback"] = detail
            record.update(provenance(self.cfg.seed, self.base["command"], self.sha))
        else:
            record = message
        self.finish_row(task, record)

    def build_done(self, task: Task, result: dict) -> None:
        key = task.artifact.key()
        self.built[key] = result
        where = f" on {task.where['node']}" if task.where else ""
        if result["ok"]:
            log(f"{task.name}: {'built' if result['built'] else 'found in the store'}{where}")
        else:
            log(f"{task.name}: FAILED{where}: {result['error']}")
        for row_task_ in self.rows:
            if key not in row_task_.waits_for:
                continue
            row_task_.waits_for.discard(key)
            if not result["ok"]:
                self.finish_row(row_task_, self.unrun(row_task_.row, RowUnavailable(result["error"])))
            elif not row_task_.waits_for:
                self.submit(row_task_)
        self.report()

    def unrun(self, row: Row, err: Exception) -> dict:
        """The record of a row that does not run: as run_row writes it for RowUnavailable, failed otherwise."""
        status, reason = "failed", crash_text(err)
        if isinstance(err, RowUnavailable):
            status = "skipped" if isinstance(err, RowSkipped) else "wired, not run"
            reason = str(err)
        record = {"row": dataclasses.asdict(row), "status": status, "results": {}, "reason": reason}
        return {**record, **provenance(self.cfg.seed, self.base["command"], self.sha)}

    def finish_row(self, task: Task, record: dict) -> None:
        row = task.row
        cluster = {"attempts": task.attempts, "exclusive_node": is_timed(row)}
        if task.errors:
            cluster["earlier_attempts"] = task.errors
        if task.where:
            cluster.update(task.where)
        rec = {**self.base, **record, "cluster": cluster}
        append_jsonl(self.records_path, rec)
        self.records.append(rec)
        if rec["status"] == "failed":
            self.progress.failed += 1
            log(f"row {row.name}: FAILED after {task.attempts} attempt(s): {rec['reason']}")
        else:
            self.progress.done += 1
            where = f" on {task.where['node']} ({task.where['cpus']:g} CPUs)" if task.where else ""
            log(f"row {row.name}: {rec['status']}{where}")
        render_table(self.cfg, self.records, self.records_path.parent)  # the table grows as rows end
        self.report()

    def report(self) -> None:
        builds = ""
        if self.builds:
            builds = f"; artifacts {len(self.built)}/{len(self.builds)} ready"
        log(self.progress.line(builds))
