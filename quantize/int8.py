"""int8 per-channel weight-only quantization (symmetric RTN), and W8A8: the same int8 weights with dynamic
per-token symmetric int8 activations. The integer matmul (``torch._int_mm``, int32 accumulation) is
QuantLinear's ``cpu_w8a8`` path; quality is measured on the reference path, which sums the same integers
exactly: a saved W8A8 checkpoint reloaded on cpu_w8a8 gives the measured figures bit for bit.

W8A8 with ``--smooth ALPHA`` (SmoothQuant, Xiao et al. 2022): a few input channels carry activations far
larger than the rest, which sets every token's int8 step. Per input channel j of a linear,
s_j = max|X_j|^α / max|W_j|^(1-α); activations are divided by s and weight columns multiplied by s, moving
range from activations into weights. 1/s is folded into the producer of the inputs (input_layernorm for qkv,
post_attention_layernorm for gate_up, the up rows of gate_up for down_proj, the v rows for o_proj without
GQA), with AWQ's fold, so the float model is unchanged. Activation maxima come from the calibration pass
(each layer's float inputs, after the preceding layers were quantized); the calibration flags apply only
with --smooth.

    python -m quantize.int8 --model smollm2-135m --out DIR                        # weight-only
    python -m quantize.int8 --model smollm2-135m --w8a8 --out DIR                 # int8 weights and activations
    python -m quantize.int8 --model smollm2-135m --w8a8 --smooth 0.5 --out DIR    # smoothed W8A8
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from quantize import cli, rtn
from quantize.awq import fold_scale, scale_producer
from quantize.calibration import LayerAlgorithm, Stage, calibrate, run_layer
from quantize.config import DECODER_LINEARS, QuantConfig
from quantize.qlinear import quant_linear, set_module
from quantize.rtn_weight import quantize_weight


@torch.no_grad()
def quantize_model(model, w8a8: bool = False, modules=None, lm_head: bool = False, progress: bool = False):
    """int8 symmetric per-channel RTN of every targeted linear; with w8a8 the layers quantize activations too
    (QuantLinear act_quant=True)."""

    cfg = int8_config(w8a8, modules, lm_head)
    return rtn.quantize_model(model, cfg, progress=progress, label="w8a8" if w8a8 else "int8"), cfg


def int8_config(w8a8: bool, modules=None, lm_head: bool = False) -> QuantConfig:

    return QuantConfig(
        bits=8, group_size=-1, sym=True, act_quant=w8a8, modules=modules or DECODER_LINEARS, lm_head=lm_head
    )


def smooth_scale(x_absmax: Tensor, weight: Tensor, alpha: float) -> Tensor:
    """SmoothQuant's s [in] = max|X_j|^α / max_i |W_ij|^(1-α) for inputs x_absmax [in] and weight [out, in]."""
    w_absmax = weight.detach().float().abs().amax(0).clamp(min=1e-5)
    return (x_absmax.float().pow(alpha) / w_absmax.pow(1 - alpha)).clamp(min=1e-5)


class SmoothQuant(LayerAlgorithm):
    """Smooth each float layer (prepare_layer: one forward whose stage hook scales each linear in turn and
    rescales the captured inputs, as AWQ does), then int8 RTN stage by stage."""

    def __init__(self, qcfg: QuantConfig, alpha: float = 0.5):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"SmoothQuant alpha must lie in [0, 1], got {alpha}")
        self.qcfg, self.alpha = qcfg, alpha
        self.stats: list[dict] = []

    def prepare_layer(self, layer_idx, layer, xs, rope) -> None:
        run_layer(layer, xs, rope, lambda st: self.smooth(st, layer), layer_idx)

    @torch.no_grad()
    def smooth(self, stage: Stage, layer: nn.Module) -> None:

        prev = scale_producer(layer, stage.name)
        if stage.name not in self.qcfg.modules or prev is None:
            return
        linear = stage.linear
        x_absmax = torch.stack([x.reshape(-1, linear.in_features).abs().amax(0) for x in stage.inputs]).amax(0)
        s = smooth_scale(x_absmax, linear.weight, self.alpha)
        fold_scale(prev[0], prev[1], linear, s)
        for x in stage.inputs:  # the rest of this forward sees the folded layer
            x.div_(s.to(x.dtype))
        self.stats.append({"layer": stage.full_name, "act_absmax": float(x_absmax.max()), "scale_max": float(s.max())})

    def quantize_stage(self, stage: Stage) -> None:
        if not self.qcfg.quantizes(stage.name):
            return

        linear = stage.linear
        qw = quantize_weight(linear.weight, self.qcfg, linear.bias, name=stage.full_name)
        set_module(stage.owner, stage.path, quant_linear(qw, self.qcfg.act_quant, linear))


def main(argv: list[str] | None = None) -> None:

    ap = cli.parser("quantize.int8", __doc__, calibration=True, bits=8, group_size=-1)
    ap.add_argument("--w8a8", action="store_true", help="quantize activations per token to int8 too")
    ap.add_argument(
        "--smooth", type=float, default=None, metavar="ALPHA", help="with --w8a8: SmoothQuant migration strength"
    )
    args = ap.parse_args(argv)
    if args.bits != 8 or args.group_size != -1:
        ap.error("quantize.int8 is 8-bit per-channel; use quantize.rtn / gptq / awq for other grids")
    if args.smooth is not None and not args.w8a8:
        ap.error("--smooth smooths activations for W8A8; give --w8a8 too")
    if args.smooth is not None and not 0.0 <= args.smooth <= 1.0:
        ap.error(f"--smooth ALPHA must lie in [0, 1], got {args.smooth}")
    if args.layer_by_layer and args.smooth is None:
        ap.error("--layer-by-layer needs the calibration pass, i.e. --smooth")
    cli.quant_config(ap, args, sym=True, act_quant=args.w8a8)  # validates the module list and --out/--eval
    probe = QuantConfig(bits=8, group_size=-1, sym=True, modules=tuple(m for m in args.modules.split(",") if m))
    model, tokenizer, path, source = cli.load(ap, args, probe)
    stats = None
    if args.smooth is None:
        model, cfg = quantize_model(model, args.w8a8, probe.modules, args.lm_head, progress=True)
        cfg.extra.update(quant_method="w8a8" if args.w8a8 else "int8")
    else:
        cfg = int8_config(True, probe.modules, args.lm_head)
        tokens = cli.calibration_tokens(ap, args, tokenizer)
        algo = SmoothQuant(cfg, args.smooth)
        start = time.perf_counter()
        calibrate(model, tokens, algo, args.batch_size, cfg.lm_head, source, progress=lambda m: cli.log(f"smooth {m}"))
        stats = {"quantize_seconds": round(time.perf_counter() - start, 1), "smooth_layers": algo.stats}
        cfg.extra.update(
            quant_method="w8a8",
            smooth_alpha=args.smooth,
            calib=args.calib,
            nsamples=args.nsamples,
            seqlen=args.seqlen,
            seed=args.seed,
        )
    cli.finish(args, model, tokenizer, path, cfg, "quantize.int8", stats, argv=argv)


if __name__ == "__main__":
    from quantize.cli import EXPECTED_ERRORS, run

    run(main, expected=EXPECTED_ERRORS)
