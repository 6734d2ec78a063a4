"""What the quantizer CLIs (quantize.rtn / int8 / gptq / awq) share: arguments, loading, calibration data,
in-memory evaluation, saving through quantize.formats, and the provenance every result record carries."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from quantize.calibration import LayerStore, ShardedCheckpoint, calibrate, layer_store_dir
from quantize.config import DECODER_LINEARS, QuantConfig, QuantConfigError
from quantize.formats import (
    CT_LAYOUT,
    DENSE_DTYPES,
    FORMATS,
    CheckpointError,
    default_format,
    holding_format,
    linear_layout,
    refusal,
    round_dense_tensors,
    save_quantized,
)
from quantize.rotation import choose_layers, choose_layers_cost, rotate_model, rotation_record
from quantize.rtn_weight import quantize_weight
from runtime.cliutil import ArgumentParser, interrupted, run  # noqa: F401 (run: the quantizers' __main__ entry)
from runtime.config import ModelConfig, UnsupportedModelError
from runtime.data import load_text, mixed_calibration_windows, parse_mixture, token_windows
from runtime.loader import ModelSpecError, check_model_spec, load_model, load_tokenizer, resolve
from runtime.model import Transformer
from runtime.paths import qspec_home, write_atomic
from runtime.provenance import module_command
from runtime.provenance import provenance as record_provenance
from runtime.scoring import window_nlls

AUTO_ROTATE_WINDOWS = 4  # calibration windows of 512 tokens --rotate-layers auto scores each layer on

EXPECTED_ERRORS = (QuantConfigError, CheckpointError, UnsupportedModelError)
EXIT_OTHER_FORMAT = 3  # --format X was asked for explicitly, the codes did not fit it: saved in another format
STARTED = time.perf_counter()  # the closing summary says how long the whole command took


REPO_ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[qspec] {msg}", file=sys.stderr, flush=True)


def parser(
    module: str, doc: str, calibration: bool = True, bits: int = 4, group_size: int = 64, checkpoint: bool = True
) -> argparse.ArgumentParser:
    """The options every quantizer shares; checkpoint=False leaves out --format / --dense-dtype (a quantizer
    whose --out is not implemented, which may then use --format for its own element format)."""
    ap = ArgumentParser(
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
    ap.add_argument(
        "--out",
        default=None,
        help="output checkpoint directory (loadable with --model DIR); checked before the model loads: it must be "
        "new, empty or a checkpoint (replaced once the new one is complete), not the --model dir, and writable",
    )
    if checkpoint:
        ap.add_argument(
            "--format",
            choices=FORMATS,
            default=None,
            help="checkpoint format of --out; default: what most loaders read for the method (gptq, rtn, int8: "
            "gptq v1, asymmetric 2/3-bit: gptq_v2; awq: awq GEMM; int8 --w8a8: compressed-tensors), and qspec's "
            "own for online rotations (--rotate), which no other loader re-installs. notes/formats.md lists who "
            "reads what. Whatever the arguments decide (bits, groups, widths, act-order, W8A8, rotations) is checked "
            "against the format before the model loads, and refused there. What only the codes show is not: "
            "gptq v1 stores zero - 1 and cannot hold a zero point of 0, which an asymmetric grid gives a group "
            "whose most negative weight is under half a step (e.g. beside a large positive outlier). Then the "
            "result is still saved, in --out, in the nearest format that holds it (gptq_v2), and one line says "
            "so: exit status 0 for the default format, 3 when --format was given (the result is not in the "
            "format asked for). --sym never has zero point 0",
        )
        ap.add_argument(
            "--dense-dtype",
            choices=("bf16", "fp32"),
            default="bf16",
            help="dtype of the unquantized tensors (embeddings, norms, biases) in --out; config.json declares it. "
            "With --out, --eval measures the model as saved (those tensors rounded to this dtype): the checkpoint "
            "reloads to the recorded perplexity",
        )
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
        "--rotate-layers",
        default=None,
        help="with --rotate --rotation-mode online: comma list of the decoder layers to rotate (default all), "
        "or auto: the layers whose rotation lowers the calibration loss of RTN-quantizing that layer alone "
        f"({AUTO_ROTATE_WINDOWS} windows of 512); the others stay plain",
    )
    ap.add_argument(
        "--no-online-hadamard",
        action="store_true",
        help="with --rotate: skip the online Hadamard on down_proj's input (residual rotation only)",
    )
    ap.set_defaults(quantizer=module.rsplit(".", 1)[-1])
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
    if hasattr(args, "batch_size") and args.batch_size < 1:
        ap.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if getattr(args, "resume", False) and args.out is None:
        ap.error("--resume continues an interrupted run's --out DIR: give --out")
    try:
        check_model_spec(args.model)
    except ModelSpecError as err:
        ap.error(str(err))
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


def layer_widths(mc: ModelConfig) -> dict[str, int]:
    """Input width of each quantizable linear of a runtime.model.Transformer, by leaf name."""
    return {
        "qkv_proj": mc.hidden_size,
        "o_proj": mc.num_heads * mc.head_dim,
        "gate_up_proj": mc.hidden_size,
        "down_proj": mc.intermediate_size,
        "lm_head": mc.hidden_size,
    }


def check_group_size(ap: argparse.ArgumentParser, cfg: QuantConfig, mc: ModelConfig, saving: bool) -> None:
    """--group-size must fit every targeted layer's input width, and a checkpoint (saving) needs a fast kernel
    (cpu_int4 and Triton take multiples of 32); in memory any group runs, on the reference path. Checked from
    config.json, before the weights load."""
    leaves = list(cfg.modules) + (["lm_head"] if cfg.lm_head else [])
    for leaf in leaves:
        block = "self_attn" if leaf in ("qkv_proj", "o_proj") else "mlp"
        name = leaf if leaf == "lm_head" else f"layers.0.{block}.{leaf}"
        try:
            cfg.group_size_for(layer_widths(mc)[leaf], name)
        except QuantConfigError as err:
            ap.error(str(err))
    if cfg.extra.get("quant_method") in ("fp8", "fp4"):
        return  # float formats: group_size is the scale block; the integer kernels' constraint does not apply
    if cfg.group_size != -1 and cfg.group_size % 32:
        why = f"--group-size {cfg.group_size} has no fast kernel (they take multiples of 32)"
        if saving:
            ap.error(f"{why}: use 32, 64, 128 or -1")
        log(f"note: {why}; measuring in memory on the reference path")


def check_out(ap: argparse.ArgumentParser, args, model_path: Path) -> None:
    """Refuse an --out the save at the end would refuse or fail on, before any work: an existing file or
    non-empty non-checkpoint directory (runtime.loader.begin_atomic_dir never deletes those), the --model
    checkpoint itself, and a place that cannot be written (a parent that is a file, no permission, read-only)."""
    if not getattr(args, "out", None):
        return
    out = Path(args.out).absolute()  # as the save will use it
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not (out / "config.json").is_file()):
        ap.error(f"--out {args.out} exists and is not a checkpoint directory: choose a new output directory")
    if out.exists() and out.resolve() == Path(model_path).resolve():
        ap.error(f"--out {args.out} is the --model checkpoint being quantized: choose a new output directory")
    parent = out.parent  # OUT.partial is written beside OUT (missing parents are created), then renamed
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        ap.error(f"--out {args.out} cannot be created: {parent} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qspec-write-test-", dir=parent))
    except OSError as err:
        ap.error(f"--out {args.out} cannot be written: {parent}: {err.strerror or err}")


def load(ap: argparse.ArgumentParser, args, cfg: QuantConfig, check=None):
    """(model fp32, tokenizer, checkpoint dir, layer source); a bad model spec, a group that does not fit, a
    --format that cannot hold the options' result or an --out that cannot be written is an argparse error, found
    from config.json before any weight is read. check(meta model) -> why not or None: the caller's own refusal
    of what --out cannot hold, on the same shapes-only model. With --layer-by-layer the model is a skeleton whose
    decoder layers the calibration pass reads from the returned ShardedCheckpoint one at a time."""

    source = None
    try:
        path = resolve(args.model)
        config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        check_group_size(ap, cfg, config, saving=args.out is not None)
        with torch.device("meta"):  # shapes only: every refusal of --format comes before the weights load
            skeleton = Transformer(config)
            check_format(ap, args, cfg, skeleton)
            why = check(skeleton) if check is not None and args.out else None
            if why:
                ap.error(why)
        check_out(ap, args, path)
        log(f"loading {args.model}")
        if getattr(args, "layer_by_layer", False):
            source = ShardedCheckpoint(path)
            model = source.skeleton()
        else:
            model, _, path = load_model(args.model, torch.float32)
            cfg.targets(model)
    except (ModelSpecError, QuantConfigError, KeyError) as err:
        ap.error(str(err).strip("'\""))
    if getattr(args, "rotate_layers", None) is not None and not args.rotate:
        ap.error("--rotate-layers applies with --rotate")
    tokenizer = CachedTokenizer(load_tokenizer(str(path)))
    if getattr(args, "rotate", False):
        if source is not None:
            ap.error("--rotate needs the whole float model in memory; drop --layer-by-layer")
        try:
            if args.rotate_layers == "auto":
                args.rotate_layers = auto_rotate_layers(ap, args, cfg, model, tokenizer)
            args.rotate_layers = rotate_layers(args.rotate_layers)
            rotate_model(
                model,
                seed=args.seed,
                online=not args.no_online_hadamard,
                mode=args.rotation_mode,
                layers=args.rotate_layers,
            )
        except ValueError as err:
            ap.error(f"--rotate: {err}")
        log(
            f"rotated ({args.rotation_mode}, seed {args.seed}, "
            f"online Hadamard on down_proj: {not args.no_online_hadamard}, "
            f"layers: {'all' if args.rotate_layers is None else args.rotate_layers})"
        )
    return model, tokenizer, path, source


def auto_rotate_layers(ap: argparse.ArgumentParser, args, cfg: QuantConfig, model, tokenizer) -> list[int]:
    """--rotate-layers auto: the layers whose rotation lowers the calibration loss of quantizing that layer alone
    (quantize.rotation.choose_layers), each layer round-tripped through RTN on this run's grid."""
    if args.rotation_mode != "online":
        ap.error("--rotate-layers auto needs --rotation-mode online")
    mse = getattr(args, "mse", False)

    def round_trip(w: torch.Tensor, name: str) -> torch.Tensor:
        return quantize_weight(w, cfg, mse=mse, name=name).dequantize()

    calib = getattr(args, "calib", None) or "wiki"
    windows = mixed_calibration_windows(tokenizer, calib, AUTO_ROTATE_WINDOWS, 512, args.seed)
    start = time.process_time()
    window_nlls(model, windows[:1], 1)  # one window pass, to price the rest in this machine's CPU seconds
    passes = choose_layers_cost(len(model.layers)) * len(windows)
    seconds = passes * (time.process_time() - start)
    log(f"--rotate-layers auto: RTN of one layer at a time, plain vs rotated, on {len(windows)} {calib} windows of "
        f"512 tokens: ~{passes:.0f} window passes, ~{seconds:.0f} CPU-s here")  # fmt: skip
    chosen, records = choose_layers(model, windows, round_trip, args.seed, not args.no_online_hadamard)
    for r in records:
        gain = (r["plain_nll"] - r["rotated_nll"]) / (len(windows) * 511)
        log(f"  layer {r['layer']:2d}: NLL/token change from rotating {-gain:+.5f}")
    if not chosen:
        ap.error("--rotate-layers auto: rotating no layer lowers the calibration loss; drop --rotate")
    return chosen


