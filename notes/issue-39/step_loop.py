"""A T-row step of the default model's int4 copy (256-token context, logits included) run N times: the workload to
put under `perf record`, so the extra cost of an 8-row verification over a 1-row decode step can be split by
function (both threads' samples; libgomp's spin-wait shows as unnamed addresses):

    PYTHONPATH=. perf record -q -o /tmp/step1.data python notes/issue-39/step_loop.py 1 3000
    PYTHONPATH=. perf record -q -o /tmp/step8.data python notes/issue-39/step_loop.py 8 3000
    perf report -i /tmp/step8.data --no-children --sort symbol -n --stdio | head -40   # compare the sample counts
"""

import sys
import time

import torch

from quantize.fast_copy import load_named_copy
from runtime.kv_cache import KVCache
from runtime.model import AttentionMetadata

CONTEXT = 256

torch.set_num_threads(2)
T, n = int(sys.argv[1]), int(sys.argv[2])
model, cfg, _ = load_named_copy(sys.argv[3] if len(sys.argv) > 3 else "smollm2-135m", "int4")
cache = KVCache(cfg, 1, CONTEXT + T + 16, model.compute_dtype)
gen = torch.Generator().manual_seed(0)
with torch.inference_mode():
    prompt = torch.randint(2, 1000, (1, CONTEXT), generator=gen)
    model(prompt, AttentionMetadata.contiguous(1, 0, CONTEXT, "cpu"), cache)
    tokens, meta = torch.randint(2, 1000, (1, T), generator=gen), AttentionMetadata.contiguous(1, CONTEXT, T, "cpu")
    for _ in range(20):
        model(tokens, meta, cache)
    start = time.perf_counter()
    for _ in range(n):
        model(tokens, meta, cache)
    print(f"T={T}: {(time.perf_counter() - start) / n * 1e3:.2f} ms a step")
