"""The unquantized reference row of a quantization table: the same evaluation and record as the quantizer
CLIs, with no layer changed.

    python -m quantize.baseline --model smollm2-135m --eval wiki:32,wiki-fr:16 --record results.jsonl
"""

from __future__ import annotations

import argparse

from quantize import cli
from runtime.loader import ModelSpecError, load_model, load_tokenizer


def main(argv: list[str] | None = None) -> None:

    ap = argparse.ArgumentParser(prog="python -m quantize.baseline", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--eval", required=True, help="texts, e.g. wiki:32,wiki-fr:16")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--record", default=None)
    args = ap.parse_args(argv)
    try:
        model, _, path = load_model(args.model)
    except ModelSpecError as err:
        ap.error(str(err))
    record = {"quant_config": None, "model": args.model, **cli.provenance(argv, "quantize.baseline")}
    record.update(cli.evaluate(model, cli.CachedTokenizer(load_tokenizer(str(path))), args.eval, args.eval_windows))
    cli.write_record(record, args.record)


if __name__ == "__main__":
    main()
