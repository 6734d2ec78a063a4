"""Convert a quantized checkpoint to another packed format: the same codes, scales and zero points, written in
the layout another tool loads (or refused, naming the layer, where that layout cannot hold them).

    python -m quantize.export --model /tmp/gptq4 --format compressed-tensors --out /tmp/gptq4-ct
    python -m quantize.export --model /tmp/rtn4 --format awq --out /tmp/rtn4-awq --dense-dtype fp32

The input is any checkpoint qspec loads (gptq v1/v2, awq GEMM, compressed-tensors, qspec). The quantizer's metadata
(qspec_quantize.json's quant_config, else the source quantization_config's non-format keys) travels along;
qspec_quantize.json is copied with the new format and an ``export`` entry.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from quantize.formats import DENSE_DTYPES, FORMATS, CheckpointError, save_quantized
from runtime.loader import ModelSpecError, load_model, resolve

# Keys of a quantization_config that describe the format (re-derived on save), not the quantizer.
FORMAT_KEYS = {
    "bits",
    "group_size",
    "sym",
    "desc_act",
    "quant_method",
    "checkpoint_format",
    "format",
    "pack_dtype",
    "lm_head",
    "act_quant",
    "version",
    "zero_point",
    "modules_to_not_convert",
    "meta",
}


def source_metadata(path: Path, hf_config: dict) -> dict:
    """The quantizer's settings to carry into the new checkpoint."""
    record = path / "qspec_quantize.json"
    if record.is_file():
        quant_config = json.loads(record.read_text()).get("quant_config")
        if quant_config:
            return quant_config
    if "qspec_quant_config" in hf_config:  # a compressed-tensors export keeps them outside quantization_config
        return hf_config["qspec_quant_config"]
    qc = hf_config.get("quantization_config", {})
    if qc.get("quant_method") == "compressed-tensors":
        return {}
    return {**{k: v for k, v in qc.items() if k not in FORMAT_KEYS}, **qc.get("meta", {})}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m quantize.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="quantized checkpoint directory to convert")
    ap.add_argument("--format", required=True, choices=FORMATS, help="format to write")
    ap.add_argument("--out", required=True, help="output checkpoint directory (loadable with --model DIR)")
    ap.add_argument(
        "--dense-dtype", choices=("bf16", "fp32"), default="bf16", help="dtype of the unquantized tensors in --out"
    )
    args = ap.parse_args(argv)
    try:
        path = resolve(args.model)
    except ModelSpecError as err:
        ap.error(str(err))
    hf_config = json.loads((path / "config.json").read_text())
    if "quantization_config" not in hf_config and not (path / "quantize_config.json").is_file():
        ap.error(f"{path} is not a quantized checkpoint (config.json has no quantization_config)")
    out = Path(args.out)
    if out.resolve() == path.resolve():
        ap.error("--out must differ from --model")
    try:
        model, _, _ = load_model(str(path), torch.float32)
        meta = source_metadata(path, hf_config)
        dense_dtype = DENSE_DTYPES[args.dense_dtype]
        save_quantized(model, out, meta, tokenizer_from=path, fmt=args.format, dense_dtype=dense_dtype)
    except CheckpointError as err:
        ap.error(str(err))
    source_record = path / "qspec_quantize.json"
    record = json.loads(source_record.read_text()) if source_record.is_file() else {}
    record.update(
        format=args.format,
        dense_dtype=args.dense_dtype,
        out=str(out),
        export={"from": str(path), "from_format": source_format(hf_config), "command": command(argv)},
    )
    (out / "qspec_quantize.json").write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k not in ("window_nlls", "stats")}, indent=2))
    return record


def source_format(hf_config: dict) -> str:
    qc = hf_config.get("quantization_config", {})
    method = qc.get("quant_method", "gptq")
    if method == "gptq":
        return qc.get("checkpoint_format", qc.get("format", "gptq"))
    return method


def command(argv: list[str] | None) -> str:
    import shlex

    return "python -m quantize.export " + shlex.join(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
