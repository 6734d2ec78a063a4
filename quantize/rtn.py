"""Round-to-nearest (RTN) weight quantization: per-channel or group-wise, symmetric or asymmetric, with an
optional MSE search of each group's range. No calibration data; the baseline every other method is scored
against.

    python -m quantize.rtn --model smollm2-135m --bits 4 --group-size 64 --out DIR
"""

from __future__ import annotations

import torch
from torch import nn

from quantize import cli
from quantize.cli import log
from quantize.config import QuantConfig
from quantize.qembedding import tie_quantized_embedding
from quantize.qlinear import quant_linear, set_module
from quantize.rtn_weight import quantize_weight  # defined below cli; re-exported here


@torch.no_grad()
def quantize_model(
    model: nn.Module, cfg: QuantConfig, mse: bool = False, progress: bool = False, label: str = "rtn"
) -> nn.Module:
    """Replace every targeted linear of a runtime.model.Transformer by an RTN QuantLinear (in place);
    progress logs one line per decoder layer, tagged with label."""
    names = cfg.targets(model)
    for i, name in enumerate(names):
        layer = model.get_submodule(name)
        set_module(
            model, name, quant_linear(quantize_weight(layer.weight, cfg, layer.bias, mse, name), cfg.act_quant, layer)
        )
        if progress and (i + 1 == len(names) or not names[i + 1].startswith(name.rsplit(".", 2)[0] + ".")):
            log(f"{label} {i + 1}/{len(names)} linears ({name.rsplit('.', 2)[0]} done)")
    if cfg.lm_head and model.config.tie_word_embeddings:
        tie_quantized_embedding(model)  # the embedding reads the quantized head's rows: no full-precision copy
    return model


def main(argv: list[str] | None = None) -> None:

    ap = cli.parser("quantize.rtn", __doc__, calibration=False)
    ap.add_argument("--mse", action="store_true", help="MSE search of each group's range (clipping)")
    args = ap.parse_args(argv)
    cfg = cli.quant_config(ap, args)
    model, tokenizer, path, _ = cli.load(ap, args, cfg)
    quantize_model(model, cfg, mse=args.mse, progress=True)
    cfg.extra.update(quant_method="rtn", mse_clip=args.mse)
    cli.finish(args, model, tokenizer, path, cfg, "quantize.rtn", argv=argv)


if __name__ == "__main__":
    from quantize.cli import EXPECTED_ERRORS, run

    run(main, expected=EXPECTED_ERRORS)
