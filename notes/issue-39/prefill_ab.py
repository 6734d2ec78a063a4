"""Versions of the CPU step's source side by side in one process, timed on prompts: TTFT (a whole 1-token
``generate`` call) of quantized copies of one model at several prompt lengths, with a bf16 copy (whose prefill GEMMs
are torch's F.linear, the same in every build) in the same rounds as the baseline. Builds (source_ab.build) and
copies are alternated round by round so host drift hits them alike. Prints each build's largest difference of the
first token's logits against the first build (per copy, at the longest prompt), then per build, copy and length the
median TTFT and its ratio to bf16's in the same rounds.

    PYTHONPATH=. python notes/issue-39/prefill_ab.py VERSIONS MODEL COPIES LENGTHS ROUNDS
    PYTHONPATH=. python notes/issue-39/prefill_ab.py HEAD,/tmp/new.cpp smollm2-135m int8,fp8 512 9
"""

import statistics
import sys
import time

import torch
from source_ab import build, switcher

from quantize.fast_copy import load_named_copy
from runtime.decoding import generate
from runtime.provenance import provenance
from runtime.sampling import SamplingParams


def main() -> None:
    torch.set_num_threads(2)
    versions = sys.argv[1].split(",")
    name, copies = sys.argv[2], sys.argv[3].split(",")
    lengths = [int(n) for n in sys.argv[4].split(",")]
    rounds = int(sys.argv[5])
    modules = [build(v) for v in versions]
    models = {c: load_named_copy(name, c)[0] for c in ["bf16", *copies]}
    use = switcher(models.values())

    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(2, 1000, (n,), generator=gen).tolist() for n in lengths}
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times, first = {}, {}
    for r in range(rounds + 1):  # round 0 warms up and keeps the first tokens
        for i, module in enumerate(modules):
            use(module)
            for copy, model in models.items():
                for n, prompt in prompts.items():
                    start = time.perf_counter()
                    out = generate(model, [prompt], params)
                    if r:
                        times.setdefault((i, copy, n), []).append(time.perf_counter() - start)
                    else:
                        first[(i, copy, n)] = out
    print(f"{name}, TTFT, {rounds} rounds, builds x copies x lengths alternated")
    print(provenance(seed=0, command="PYTHONPATH=. python " + " ".join(sys.argv)))
    for copy in copies:
        same = all(
            first[(i, copy, n)].tokens == first[(0, copy, n)].tokens for i in range(len(versions)) for n in lengths
        )
        print(f"{copy}: first tokens the same in every build: {same}")
    for i, version in enumerate(versions):
        for copy in models:
            cells = []
            for n in lengths:
                ms = statistics.median(times[(i, copy, n)]) * 1e3
                base = statistics.median(times[(i, "bf16", n)]) * 1e3
                cells.append(f"{n}: {ms:.1f} ms ({ms / base:.3f}x bf16)")
            print(f"{version:>14} {copy:>5}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
