"""The CPU step's quantized bf16-activation kernels over every decoder layer of a real model's shapes (random int4
or int8 g64 codes, streamed from memory as in a decode step): tiles read as one stream a core or eight
(set_quant_streams), int4 codes unpacked one pair column a load or four (set_quant_quads), at the row counts named
on the command line; rounds interleaved, median ms per pass and GB/s of codes, scales and zeros.
A kernel-level probe, not a speed claim (those come from evals.speed.bench_decode's whole steps).

    PYTHONPATH=. python scripts/quant_stream_micro.py smollm2-135m 4 1 8
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from runtime.kernels import cpu_step
from scripts.dense_stream_micro import SHAPES
from scripts.quant_kernel_micro import layer


def main(model: str, bits: int, row_counts: list[int], rounds: int = 7) -> None:
    shapes, layers, _, _ = SHAPES[model]
    torch.set_num_threads(2)
    ext = cpu_step.extension()
    handles = [(layer(n, k, bits, False, seed=i, bf16_acts=True), k) for i in range(layers) for n, k in shapes]
    gigabytes = sum(n * k * bits / 8 + n * -(-k // 64) * 5 for n, k in shapes) * layers / 1e9
    g = torch.Generator().manual_seed(0)
    for rows in row_counts:
        xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in handles}}
        times = {(streams, quads): [] for streams in (0, 8) for quads in (0, 1)}
        for _ in range(rounds):
            for streams, quads in times:
                ext.set_quant_streams(streams)
                ext.set_quant_quads(quads)
                start = time.perf_counter()
                for h, k in handles:
                    ext.linear(h, xs[k])
                times[streams, quads].append(time.perf_counter() - start)
        ext.set_quant_streams(8)
        ext.set_quant_quads(1)
        for (streams, quads), t in times.items():
            ms = statistics.median(t[1:]) * 1e3
            label = f"{streams or 1} tile stream(s), {4 if quads else 1} pair column(s) a load"
            print(f"{model} int{bits} {rows} rows, {label}: {ms:7.2f} ms a pass, {gigabytes / ms * 1e3:5.1f} GB/s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [int(a) for a in sys.argv[3:]] or [1])