def rotate_layers(spec) -> list[int] | None:
    """--rotate-layers "10,12,14" -> [10, 12, 14] (None: every layer); already parsed lists pass through."""
    if spec is None or isinstance(spec, list):
        return spec
    try:
        return sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--rotate-layers {spec!r}: a comma list of layer indices, e.g. 10,12,14") from None


def online_rotation(args) -> bool:
    """Whether --rotate leaves rotations the model must apply at run time (Hadamards on norm outputs or on
    down_proj's input), which only qspec's loader re-installs."""
    if not getattr(args, "rotate", False):
        return False
    return args.rotation_mode == "online" or not args.no_online_hadamard


def check_format(ap: argparse.ArgumentParser, args, cfg: QuantConfig, model) -> None:
    """Resolve --format (the method's default when not given: qspec's own for online rotations) and, with --out,
    refuse a setting the format cannot hold (ragged groups, act-order g_idx, bits, W8A8, online rotations in
    compressed-tensors): one argparse error. Needs only shapes (model may live on the meta device)."""
    if not hasattr(args, "dense_dtype") or hasattr(args, "checkpoint_format"):
        return  # a parser without checkpoint options, or a quantizer that fixes its format and checks it itself
    act_quant = cfg.act_quant or getattr(args, "w8a8", False)
    online = online_rotation(args)
    args.format_given = args.format is not None  # an explicit --format: saving another one exits non-zero
    args.format = args.format or default_format(args.quantizer, act_quant, cfg.bits, cfg.sym, online)
    if args.out is None:
        return
    if online and args.format == "compressed-tensors":
        # its transform_config runs Hadamards of order 2^k only (576 and 1536 are not), and transformers does not
        # apply it at all (notes/issue-28.md): its loaders would run the rotated weights without the rotations
        ap.error("--rotate leaves online Hadamard rotations, which compressed-tensors' loaders cannot re-install: "
                 "use --format qspec (the default with --rotate), or --rotation-mode residual --no-online-hadamard "
                 "for a pure weight transform")  # fmt: skip
    if online and args.format != "qspec":
        log(f"note: online rotation in {args.format}: only qspec's loader re-installs the online Hadamard; other "
            "tools would run these weights without it (--format qspec makes them refuse the file instead)")  # fmt: skip
    names = cfg.target_names(model)
    # act-order leaves a g_idx on grouped layers unless groups are static (AWQ: only with --gptq)
    act_order = getattr(args, "act_order", False) and not getattr(args, "static_groups", False)
    act_order = act_order and (args.quantizer != "awq" or getattr(args, "gptq", False))
    widths = [model.get_submodule(n).in_features for n in names]
    parts = {name: [n for _, n in rows] for name, rows in linear_layout(model, quantized_head=cfg.lm_head)}
    for name in names:
        layer = model.get_submodule(name)
        group_size = cfg.group_size_for(layer.in_features, name)
        why = refusal(
            args.format,
            name,
            layer.in_features,
            layer.out_features,
            cfg.bits,
            group_size,
            g_idx=act_order and group_size < layer.in_features,
            act_quant=act_quant,
            sym=cfg.sym or act_quant,
            widths=widths,
            parts=parts.get(name),
        )
        if why:
            ap.error(why)
    tied = model.config.tie_word_embeddings and not (
        getattr(args, "rotate", False) and args.rotation_mode == "residual"
    )
    if args.format in CT_LAYOUT and cfg.lm_head and tied:
        ap.error(f"--lm-head on a tied model cannot be expressed in {args.format}: drop --lm-head or use gptq")


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

        ident = f"{getattr(self.tokenizer, 'name_or_path', '')}|{len(self.tokenizer)}|{add_special_tokens}|"
        key = hashlib.sha256((ident + text).encode()).hexdigest()[:32]
        path = qspec_home() / "token_cache" / f"{key}.pt"
        if path.is_file():
            return SimpleNamespace(input_ids=torch.load(path).tolist())
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        write_atomic(path, lambda tmp: torch.save(torch.tensor(ids, dtype=torch.int32), tmp))
        return SimpleNamespace(input_ids=ids)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)


