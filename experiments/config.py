"""Experiment configs: YAML -> dataclasses, where an unknown or mistyped key is an error naming its path.

A ``grid:`` block expands into rows, one per point of the product of its axes (``axes: {bits: [3, 4]}``, or
``{calib: {wiki: wiki, mixed: "wiki:0.5,wiki-es:0.25,wiki-fr:0.25"}}`` where the keys name the values), each
named by its ``name`` template filled with the point's labels: a row keeps its name when other values join an
axis, so records of earlier runs still line up.
"""

from __future__ import annotations

import dataclasses
import itertools
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

LOSSLESS_CLASSES = ("exact", "same math", "same distribution", "approximate")
KINDS = ("table", "prompt_length", "concurrency", "spec_k")


class ConfigError(ValueError):
    """A config that cannot be run; the message names the offending key or value."""


@dataclass
class ModelSection:
    spec: str = "smollm2-135m"  # registry name, checkpoint dir, .gguf; "tiny-random" = a tiny random model
    dtype: str = "fp32"
    device: str = "cpu"  # where rows load the model: cpu, cuda (a GPU node: set ray.gpus too)
    tiny: dict = field(default_factory=dict)  # ModelConfig overrides for spec "tiny-random"


@dataclass
class HumanEvalSection:
    """HumanEval pass@1 of each evaluated row's model (evals.quality.humaneval: greedy completions of the raw code
    prompts, each run in its sandbox; completions and results cached per checkpoint and settings under $QSPEC_HOME)."""

    subset: str | None = "quick40"  # a fixed subset (evals.quality.humaneval.SUBSETS); null: all 164 problems
    limit: int | None = None  # only the first N problems (of the subset)
    max_new_tokens: int = 384
    batch_size: int = 8  # prompts decoded together (part of the completion cache key)

    def __post_init__(self):
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"evals.humaneval.{name}: {getattr(self, name)} must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"evals.humaneval.limit: {self.limit} must be >= 1 (or null: every problem)")


@dataclass
class EvalSection:
    fidelity_sequences: int = 8  # teacher-forced windows from the wiki eval split
    fidelity_seqlen: int = 256
    greedy_prompts: int = 8  # free-running greedy match prompts (wiki eval openings)
    greedy_prompt_tokens: int = 64
    greedy_tokens: int = 32
    tasks: list[str] = field(default_factory=lambda: ["qspec_wiki_topic", "qspec_wiki_title", "qspec_wiki_lastword"])
    # perplexity and fidelity per text (runtime.data names: wiki, wiki-es, wiki-fr, wiki-desc, chat), eval split,
    # teacher-forced against the reference on the same windows
    texts: list[str] = field(default_factory=list)
    text_windows: int = 8
    text_seqlen: int = 512
    task_limit: int | None = 50  # documents per task
    task_docs: int = 500  # documents generated per offline task
    bootstrap_iters: int = 200
    # torch threads outside timed sections: 0 = every core (an idle machine); 1 lets several runs share one
    threads: int = 0
    humaneval: HumanEvalSection | None = None  # set: HumanEval pass@1 (95% CI) of every evaluated row
    # speculator rows' "lossless?" column: the two-token test (evals.speculation.lossless) with this many sampled
    # runs (the verdict's budget is 2000); 0: not tested, the column shows the row's claim. Model changes are
    # classified for free.
    verdict_samples: int = 0


@dataclass
class BenchSection:
    prompts: int = 4  # timed prompts (batch 1 unless the row batches)
    prompt_tokens: int = 128
    new_tokens: int = 32
    repeats: int = 3  # baseline and variant alternate this many times; medians are compared
    warmup: int = 1
    lock: bool = True  # hold /tmp/qspec-bench.lock while timing (off for the tiny smoke config)


@dataclass
class Row:
    name: str
    kind: str  # a key of experiments.rows.ROWS
    lossless_class: str = "approximate"  # the claim; the runner checks it against the measurements
    params: dict = field(default_factory=dict)
    run_evals: bool = True  # fidelity, perplexity, tasks (and HumanEval, where evals.humaneval is set)
    run_bench: bool = True
    run_humaneval: bool = True  # with run_evals and evals.humaneval set; off: the other evals only
    grid: dict = field(default_factory=dict)  # a grid row's point: axis -> label (set by the expansion)


@dataclass
class GridBlock:
    """Rows from the product of axes: each axis is a params field with a list of values, or a mapping
    label -> value; the row name is ``name`` with every axis's label filled in (``"{method}{bits} g{group_size}"``)."""

    name: str
    kind: str
    axes: dict
    lossless_class: str = "approximate"
    params: dict = field(default_factory=dict)  # the same in every row of the block
    run_evals: bool = True
    run_bench: bool = True


@dataclass
class RaySection:
    """What each task asks of a Ray cluster (``experiments.run CONFIG --ray``). A timed row (run_bench, or a kind
    that times itself) holds a whole node: every CPU and GPU of it, so nothing shares the cores it measures on."""

    cpus: int = 1  # CPUs of an evaluation row, and its torch threads
    gpus: float = 0.0  # GPUs of an evaluation row
    memory_gb: float = 4.0  # memory Ray reserves for a row (SmolLM2 quantized rows scoring texts: ~4.3 GB)
    build_cpus: int = 1  # CPUs of an artifact build (a quantizer or head trainer's CLI)
    build_memory_gb: float = 3.0


