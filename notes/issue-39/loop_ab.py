"""c(T) as the speculative loop pays it (evals.speculation.cost_model.loop_step_sampler: c(1) a plain greedy decoding
step, c(T) a speculative step feeding T tokens, its host work, head and verification included) for Python-side
variants alternated round by round in one process: "torch" (greedy's argmax by torch's reduction, the code before
the argmax kernel) against "kernel" (runtime.sampling.argmax through the CPU step's argmax_rows). Prints per
variant and T the median and minimum over rounds of ms per step and c(T)/c(1).

    PYTHONPATH=. python notes/issue-39/loop_ab.py MODEL COPY TS ROUNDS
    PYTHONPATH=. python notes/issue-39/loop_ab.py smollm2-135m int4 1,8 15
"""

import statistics
import sys

import torch

from evals.speculation.cost_model import loop_step_sampler
from quantize.fast_copy import load_named_copy
from runtime.kernels import cpu_step
from runtime.provenance import provenance

STEPS = 64


def main() -> None:
    name, copy, Ts, rounds = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4])
    model, cfg, _ = load_named_copy(name, copy)
    prompts = torch.randint(2, cfg.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    samplers = {T: loop_step_sampler(model, prompts, T, steps=STEPS) for T in Ts}
    kernel = cpu_step.argmax_rows
    variants = {"torch": lambda x: None, "kernel": kernel}
    ms: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        for label, fn in variants.items():
            cpu_step.argmax_rows = fn
            for T, sampler in samplers.items():
                seconds = sampler()
                if r:
                    ms.setdefault((label, T), []).append(seconds * 1e3)
    cpu_step.argmax_rows = kernel
    print(provenance(), f"{name} {copy}, 256-token context, {STEPS}-token runs, {rounds} rounds")
    for label in variants:
        base = ms[label, Ts[0]]
        for T in Ts:
            v = ms[label, T]
            print(
                f"{label:7s} T={T}: median {statistics.median(v):.3f} ms, min {min(v):.3f} ms; "
                f"c(T)/c({Ts[0]}) medians {statistics.median(v) / statistics.median(base):.3f}, "
                f"minima {min(v) / min(base):.3f}"
            )


if __name__ == "__main__":
    main()
