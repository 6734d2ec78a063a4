"""Plain decode steps of the 1.5B (bf16) by their index within a run: five rounds, each a 24-step run (the cost
curve's old run length) and a 256-step run from the same random 256-token context, the long run's steps in
buckets by index (medians). Shows the host's slow phases landing on a long run's later steps.

    PYTHONPATH=. python notes/issue-37/step_index.py
"""

import statistics

import torch

from evals.speculation.specbench_suite import plain_decode
from runtime.loader import load_model
from runtime.sampling import SamplingParams

torch.set_num_threads(2)
model, cfg, path = load_model("qwen2.5-coder-1.5b", dtype=torch.bfloat16)
rand = torch.randint(2, cfg.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0)).tolist()
long_run = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
short_run = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
buckets = [(0, 8), (8, 24), (24, 64), (64, 128), (128, 192), (192, 255)]
for r in range(5):
    out, _ = plain_decode(model, rand, short_run)
    short = statistics.median(out.timing.step_times_s)
    out, decode_s = plain_decode(model, rand, long_run)
    st = out.timing.step_times_s
    by_index = " ".join(f"{a}-{b}:{statistics.median(st[a:b]) * 1e3:.1f}" for a, b in buckets)
    mean = decode_s / len(st) * 1e3
    print(f"round {r}: x24 {short * 1e3:.1f} | x256 by index {by_index} mean={mean:.1f}", flush=True)
