"""Decode steps of the default model (bf16) at one long context, KV formats interleaved step by step in one process
(the shared cores' speed drifts over minutes; alternating every few steps cancels the drift). Each format's cache is
filled once by a prefill of the same prompt; then every round runs STEPS decode steps per configuration at the same
position (each step rewrites the slot after the prompt) and times each whole step (forward, lm_head). Usage, from the
repository root:

    PYTHONPATH=. python notes/issue-39/kv_steps.py PROMPT_TOKENS [CONFIGS] [ROUNDS] [STEPS]

CONFIGS: comma-separated KV dtypes, each optionally with the attention's piece size (int8:1024, auto:1024;
int8:0 turns the split off), default auto,int8:0,int8:1024. Prints each configuration's median step and the
ratio of the first configuration's median to each.
"""

import platform
import statistics
import subprocess
import sys
import time

import torch

from runtime.kernels import cpu_step
from runtime.kv_policy import KVCacheSpec
from runtime.loader import load_model
from runtime.model import AttentionMetadata, decode_meta

torch.set_num_threads(2)
length = int(sys.argv[1])
configs = (sys.argv[2] if len(sys.argv) > 2 else "auto,int8:0,int8:1024").split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 4
model = load_model("smollm2-135m", dtype=torch.bfloat16)[0]
ext = cpu_step.extension()
sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(
    f"command: python {' '.join(sys.argv)}; git {sha}; torch {torch.__version__}; {ext.isa()} family; "
    f"{platform.processor() or platform.machine()}; 2 threads",
    flush=True,
)
prompt = torch.tensor([[(i * 7919) % 40000 + 100 for i in range(length)]])
caches = {}
with torch.inference_mode():
    for fmt in dict.fromkeys(c.partition(":")[0] for c in configs):
        t0 = time.perf_counter()
        caches[fmt] = KVCacheSpec(dtype=fmt).build(model, 1, length + 8)
        model(prompt, AttentionMetadata.contiguous(1, 0, length, "cpu"), caches[fmt])
        print(f"{fmt}: prefill {time.perf_counter() - t0:.1f} s", flush=True)
    times = {c: [] for c in configs}
    token, lens = torch.tensor([[42]]), torch.tensor([length])
    for _ in range(rounds):
        for spec in configs:
            fmt, _, piece = spec.partition(":")
            if piece:
                ext.set_kv_piece(int(piece) or 1 << 40)
            for _ in range(steps):
                t0 = time.perf_counter()
                model(token, decode_meta(lens), caches[fmt])
                times[spec].append(time.perf_counter() - t0)
base = statistics.median(times[configs[0]])
for spec in configs:
    med = statistics.median(times[spec])
    print(f"{spec:14s} step median {med * 1e3:.2f} ms over {len(times[spec])}, {configs[0]} / this = {base / med:.3f}x")
