"""The CPU step's dense bf16 kernels over every layer of a real model's shapes (random weights, streamed from
memory as in a decode step: the model's decoder layers and its head), one weight stream a core against the default
four, at the row counts named on the command line; rounds interleaved, median ms per pass and GB/s of weights.
A kernel-level probe, not a speed claim (those come from evals.speed.bench_decode's whole steps).

    PYTHONPATH=. python scripts/dense_stream_micro.py qwen2.5-coder-0.5b 1 9
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from runtime.kernels import cpu_step
from runtime.kernels.huge_pages import place

# model -> ((N, K) of the fused qkv, o, gate_up and down projections), layers, hidden size, vocabulary
SHAPES = {
    "qwen2.5-coder-0.5b": ([(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24, 896, 151936),
    "qwen2.5-coder-1.5b": ([(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)], 28, 1536, 151936),
    "smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, 576, 49152),
}


def main(model: str, row_counts: list[int], rounds: int = 7) -> None:
    shapes, layers, hidden, vocab = SHAPES[model]
    torch.set_num_threads(2)
    ext = cpu_step.extension()
    g = torch.Generator().manual_seed(0)
    weights = [place(torch.randn(n, k, generator=g).to(torch.bfloat16)) for _ in range(layers) for n, k in shapes]
    weights.append(place(torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)))
    handles = [cpu_step.dense_handle(w) for w in weights]
    gigabytes = sum(w.numel() * 2 for w in weights) / 1e9
    for rows in row_counts:
        xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {w.shape[1] for w in weights}}
        times = {0: [], 4: []}
        for _ in range(rounds):
            for streams in times:
                ext.set_dense_streams(streams)
                start = time.perf_counter()
                for h, w in zip(handles, weights):
                    ext.linear(h, xs[w.shape[1]])
                times[streams].append(time.perf_counter() - start)
        ext.set_dense_streams(4)
        for streams, t in times.items():
            ms = statistics.median(t[1:]) * 1e3
            print(f"{model} {rows} rows, {streams} streams: {ms:7.1f} ms a pass, {gigabytes / ms * 1e3:5.1f} GB/s")


if __name__ == "__main__":
    main(sys.argv[1], [int(a) for a in sys.argv[2:]] or [1])
