"""Speed: decode and layer speed on this machine against HF and llama.cpp, paged decode attention on CUDA
(paged_decode_ops), back-of-envelope memory and roofline arithmetic, and the one-shot GPU check. Commands:
``python -m evals.speed.bench_decode``, ``evals.speed.bench_quant``, ``evals.speed.bench_paged_decode``,
``evals.speed.calculator``, ``evals.speed.gpu_check``."""
