"""Experiment configs: YAML -> dataclasses, where an unknown or mistyped key is an error naming its path."""

from __future__ import annotations

import dataclasses
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
    tiny: dict = field(default_factory=dict)  # ModelConfig overrides for spec "tiny-random"


@dataclass
class EvalSection:
    fidelity_sequences: int = 8  # teacher-forced windows from the wiki eval split
    fidelity_seqlen: int = 256
    greedy_prompts: int = 8  # free-running greedy match prompts (wiki eval openings)
    greedy_prompt_tokens: int = 64
    greedy_tokens: int = 32
    tasks: list[str] = field(default_factory=lambda: ["qspec_wiki_topic", "qspec_wiki_title", "qspec_wiki_lastword"])
    task_limit: int | None = 50  # documents per task
    task_docs: int = 500  # documents generated per offline task
    bootstrap_iters: int = 200
    # torch threads outside timed sections: 0 = every core (an idle machine); 1 lets several runs share one
    threads: int = 0


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
    run_evals: bool = True  # fidelity, perplexity, tasks
    run_bench: bool = True


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
    rows: list[Row] = field(default_factory=list)
    sweep: SweepSection = field(default_factory=SweepSection)
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
    return from_dict(ExperimentConfig, apply_overrides(data, overrides or []))
