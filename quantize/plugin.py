"""Run any quantizer of quantize.registry (a plug-in's, or a built-in's in-memory one) on a model and save it through
quantize.formats, like the built-in CLIs: the same flags, --eval, --out DIR (reloads with --model DIR), --record.
A CalibratedQuantizer also takes the calibration flags of GPTQ and AWQ (--calib, --nsamples, --seqlen, --batch-size,
--layer-by-layer, --resume) and runs in their layer-by-layer pass.

    python -m quantize.plugin --method my_pkg.quant:MyQuantizer --model smollm2-135m --bits 4 --group-size 64 --out DIR
    python -m quantize.plugin --method rtn:mse=1 --model smollm2-135m --eval wiki
    python -m quantize.plugin --method qspec_plugin_example.clipsearch:ClipSearch --nsamples 32 --out DIR
"""

from __future__ import annotations

from argparse import ArgumentParser

from quantize import cli
from quantize.registry import CalibrationStages, QuantizerError, build, calibrated

MODULE = "quantize.plugin"


def parser(calibration: bool) -> ArgumentParser:
    ap = cli.parser(MODULE, __doc__, calibration=calibration)
    ap.add_argument("--method", required=True, help="NAME[:key=value,...]: a registered quantizer or module:attr")
    if calibration:
        cli.add_resume_arg(ap)
    return ap


def main(argv: list[str] | None = None) -> dict:
    first = ArgumentParser(add_help=False)
    first.add_argument("--method")
    method = first.parse_known_args(argv)[0].method
    try:
        quantizer = None if method is None else build(method)  # imports and checks it before any model loads
    except QuantizerError as err:
        parser(calibration=False).error(str(err))
    ap = parser(calibration=quantizer is not None and calibrated(quantizer))
    args = ap.parse_args(argv)
    cfg = quantizer.config(cli.quant_config(ap, args))
    model, tokenizer, path, source = cli.load(ap, args, cfg)
    settings = {"quant_method": quantizer.name, "quantizer": args.method, "quantizer_settings": quantizer.describe()}
    if not calibrated(quantizer):
        cli.log(f"quantizing with {args.method}")
        model = quantizer.quantize_model(model, cfg)
        cfg.extra.update(settings)
        return cli.finish(args, model, tokenizer, path, cfg, MODULE, argv=argv)
    store = cli.layer_store(args, MODULE)  # after every argument check: a bad one leaves nothing behind
    tokens = cli.calibration_tokens(ap, args, tokenizer)
    stages = CalibrationStages(quantizer, cfg)
    seconds = cli.run_calibration(args, model, tokens, stages, cfg, source, store, quantizer.name)
    cfg.extra.update(settings, calib=args.calib, nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed)
    stats = {"quantize_seconds": round(seconds, 1), "layers": stages.stats}
    return cli.finish(args, model, tokenizer, path, cfg, MODULE, stats, argv, store=store)


if __name__ == "__main__":
    from quantize.cli import EXPECTED_ERRORS, run

    run(main, expected=EXPECTED_ERRORS)
