"""Speculation: what speculative decoding accepts, what it buys and whether it is lossless. The Spec-Bench-style
suite (specbench_suite), speed against plain decoding, in the engine under concurrency, the speedup predicted per
hardware from measured acceptance, and the verdict's statistics (lossless, the exact two-token tests of chain_test,
the pytest helpers of testing). Commands: ``python -m evals.speculation.specbench``,
``evals.speculation.bench_spec``, ``evals.speculation.bench_engine_spec``, ``evals.speculation.spec_cost``,
``evals.speculation.verdict``, ``evals.speculation.verifier_check``."""
