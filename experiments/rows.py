"""The experiment rows: each kind builds a Variant from the other packages' public entry points.

A Variant says how to (1) score sequences teacher-forced or, for engine paths that only emit tokens,
capture the logits they sampled from, (2) generate greedily, (3) build an lm-eval model for tasks,
(4) time itself against the baseline it claims to speed up. A row that cannot run here (its quantizer failed,
its speculator cannot be built) raises RowUnavailable; the runner records it as "not run" with the reason.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from evals.quality.fidelity import (
    Scorer,
    batched_scorer,
    cached_scorer,
    engine_greedy_logits,
    greedy_outputs,
    model_scorer,
)
from evals.quality.long_context_measures import capacity, long_context_summary
from evals.speculation.specbench_suite import run_suite
from experiments.artifacts import Artifact, BuildError, ensure_built
from quantize.config import QuantConfig
from quantize.formats import default_format, refusal
from quantize.fp8 import float_config
from quantize.fp8 import quantize_model as float_quantize_model
from quantize.fplinear import FPLinear
from quantize.qlinear import QuantLinear
from quantize.registry import QuantizerError, module_of
from quantize.registry import check_method as check_quantizer
from quantize.registry import resolve as resolve_quantizer
from runtime.config import DTYPES, ModelConfig
from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.kv_policy import KVCacheSpec
from runtime.kv_quant import bytes_per_token_head
from runtime.loader import load_model, resolve
from runtime.model import Transformer
from runtime.prompts import build_suite, encode_messages
from runtime.reference.naive_attention import naive_attention
from runtime.sampling import SamplingParams
from speculate.base import SpeculatorError
from speculate.cli import build_speculator
from speculate.generate import speculative_generate
from speculate.registry import BuildContext, build, check_method
from speculate.training import head_dir


class RowUnavailable(RuntimeError):
    """The row cannot run here (its quantizer failed, its speculator cannot be built); recorded, not fatal."""


class RowSkipped(RowUnavailable):
    """The row's recipe cannot exist for this model (a checkpoint format refuses it); recorded as skipped."""


SELF_TIMED_KINDS = ("specbench",)  # rows that time themselves while they are built (run_bench off)


def is_timed(row) -> bool:
    """Whether the row measures wall time (then on a cluster it holds a whole node)."""
    return row.run_bench or row.kind in SELF_TIMED_KINDS


@dataclass(frozen=True)
class ModelSource:
    """Where a row's model (Variant.model) comes from, for evaluations cached per checkpoint
    (evals.quality.humaneval): the checkpoint directory, the dtype it was loaded in, and what the row did to it in
    memory after loading ("": nothing, it is the model ``load_model(path, dtype)`` gives, so the cache is shared with
    ``evals.quality.humaneval --model``)."""

    path: Path
    dtype: str
    recipe: str = ""


def model_source(ctx, path: Path | str | None = None, recipe: str = "", dtype: str | None = None) -> ModelSource | None:
    """The source of a model loaded from `path` (default: the reference's checkpoint); None for a model without
    files (tiny-random)."""
    path = path or ctx.path
    return None if path is None else ModelSource(Path(path), dtype or ctx.cfg.model.dtype, recipe)


@dataclass
class Variant:
    greedy: Callable[[list[list[int]], int], list[list[int]]]  # (prompts, max_tokens) -> outputs
    timed: Callable[[list[list[int]], int], object]  # what the speed column times
    baseline_timed: Callable[[list[list[int]], int], object] | None  # None: the plain reference decode
    baseline_name: str = "plain decode (contiguous cache, batch 1, fp32)"
    scorer: Scorer | None = None  # teacher-forced logits; None: use engine_logits
    engine_logits: Callable[[list[list[int]], int], tuple[list[list[int]], list[torch.Tensor]]] | None = None
    lm_factory: Callable[[], object] | None = None
    model: object = None  # the model the variant runs (for weight memory)
    extra: dict = field(default_factory=dict)
    bench_batch: int = 1  # prompts per timed call (both sides)
    # set where the row's model is one checkpoint-backed model that plain decoding runs (its own HumanEval pass@1);
    # None: the row changes how the reference decodes (engine, cache, speculation), not the model
    source: ModelSource | None = None
    # the model HumanEval decodes, where it is not `model`: a quantized row scores perplexity and fidelity on its
    # weights dequantized once (the quantization alone) but takes pass@1 from the fast kernels a user deploys
    humaneval_model: object = None
    speculator: object = None  # a speculator row's speculator (its verdict is a distribution test, not its logits)


