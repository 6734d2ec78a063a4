"""qspec's evaluations: perplexity, teacher-forced fidelity, lm-eval tasks, serving metrics, the memory and
roofline calculator, and the benchmarks (``python -m evals.bench_decode`` and friends, each printing ratios
against a baseline measured in the same run)."""

import importlib

from evals.fidelity import compare_teacher_forced, greedy_outputs, token_match
from evals.metrics import SLO, RequestRecord, distribution, percentile, summarize

# Entry-point modules (python -m ...) load on first use of their names: importing them with the package would
# make runpy warn that the module ran after it was already imported.
_LAZY = {
    "PerplexityResult": "evals.perplexity",
    "perplexity": "evals.perplexity",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SLO",
    "PerplexityResult",
    "RequestRecord",
    "compare_teacher_forced",
    "distribution",
    "greedy_outputs",
    "percentile",
    "perplexity",
    "summarize",
    "token_match",
]