@dataclass
class SweepSection:
    """For prompt_length / concurrency / spec_k configs: the x values and the series to plot."""

    values: list[int] = field(default_factory=list)
    series: list[dict] = field(default_factory=list)  # each: {name, ...kind-specific settings}
    new_tokens: int = 32
    repeats: int = 2


@dataclass
class ExperimentConfig:
    name: str
    kind: str = "table"
    description: str = ""
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    evals: EvalSection = field(default_factory=EvalSection)
    bench: BenchSection = field(default_factory=BenchSection)
    rows: list[Row] = field(default_factory=list)  # a grid's rows follow the written ones (load_config expands)
    grid: list[GridBlock] = field(default_factory=list)
    sweep: SweepSection = field(default_factory=SweepSection)
    ray: RaySection = field(default_factory=RaySection)
    results_dir: str = "results"
    time_budget_minutes: float | None = None  # the stated bound; the runner reports the measured wall time

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"kind: {self.kind!r} is not one of {list(KINDS)}")
        names = [r.name for r in self.rows]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"rows: duplicate row names {dup}")
        for r in self.rows:
            if r.lossless_class not in LOSSLESS_CLASSES:
                allowed = list(LOSSLESS_CLASSES)
                raise ConfigError(f"rows[{r.name}].lossless_class: {r.lossless_class!r} not in {allowed}")
        if self.ray.cpus < 1 or self.ray.build_cpus < 1 or self.ray.gpus < 0:
            raise ConfigError("ray: cpus and build_cpus must be >= 1, gpus >= 0")
        if self.evals.threads < 0:
            raise ConfigError(f"evals.threads: {self.evals.threads} must be >= 0 (0 = every core)")
        if self.kind == "table" and not self.rows:
            raise ConfigError("rows: a table config needs at least one row")
        if self.kind != "table" and not self.sweep.values:
            raise ConfigError(f"sweep.values: a {self.kind} config needs x values")


def _check(value, tp, where: str):
    """Build a value of annotated type tp from YAML data, raising ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check(value, a, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp) or (typing.Any,)
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return value
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def from_dict(cls, data: dict, where: str = "config"):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            label = f"{where}.{f.name}" if where != "config" else f.name
            kwargs[f.name] = _check(data[f.name], hints[f.name], label)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key {f.name!r}")
    return cls(**kwargs)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """--set evals.task_limit=20 bench.repeats=2: dotted keys, YAML values, validated like the file."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    data = apply_overrides(data, overrides or [])
    if data.get("grid") is not None:
        if not isinstance(data["grid"], list):
            raise ConfigError(f"grid: expected a list of blocks, got {type(data['grid']).__name__}")
        blocks = [_check(b, GridBlock, f"grid[{i}]") for i, b in enumerate(data["grid"])]
        data["rows"] = list(data.get("rows") or []) + [
            dataclasses.asdict(r) for i, b in enumerate(blocks) for r in expand_grid(b, f"grid[{i}]")
        ]
    return from_dict(ExperimentConfig, data)


def expand_grid(block: GridBlock, where: str = "grid") -> list[Row]:
    """The block's rows, one per point of the product of its axes in the order written (last axis fastest)."""
    axes: list[tuple[str, list[tuple[str, object]]]] = []
    for axis, values in block.axes.items():
        if isinstance(values, dict):
            points = [(str(label), value) for label, value in values.items()]
        elif isinstance(values, list):
            points = [(str(value), value) for value in values]
        else:
            raise ConfigError(f"{where}.axes.{axis}: expected a list or a mapping label -> value")
        if not points:
            raise ConfigError(f"{where}.axes.{axis}: no values")
        if axis in block.params:
            raise ConfigError(f"{where}.axes.{axis}: also fixed in {where}.params")
        axes.append((axis, points))
    named = {f for _, f, _, _ in string.Formatter().parse(block.name) if f is not None}
    unknown = sorted(named - block.axes.keys())
    if unknown:
        raise ConfigError(f"{where}.name: {block.name!r} names {unknown}, which are not axes {sorted(block.axes)}")
    unnamed = [axis for axis, points in axes if len(points) > 1 and axis not in named]
    if unnamed:
        raise ConfigError(f"{where}.name: {block.name!r} leaves out axes {unnamed}: their rows would share a name")
    rows = []
    for point in itertools.product(*(points for _, points in axes)):
        labels = {axis: label for (axis, _), (label, _) in zip(axes, point)}
        values = {axis: value for (axis, _), (_, value) in zip(axes, point)}
        rows.append(
            Row(
                name=block.name.format(**labels),
                kind=block.kind,
                lossless_class=block.lossless_class,
                params={**block.params, **values},
                run_evals=block.run_evals,
                run_bench=block.run_bench,
                grid=labels,
            )
        )
    return rows
