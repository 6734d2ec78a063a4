"""FP8 and emulated FP4 weight quantization, on quantize.fplinear's FloatWeight / FPLinear: round to nearest
(no calibration data) or, for e4m3, GPTQ error feedback onto the e4m3 grid at fixed scales (quantize.gptq's
one solver with FP8Grid; calibration as in the other quantizers).

  --format e4m3                         FP8 e4m3 weights, per-channel scales, activations in the model dtype
  --format e4m3 --block-size 128        FP8 e4m3 weights with one scale per 128 x 128 block
  --format e4m3 --w8a8                  W8A8-FP8: per-channel weights, dynamic per-token e4m3 activations
                                        (torch._scaled_mm on GPUs with FP8; dequantized on CPU)
  --format mxfp4 | nvfp4                EMULATED FP4 (APPROXIMATE row): e2m1 in blocks of 32 with e8m0
                                        power-of-two scales (MX) or blocks of 16 with e4m3 scales and a
                                        per-tensor fp32 scale (NV); dequantized, no FP4 kernel

  --format e4m3 --gptq [--act-order]    GPTQ onto the e4m3 grid (scales amax / 448, fixed before any update)
  --format e4m3 --scale-search N        per-channel scale = amax / 448 * 2^(-k/N), best k per channel (weight
                                        squared error; with --gptq or --scale-objective hessian the
                                        Hessian-weighted error of rounding, H from the calibration pass)

    python -m quantize.fp8 --model smollm2-135m --format e4m3 --eval wiki:64
    python -m quantize.fp8 --model smollm2-135m --format e4m3 --gptq --act-order --eval wiki:64
    python -m quantize.fp8 --model smollm2-135m --format e4m3 --w8a8 --out DIR    (compressed-tensors
                                        float-quantized: vLLM / llm-compressor read it; qspec loads --model DIR)
    python -m quantize.fp8 --model smollm2-135m --format nvfp4 --eval wiki:64 --record fp4.jsonl
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from quantize import cli
from quantize.calibration import Stage, calibrate
from quantize.config import DECODER_LINEARS, QuantConfig
from quantize.formats import float_refusal
from quantize.fplinear import (
    FORMATS,
    FP4_BLOCK,
    FloatWeight,
    FPLinear,
    fp8_scales,
    quantize_fp4,
    quantize_fp8,
    round_e4m3,
)
from quantize.gptq import GPTQ, ElementGrid, accumulate_hessian, add_gptq_args, gptq_config, layer_error
from quantize.qlinear import set_module


def row_errors(weight: Tensor, w_hat: Tensor, H: Tensor | None) -> Tensor:
    """Per output row [out]: Σ (w - ŵ)² (H None), or the Hessian-weighted (w - ŵ) H (w - ŵ)ᵀ."""
    delta = weight - w_hat
    return (delta * delta).sum(1) if H is None else ((delta @ H) * delta).sum(1)


def search_fp8_scales(weight: Tensor, steps: int, H: Tensor | None = None) -> Tensor:
    """Per-channel e4m3 scales [out, 1]: amax / 448 * 2^(-k / steps) for the k in 0..steps-1 with the smallest
    row error of rounding (row_errors). One octave is every distinct grid: e4m3 is a float format, so scales a
    power of two apart round the same (except at saturation and subnormals); k > 0 clips the largest weights."""
    w = weight.detach().float()
    base = fp8_scales(w)
    best_err = torch.full((w.shape[0],), float("inf"))
    best = base.clone()
    for k in range(steps):
        s = base * 2.0 ** (-k / steps)
        err = row_errors(w, round_e4m3(w / s).float() * s, H)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[:, None], s, best)
    return best


@dataclass
class FP8Grid(ElementGrid):
    """The e4m3 grid at fixed scales for quantize.gptq's solver: per output channel (block 0) or per
    block x block block, fixed before any update (given, else amax / 448 of the weight)."""

    block: int = 0
    scales: Tensor | None = None  # [out, 1] or [out/b, in/b]

    def start(self, W: Tensor) -> bool:
        out_features, n = W.shape
        if self.scales is None:
            self.scales = fp8_scales(W, self.block)
        self.group_size = self.block or n
        # the scales of each column group [out, n_groups]: block scales repeated down their rows
        self.col_scales = self.scales if not self.block else self.scales.repeat_interleave(self.block, 0)[:out_features]
        return True  # every scale is fixed before any update

    def round(self, w: Tensor, g: int) -> tuple[Tensor, Tensor]:
        s = self.col_scales[:, g]
        code = round_e4m3(w / s).float()
        return code, code * s

    def build(self, codes: Tensor, g_idx: Tensor | None, bias: Tensor | None) -> FloatWeight:
        return FloatWeight(codes.to(torch.float8_e4m3fn), self.scales, "e4m3", self.block, bias=bias)

    def module(self, qweight: FloatWeight, act_quant: bool, linear: nn.Module) -> nn.Module:
        layer = FPLinear(qweight, act_quant=act_quant, compute_dtype=linear.weight.dtype, path="reference")
        return layer.to(linear.weight.device)


def float_config(
    fmt: str,
    block_size: int = 0,
    w8a8: bool = False,
    modules=None,
    lm_head: bool = False,
    gptq: bool = False,
    scale_search: int = 0,
    scale_objective: str | None = None,
):
    """The QuantConfig recording these settings (bits 8 / 4; group_size = input columns per scale)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")
    if w8a8 and (fmt != "e4m3" or block_size):
        raise ValueError("W8A8-FP8 is per-channel e4m3 (no --block-size)")
    if fmt != "e4m3" and block_size:
        raise ValueError(f"{fmt} has fixed blocks of {FP4_BLOCK[fmt]}; --block-size applies to e4m3")
    if block_size < 0:
        raise ValueError(f"--block-size must be >= 0 (0 = per-channel), got {block_size}")
    if gptq and fmt != "e4m3":
        raise ValueError(f"--gptq rounds onto the e4m3 grid only; {fmt} is round-to-nearest")
    if scale_search < 0:
        raise ValueError(f"--scale-search must be >= 0 (0 = amax / 448), got {scale_search}")
    objective = scale_objective or ("hessian" if gptq else "weight")
    if objective not in ("weight", "hessian"):
        raise ValueError(f"--scale-objective must be weight or hessian, got {objective!r}")
    if scale_objective and not scale_search:
        raise ValueError("--scale-objective needs --scale-search N")
    if scale_search and (fmt != "e4m3" or block_size):
        raise ValueError("--scale-search searches per-channel e4m3 scales (no --block-size, no FP4)")
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
        weight_rounding="gptq" if gptq else "nearest",
        scale_search=scale_search,
        scale_objective=objective if scale_search else None,
    )
    return cfg


