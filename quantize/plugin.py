"""Run any in-memory quantizer of quantize.registry (a plug-in's, or a built-in's) on a model and save it through
quantize.formats, like the built-in CLIs: the same flags, --eval, --out DIR (reloads with --model DIR), --record.

    python -m quantize.plugin --method my_pkg.quant:MyQuantizer --model smollm2-135m --bits 4 --group-size 64 --out DIR
    python -m quantize.plugin --method rtn:mse=1 --model smollm2-135m --eval wiki
"""

from __future__ import annotations

from quantize import cli
from quantize.registry import QuantizerError, build


def main(argv: list[str] | None = None) -> dict:
    ap = cli.parser("quantize.plugin", __doc__, calibration=False)
    ap.add_argument("--method", required=True, help="NAME[:key=value,...]: a registered quantizer or module:attr")
    args = ap.parse_args(argv)
    try:
        quantizer = build(args.method)  # imports and checks the plug-in before any model loads
    except QuantizerError as err:
        ap.error(str(err))
    cfg = quantizer.config(cli.quant_config(ap, args))
    model, tokenizer, path, _ = cli.load(ap, args, cfg)
    cli.log(f"quantizing with {args.method}")
    model = quantizer.quantize_model(model, cfg)
    cfg.extra.update(quant_method=quantizer.name, quantizer=args.method, quantizer_settings=quantizer.describe())
    return cli.finish(args, model, tokenizer, path, cfg, "quantize.plugin", argv=argv)


if __name__ == "__main__":
    from quantize.cli import EXPECTED_ERRORS, run

    run(main, expected=EXPECTED_ERRORS)
