"""Quality: what a model or a change to it (quantization, a KV cache format) does to its outputs. Perplexity under
the GPTQ-paper protocol, teacher-forced fidelity against a reference (fidelity), lm-eval tasks on the runtime
(lm_eval_adapter, lm_eval_tasks, the offline wiki_tasks), HumanEval pass@1 in a sandbox (humaneval_problems,
humaneval_sandbox, humaneval_eval), quality out of domain, and long-context KV caches (long_context_measures).
Commands: ``python -m evals.quality.perplexity``, ``evals.quality.tasks``, ``evals.quality.humaneval``,
``evals.quality.ood``, ``evals.quality.long_context``."""