def weight_bytes(model) -> int:
    """Bytes of the model's weights as stored: packed size for quantized layers, tied tensors once."""

    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, QuantLinear | FPLinear):
            total += module.qweight().weight_bytes() if isinstance(module, QuantLinear) else module.weight_bytes()
            seen.update(id(b) for b in module.buffers(recurse=False))
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def linear_bytes_per_weight(model) -> float:
    """Bytes per weight of the decoder layers' linears as stored (codes, scales and zeros of a quantized layer;
    the dtype's size of a float one): what a recipe costs per weight, embeddings and norms aside."""
    stored = weights = 0
    for module in model.layers.modules():
        if isinstance(module, QuantLinear):
            stored += module.qweight().weight_bytes()
        elif isinstance(module, FPLinear):
            stored += module.weight_bytes()
        elif isinstance(module, torch.nn.Linear):
            stored += module.weight.numel() * module.weight.element_size()
        else:
            continue
        weights += module.in_features * module.out_features
    return stored / weights


def plain_generate(model, batch: int = 1, use_cache: bool = True):
    def run(prompts, max_tokens):
        return greedy_outputs(model, prompts, max_tokens, batch_size=batch, use_cache=use_cache)

    return run


def qspec_lm(ctx, model, score_mode: str = "cache", batch_size: int = 8):
    from evals.quality.lm_eval_adapter import QspecLM

    return lambda: QspecLM(model=model, tokenizer=ctx.tokenizer, batch_size=batch_size, score_mode=score_mode)


# ---- rows on the runtime that exists ----------------------------------------------------------------


def model_variant(ctx, m, source: ModelSource | None = None, **extra) -> Variant:
    """A model run through plain decoding: the variant of every row that changes only the model."""
    return Variant(
        greedy=plain_generate(m),
        timed=plain_generate(m),
        baseline_timed=None,
        baseline_name=f"plain decode (contiguous cache, batch 1, {ctx.cfg.model.dtype})",
        scorer=model_scorer(m),
        lm_factory=qspec_lm(ctx, m, "cache"),
        model=m,
        extra=extra,
        source=source,
    )


def reference_row(ctx, params: dict) -> Variant:
    m = ctx.model
    return model_variant(ctx, m, source=model_source(ctx))


def bf16_model(ctx):
    """The unquantized model in bf16 (mixed, bf16 head): the reference itself when it is loaded so, else a copy."""
    m = ctx.model
    head = m.lm_head.weight.dtype
    if m.compute_dtype == torch.bfloat16 and m.residual_dtype == torch.float32 and head == torch.bfloat16:
        return m
    return copy.deepcopy(m).set_dtype(torch.bfloat16, mixed=True)


def kv_cache_row(ctx, params: dict) -> Variant:
    m = ctx.model
    return Variant(
        greedy=plain_generate(m, use_cache=True),
        timed=plain_generate(m, use_cache=True),
        baseline_timed=plain_generate(m, use_cache=False),
        baseline_name="full recompute of the sequence every step (no cache)",
        scorer=cached_scorer(m, prefill=params.get("prefill"), chunk=int(params.get("chunk", 1))),
        # every other row scores tasks through the cache; this row's task column is the no-cache path
        lm_factory=qspec_lm(ctx, m, "forward"),
        model=m,
    )


