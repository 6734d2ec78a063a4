"""Median decode step (the loop's own clock) of one generate call per KV cache format, on a random SmolLM2-shaped
model of LAYERS layers in bf16 (mixed). Usage, from the repository root:

    NT=48 PYTHONPATH=. python notes/issue-39/kv_step_bench.py LAYERS CONTEXT THREADS auto,int8 [ROUNDS]
"""

import json
import os
import statistics
import sys

import torch

from runtime.config import ModelConfig
from runtime.decoding import generate
from runtime.kv_policy import KVCacheSpec
from runtime.model import random_model
from runtime.sampling import SamplingParams

layers, context, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
formats = sys.argv[4].split(",")
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 2
torch.set_num_threads(threads)
hf = json.load(open(os.path.expanduser("~/.cache/qspec/models/smollm2-135m/config.json")))
base = ModelConfig.from_hf(hf)
config = base.__class__(**{**base.__dict__, "num_layers": layers, "max_position_embeddings": max(context + 64, 8256)})
model = random_model(config, seed=0).set_dtype(torch.bfloat16, mixed=True)
prompt = torch.randint(1, 1000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
params = SamplingParams(temperature=0.0, max_tokens=int(os.environ.get("NT", "24")), ignore_eos=True)
for _ in range(rounds):
    for fmt in formats:
        out = generate(model, [prompt], params, compile="off", kv_cache=KVCacheSpec(dtype=fmt))
        step = statistics.median(out.timing.step_times_s)
        print(f"ctx {context} {fmt:9s} median step {1e3 * step:.2f} ms  ttft {out.timing.ttft_s:.2f}s", flush=True)
