"""Whole decode steps, A/B in one process: the dense weights read as one stream a core (the old layout), as four
streams, and as four streams from huge pages; rounds interleaved, TPOT = (wall(N) - wall(1)) / (N - 1).

    PYTHONPATH=. python notes/issue-39/dense_layout_ab.py qwen2.5-coder-0.5b bf16 48 5
"""

import os
import statistics
import sys
import time

from quantize.fast_copy import named_fast_copy
from runtime.decoding import generate
from runtime.kernels import cpu_step
from runtime.loader import load_model
from runtime.sampling import SamplingParams

name, variant, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
base, _, _ = load_model(name)
ids = list(range(1000, 1128))
os.environ["QSPEC_HUGE_PAGES"] = "0"  # read when the step first builds a layer's handle
small = named_fast_copy(base, variant)
generate(small, [ids], SamplingParams(max_tokens=2, ignore_eos=True))
os.environ["QSPEC_HUGE_PAGES"] = "1"
huge = named_fast_copy(base, variant)
generate(huge, [ids], SamplingParams(max_tokens=2, ignore_eos=True))
del base
ext = cpu_step.extension()
configs = {"1 stream, 4K": (small, 0), "4 streams, 4K": (small, 4), "4 streams, 2M": (huge, 4)}
tpot = {k: [] for k in configs}
for _ in range(rounds):
    for key, (model, streams) in configs.items():
        ext.set_dense_streams(streams)
        t0 = time.perf_counter()
        generate(model, [ids], SamplingParams(max_tokens=n, ignore_eos=True))
        t1 = time.perf_counter()
        generate(model, [ids], SamplingParams(max_tokens=1, ignore_eos=True))
        t2 = time.perf_counter()
        tpot[key].append(((t1 - t0) - (t2 - t1)) / (n - 1))
ext.set_dense_streams(4)
old = statistics.median(tpot["1 stream, 4K"])
for key, values in tpot.items():
    m = statistics.median(values)
    print(f"{name} {variant}: {key:14s} TPOT {1e3 * m:6.2f} ms  x old {old / m:.2f}")
