"""Decode of the default model (bf16) at a long prompt for two KV formats, interleaved in one process: the loop's own
TPOT and the CPU step's attention phase per token (ext.profile). Usage, from the repository root:

    PYTHONPATH=. python notes/issue-39/kv_phases.py PROMPT_TOKENS NEW_TOKENS [FORMATS] [ROUNDS]

FORMATS: comma-separated KV dtypes, each optionally with the quantized attention's piece size (int8:1024;
int8:0 turns the split off), e.g. auto,int8:0,int8:1024.
"""

import sys
import time

import torch

from runtime.decoding import generate
from runtime.kernels import cpu_step
from runtime.kv_policy import KVCacheSpec
from runtime.loader import load_model
from runtime.sampling import SamplingParams

torch.set_num_threads(2)
length, new = int(sys.argv[1]), int(sys.argv[2])
formats = sys.argv[3].split(",") if len(sys.argv) > 3 else ["auto", "int8"]
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
model = load_model("smollm2-135m", dtype=torch.bfloat16)[0]
ext = cpu_step.extension()
prompt = [(i * 7919) % 40000 + 100 for i in range(length)]
params = SamplingParams(max_tokens=new, ignore_eos=True)
for _ in range(rounds):
    for spec in formats:
        fmt, _, piece = spec.partition(":")
        if piece:
            ext.set_kv_piece(int(piece) or 1 << 40)
        ext.profile(True)
        t0 = time.perf_counter()
        out = generate(model, [prompt], params, kv_cache=KVCacheSpec(dtype=fmt))
        phases = ext.profile(False)  # norm, qkv, rope+kv write, attention, o, gate_up, act, down (seconds)
        print(
            f"{spec:14s} own TPOT {out.timing.tpot_s * 1e3:.1f} ms, attention {phases[3] * 1e3 / new:.2f} ms a token, "
            f"step {sum(phases) * 1e3 / new:.2f} ms a token, call {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
