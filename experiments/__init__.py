"""qspec's experiments: YAML configs (``configs/``) loaded into dataclasses, the runner
(``python -m experiments.run CONFIG``), JSONL result records, rendered tables and plots."""

from experiments.config import ConfigError, ExperimentConfig, load_config
from experiments.records import append_jsonl, read_jsonl

__all__ = ["ConfigError", "ExperimentConfig", "append_jsonl", "load_config", "read_jsonl"]