def batching_row(ctx, params: dict) -> Variant:
    m, b = ctx.model, int(params.get("batch_size", 8))
    # companions of other lengths share each scored sequence's batch, as in a serving batch
    companions = [s[: max(8, len(s) * (i + 1) // (b + 1))] for i, s in enumerate(ctx.fidelity_seqs[: b - 1])]
    return Variant(
        greedy=plain_generate(m, batch=b),
        timed=plain_generate(m, batch=b),
        baseline_timed=plain_generate(m, batch=1),
        baseline_name="the same prompts one at a time",
        scorer=batched_scorer(m, companions),
        lm_factory=qspec_lm(ctx, m, "forward", batch_size=b),
        model=m,
        bench_batch=b,
    )


def attention_row(ctx, params: dict) -> Variant:
    """SDPA is what the runtime runs; naive attention is the textbook baseline. The fidelity columns
    measure the naive path against the SDPA reference (symmetric), the speed column SDPA over naive."""
    m = ctx.model

    def naive_scorer(tokens):
        with naive_attention(m):
            return m(tokens)

    def naive_generate(prompts, max_tokens):
        with naive_attention(m):
            return greedy_outputs(m, prompts, max_tokens)

    def naive_lm():
        from evals.quality.lm_eval_adapter import QspecLM

        class NaiveLM(QspecLM):
            def score_pairs(self, pairs):
                with naive_attention(self.model):
                    return super().score_pairs(pairs)

        return NaiveLM(model=m, tokenizer=ctx.tokenizer, batch_size=8, score_mode="cache")

    return Variant(
        greedy=naive_generate,
        timed=plain_generate(m),
        baseline_timed=naive_generate,
        baseline_name="naive attention (materialised softmax(QK^T)V)",
        scorer=naive_scorer,
        lm_factory=naive_lm,
        model=m,
    )


def dtype_row(ctx, params: dict) -> Variant:
    """The reference model cast to another dtype. A dtype wider than the reference's (fp32 beside a bf16 reference)
    is loaded from the checkpoint, so it holds the checkpoint's values, not the reference's rounded ones."""
    name = params.get("dtype", "bf16")
    if name not in DTYPES:
        raise ValueError(f"rows.params.dtype: {name!r} not in {sorted(DTYPES)}")
    dtype, mixed = DTYPES[name], bool(params.get("mixed", True))
    if ctx.path is not None and dtype.itemsize > ctx.model.compute_dtype.itemsize:
        m, _, _ = load_model(str(ctx.path), dtype, ctx.cfg.model.device)
        m.set_dtype(dtype, mixed=mixed)
        recipe = "" if dtype == torch.float32 else f"set_dtype({name}, mixed={mixed})"
    else:
        m = copy.deepcopy(ctx.model).set_dtype(dtype, mixed=mixed)
        recipe = f"{ctx.cfg.model.dtype} load, set_dtype({name}, mixed={mixed})"
    return model_variant(ctx, m, source=model_source(ctx, recipe=recipe, dtype=name), dtype=name, mixed=mixed)


# ---- quantized models (issue 3 quantizers, issue 4 formats) -------------------------------------------

# the quantizers (built-ins and plug-ins: module:attr or a qspec.quantizers entry point) are quantize.registry's


def option(args: list[str], flag: str, default=None):
    """The value after ``flag`` in a CLI argument list (default when absent)."""
    return args[args.index(flag) + 1] if flag in args[:-1] else default


def quantized_artifact(spec: str, params: dict) -> Artifact:
    """The checkpoint of a quantized row's recipe: built once by the quantizer's own CLI into the store,
    reused by every row and run with the same recipe and input model. Raises RowSkipped for a recipe the
    checkpoint formats refuse for this model (group 128 on SmolLM2's 576-wide layers)."""
    method = params.get("method")
    try:
        module, args = module_of(str(method))
    except QuantizerError as err:
        raise ValueError(f"rows.params.method: {err}") from None
    entry = resolve_quantizer(check_quantizer(method).name)
    if spec == "tiny-random":
        raise RowUnavailable("quantized rows run the quantizer's CLI on a model spec; tiny-random has no files")
    if entry.grid:
        args += ["--bits", str(params.get("bits", 4)), "--group-size", str(params.get("group_size", 64))]
    if "calib" in params:
        if not entry.calibrated:
            raise ValueError(f"rows.params.calib: {method} takes no calibration data")
        args += ["--calib", str(params["calib"])]
    args += [str(a) for a in params.get("args", [])]
    if entry.grid:
        why = checkpoint_refusal(spec, method, args)
        if why:
            raise RowSkipped(f"no checkpoint can hold this recipe: {why}")
    label = f"{Path(spec).name.removesuffix('.gguf')}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', str(method))}"
    return Artifact("quantized", module, tuple(args), spec, label)


def checkpoint_refusal(spec: str, method: str, args: list[str]) -> str | None:
    """Why the quantizer's checkpoint format would refuse to save this recipe for this model, from config.json
    (quantize.formats.refusal on every targeted layer of a weightless model), before anything is built."""
    config = ModelConfig.from_dir(resolve(spec))
    bits, group = int(option(args, "--bits", 4)), int(option(args, "--group-size", 64))
    fmt = option(args, "--format") or default_format(method, "--w8a8" in args, bits, "--sym" in args)
    with torch.device("meta"):
        model = Transformer(config)
    names = QuantConfig(bits=bits, group_size=group).target_names(model)
    widths = [model.get_submodule(n).in_features for n in names]
    for name in names:
        layer = model.get_submodule(name)
        g = layer.in_features if group == -1 else min(group, layer.in_features)
        why = refusal(fmt, name, layer.in_features, layer.out_features, bits, g, widths=widths)
        if why:
            return why
    return None


def built(ctx, artifact: Artifact) -> Path:
    """The artifact's directory in the run's store, built now if no run built it before."""
    try:
        return ensure_built(artifact, ctx.store)[0]
    except BuildError as err:
        raise RowUnavailable(str(err)) from err


def quantized_row(ctx, params: dict) -> Variant:

    artifact = quantized_artifact(ctx.cfg.model.spec, params)
    out = built(ctx, artifact)
    device = ctx.cfg.model.device
    # quality columns: the exact fp32 reference math on weights dequantized once (the `dense` path), the rest of the
    # model (embeddings, norms, head, activations between layers) in the reference's dtype, so they measure the
    # quantization alone (HumanEval instead decodes the fast copy below: pass@1 of what a user deploys)
    m, _, _ = load_model(str(out), dtype=DTYPES[ctx.cfg.model.dtype], device=device)
    for layer in m.modules():
        if isinstance(layer, (QuantLinear, FPLinear)):
            layer.set_path("dense")
    # speed column: what a user runs, the fast int kernels with bf16 activations, against the same model
    # unquantized in bf16 (mixed), so the ratio is the quantization's own speedup
    fast, _, _ = load_model(str(out), dtype=torch.bfloat16, device=device)
    for layer in fast.modules():
        if isinstance(layer, QuantLinear):
            layer.set_path(layer.auto_path(layer.scales.device), pin=False)
        elif isinstance(layer, FPLinear):
            layer.auto = True  # scaled_mm on an FP8 GPU, else dequantize each forward
    bf16_base = bf16_model(ctx)
    # HumanEval decodes `fast`, exactly what `evals.quality.humaneval --model OUT --dtype bf16` loads (its cache too)
    source = model_source(ctx, out, dtype="bf16")
    variant = model_variant(ctx, m, source, checkpoint=str(out), build_command=" ".join(artifact.command(out)[1:]))
    variant.humaneval_model = fast
    variant.timed = plain_generate(fast)
    variant.baseline_timed = plain_generate(bf16_base)
    variant.baseline_name = "the unquantized model in bf16 (mixed); both sides bf16 activations, batch 1"
    variant.extra["timed_paths"] = sorted({x.path for x in fast.modules() if isinstance(x, (QuantLinear, FPLinear))})
    return variant


def float_quant_row(ctx, params: dict) -> Variant:
    """FP8 (e4m3, per-channel or per-block, optionally W8A8) and emulated FP4 (mxfp4 / nvfp4) weights from
    quantize.fp8, quantized in memory (round to nearest, no calibration, nothing to cache). Quality columns: the
    exact fp32 math on weights dequantized once (FPLinear's dense path); HumanEval decodes the fast copy. Speed
    column: the layers' own path in bf16 (torch._scaled_mm for W8A8 on an FP8 GPU; elsewhere dequantize each
    forward, since this CPU has no FP8 or FP4 matmul) against the unquantized model in bf16. FP4 is emulated: its
    speed is not FP4's."""
    fmt = params.get("format", "e4m3")
    try:
        cfg = float_config(fmt, int(params.get("block_size", 0)), bool(params.get("w8a8", False)))
    except ValueError as err:
        raise ValueError(f"rows.params: {err}") from err
    m = float_quantize_model(copy.deepcopy(ctx.model), cfg)
    for layer in m.modules():
        if isinstance(layer, FPLinear):
            layer.set_path("dense")
    fast = float_quantize_model(copy.deepcopy(ctx.model), cfg).set_dtype(torch.bfloat16, mixed=True)
    for layer in fast.modules():
        if isinstance(layer, FPLinear):
            layer.auto = True  # picks scaled_mm / dequant at the first forward on its device
    bf16_base = bf16_model(ctx)
    recipe = f"{ctx.cfg.model.dtype} load, quantize.fp8 {json.dumps(cfg.to_dict(), sort_keys=True)}, bf16 mixed, auto"
    source = model_source(ctx, recipe=recipe)
    variant = model_variant(ctx, m, source, quant_config=cfg.to_dict(), emulated=fmt != "e4m3")
    variant.humaneval_model = fast  # pass@1 of the kernels a user runs; perplexity and fidelity of the dense copy
    variant.timed = plain_generate(fast)
    variant.baseline_timed = plain_generate(bf16_base)
    variant.baseline_name = "the unquantized model in bf16 (mixed); both sides bf16 activations, batch 1"
    return variant


# ---- serving engine (issue 6) -----------------------------------------------------------------------


def engine_logits_run(make_engine, ctx, concurrent: bool):
    """Greedy outputs from the engine plus, per request, the logits its sampler saw (evals.quality.fidelity)."""

    def run(prompts, max_tokens):
        return engine_greedy_logits(make_engine(), prompts, max_tokens, concurrent)

    return run


def engine_row(ctx, params: dict) -> Variant:

    m = ctx.model
    mode = params.get("mode", "paged")
    settings = dict(params.get("engine", {}))
    try:
        EngineConfig(**settings)
    except TypeError as err:
        raise ValueError(f"rows.params.engine: {err}") from err
    concurrent = mode in ("continuous", "prefix")
    default = {"enable_prefix_caching": mode == "prefix", "max_num_seqs": 16 if concurrent else 1}

    def make_engine(**over):
        return LLMEngine(m, ctx.tokenizer, EngineConfig(**{**default, **settings, **over}))

    def engine_generate(**over):
        def run(prompts, max_tokens):
            p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            return [o.output_ids for o in make_engine(**over).generate(prompts, p)]

        return run

    if mode == "paged":
        baseline, baseline_name, bench_batch = plain_generate(m), "contiguous KV cache (runtime.generate)", 1
    elif mode == "continuous":
        b = int(settings.get("max_num_seqs", 16))
        baseline = engine_generate(policy="static")
        baseline_name, bench_batch = "static batching (same engine, policy=static)", b
    elif mode == "prefix":
        baseline = engine_generate(enable_prefix_caching=False)
        baseline_name, bench_batch = "same engine without prefix caching", int(params.get("bench_batch", 4))
    else:
        raise ValueError(f"rows.params.mode: {mode!r} not in ['paged', 'continuous', 'prefix']")
    return Variant(
        greedy=engine_generate(),
        timed=engine_generate(),
        baseline_timed=baseline,
        baseline_name=baseline_name,
        engine_logits=engine_logits_run(make_engine, ctx, concurrent),
        model=m,
        bench_batch=bench_batch,
        extra={"mode": mode, "engine": {**default, **settings}},
    )


# ---- the KV cache: quantized or bounded (issue 30) ---------------------------------------------------


def kv_spec(params: dict) -> KVCacheSpec:
    try:
        return KVCacheSpec(
            params.get("kv_cache_dtype", "auto"),
            params.get("policy", "full"),
            int(params.get("sinks", 4)),
            int(params.get("window", 1020)),
            int(params.get("block_size", 64)),
        )
    except ValueError as err:
        raise ValueError(f"rows.params: {err}") from err


def kv_memory(ctx, kv: KVCacheSpec, budget_mib: float, seq_tokens: int) -> dict:
    """What the cache buys: bytes per token (codes + scales) against a bf16 cache, and the serving engine's
    concurrent sequences of seq_tokens under a budget, against bf16 (the engine's own sizing, int4's residual in)."""
    cfg = ctx.model.config
    heads = cfg.num_layers * cfg.num_kv_heads
    own = heads * bytes_per_token_head(kv.dtype, cfg.head_dim, 2, kv.block_size)
    bf16 = heads * bytes_per_token_head("auto", cfg.head_dim, 2)
    out = {"kv_bytes_per_token": own, "kv_bytes_per_token_bf16": bf16, "kv_memory_vs_bf16": bf16 / own}
    if kv.policy == "sink-window":  # a fixed number of tokens, whatever the context
        out["kv_tokens_kept"] = kv.sinks + kv.window
        return out
    budget = int(budget_mib * 2**20)
    held = [capacity(cfg, torch.bfloat16, d, budget, seq_tokens, kv.block_size) for d in ("auto", kv.dtype)]
    out["engine_sequences"] = {
        "budget_mib": budget_mib,
        "sequence_tokens": seq_tokens,
        "bf16": held[0].concurrent_sequences,
        "this": held[1].concurrent_sequences,
    }
    return out


def kv_row(ctx, params: dict) -> Variant:
    """The model unchanged, its KV cache quantized (int8, fp8_e4m3, int4 KIVI-style) or bounded (StreamingLLM
    sink + window): runtime.kv_policy. Approximate. Quality columns: teacher-forced through the cache (the first
    half of each sequence prefilled, the rest decoded token by token, every token read back from the cache) and
    greedy decoding through it; speed: plain decoding through it against the full-precision cache. What it buys:
    KV bytes per token and the engine's concurrent sequences at a fixed KV budget (results.kv_memory); with
    params.long_context, perplexity at 2k / 4k / 8k, passkey retrieval and long-prompt greedy agreement
    (evals.quality.long_context; the full-precision cache's figures are computed once per run)."""
    m, kv = ctx.model, kv_spec(params)

    def run(spec: KVCacheSpec):
        def go(prompts, max_tokens):
            p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            return [generate(m, [list(q)], p, kv_cache=spec).tokens[0] for q in prompts]

        return go

    extra = {"kv_cache": kv.label(), "kv_memory": kv_memory(ctx, kv, float(params.get("budget_mib", 1024)),
                                                            int(params.get("sequence_tokens", 2048)))}  # fmt: skip
    settings = params.get("long_context")
    if settings:
        if ctx.tokenizer is None:
            raise RowUnavailable("long-context measures read wiki text: this model has no tokenizer")
        try:
            extra["long_context"] = long_context_summary(
                m, ctx.tokenizer, kv, ctx.cache.setdefault("long_context", {}), seed=ctx.cfg.seed, **settings
            )
        except TypeError as err:
            raise ValueError(f"rows.params.long_context: {err}") from err
    return Variant(
        greedy=run(kv),
        timed=run(kv),
        baseline_timed=run(KVCacheSpec()),
        baseline_name="the full-precision KV cache (plain decoding, batch 1)",
        scorer=cached_scorer(m, kv=kv),
        model=m,
        extra=extra,
    )


# ---- speculative decoding (issue 5) -----------------------------------------------------------------


def speculative_row(ctx, params: dict) -> Variant:
    """issue 5's public entry points: ``speculate.cli.build_speculator`` and
    ``speculate.generate.speculative_generate``. The greedy column always decodes greedily (the lossless
    speculators must reproduce plain greedy output exactly); the speed column runs at the row's temperature
    against plain decoding at the same temperature. The teacher-forced columns score the target itself:
    speculation never changes the model, only how many target forwards a token costs."""

    m = ctx.model
    name = params.get("speculator")
    k = int(params.get("k", 4))
    temperature = float(params.get("temperature", 0.0))
    settings = dict(params.get("settings", {}))
    try:
        spec = build_speculator(name, m, ctx.path or "", k=k, **settings)
    except TypeError as err:
        raise ValueError(f"rows.params.settings: {err}") from err
    except (SpeculatorError, FileNotFoundError, OSError) as err:  # e.g. Medusa heads not trained yet
        raise RowUnavailable(f"{name}: {err}") from err

    def run(temp: float):
        def go(prompts, max_tokens):
            p = SamplingParams(temperature=temp, max_tokens=max_tokens, ignore_eos=True, seed=ctx.cfg.seed)
            out = speculative_generate(m, [list(q) for q in prompts], p, spec)
            # one row at a time (batch 1) would be slower to aggregate; the loop batches rows itself
            stats = out.stats.to_dict()
            ctx.spec_stats = {
                key: stats[key]
                for key in ("acceptance_rate", "mean_accepted_per_step", "target_forwards_per_token", "drafted")
                if key in stats
            }
            return out.tokens

        return go

    def plain(prompts, max_tokens):

        p = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=ctx.cfg.seed)
        return [generate(m, [list(q)], p).tokens[0] for q in prompts]

    def speculative_batch1(prompts, max_tokens):
        return [run(temperature)([q], max_tokens)[0] for q in prompts]

    return Variant(
        greedy=run(0.0),
        timed=speculative_batch1,
        baseline_timed=plain,
        baseline_name=f"plain decoding, batch 1, temperature {temperature:g}",
        scorer=model_scorer(m),
        model=m,
        extra={"speculator": spec.name, "k": k, "temperature": temperature, "lossless": spec.lossless},
        speculator=spec,
    )


def specbench_row(ctx, params: dict) -> Variant:
    """issue 16: one speculator on the ``evals.speculation.specbench`` suite (six chat-templated categories from the
    wiki eval split, 128+ new tokens), against plain decoding in the same run; the suite's per-category rows (tokens
    per step, acceptance per position, draft/verify split, speedup, greedy identity) go in the record. The
    suite times itself (set run_bench: false); the greedy column decodes the fidelity prompts as any row."""

    m, method = ctx.model, params.get("method")
    if ctx.tokenizer is None:
        raise RowUnavailable("the suite is chat-templated text: this model has no tokenizer")
    heads = {kind: head_dir(kind, ctx.path) for kind in ("medusa", "eagle")}
    if "head_recipe" in params:  # heads trained once into the store by this recipe, not the default ones
        artifact = head_artifact(ctx.cfg.model.spec, params)
        heads[artifact.kind] = built(ctx, artifact)
    try:
        spec = build(method, m, BuildContext(target_path=ctx.path, heads=heads))
    except (SpeculatorError, ValueError) as err:
        raise RowUnavailable(f"{method}: {err}") from err
    max_tokens = int(params.get("max_tokens", 128))
    suite = build_suite(int(params.get("per_category", 2)), ctx.cfg.seed, copy_tokens=max_tokens)
    suite = [s for s in suite if s.category in params.get("categories", [s.category])]
    prompts = [(s.category, encode_messages(ctx.tokenizer, s.messages)) for s in suite]
    temperature = float(params.get("temperature", 0.0))
    result = run_suite(
        m,
        prompts,
        ["plain", method],
        [int(b) for b in params.get("batch_sizes", [1])],
        max_tokens,
        heads,
        tokenizer=ctx.tokenizer,
        seed=ctx.cfg.seed,
        temperature=temperature,
        target_path=ctx.path,
    )

    def greedy(prompts, max_tokens):
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=ctx.cfg.seed)
        return speculative_generate(m, [list(q) for q in prompts], p, spec).tokens

    return Variant(
        greedy=greedy,
        timed=greedy,
        baseline_timed=None,
        scorer=model_scorer(m),
        model=m,
        extra={
            "speculator": method,
            "lossless": spec.lossless,
            "temperature": temperature,
            "suite": [r for r in result["rows"] if r["method"] == method],
            "suite_not_identical": result["not_identical"],
        },
        speculator=spec,
    )


def head_artifact(spec: str, params: dict) -> Artifact:
    """Draft heads trained by ``speculate.<medusa|eagle>.train`` with the row's ``head_recipe`` (its CLI
    arguments), once per recipe and input model."""
    try:
        kind = check_method(params.get("method", "")).name
    except ValueError as err:
        raise ValueError(f"rows.params.method: {err}") from err
    if kind not in ("medusa", "eagle"):
        raise ValueError(f"rows.params.head_recipe: {kind!r} has no heads to train (medusa and eagle do)")
    recipe = params["head_recipe"]
    if not isinstance(recipe, list):
        raise ValueError(f"rows.params.head_recipe: a list of the trainer's arguments, got {recipe!r}")
    return Artifact(kind, f"speculate.{kind}.train", tuple(str(a) for a in recipe), spec, Path(spec).name)


def row_artifacts(spec: str, row) -> list[Artifact]:
    """What a row needs built before it runs: a cluster sweep builds each artifact once, ahead of its rows."""
    if row.kind == "quantized":
        return [quantized_artifact(spec, row.params)]
    if row.kind == "specbench" and "head_recipe" in row.params:
        return [head_artifact(spec, row.params)]
    return []


def plan_row(spec: str, row) -> list[Artifact]:
    """A row checked without loading a model (a quantized recipe's checkpoint refusal reads config.json only): its
    kind, its speculation method, the artifacts it needs built. Raises ValueError naming the row for a bad one, and
    RowUnavailable / RowSkipped (recorded when the row runs, not errors) for one that cannot run here."""
    if row.kind not in ROWS:
        raise ValueError(f"rows[{row.name}].kind: {row.kind!r} not in {sorted(ROWS)}")
    try:
        if row.kind == "specbench":
            check_method(row.params.get("method", ""))
        return row_artifacts(spec, row)
    except ValueError as err:
        raise ValueError(f"rows[{row.name}]: {err}") from err


ROWS: dict[str, Callable] = {
    "specbench": specbench_row,
    "reference": reference_row,
    "kv_cache": kv_cache_row,
    "batching": batching_row,
    "attention": attention_row,
    "dtype": dtype_row,
    "quantized": quantized_row,
    "float_quant": float_quant_row,
    "engine": engine_row,
    "speculative": speculative_row,
    "kv": kv_row,
}