@torch.no_grad()
def quantize_model(model: nn.Module, cfg: QuantConfig, progress: bool = False) -> nn.Module:
    """Replace every targeted linear by an FPLinear on the reference path (in place). Tied lm_head: the
    embedding keeps its own full-precision table."""
    fmt, block = cfg.extra["fmt"], cfg.extra.get("weight_block_size") or [0]
    search = cfg.extra.get("scale_search", 0)
    for i, name in enumerate(cfg.targets(model)):
        layer = model.get_submodule(name)
        if fmt == "e4m3":
            scales = search_fp8_scales(layer.weight, search) if search else None
            fw = quantize_fp8(layer.weight, block[0], layer.bias, scales)
        else:
            fw = quantize_fp4(layer.weight, fmt, layer.bias)
        q = FPLinear(fw, act_quant=cfg.act_quant, compute_dtype=layer.weight.dtype, path="reference")
        set_module(model, name, q.to(layer.weight.device))
        if progress:
            cli.log(f"{fmt} {i + 1} {name}")
    return model


class FP8GPTQ(GPTQ):
    """GPTQ (quantize.gptq) onto FP8Grid in the calibration pass; also records each layer's Hessian-weighted
    error of plain rounding at the same scales, the baseline GPTQ's error is compared with."""

    def __init__(self, cfg: QuantConfig, gcfg, log=None):
        super().__init__(cfg, gcfg, log, grid_for=self.fp8_grid)
        self.rtn_errors: dict[str, float] = {}

    def fp8_grid(self, stage: Stage, H: Tensor) -> FP8Grid:
        block = (self.qcfg.extra.get("weight_block_size") or [0])[0]
        search = self.qcfg.extra.get("scale_search", 0)
        objective = H if self.qcfg.extra.get("scale_objective") == "hessian" else None
        weight = stage.linear.weight.detach().float()
        scales = search_fp8_scales(weight, search, objective) if search else fp8_scales(weight, block)
        self.rtn_errors[stage.full_name] = layer_error(weight, quantize_fp8(weight, block, scales=scales), H)
        return FP8Grid(block, scales)

    def layer_stats(self) -> list[dict]:
        return [{**s, "rtn_hessian_error": self.rtn_errors.get(s["layer"])} for s in self.stats]


class FP8Searched(FP8GPTQ):
    """Round to nearest (no error feedback) at per-channel scales searched on each layer's Hessian-weighted
    error: the scale-search lever alone, with the calibration pass only supplying H."""

    def quantize_stage(self, stage: Stage) -> None:
        if not self.qcfg.quantizes(stage.name):
            return
        linear = stage.linear
        grid = self.fp8_grid(stage, accumulate_hessian(stage.inputs, self.gcfg.first_token_weight))
        fw = quantize_fp8(linear.weight, 0, linear.bias, scales=grid.scales)
        self.stats.append({"layer": stage.full_name, "hessian_error": self.rtn_errors[stage.full_name]})
        set_module(stage.owner, stage.path, grid.module(fw, self.qcfg.act_quant, linear))