def add_resume_arg(ap: argparse.ArgumentParser) -> None:
    """--resume for a calibration quantizer that keeps finished layers (layer_store)."""
    ap.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run with the same arguments: its finished layers (kept in OUT.layers.partial) "
        "are restored, not recomputed; the result equals an uninterrupted run's",
    )


NOT_SETTINGS = ("resume", "eval", "eval_windows", "record", "out", "layer_by_layer", "batch_size")


def layer_store(args, module: str):
    """Where a calibration quantizer keeps finished layers (``OUT.layers.partial``), so that Ctrl-C keeps them
    and ``--resume`` finishes the run; None without --out."""

    if not args.out:
        return None
    settings = {"module": module, **{k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}}
    store = LayerStore(layer_store_dir(args.out), settings, resume=args.resume)
    if args.resume:
        kept = store.kept_layers()
        log(f"--resume: {kept} finished layers kept in {store.dir}" if kept else "--resume: none kept; starting")
    return store


def run_calibration(args, model, tokens, algorithm, qcfg, source, store, name: str) -> float:
    """The layer-by-layer pass of a calibration quantizer (GPTQ, AWQ) with its finished layers kept in store;
    Ctrl-C ends it with one line saying what was kept. Returns the pass's seconds."""
    start = time.perf_counter()
    try:
        calibrate(
            model,
            tokens,
            algorithm,
            args.batch_size,
            qcfg.lm_head,
            source,
            progress=lambda m: log(f"{name} {m}"),
            store=store,
        )
    except KeyboardInterrupt:
        interrupted_calibration(store, len(model.layers))
    return time.perf_counter() - start


