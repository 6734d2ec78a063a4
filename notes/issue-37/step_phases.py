"""Where a step of T rows goes, by phase (the CPU step's own clock: norm, qkv, rope_kv, attn, o, gate_up, act, down),
for one sequence at a fixed context: ms per step, mean of 5 steps after one warm-up.

    PYTHONPATH=. python notes/issue-37/step_phases.py [model] [Ts] [copy]
    PYTHONPATH=. python notes/issue-37/step_phases.py qwen2.5-coder-1.5b 1,8,40,64
    QSPEC_CPU_AMX=exact PYTHONPATH=. python notes/issue-37/step_phases.py smollm2-135m 1,8 int4   # a quantized copy
"""

import sys
import time

import torch

from quantize.fast_copy import load_named_copy
from runtime.kernels import cpu_step
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata

PHASES = ["norm", "qkv", "rope_kv", "attn", "o", "gate_up", "act", "down"]
CONTEXT = 160

torch.set_num_threads(2)
ext = cpu_step.extension()
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
Ts = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,8,40,64").split(",")]
copy = sys.argv[3] if len(sys.argv) > 3 else "bf16"
model, cfg, _ = load_named_copy(name, copy)
cache = KVCache(cfg, 1, CONTEXT + max(Ts) + 16, model.compute_dtype)
gen = torch.Generator().manual_seed(0)
with torch.inference_mode():
    prompt = torch.randint(2, 1000, (1, CONTEXT), generator=gen)
    model(prompt, AttentionMetadata.contiguous(1, 0, CONTEXT, "cpu"), cache, hidden_only=True)
    for T in Ts:
        tokens = torch.randint(2, 1000, (1, T), generator=gen)
        meta = AttentionMetadata.contiguous(1, CONTEXT, T, "cpu")
        model(tokens, meta, cache, hidden_only=True)
        ext.profile(True)
        start = time.perf_counter()
        for _ in range(5):
            model(tokens, meta, cache, hidden_only=True)
        per_step = (time.perf_counter() - start) / 5
        phases = ext.profile(False)
        parts = " ".join(f"{p}={1e3 * s / 5:.1f}" for p, s in zip(PHASES, phases))
        print(f"T={T}: {per_step * 1e3:.1f} ms  {parts}", flush=True)
