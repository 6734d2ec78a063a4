"""int8 per-channel weight-only quantization (symmetric RTN), and W8A8: the same int8 weights with dynamic
per-token symmetric int8 activations, multiplied as integers (``torch._int_mm``, int32 accumulation) where the
device has it.

    python -m quantize.int8 --model smollm2-135m --out DIR            # weight-only
    python -m quantize.int8 --model smollm2-135m --w8a8 --out DIR     # int8 weights and activations
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from quantize.config import QuantConfig
from quantize.qlinear import QuantLinear, quantize_activations_per_token


def int_mm_available(device: torch.device) -> bool:
    return hasattr(torch, "_int_mm") and device.type in ("cpu", "cuda")


def w8a8_int_forward(layer: QuantLinear, x: Tensor) -> Tensor:
    """W8A8 matmul in integers: y = (q_x @ (codes - 128)ᵀ) * s_x * s_w, exact int32 accumulation.

    Needs a symmetric per-channel 8-bit QuantLinear (zeros == 128, one group)."""
    shape = x.shape
    q, s_x = quantize_activations_per_token(x.reshape(-1, shape[-1]))  # [M, K] int8, [M, 1]
    w = (layer.codes.to(torch.int16) - 128).to(torch.int8)  # [N, K]
    m = q.shape[0]
    if q.device.type == "cuda" and m <= 16:  # cuBLAS int8 GEMM needs M > 16: pad rows
        q = F.pad(q, (0, 0, 0, 17 - m))
    acc = torch._int_mm(q, w.t())[:m]  # [M, N] int32
    y = acc.float() * s_x * layer.scales.float()[:, 0]
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.view(*shape[:-1], -1).to(x.dtype)


class W8A8Linear(QuantLinear):
    """QuantLinear whose forward is the integer matmul (path 'int_mm'); reference_forward stays available."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.group_size != self.in_features or not bool((self.zeros == 128).all()):
            raise ValueError("the int8 matmul path needs symmetric per-channel 8-bit weights")
        self.path = "int_mm" if int_mm_available(self.codes.device) else "reference"

    def forward(self, x: Tensor) -> Tensor:
        if self.path == "int_mm" and int_mm_available(x.device):
            return w8a8_int_forward(self, x)
        return self.reference_forward(x)


@torch.no_grad()
def quantize_model(model, w8a8: bool = False, modules=None, lm_head: bool = False, progress: bool = False):
    """int8 symmetric per-channel RTN of every targeted linear; with w8a8 the layers quantize activations too
    (quantize.rtn.quant_linear builds W8A8Linear for act_quant configs)."""
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
    model, tokenizer, path = cli.load(ap, args, probe)
    model, cfg = quantize_model(model, args.w8a8, probe.modules, args.lm_head, progress=True)
    cfg.extra.update(quant_method="w8a8" if args.w8a8 else "int8")
    cli.finish(args, model, tokenizer, path, cfg, "quantize.int8", argv=argv)


if __name__ == "__main__":
    main()
