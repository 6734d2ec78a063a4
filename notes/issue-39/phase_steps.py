"""Where an 8000-token decode step's time goes, phase by phase (the CPU step's own clocks, ext.profile), for one KV
format: the default model in bf16, a prompt of PROMPT_TOKENS, 20 warm-up steps, then 200 steps at the same position
(each rewrites the slot after the prompt). Run it in alternating processes against another build to A/B a kernel
(the phases of one process share its host phase). Usage, from the repository root:

    PYTHONPATH=. python notes/issue-39/phase_steps.py PROMPT_TOKENS [KV_DTYPE]

Prints the wall clock per step and ms per step of each phase (norm, qkv, rope_kv, attn, o, gate_up, act, down).
"""

import sys
import time

import torch

from runtime.kernels import cpu_step
from runtime.kv_policy import KVCacheSpec
from runtime.loader import load_model
from runtime.model import AttentionMetadata, decode_meta

torch.set_num_threads(2)
length = int(sys.argv[1])
kv_dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
steps = 200
model = load_model("smollm2-135m", dtype=torch.bfloat16)[0]
ext = cpu_step.extension()
cache = KVCacheSpec(dtype=kv_dtype).build(model, 1, length + 8)
prompt = torch.tensor([[(i * 7919) % 40000 + 100 for i in range(length)]])
with torch.inference_mode():
    model(prompt, AttentionMetadata.contiguous(1, 0, length, "cpu"), cache)
    token, lens = torch.tensor([[42]]), torch.tensor([length])
    for _ in range(20):
        model(token, decode_meta(lens), cache)
    ext.profile(True)
    t0 = time.perf_counter()
    for _ in range(steps):
        model(token, decode_meta(lens), cache)
    wall = (time.perf_counter() - t0) / steps
    phases = ext.profile(False)
names = "norm qkv rope_kv attn o gate_up act down".split()
print(f"wall {wall * 1e3:.2f} ms/step; " + " ".join(f"{n} {v / steps * 1e3:.3f}" for n, v in zip(names, phases)))
