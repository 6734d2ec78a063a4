"""Every decoder linear of a model's int4 copy called once through `ext.linear` (the CPU step's kernels, fp32 in and
out), for M rows, at 1 and 2 threads; the M values interleaved round by round. Prints ms per pass over all layers
and the extra over the first M: what more rows cost the linears alone.

    PYTHONPATH=. python notes/issue-39/linear_rows.py [model] [Ms] [threads]
    PYTHONPATH=. python notes/issue-39/linear_rows.py smollm2-135m 1,2,4,8,16 1,2
"""

import statistics
import sys
import time

import torch

from quantize.fast_copy import load_named_copy
from runtime.kernels import cpu_step

ext = cpu_step.extension()
model, cfg, _ = load_named_copy(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m", "int4")
handles = [cpu_step.weight_handle(m, model.compute_dtype) for _, _, *linears in model.step_layers() for m in linears]
Ms = [int(m) for m in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8,16").split(",")]
threads = [int(t) for t in (sys.argv[3] if len(sys.argv) > 3 else "1,2").split(",")]
inputs = {M: {h.K: torch.randn(M, h.K, generator=torch.Generator().manual_seed(M)) for h in handles} for M in Ms}
times = {}
for r in range(7):  # round 0 warms up
    for t in threads:
        torch.set_num_threads(t)
        for M in Ms:
            start = time.perf_counter()
            for h in handles:
                ext.linear(h, inputs[M][h.K])
            if r:
                times.setdefault((t, M), []).append(time.perf_counter() - start)
for t in threads:
    med = {M: statistics.median(times[(t, M)]) * 1e3 for M in Ms}
    print(f"threads {t}: " + " ".join(f"M={M}: {med[M]:.2f} ms (+{med[M] - med[Ms[0]]:.2f})" for M in Ms))
