"""The head's one-pass widening (CpuStepBackend.linear_widened) on and off in one process: c(T) (a T-row step over
a 256-token context, logits included) with each, alternated round by round so host drift hits both alike. Prints
the largest logit difference (0: the same bits) and per setting the median c(T) and c(T)/c(first T).

    PYTHONPATH=. python notes/issue-39/head_ab.py MODEL COPY TS ROUNDS
    PYTHONPATH=. python notes/issue-39/head_ab.py smollm2-135m int4 1,8 15
"""

import statistics
import sys
import time

import torch

from quantize.fast_copy import load_named_copy
from runtime.backends import CpuStepBackend
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata
from runtime.provenance import provenance

CONTEXT, STEPS = 256, 3

torch.set_num_threads(2)
name, copy = sys.argv[1], sys.argv[2]
Ts = [int(t) for t in sys.argv[3].split(",")]
rounds = int(sys.argv[4])
model, cfg, _ = load_named_copy(name, copy)
hook = CpuStepBackend.linear_widened
settings = {"widened": hook, "off": lambda self, layer, x: None}
cache = KVCache(cfg, 1, CONTEXT + max(Ts) + 16, model.compute_dtype)
gen = torch.Generator().manual_seed(0)
times = {(s, T): [] for s in settings for T in Ts}
logits = {}
with torch.inference_mode():
    model(
        torch.randint(2, 1000, (1, CONTEXT), generator=gen), AttentionMetadata.contiguous(1, 0, CONTEXT, "cpu"), cache
    )
    steps = {
        T: (torch.randint(2, 1000, (1, T), generator=gen), AttentionMetadata.contiguous(1, CONTEXT, T, "cpu"))
        for T in Ts
    }
    for r in range(rounds + 1):
        for setting, fn in settings.items():
            CpuStepBackend.linear_widened = fn
            for T, (tokens, meta) in steps.items():
                start = time.perf_counter()
                for _ in range(STEPS):
                    out = model(tokens, meta, cache)
                if r:
                    times[(setting, T)].append((time.perf_counter() - start) / STEPS)
                else:
                    logits[(setting, T)] = out
CpuStepBackend.linear_widened = hook
print(provenance(seed=0, command="PYTHONPATH=. python " + " ".join(sys.argv)))
for T in Ts:
    print(f"T={T}: largest logit difference: {float((logits[('widened', T)] - logits[('off', T)]).abs().max()):.3g}")
for setting in settings:
    ms = {T: statistics.median(times[(setting, T)]) * 1e3 for T in Ts}
    print(f"{setting:>8}: " + " ".join(f"c({T})={ms[T]:.2f} ms ({ms[T] / ms[Ts[0]]:.2f})" for T in Ts))
