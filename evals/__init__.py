"""qspec's evaluations, grouped by what they measure (each benchmark prints ratios against a baseline measured in
the same run):

- ``evals.quality``: what a change does to the model's outputs: perplexity, teacher-forced fidelity, lm-eval
  tasks, HumanEval pass@1, out-of-domain texts, long-context KV caches.
- ``evals.speculation``: speculative decoding: acceptance and speedup (specbench, bench_spec, the engine), the
  cost model per hardware, and the lossless verdict with its exact two-token tests.
- ``evals.serving``: the serving engine and OpenAI-compatible servers under load: TTFT, TPOT, ITL, goodput.
- ``evals.speed``: decode and layer speed, the memory and roofline calculator, and the GPU check.

The reference attention implementations that check the runtime's kernels live beside it, in
``runtime.reference``. This package re-exports the fidelity and serving-metric functions other layers use most."""

import importlib

from evals.quality.fidelity import compare_teacher_forced, greedy_outputs, token_match
from evals.serving.metrics import SLO, RequestRecord, distribution, percentile, summarize

# Entry-point modules (python -m ...) load on first use of their names: importing them with the package would
# make runpy warn that the module ran after it was already imported.
_LAZY = {
    "PerplexityResult": "evals.quality.perplexity",
    "perplexity": "evals.quality.perplexity",
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
