"""Serving: the engine and any OpenAI-compatible server under load, with ``vllm bench serve``'s latency definitions
(metrics: TTFT, TPOT, ITL, E2E, throughput, goodput; serving_load: the workload and the streaming client).
Commands: ``python -m evals.serving.bench_serving`` (the engine in-process), ``evals.serving.loadgen`` (a server
over HTTP), ``evals.serving.stub_server`` (a server with known latencies, no model)."""