def parse_args(argv: list[str] | None):
    ap = cli.parser("quantize.fp8", __doc__, calibration=True, bits=8, group_size=-1, checkpoint=False)
    ap.add_argument("--format", default="e4m3", choices=FORMATS, help="element format (mxfp4/nvfp4: emulated)")
    ap.add_argument("--block-size", type=int, default=0, help="e4m3: square weight blocks per scale (0 = per-channel)")
    ap.add_argument("--w8a8", action="store_true", help="e4m3: dynamic per-token FP8 activations too")
    ap.add_argument(
        "--gptq",
        action="store_true",
        help="e4m3: GPTQ error feedback onto the e4m3 grid (calibration options below) instead of round-to-nearest",
    )
    ap.add_argument(
        "--scale-search",
        type=int,
        default=0,
        metavar="N",
        help="per-channel e4m3: try scales amax/448 * 2^(-k/N), k < N, keep each channel's best (see "
        "--scale-objective)",
    )
    ap.add_argument(
        "--scale-objective",
        choices=("weight", "hessian"),
        default=None,
        help="--scale-search minimises each channel's weight squared error (default without --gptq) or its "
        "Hessian-weighted error of rounding (default with --gptq; without it, the calibration pass runs for H only)",
    )
    ap.add_argument(
        "--dense-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="--out: dtype of the unquantized tensors (embeddings, norms); the checkpoint is compressed-tensors "
        "float-quantized (e4m3 weights, fp32 scales), what vLLM and llm-compressor read",
    )
    ap.set_defaults(checkpoint_format="compressed-tensors")
    add_gptq_args(ap, block_flag="--gptq-block-size")
    args = ap.parse_args(argv)
    if args.bits != 8 or args.group_size != -1 or args.sym:
        ap.error("quantize.fp8 sets its own grid: use --format / --block-size, not --bits / --group-size / --sym")
    if args.out and args.format != "e4m3":
        ap.error(f"--out: {args.format} is emulated (no FP4 checkpoint layout is written): only e4m3 is saved")
    if not args.eval and not args.out:
        ap.error("nothing to do: give --eval TEXTS to measure the quantized model and/or --out DIR to save it")
    if args.static_groups or args.mse:
        ap.error("--static-groups / --mse shape integer grids; FP8 scales are fixed (see --scale-search)")
    calibrated = args.gptq or args.scale_objective == "hessian"
    if (not args.gptq and args.act_order) or (not calibrated and args.layer_by_layer):
        ap.error(
            "--act-order / --layer-by-layer apply with --gptq (--layer-by-layer also with --scale-objective hessian)"
        )
    return ap, args


def main(argv: list[str] | None = None) -> None:
    ap, args = parse_args(argv)
    gcfg = gptq_config(ap, args)
    modules = tuple(m for m in args.modules.split(",") if m)
    try:
        cfg = float_config(
            args.format,
            args.block_size,
            args.w8a8,
            modules,
            args.lm_head,
            args.gptq,
            args.scale_search,
            args.scale_objective,
        )
    except ValueError as err:
        ap.error(str(err))

    def refusal(skeleton) -> str | None:  # --out: refused before the model loads, one line naming the layer
        return float_refusal(skeleton, cfg.target_names(skeleton), args.format, args.block_size)

    model, tokenizer, path, source = cli.load(ap, args, cfg, check=refusal)
    stats = {}
    if args.gptq or cfg.extra["scale_objective"] == "hessian":
        tokens = cli.calibration_tokens(ap, args, tokenizer)
        algo = (FP8GPTQ if args.gptq else FP8Searched)(cfg, gcfg, log=cli.log)
        start = time.perf_counter()
        calibrate(model, tokens, algo, args.batch_size, cfg.lm_head, source, progress=lambda m: cli.log(f"calib {m}"))
        cfg.extra.update(calib=args.calib, nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed)
        if args.gptq:
            cfg.extra.update(gptq=asdict(gcfg))
        stats = {"quantize_seconds": round(time.perf_counter() - start, 1), "layers": algo.layer_stats()}
    else:
        quantize_model(model, cfg, progress=True)
    for layer in model.modules():  # evaluate on weights dequantized once: bit-identical to reference, faster
        if isinstance(layer, FPLinear):
            layer.set_path("dense")
    cli.finish(args, model, tokenizer, path, cfg, "quantize.fp8", stats, argv=argv)


if __name__ == "__main__":
    main()
