"""AMX row policies side by side in one process: c(T) (a T-row step over a fixed context, logits included) under
each policy, the policies alternated round by round so host drift hits them alike. Prints ms per step (median of
the rounds) and c(T)/c(1) per policy, and c(1) against the first policy's.

    PYTHONPATH=. python notes/issue-39/policy_ab.py [model] [copy] [Ts] [policies] [rounds]
    PYTHONPATH=. python notes/issue-39/policy_ab.py qwen2.5-coder-1.5b int4 1,2,4,8 exact,dense 7
"""

import statistics
import sys
import time

import torch

from quantize.fast_copy import load_named_copy
from runtime.kernels import cpu_step
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata
from runtime.provenance import provenance

CONTEXT = 256
STEPS = 5  # steps per timing

torch.set_num_threads(2)
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
copy = sys.argv[2] if len(sys.argv) > 2 else "int4"
Ts = [int(t) for t in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8").split(",")]
policies = (sys.argv[4] if len(sys.argv) > 4 else "exact,dense").split(",")
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 7
model, cfg, _ = load_named_copy(name, copy)
cache = KVCache(cfg, 1, CONTEXT + max(Ts) + 16, model.compute_dtype)
gen = torch.Generator().manual_seed(0)
times = {(p, T): [] for p in policies for T in Ts}
with torch.inference_mode():
    prompt = torch.randint(2, 1000, (1, CONTEXT), generator=gen)
    model(prompt, AttentionMetadata.contiguous(1, 0, CONTEXT, "cpu"), cache)
    steps = {
        T: (torch.randint(2, 1000, (1, T), generator=gen), AttentionMetadata.contiguous(1, CONTEXT, T, "cpu"))
        for T in Ts
    }
    for r in range(rounds + 1):  # round 0 warms each policy up
        for p in policies:
            with cpu_step.amx_policy(p):
                for T, (tokens, meta) in steps.items():
                    start = time.perf_counter()
                    for _ in range(STEPS):
                        model(tokens, meta, cache)
                    if r:
                        times[(p, T)].append((time.perf_counter() - start) / STEPS)
med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
print(f"{name} {copy}, context {CONTEXT}, {rounds} rounds x {STEPS} steps, isa {cpu_step.extension().isa()}")
print(provenance(seed=0, command="PYTHONPATH=. python " + " ".join(sys.argv)))
for p in policies:
    curve = " ".join(f"c({T})={med[(p, T)]:.1f} ms ({med[(p, T)] / med[(p, Ts[0])]:.2f})" for T in Ts)
    print(f"{p:>12}: {curve}; c({Ts[0]}) x {policies[0]}'s: {med[(p, Ts[0])] / med[(policies[0], Ts[0])]:.3f}")
