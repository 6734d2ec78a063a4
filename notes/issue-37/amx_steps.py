"""Forward steps of T rows (T = 1 a plain decode step, T = k + 1 a chain verification) on a real model, the CPU
step's AMX row policies alternated in one process (off: vector kernels; dense: AMX tiles for dense bf16 layers at
every row count; exact: quantized layers too): median ms per step (5 rounds x 4 calls) and c(T) / c(T[0]).

    PYTHONPATH=. python notes/issue-37/amx_steps.py [model] [dtype] [Ts] [context] [policies]
    PYTHONPATH=. python notes/issue-37/amx_steps.py qwen2.5-coder-1.5b bf16 1,2,5,9 256 off,dense
"""

import statistics
import sys
import time

import torch

from evals.speed.bench_decode import named_fast_copy
from runtime.kernels import cpu_step
from runtime.kv_cache import KVCache
from runtime.loader import load_model
from runtime.model import AttentionMetadata

torch.set_num_threads(2)
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
dtype = sys.argv[2] if len(sys.argv) > 2 else "bf16"
Ts = [int(t) for t in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8,9,16").split(",")]
context = int(sys.argv[4]) if len(sys.argv) > 4 else 256
modes = sys.argv[5].split(",") if len(sys.argv) > 5 else ["off", "dense"]
ext = cpu_step.extension()
if dtype in ("bf16", "fp32"):
    model, cfg, _ = load_model(name, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
else:  # a quantized copy as bench_decode's qspec rows build it (int8, int4, fp8, w8a8, w4a8)
    base, cfg, _ = load_model(name)
    model = named_fast_copy(base, dtype)
    del base
gen = torch.Generator().manual_seed(0)
cache = KVCache(cfg, 1, context + 64, model.compute_dtype)
with torch.inference_mode():
    prompt = torch.randint(2, cfg.vocab_size, (1, context), generator=gen)
    model(prompt, AttentionMetadata.contiguous(1, 0, context, "cpu"), cache, hidden_only=True)
    times = {(m, T): [] for m in modes for T in Ts}
    for rnd in range(6):
        for m in modes:
            ext.set_amx(m)
            for T in Ts:
                tokens = torch.randint(2, cfg.vocab_size, (1, T), generator=gen)
                meta = AttentionMetadata.contiguous(1, context, T, "cpu")
                for _ in range(4):
                    t0 = time.perf_counter()
                    h = model(tokens, meta, cache, hidden_only=True)
                    model.logits(h)
                    if rnd > 0:
                        times[(m, T)].append(time.perf_counter() - t0)
ext.set_amx("dense")
for m in modes:
    med = {T: statistics.median(times[(m, T)]) for T in Ts}
    row = "  ".join(f"T={T}: {med[T] * 1e3:6.1f} ms ({med[T] / med[Ts[0]]:.2f})" for T in Ts)
    print(f"{m:12s} {row}", flush=True)
