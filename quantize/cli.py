"""What the quantizer CLIs (quantize.rtn / int8 / gptq / awq) share: arguments, loading, calibration data,
in-memory evaluation, saving through quantize.formats, and the provenance every result record carries."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from quantize.config import DECODER_LINEARS, QuantConfig, QuantConfigError
from quantize.formats import save_quantized
from quantize.rotation import rotate_model, rotation_record
from runtime.layout import decoder_linear_names
from runtime.provenance import module_command
from runtime.provenance import provenance as record_provenance

REPO_ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[qspec] {msg}", file=sys.stderr, flush=True)


def parser(
    module: str, doc: str, calibration: bool = True, bits: int = 4, group_size: int = 128
) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=f"python -m {module}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m", help="registry name, checkpoint dir or .gguf")
    ap.add_argument("--bits", type=int, default=bits, help="2, 3, 4 or 8")
    ap.add_argument("--group-size", type=int, default=group_size, help="input columns per group; -1 = per-channel")
    ap.add_argument("--sym", action="store_true", help="symmetric grid (default asymmetric)")
    ap.add_argument("--modules", default=",".join(DECODER_LINEARS), help="comma list of decoder linears to quantize")
    ap.add_argument(
        "--lm-head", action="store_true", help="quantize the output head too (tied: the embedding reads its rows)"
    )
    ap.add_argument("--out", default=None, help="output checkpoint directory (loadable with --model DIR)")
    ap.add_argument(
        "--rotate",
        action="store_true",
        help="QuaRot-style Hadamard rotation first (norms folded, residual stream rotated, head untied; "
        "float model unchanged): see quantize/rotation.py",
    )
    ap.add_argument(
        "--rotation-mode",
        default="online",
        choices=["online", "residual"],
        help="with --rotate: online = Hadamard on each norm's output (norm weights kept: measured better on "
        "SmolLM2); residual = QuaRot's folded norms and rotated residual stream (untied head)",
    )
    ap.add_argument(
        "--no-online-hadamard",
        action="store_true",
        help="with --rotate: skip the online Hadamard on down_proj's input (residual rotation only)",
    )
    if calibration:
        ap.add_argument(
            "--calib",
            default="wiki",
            help="calibration texts (calib split, documents >= 5000): wiki | wiki-es | wiki-fr | wiki-desc, or a "
            "mixture with proportions: wiki:0.5,wiki-fr:0.25,wiki-es:0.25",
        )
        ap.add_argument("--nsamples", type=int, default=128, help="calibration windows")
        ap.add_argument("--seqlen", type=int, default=512, help="tokens per calibration window")
        ap.add_argument("--batch-size", type=int, default=8, help="windows per forward in the calibration pass")
        ap.add_argument(
            "--layer-by-layer",
            action="store_true",
            help="read decoder layers from the checkpoint's safetensors one at a time (models larger than memory)",
        )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--eval",
        default=None,
        help="after quantizing, perplexity on these texts (wiki, wiki-es, wiki-fr, wiki-desc, chat): wiki,wiki-fr "
        "or wiki:64,wiki-fr:32",
    )
    ap.add_argument("--eval-windows", type=int, default=64, help="first N eval-split windows of 512 tokens (default)")
    ap.add_argument("--record", default=None, help="append a JSON result record to this file")
    return ap


def quant_config(ap: argparse.ArgumentParser, args, **overrides) -> QuantConfig:
    if args.out is None and args.eval is None:
        ap.error("nothing to do: give --out DIR to save the quantized model and/or --eval TEXTS to measure it")
    if hasattr(args, "nsamples") and args.nsamples < 1:
        ap.error(f"--nsamples must be at least 1, got {args.nsamples}")
    if hasattr(args, "seqlen") and args.seqlen < 2:
        ap.error(f"--seqlen must be at least 2, got {args.seqlen}")
    try:
        return QuantConfig(
            bits=overrides.pop("bits", args.bits),
            group_size=overrides.pop("group_size", args.group_size),
            sym=overrides.pop("sym", args.sym),
            modules=tuple(m for m in args.modules.split(",") if m),
            lm_head=args.lm_head,
            **overrides,
        )
    except QuantConfigError as err:
        ap.error(str(err))


def load(ap: argparse.ArgumentParser, args, cfg: QuantConfig):
    """(model fp32, tokenizer, checkpoint dir, layer source); a bad model spec or a group that does not fit is
    an argparse error. With --layer-by-layer the model is a skeleton whose decoder layers the calibration
    pass reads from the returned ShardedCheckpoint one at a time."""
    from quantize.calibration import ShardedCheckpoint
    from runtime.loader import ModelSpecError, load_model, load_tokenizer, resolve

    source = None
    try:
        if getattr(args, "layer_by_layer", False):
            path = resolve(args.model)
            source = ShardedCheckpoint(path)
            model = source.skeleton()
            for name in decoder_linear_names(len(model.layers), cfg.modules):  # widths from the meta skeleton
                cfg.group_size_for(model.get_submodule(name).in_features, name)
        else:
            model, _, path = load_model(args.model, torch.float32)
            cfg.targets(model)
    except (ModelSpecError, QuantConfigError, KeyError) as err:
        ap.error(str(err).strip("'\""))
    if getattr(args, "rotate", False):
        if source is not None:
            ap.error("--rotate needs the whole float model in memory; drop --layer-by-layer")
        try:
            rotate_model(model, seed=args.seed, online=not args.no_online_hadamard, mode=args.rotation_mode)
        except ValueError as err:
            ap.error(f"--rotate: {err}")
        log(
            f"rotated ({args.rotation_mode}, seed {args.seed}, "
            f"online Hadamard on down_proj: {not args.no_online_hadamard})"
        )
    return model, CachedTokenizer(load_tokenizer(str(path))), path, source


class CachedTokenizer:
    """Wraps a tokenizer so that tokenizing a whole split (~90 s for the calibration split on a busy 2-core
    machine) happens once: ``tok(text, add_special_tokens=...)`` ids are kept under $QSPEC_HOME/token_cache,
    keyed by the tokenizer and the text's hash. Everything else passes through."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text, add_special_tokens: bool = True, **kwargs):
        if kwargs or not isinstance(text, str):
            return self.tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)
        import hashlib
        from types import SimpleNamespace

        from runtime.paths import qspec_home

        ident = f"{getattr(self.tokenizer, 'name_or_path', '')}|{len(self.tokenizer)}|{add_special_tokens}|"
        key = hashlib.sha256((ident + text).encode()).hexdigest()[:32]
        path = qspec_home() / "token_cache" / f"{key}.pt"
        if path.is_file():
            return SimpleNamespace(input_ids=torch.load(path).tolist())
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(torch.tensor(ids, dtype=torch.int32), tmp)
        tmp.replace(path)
        return SimpleNamespace(input_ids=ids)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)


