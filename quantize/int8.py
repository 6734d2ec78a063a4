"""int8 per-channel weight-only quantization (symmetric RTN), and W8A8: the same int8 weights with dynamic
per-token symmetric int8 activations. The integer matmul (``torch._int_mm``, int32 accumulation) is
QuantLinear's ``cpu_w8a8`` path; quality is measured on the reference path (same math, float summation).

    python -m quantize.int8 --model smollm2-135m --out DIR            # weight-only
    python -m quantize.int8 --model smollm2-135m --w8a8 --out DIR     # int8 weights and activations
"""

from __future__ import annotations

import torch

from quantize.config import QuantConfig


@torch.no_grad()
def quantize_model(model, w8a8: bool = False, modules=None, lm_head: bool = False, progress: bool = False):
    """int8 symmetric per-channel RTN of every targeted linear; with w8a8 the layers quantize activations too
    (QuantLinear act_quant=True)."""
    from quantize import rtn
    from quantize.config import DECODER_LINEARS

    cfg = QuantConfig(
        bits=8, group_size=-1, sym=True, act_quant=w8a8, modules=modules or DECODER_LINEARS, lm_head=lm_head
    )
    return rtn.quantize_model(model, cfg, progress=progress), cfg


def main(argv: list[str] | None = None) -> None:
    from quantize import cli

    ap = cli.parser("quantize.int8", __doc__, calibration=False, bits=8, group_size=-1)
    ap.add_argument("--w8a8", action="store_true", help="quantize activations per token to int8 too")
    args = ap.parse_args(argv)
    if args.bits != 8 or args.group_size != -1:
        ap.error("quantize.int8 is 8-bit per-channel; use quantize.rtn / gptq / awq for other grids")
    cli.quant_config(ap, args, sym=True, act_quant=args.w8a8)  # validates the module list and --out/--eval
    probe = QuantConfig(bits=8, group_size=-1, sym=True, modules=tuple(m for m in args.modules.split(",") if m))
    model, tokenizer, path, _ = cli.load(ap, args, probe)
    model, cfg = quantize_model(model, args.w8a8, probe.modules, args.lm_head, progress=True)
    cfg.extra.update(quant_method="w8a8" if args.w8a8 else "int8")
    cli.finish(args, model, tokenizer, path, cfg, "quantize.int8", argv=argv)


if __name__ == "__main__":
    main()
