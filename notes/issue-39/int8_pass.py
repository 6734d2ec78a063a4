"""One pass of the CPU step's quantized kernels over every decoder layer of a model's shapes (random codes in huge
pages, as scripts/quant_stream_micro.py), one layout per run: i8pc (int8 per channel, bf16 activations), i8g64,
w8a8pc (int8 per channel, int8 activations), i4g64; 9 passes, median ms and GB/s of codes. A kernel probe for
A/B runs in alternating processes (notes/issue-39.md, twenty-seventh session), not a speed claim.

    PYTHONPATH=. python notes/issue-39/int8_pass.py smollm2-135m i8pc [ROWS]
"""

import statistics
import sys
import time

import torch

from runtime.kernels import cpu_step
from scripts.dense_stream_micro import SHAPES
from scripts.quant_kernel_micro import layer


def main(model: str, mode: str, rows: int) -> None:
    shapes, layers, _, _ = SHAPES[model]
    torch.set_num_threads(2)
    ext = cpu_step.extension()
    bits = 4 if mode.startswith("i4") else 8
    int8_acts = mode.startswith("w8a8")
    handles = [
        (layer(n, k, bits, int8_acts, group=k if mode.endswith("pc") else 64, seed=i, bf16_acts=not int8_acts), k)
        for i in range(layers)
        for n, k in shapes
    ]
    gigabytes = sum(n * k * bits / 8 for n, k in shapes) * layers / 1e9
    xs = {k: torch.randn(rows, k) for _, k in handles}
    times = []
    for _ in range(9):
        start = time.perf_counter()
        for h, k in handles:
            ext.linear(h, xs[k])
        times.append(time.perf_counter() - start)
    ms = statistics.median(times[1:]) * 1e3
    print(f"{mode} rows={rows}: {ms:.2f} ms {gigabytes / ms * 1e3:.1f} GB/s (codes)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