def calibration_tokens(ap: argparse.ArgumentParser, args, tokenizer) -> torch.Tensor:
    """[nsamples, seqlen] token ids from the calibration split of --calib (one text, or a weighted mixture:
    each text's share of the windows is its proportion, largest remainders rounded up)."""
    from runtime.data import mixed_calibration_windows, parse_mixture

    try:
        parse_mixture(args.calib)
    except ValueError as err:
        ap.error(f"--calib {args.calib!r}: {err}")
    try:
        windows = mixed_calibration_windows(tokenizer, args.calib, args.nsamples, args.seqlen, args.seed)
    except ValueError as err:
        ap.error(f"calibration data: {err}")
    return torch.tensor(windows, dtype=torch.long)


def provenance(argv: list[str] | None, module: str) -> dict:
    return {**record_provenance(command=module_command(module, argv)), "threads": torch.get_num_threads()}


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def finish(
    args,
    model,
    tokenizer,
    path: Path,
    cfg: QuantConfig,
    module: str,
    stats: dict | None = None,
    argv: list[str] | None = None,
) -> dict:
    """Evaluate (if asked), save (if asked) and write the result record."""
    if getattr(args, "rotate", False):
        cfg.extra["rotation"] = rotation_record(args.seed, not args.no_online_hadamard, args.rotation_mode)
    record = {
        "quant_config": cfg.to_dict(),
        "model": args.model,
        "seed": args.seed,
        "stats": stats or {},
        "peak_rss_gb": round(peak_rss_gb(), 3),  # before the evaluation below
        "cpu_seconds": round(cpu_seconds(), 1),  # process CPU time so far: loading + quantizing
        **provenance(argv, module),
    }
    if args.eval:
        record.update(evaluate(model, tokenizer, args.eval, args.eval_windows))
    if args.out:
        save(model, Path(args.out), cfg, path, record)
        record["out"] = str(args.out)
    write_record(record, args.record)
    return record


def write_record(record: dict, path: str | None) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    shown = {k: v for k, v in record.items() if k not in ("window_nlls", "stats")}
    print(json.dumps(shown, indent=2))


def evaluate(model, tokenizer, texts: str, default_windows: int) -> dict:
    """Perplexity (evals.perplexity protocol: eval split, 512-token windows, no BOS) on 'wiki:64,wiki-fr:32'
    style text lists, keeping each window's summed NLL so any prefix of the windows can be re-scored."""
    import math

    from runtime.data import load_text, token_windows
    from runtime.scoring import window_nlls

    out = {"eval_protocol": "eval split, first N windows x 512 tokens, no BOS", "perplexity": {}, "window_nlls": {}}
    for item in texts.split(","):
        text, _, n = item.partition(":")
        windows = token_windows(tokenizer, load_text(text, "eval"), 512, int(n) if n else default_windows)
        nlls = window_nlls(model, windows)
        out["perplexity"][text] = math.exp(sum(nlls) / (len(windows) * 511))
        out["window_nlls"][text] = nlls
        log(f"perplexity {text}: {out['perplexity'][text]:.4f} ({len(windows)} windows)")
    return out


def save(model, out: Path, cfg: QuantConfig, source: Path, record: dict) -> None:
    save_quantized(model, out, cfg.to_dict(), tokenizer_from=source)
    (out / "qspec_quantize.json").write_text(json.dumps(record, indent=2))
    log(f"saved {out}")
