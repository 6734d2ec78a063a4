"""Check the Triton kernels against QuantLinear's reference path over a grid of shapes and formats.

    python -m quantize.kernels.selfcheck --device cpu   # Triton interpreter (sets TRITON_INTERPRET=1 itself)
    python -m quantize.kernels.selfcheck --device cuda  # compiled kernels on a GPU

Random codes, scales, zero points and (act-order) g_idx permutations; odd M/K/N that do not fill a tile.
Prints one line per case and a JSON summary with the max relative error per case (max|y-ref| / max|ref|).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

from quantize.qlinear import QuantizedWeight, QuantLinear

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def random_qweight(out_f: int, in_f: int, bits: int, group_size: int, act_order: bool, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    gs = in_f if group_size == -1 else group_size
    n_groups = -(-in_f // gs)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_f, n_groups, generator=gen) * 0.02 + 0.001).half().float()
    zeros = torch.randint(0, 2**bits, (out_f, n_groups), generator=gen).float()
    g_idx = None
    if act_order:
        g_idx = (torch.argsort(torch.randperm(in_f, generator=gen)) // gs).to(torch.int32)
    bias = torch.randn(out_f, generator=gen) * 0.1
    return QuantizedWeight(codes, scales, zeros, bits, gs, g_idx, bias)


SHAPES = {  # (M, K, N): none fills a tile; K=160 with 3 bits ends mid-word, N=33/40/100 mask columns
    "smoke": [(3, 160, 40)],
    "quick": [(1, 96, 40), (3, 160, 72), (17, 64, 33)],
    "full": [(1, 96, 40), (3, 160, 72), (17, 64, 33), (33, 256, 100), (2, 4096, 64)],
}


def cases(subset: str, dtypes: list[str]):
    """Every bit width x kernel x grouping (g32, g128 ragged, per-channel, act-order) on SHAPES[subset]."""
    groupings = [(32, False), (32, True), (-1, False)] + ([(128, False), (64, True)] if subset != "smoke" else [])
    for bits, (group_size, act_order), (m, k, n), kernel, dtype in itertools.product(
        (2, 3, 4, 8), groupings, SHAPES[subset], ("gemv", "gemm"), dtypes
    ):
        if subset == "smoke" and dtype != "float32" and (bits != 4 or act_order):
            continue  # smoke: 16-bit inputs on the plain 4-bit case only
        yield dict(bits=bits, group_size=group_size, act_order=act_order, m=m, k=k, n=n, kernel=kernel, dtype=dtype)


def run(device: str, dtypes: list[str], subset: str) -> list[dict]:
    import torch

    from quantize.kernels.triton_qmm import quant_matmul

    results = []
    all_cases = list(cases(subset, dtypes)) + [
        dict(bits=8, group_size=-1, act_order=False, m=m, k=96, n=40, kernel=kern, dtype="float32", w8a8=True)
        for m, kern in ((1, "gemv"), (5, "gemm"))
    ]
    for i, case in enumerate(all_cases):
        qw = random_qweight(case["n"], case["k"], case["bits"], case["group_size"], case["act_order"], seed=i)
        act_quant = case.get("w8a8", False)
        ref_layer = QuantLinear(qw, act_quant=act_quant, path="reference")
        layer = QuantLinear(qw, act_quant=act_quant, path="triton").to(device)
        dtype = getattr(torch, case["dtype"])
        x = torch.randn(case["m"], case["k"], generator=torch.Generator().manual_seed(i)).to(dtype)
        ref = ref_layer(x.float())
        y = quant_matmul(x.to(device), layer, kernel=case["kernel"]) + layer.bias.to(device)
        err = float((y.float().cpu() - ref).abs().max() / ref.abs().max())
        case = dict(case, max_rel_err=err, ok=err <= TOLERANCE[case["dtype"]])
        results.append(case)
        print(json.dumps(case), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quantize.kernels.selfcheck", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu = Triton interpreter")
    ap.add_argument("--dtypes", default=None, help="comma list; default float32,float16 (cpu) / +bfloat16 (cuda)")
    ap.add_argument("--subset", choices=sorted(SHAPES), default="quick", help="how many shapes and groupings")
    ap.add_argument("--json", default=None, help="write all results to this file")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    dtypes = (args.dtypes or ("float32,float16" if args.device == "cpu" else "float32,float16,bfloat16")).split(",")
    bad = [d for d in dtypes if d not in TOLERANCE]
    if bad:
        ap.error(f"unknown dtype(s) {bad}; choose from {sorted(TOLERANCE)}")
    results = run(args.device, dtypes, args.subset)
    failed = [r for r in results if not r["ok"]]
    summary = {
        "cases": len(results),
        "failed": len(failed),
        "max_rel_err": {d: max(r["max_rel_err"] for r in results if r["dtype"] == d) for d in dtypes},
    }
    print(json.dumps({"summary": summary}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