def interrupted_calibration(store, n_layers: int) -> None:
    """Ctrl-C during a calibration pass: one line saying what was kept, exit code 130."""

    if store is None or store.kept_layers() == 0:
        interrupted("no finished layer to keep" + ("" if store else " (only runs with --out keep layers)"))
    interrupted(
        f"{store.kept_layers()} of {n_layers} layers kept in {store.dir}; the same command with --resume finishes it"
    )


def calibration_tokens(ap: argparse.ArgumentParser, args, tokenizer) -> torch.Tensor:
    """[nsamples, seqlen] token ids from the calibration split of --calib (one text, or a weighted mixture:
    each text's share of the windows is its proportion, largest remainders rounded up)."""

    try:
        parse_mixture(args.calib)
    except ValueError as err:
        ap.error(f"--calib {args.calib!r}: {err}")
    log(f"tokenizing the {args.calib} calibration split (cached under $QSPEC_HOME/token_cache after the first run)")
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
    store: LayerStore | None = None,
) -> dict:
    """Evaluate (if asked), save (if asked) and write the result record; then remove the calibration's kept layers
    (store), which the saved checkpoint replaces.

    The format to save in is settled before the evaluation: when the codes do not fit the chosen one (a GPTQ v1
    zero point of 0), the nearest format that holds them is written instead and one line says why; if the user
    asked for the format with --format, the run then ends with exit status EXIT_OTHER_FORMAT, the result saved.
    With --out the evaluation measures what is saved (the unquantized tensors rounded to --dense-dtype; quantized
    layers are stored exactly): the checkpoint reloads to the recorded figures bit for bit on the reference path
    the quantizers measure on (and, for W8A8, on cpu_w8a8 too, which sums the same integers)."""
    if getattr(args, "rotate", False):
        cfg.extra["rotation"] = rotation_record(
            args.seed, not args.no_online_hadamard, args.rotation_mode, getattr(args, "rotate_layers", None)
        )
    record = {
        "quant_config": cfg.to_dict(),
        "model": args.model,
        "seed": args.seed,
        "stats": stats or {},
        "peak_rss_gb": round(peak_rss_gb(), 3),  # before the evaluation below
        "cpu_seconds": round(cpu_seconds(), 1),  # process CPU time so far: loading + quantizing
        **provenance(argv, module),
    }
    fmt = getattr(args, "checkpoint_format", None) or getattr(args, "format", None)  # quantize.fp8 fixes its own
    asked = fmt
    if args.out:
        try:
            fmt, why = holding_format(model, fmt, cfg.to_dict())
        except CheckpointError as err:  # no format holds it: a refusal missing before the work (a bug)
            write_record({**record, "format": fmt, "save_error": str(err)}, args.record)
            raise SystemExit(f"error: {args.out} not written: {err}") from err
        record.update(format=fmt, dense_dtype=args.dense_dtype)
        if why:
            record.update(format_requested=asked, format_fallback=why)
            given = getattr(args, "format_given", False)
            status = f" (exit status {EXIT_OTHER_FORMAT} at the end)" if given else ""
            log(f"{'--format' if given else 'the default format'} {asked} cannot hold this result, so {args.out} is "
                f"written as {fmt}{status}: {why}")  # fmt: skip
    if args.out:  # measure the checkpoint: its unquantized tensors as --dense-dtype stores them
        round_dense_tensors(model, DENSE_DTYPES[args.dense_dtype])
    if args.eval:
        record.update(evaluate(model, tokenizer, args.eval, args.eval_windows))
    if args.out:
        try:
            save(model, Path(args.out), cfg, path, record, fmt, DENSE_DTYPES[args.dense_dtype])
        except CheckpointError as err:  # e.g. a v1 zero point of 0, known only after quantizing
            write_record({**record, "save_error": str(err)}, args.record)
            raise SystemExit(f"error: {args.out} not written: {err}") from err
        record["out"] = str(args.out)
        if store is not None:
            store.remove()  # the checkpoint is complete: the kept layers are no longer needed
    write_record(record, args.record)
    log(summary_line(module, args, cfg, record))
    if fmt != asked and getattr(args, "format_given", False):
        sys.stdout.flush()
        print(
            f"error: --format {asked} cannot hold this result; it is saved in {args.out} as {fmt} instead (see above)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_OTHER_FORMAT)
    return record


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def summary_line(module: str, args, cfg: QuantConfig, record: dict) -> str:
    """The closing human summary: what was made, where, how big, how long."""
    what = f"{module.removeprefix('quantize.')} {cfg.describe()}{' + lm_head' if cfg.lm_head else ''} of {args.model}"
    parts = [f"done in {time.perf_counter() - STARTED:.0f} s: {what}"]
    if "perplexity" in record:
        parts.append("perplexity " + ", ".join(f"{k} {v:.3f}" for k, v in record["perplexity"].items()))
    if args.out:
        size = dir_bytes(Path(args.out)) / 1e6
        parts.append(f"saved {args.out} as {record['format']} ({size:.0f} MB); use it with --model {args.out}")
    return "; ".join(parts)


def write_record(record: dict, path: str | None) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    shown = {k: v for k, v in record.items() if k not in ("window_nlls", "stats")}
    print(json.dumps(shown, indent=2))


def evaluate(model, tokenizer, texts: str, default_windows: int) -> dict:
    """Perplexity (evals.quality.perplexity protocol: eval split, 512-token windows, no BOS) on 'wiki:64,wiki-fr:32'
    style text lists, keeping each window's summed NLL so any prefix of the windows can be re-scored."""
    import math

    out = {"eval_protocol": "eval split, first N windows x 512 tokens, no BOS", "perplexity": {}, "window_nlls": {}}
    for item in texts.split(","):
        text, _, n = item.partition(":")
        windows = token_windows(tokenizer, load_text(text, "eval"), 512, int(n) if n else default_windows)
        nlls = window_nlls(model, windows)
        out["perplexity"][text] = math.exp(sum(nlls) / (len(windows) * 511))
        out["window_nlls"][text] = nlls
        log(f"perplexity {text}: {out['perplexity'][text]:.4f} ({len(windows)} windows)")
    return out


def save(model, out: Path, cfg: QuantConfig, source: Path, record: dict, fmt: str, dense_dtype: torch.dtype) -> None:
    log(f"saving {out} (packing codes, writing safetensors)")
    start = time.perf_counter()
    save_quantized(model, out, cfg.to_dict(), tokenizer_from=source, fmt=fmt, dense_dtype=dense_dtype)
    (out / "qspec_quantize.json").write_text(json.dumps(record, indent=2))
    log(f"saved {out} in {time.perf_counter() - start:.1f} s")
