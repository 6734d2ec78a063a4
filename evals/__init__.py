"""qspec's evaluations: perplexity, teacher-forced fidelity, lm-eval tasks, serving metrics, the memory and
roofline calculator, and the benchmarks (``python -m evals.bench_decode`` and friends, each printing ratios
against a baseline measured in the same run)."""

from evals.fidelity import compare_teacher_forced, greedy_outputs, token_match
from evals.metrics import SLO, RequestRecord, distribution, percentile, summarize
from evals.perplexity import PerplexityResult, perplexity

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
