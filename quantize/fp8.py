"""FP8 and emulated FP4 weight quantization (round to nearest, no calibration data), on quantize.fplinear's
FloatWeight / FPLinear.

  --format e4m3                         FP8 e4m3 weights, per-channel scales, activations in the model dtype
  --format e4m3 --block-size 128        FP8 e4m3 weights with one scale per 128 x 128 block
  --format e4m3 --w8a8                  W8A8-FP8: per-channel weights, dynamic per-token e4m3 activations
                                        (torch._scaled_mm on GPUs with FP8; dequantized on CPU)
  --format mxfp4 | nvfp4                EMULATED FP4 (APPROXIMATE row): e2m1 in blocks of 32 with e8m0
                                        power-of-two scales (MX) or blocks of 16 with e4m3 scales and a
                                        per-tensor fp32 scale (NV); dequantized, no FP4 kernel

    python -m quantize.fp8 --model smollm2-135m --format e4m3 --eval wiki:64
    python -m quantize.fp8 --model smollm2-135m --format nvfp4 --eval wiki:64 --record fp4.jsonl
"""

from __future__ import annotations

import torch
from torch import nn

from quantize import cli
from quantize.config import DECODER_LINEARS, QuantConfig
from quantize.fplinear import FORMATS, FP4_BLOCK, FPLinear, quantize_fp4, quantize_fp8
from quantize.qlinear import set_module


def float_config(fmt: str, block_size: int = 0, w8a8: bool = False, modules=None, lm_head: bool = False):
    """The QuantConfig recording these settings (bits 8 / 4; group_size = input columns per scale)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")
    if w8a8 and (fmt != "e4m3" or block_size):
        raise ValueError("W8A8-FP8 is per-channel e4m3 (no --block-size)")
    if fmt != "e4m3" and block_size:
        raise ValueError(f"{fmt} has fixed blocks of {FP4_BLOCK[fmt]}; --block-size applies to e4m3")
    if block_size < 0:
        raise ValueError(f"--block-size must be >= 0 (0 = per-channel), got {block_size}")
    group = FP4_BLOCK.get(fmt, block_size or -1)
    cfg = QuantConfig(
        bits=8 if fmt == "e4m3" else 4,
        group_size=group,
        sym=True,
        act_quant=w8a8,
        modules=DECODER_LINEARS if modules is None else modules,
        lm_head=lm_head,
    )
    cfg.extra.update(
        quant_method="fp8" if fmt == "e4m3" else "fp4",
        fmt=fmt,
        weight_block_size=[block_size, block_size] if block_size else None,
        activation_scheme="dynamic" if w8a8 else "none",
        emulated=fmt != "e4m3",
    )
    return cfg


@torch.no_grad()
def quantize_model(model: nn.Module, cfg: QuantConfig, progress: bool = False) -> nn.Module:
    """Replace every targeted linear by an FPLinear on the reference path (in place). Tied lm_head: the
    embedding keeps its own full-precision table."""
    fmt, block = cfg.extra["fmt"], cfg.extra.get("weight_block_size") or [0]
    for i, name in enumerate(cfg.targets(model)):
        layer = model.get_submodule(name)
        if fmt == "e4m3":
            fw = quantize_fp8(layer.weight, block[0], layer.bias)
        else:
            fw = quantize_fp4(layer.weight, fmt, layer.bias)
        q = FPLinear(fw, act_quant=cfg.act_quant, compute_dtype=layer.weight.dtype, path="reference")
        set_module(model, name, q.to(layer.weight.device))
        if progress:
            cli.log(f"{fmt} {i + 1} {name}")
    return model


def main(argv: list[str] | None = None) -> None:
    ap = cli.parser("quantize.fp8", __doc__, calibration=False, bits=8, group_size=-1, checkpoint=False)
    ap.add_argument("--format", default="e4m3", choices=FORMATS, help="element format (mxfp4/nvfp4: emulated)")
    ap.add_argument("--block-size", type=int, default=0, help="e4m3: square weight blocks per scale (0 = per-channel)")
    ap.add_argument("--w8a8", action="store_true", help="e4m3: dynamic per-token FP8 activations too")
    args = ap.parse_args(argv)
    if args.bits != 8 or args.group_size != -1 or args.sym:
        ap.error("quantize.fp8 sets its own grid: use --format / --block-size, not --bits / --group-size / --sym")
    if args.out:
        ap.error("saving FP8/FP4 checkpoints is not implemented; measure in memory with --eval")
    if not args.eval:
        ap.error("nothing to do: give --eval TEXTS to measure the quantized model")
    try:
        cfg = float_config(
            args.format, args.block_size, args.w8a8, tuple(m for m in args.modules.split(",") if m), args.lm_head
        )
    except ValueError as err:
        ap.error(str(err))
    model, tokenizer, path, _ = cli.load(ap, args, cfg)
    quantize_model(model, cfg, progress=True)
    for layer in model.modules():  # evaluate on weights dequantized once: bit-identical to reference, faster
        if isinstance(layer, FPLinear):
            layer.set_path("dense")
    cli.finish(args, model, tokenizer, path, cfg, "quantize.fp8", argv=argv)


if __name__ == "__main__":
    main()
