"""The GPU check: ``python -m evals.speed.gpu_check`` (one GPU, <= 8 min, no network, no input files).

Builds random weights of real shapes on the device (SmolLM2-135M; a 1B Llama: hidden 2048, 16 layers, 32/8
heads, MLP 8192, vocab 128256, tied; an 8B Llama shape with 4 of its 32 layers) and measures, in one run:
exactness vs HF transformers on the same weights (fp32 greedy identical, bf16 teacher-forced argmax
agreement) and that every path runs (plain, speculative, engine, quantized) in fp32 and bf16; decode at batch
1/16/64, eager and compiled, vs HF eager and HF static cache (compiled); the share of the copy-bandwidth floor;
int4/int8 vs bf16 at batch 1/16; n-gram, draft and quant-draft speculation on a repetitive prompt and the
verify-cost curve T = 1..32; the engine, continuous vs static batching at 64 requests; the paged decode kernel
vs gather + SDPA. Prints one table (bars from issue 13 next to measured values) and writes a JSON record.

Each section is guarded: a failure is recorded and the rest still run; a global time budget skips what no
longer fits (recorded as skipped). ``--smoke`` runs every section on tiny shapes (CPU: seconds; compiled steps
are traced with dynamo's eager backend there), so the code cannot rot; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from quantize.config import QuantConfig
from quantize.qlinear import QuantLinear
from quantize.rtn_weight import quantize_weight
from runtime.compiled import BUCKETS, compiled_decoder, coordinate_descent, resolve_compile
from runtime.config import ModelConfig
from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.kv_cache import KVCache
from runtime.layout import device_of
from runtime.model import AttentionMetadata, Transformer
from runtime.paged_cache import triton_decode_wins
from runtime.provenance import provenance
from runtime.sampling import SamplingParams
from speculate.draft import quantized_draft
from speculate.generate import speculative_generate
from speculate.ngram import NgramSpeculator
from speculate.registry import build


def llama(vocab, hidden, mlp, layers, heads, kv_heads, tied=True, theta=500000.0) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, rope_theta=theta,
        max_position_embeddings=4096, tie_word_embeddings=tied, eos_token_ids=[2],
    )  # fmt: skip


SHAPES = {
    "smollm2-135m": llama(49152, 576, 1536, 30, 9, 3, theta=100000.0),
    "llama-1b": llama(128256, 2048, 8192, 16, 32, 8),
    "llama-8b-4L": llama(128256, 4096, 14336, 4, 32, 8, tied=False),
}
SMOKE_SHAPES = {
    "smollm2-135m": llama(256, 128, 128, 2, 4, 2),
    "llama-1b": llama(512, 128, 256, 2, 8, 2),
    "llama-8b-4L": llama(512, 128, 256, 1, 8, 2, tied=False),
}

BARS = [  # (key, bar text, threshold); value: measured ratio or bool
    ("fp32_greedy_identical", "fp32 greedy identical to HF (SmolLM2 and 1B shapes)", True),
    ("every_path_runs", "fp32 and bf16: plain, speculative, engine, quantized all run", True),
    ("b1_vs_hf_static", "1B bf16 batch-1 decode >= 1.2x HF static cache", 1.2),
    ("b1_floor_share", "1B bf16 batch-1 decode >= 50% of copy-bandwidth floor", 0.5),
    ("int4_vs_bf16", "int4 g128 batch-1 decode >= 1.8x our bf16", 1.8),
    ("int8_vs_bf16", "int8 batch-1 decode >= 1.3x our bf16", 1.3),
    ("continuous_vs_static", "continuous batching >= static at 64 requests", 1.0),
    ("ngram_speedup", "n-gram where drafts match (copying weights) >= 2x plain, greedy identical", 2.0),
]


class Check:
    """Shared state of one run: device, shapes, budget, the record."""

    def __init__(self, args):
        self.args = args
        self.smoke = args.smoke
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.shapes = SMOKE_SHAPES if self.smoke else SHAPES
        # compiled decode: CUDA graphs on a GPU; on CPU (smoke) dynamo's eager backend (traces, no compiler),
        # and only where a bar reads it (exactness, decode, n-gram): elsewhere the smoke run stays eager
        self.compile = resolve_compile("on", self.device) if self.cuda else "eager"
        self.compile_more = "off" if self.smoke else self.compile
        self.t_end = time.perf_counter() + args.budget_s
        self.models: dict = {}
        self.record: dict = {"sections": {}, "bars": {}}
        self.rows: list[tuple[str, str, str]] = []  # (section, what, value) for the table

    def left(self) -> float:
        return self.t_end - time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn) -> float:
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t

    def row(self, section: str, what: str, value) -> None:
        self.rows.append((section, what, value if isinstance(value, str) else f"{value:.4g}"))

    def model(self, shape: str, dtype: torch.dtype) -> Transformer:
        """Random weights of a real shape, made on the device (cached per shape and dtype)."""
        key = (shape, dtype)
        if key not in self.models:
            self.models[key] = random_model_on(self.shapes[shape], self.device, dtype, seed=self.args.seed)
        return self.models[key]

    def tokens(self, n: int, seed: int = 0, vocab: int | None = None) -> list[int]:
        gen = torch.Generator().manual_seed(self.args.seed + seed)
        return torch.randint(3, vocab or 500, (n,), generator=gen).tolist()


@torch.no_grad()
def random_model_on(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """runtime.model.random_model's recipe, drawn on the device (CPU generators take minutes for 8B shapes)."""
    with torch.device(device):
        model = Transformer(cfg)
    gen = torch.Generator(device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
        else:
            p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=device))
    return model.set_dtype(dtype, mixed=False).eval()


def hf_twin(model: Transformer, dtype: torch.dtype):
    """transformers' own model on the same weights and device (the oracle)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = model.config.to_hf()
    model_type = hf_cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **{k: v for k, v in hf_cfg.items() if k != "architectures"})
    device = device_of(model)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(model.hf_state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF twin: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(device=device, dtype=dtype).eval()


def hf_generate(hf, prompts: list[list[int]], n: int, static: bool, smoke: bool) -> list[list[int]]:
    ids = torch.tensor(prompts, device=hf.device)
    kwargs = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
        kwargs["disable_compile"] = smoke  # HF compiles its static-cache forward; on CPU (smoke) only trace paths
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[:, ids.shape[1] :].tolist()


def ms_per_token(c: Check, run, n1: int, n2: int) -> float:
    """Decode ms per step from two lengths (prefill and first-call costs cancel); run(n) generates n tokens."""
    repeats = 1 if c.smoke else 2
    if not c.smoke:  # warm-up: compiles, captures graphs, fills allocator caches. The longer run first: HF's
        run(n2)  # static cache is sized by it and reused by the shorter one (a smaller one would recompile)
        run(n1)
    t1 = min(c.timed(lambda: run(n1)) for _ in range(repeats))
    t2 = min(c.timed(lambda: run(n2)) for _ in range(repeats))
    return 1e3 * max(t2 - t1, 1e-6) / (n2 - n1)


def floor_ms(c: Check, model: Transformer) -> float:
    """Bytes every decode step reads (decoder weights + head; not the embedding) over the copy bandwidth."""
    nbytes = sum(b.numel() * b.element_size() for n, b in model.named_parameters() if not n.startswith("embed"))
    nbytes += sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype != torch.float32 or b.numel() > 4096)
    if model.config.tie_word_embeddings:
        nbytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return 1e3 * nbytes / c.record["copy_bandwidth_gb_s"] / 1e9


# ---- sections ------------------------------------------------------------------------------------------------


def sec_bandwidth(c: Check) -> dict:
    n = (64 << 20) if c.smoke else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=c.device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = sorted(c.timed(lambda: dst.copy_(src)) for _ in range(10))
    gb_s = 2 * n / times[len(times) // 2] / 1e9  # bytes read + written
    c.record["copy_bandwidth_gb_s"] = gb_s
    c.row("bandwidth", "copy GB/s (read + write)", gb_s)
    return {"copy_gb_s": gb_s, "bytes": n}


def sec_exactness(c: Check) -> dict:
    out: dict = {}
    n_new = 8 if c.smoke else 32
    for shape in ("smollm2-135m", "llama-1b"):
        model = c.model(shape, torch.float32)
        vocab = model.config.vocab_size
        prompt = c.tokens(16, 1, vocab)
        hf = hf_twin(model, torch.float32)
        ref = hf_generate(hf, [prompt], n_new, static=False, smoke=c.smoke)[0]
        params = SamplingParams(max_tokens=n_new, ignore_eos=True)
        eager = generate(model, [prompt], params, compile="off").tokens[0]
        compiled = generate(model, [prompt], params, compile=c.compile).tokens[0] if shape == "llama-1b" else eager
        out[f"{shape}_fp32_greedy_identical_eager"] = eager == ref
        out[f"{shape}_fp32_greedy_identical_compiled"] = compiled == ref
        out[f"{shape}_first_divergence"] = next((i for i, (a, b) in enumerate(zip(eager, ref)) if a != b), None)
        c.row("exactness", f"{shape} fp32 greedy == HF (eager / compiled)", f"{eager == ref} / {compiled == ref}")
        del hf
        # bf16: teacher-forced argmax agreement with HF bf16 on the same weights (plain bf16, as HF does it)
        model16 = c.model(shape, torch.bfloat16)
        hf16 = hf_twin(model16, torch.bfloat16)
        seq = torch.tensor([c.tokens(64 if c.smoke else 256, 2, vocab)], device=c.device)
        ours = model16(seq).argmax(-1)
        theirs = hf16(seq).logits.argmax(-1)
        agree = float((ours == theirs).float().mean())
        out[f"{shape}_bf16_teacher_forced_argmax_agreement"] = agree
        c.row("exactness", f"{shape} bf16 teacher-forced argmax agreement", agree)
        del hf16
    c.record["fp32_greedy_identical"] = all(v for k, v in out.items() if "greedy_identical" in k)
    return out


def sec_paths(c: Check) -> dict:
    """Every path runs in fp32 and bf16 and keeps greedy output: speculative (n-gram), engine, quantized."""
    out: dict = {}
    n_new = 8 if c.smoke else 16
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        model = c.model("smollm2-135m", dtype)
        span = c.tokens(12, 3, model.config.vocab_size)
        prompts = [span * 3, c.tokens(20, 4, model.config.vocab_size)]
        params = SamplingParams(max_tokens=n_new, ignore_eos=True)
        plain = generate(model, prompts, params, compile="off").tokens
        # eager here (the speculation section times the compiled path): this checks that the paths run
        spec = speculative_generate(model, prompts, params, NgramSpeculator(k=8), compile="off").tokens
        out[f"{name}_speculative_equals_plain"] = spec == plain
        engine = LLMEngine(model, config=EngineConfig(kv_cache_bytes=256 << 20, max_num_seqs=4))
        got = [o.output_ids for o in engine.generate(prompts, [params] * len(prompts))]
        out[f"{name}_engine_equals_plain"] = got == plain
        out[f"{name}_engine_decode_kernel"] = engine.cache.decode_kernel
        for bits in (4, 8):
            quant = quantized_draft(model, bits=bits)  # RTN copy, automatic fast path per layer
            q_out = generate(quant, prompts, params, compile="off").tokens
            paths = sorted({m.path for m in quant.modules() if isinstance(m, QuantLinear)})
            out[f"{name}_int{bits}_runs"] = len(q_out) == len(prompts) and all(len(t) == n_new for t in q_out)
            out[f"{name}_int{bits}_paths"] = paths
            del quant
        c.row("paths", f"{name}: spec / engine == plain", f"{spec == plain} / {got == plain}")
    out["quant_layer_paths"] = quant_layer_selfcheck(c)
    ok = all(v for k, v in out.items() if k.endswith(("_equals_plain", "_runs")))
    ok = ok and all(r["ok"] for r in out["quant_layer_paths"])
    c.record["every_path_runs"] = ok
    return out


def quant_layer_selfcheck(c: Check) -> list[dict]:
    """Each QuantLinear path on this device against the reference: relative error and exact code recovery."""
    gen = torch.Generator(c.device).manual_seed(c.args.seed)
    w = 0.05 * torch.randn(256, 1024, generator=gen, device=c.device)
    cases = [(4, 128, False, "cuda_int4" if c.cuda else "cpu_int4"), (8, -1, True, "cuda_int8"), (3, 128, False, None)]
    if c.cuda:
        cases += [(4, 128, False, "triton"), (8, -1, True, "triton")]
    out = []
    for bits, group, sym, path in cases:
        qw = quantize_weight(w, QuantConfig(bits=bits, group_size=group, sym=sym))
        ref = QuantLinear(qw, compute_dtype=torch.bfloat16, path="reference")
        layer = QuantLinear(qw, compute_dtype=torch.bfloat16, path="reference")
        layer.auto = path is None  # None: the automatic rule's choice
        if path is not None:
            layer.set_path(path)
        x = torch.randn(5, 1024, generator=gen, device=c.device).bfloat16()
        y, y_ref = layer(x).float(), ref(x.float())
        err = float((y - y_ref).abs().max() / y_ref.abs().max())
        exact = torch.equal(layer.codes_now().cpu(), qw.codes.cpu())
        out.append({"bits": bits, "path": layer.path, "rel_err": err, "codes_exact": exact, "ok": err < 2e-2 and exact})
    return out


def decode_point(
    c: Check, model: Transformer, hf, prompts: list[list[int]], n1: int, n2: int, with_static: bool, mode: str
) -> dict:
    """ms per decode step: ours eager and compiled, HF eager and (with_static) HF's static cache, compiled."""

    def ours(n: int, mode: str):
        return generate(model, prompts, SamplingParams(max_tokens=n, ignore_eos=True), compile=mode)

    res = {
        "ours_eager_ms": ms_per_token(c, lambda n: ours(n, "off"), n1, n2),
        "ours_compiled_ms": ms_per_token(c, lambda n: ours(n, mode), n1, n2),
    }
    if hf is not None:
        res["hf_eager_ms"] = ms_per_token(c, lambda n: hf_generate(hf, prompts, n, False, c.smoke), n1, n2)
        if with_static:
            res["hf_static_ms"] = ms_per_token(c, lambda n: hf_generate(hf, prompts, n, True, c.smoke), n1, n2)
    return res


@torch.no_grad()
def step_parts_ms(c: Check, model: Transformer, B: int, max_len: int, mode: str) -> dict:
    """The compiled decode step's pieces timed alone, back to back with one sync at the end: the captured decoder
    graph at T = 1 and the eager head + argmax. What a generated token costs beyond the two is the loop's own
    (the per-step sync, Python, host-to-device copies): where the time above the bandwidth floor goes."""
    decoder = compiled_decoder(model, B, max_len, mode)  # the one generate() used: same batch and capacity
    tokens = torch.zeros(B, 1, dtype=torch.long, device=c.device)
    positions = torch.full((B, 1), max_len // 2, dtype=torch.long, device=c.device)  # a slot the next prefill rewrites
    last = decoder(tokens, positions)[:, -1]  # warm
    n = 4 if c.smoke else 50
    graph = c.timed(lambda: [decoder(tokens, positions) for _ in range(n)]) / n
    head = c.timed(lambda: [model.logits(last).argmax(-1) for _ in range(n)]) / n
    return {"graph_ms": 1e3 * graph, "head_argmax_ms": 1e3 * head}


def decode_case(c: Check, out: dict, shape: str, B: int, hf, with_static: bool, mode: str) -> None:
    n1, n2 = (4, 12) if c.smoke else (32, 160)  # prompt 32 + 160 + 32 padding: one 256-slot static cache
    model = c.model(shape, torch.bfloat16)
    prompts = [c.tokens(32, 10 + b, model.config.vocab_size) for b in range(B)]
    res = decode_point(c, model, hf, prompts, n1, n2, with_static, mode)
    if mode != "off":
        parts = step_parts_ms(c, model, B, 32 + n2, mode)
        res.update(parts, loop_ms=res["ours_compiled_ms"] - parts["graph_ms"] - parts["head_argmax_ms"])
    floor = floor_ms(c, model)
    res["floor_ms"] = floor
    res["floor_share"] = floor / res["ours_compiled_ms"] if B == 1 else None
    res["tok_s_compiled"] = B * 1e3 / res["ours_compiled_ms"]
    out[f"{shape}_b{B}"] = res
    text = " / ".join(f"{k.removesuffix('_ms')} {v:.3g}" for k, v in res.items() if k.endswith("_ms"))
    c.row("decode ms/step", f"{shape} bf16 b{B}", text)


def sec_decode(c: Check) -> dict:
    """The bar's point: 1B bf16 batch 1, ours (eager, compiled) vs HF (eager, static cache compiled)."""
    out: dict = {}
    model = c.model("llama-1b", torch.bfloat16)
    hf = hf_twin(model, torch.bfloat16)
    decode_case(c, out, "llama-1b", 1, hf, with_static=True, mode=c.compile)
    b1 = out["llama-1b_b1"]
    c.record["b1_floor_share"] = b1["floor_share"]
    if "hf_static_ms" in b1:
        c.record["b1_vs_hf_static"] = b1["hf_static_ms"] / b1["ours_compiled_ms"]
    return out


def sec_decode_more(c: Check) -> dict:
    """Batch 16 and 64 on the 1B shape (HF eager alongside), SmolLM2 and the 8B shape at batch 1."""
    out: dict = {}
    if c.smoke:  # the same code as the decode section's; one more batch size and the untied 8B shape
        cases = [("llama-1b", 2), ("llama-8b-4L", 1)]
    else:
        cases = [("llama-1b", 16), ("llama-1b", 64), ("smollm2-135m", 1), ("llama-8b-4L", 1)]
    for shape, B in cases:
        if c.left() < 60 and not c.smoke:
            out[f"{shape}_b{B}"] = "skipped (time budget)"
            continue
        hf = hf_twin(c.model(shape, torch.bfloat16), torch.bfloat16) if shape != "llama-8b-4L" else None
        decode_case(c, out, shape, B, hf, with_static=False, mode=c.compile_more)
        del hf
    return out


def quant_point(c: Check, model: Transformer, prompts: list[list[int]], n1: int, n2: int) -> float:
    def run(n: int):
        return generate(model, prompts, SamplingParams(max_tokens=n, ignore_eos=True), compile=c.compile_more)

    return ms_per_token(c, run, n1, n2)


def quant_batch(c: Check, out: dict, B: int) -> None:
    n1, n2 = (4, 12) if c.smoke else (32, 160)
    base = c.model("llama-1b", torch.bfloat16)
    prompts = [c.tokens(32, 20 + b, base.config.vocab_size) for b in range(B)]
    bf16 = quant_point(c, base, prompts, n1, n2)
    out[f"bf16_b{B}_ms"] = bf16
    for bits, label in ((4, "int4_g128"), (8, "int8")):
        if c.left() < 60 and not c.smoke:
            out[f"{label}_b{B}"] = "skipped (time budget)"
            continue
        q = quantized_draft(base, bits=bits)  # RTN int4 g128 asym / int8 per-channel sym, bf16, automatic path
        ms = quant_point(c, q, prompts, n1, n2)
        paths = sorted({m.path for m in q.modules() if isinstance(m, QuantLinear)})
        out[f"{label}_b{B}"] = {"ms": ms, "speedup_vs_bf16": bf16 / ms, "paths": paths}
        c.row("quantized decode", f"{label} b{B}: ms / x bf16 / path", f"{ms:.3g} / {bf16 / ms:.3g} / {paths}")
        if B == 1:
            c.record[f"{label.split('_')[0]}_vs_bf16"] = bf16 / ms
        del q


def sec_quant(c: Check) -> dict:
    out: dict = {}
    quant_batch(c, out, 1)
    return out


def sec_quant_more(c: Check) -> dict:
    if c.smoke:
        return {"note": "smoke: the quant section's code at another batch size; nothing new to check"}
    out: dict = {}
    quant_batch(c, out, 16)
    return out


def spec_setup(c: Check, mode: str):
    """The 1B shape, a repetitive prompt (a 24-token span 4 times) and plain compiled decoding's output and time.
    Prompt 96 + 96 new tokens + the speculator's headroom fit the 256-slot static cache the decode section
    compiled, so plain decoding reuses its graph."""
    model = c.model("llama-1b", torch.bfloat16)
    span = c.tokens(24, 30, model.config.vocab_size)
    prompt = [span * (2 if c.smoke else 4)]
    params = SamplingParams(max_tokens=12 if c.smoke else 96, ignore_eos=True)
    plain = generate(model, prompt, params, compile=mode)  # warm
    t_plain = c.timed(lambda: generate(model, prompt, params, compile=mode))
    return model, prompt, params, plain.tokens, t_plain, mode


def spec_case(c: Check, out: dict, name: str, spec, setup) -> None:
    model, prompt, params, plain, t_plain, mode = setup
    res = speculative_generate(model, prompt, params, spec, compile=mode)  # warm: compiles its bucket
    t = c.timed(lambda: speculative_generate(model, prompt, params, spec, compile=mode))
    identical = res.tokens == plain
    out[name] = {"identical": identical, "speedup": t_plain / t, "plain_s": t_plain, "spec_s": t, **res.stats.to_dict()}
    if not identical:
        out[name]["divergence"] = first_divergence(model, prompt[0], plain[0], res.tokens[0])
    c.row("speculation", f"{name}: x plain / identical / tokens per step", f"{t_plain / t:.3g} / {identical} / "
          f"{res.stats.mean_tokens_per_step:.3g}")  # fmt: skip


@torch.no_grad()
def first_divergence(model: Transformer, prompt: list[int], plain: list[int], spec: list[int]) -> dict:
    """Where speculative output leaves plain greedy output, and plain's top-2 logit margin there (one eager
    forward over prompt + plain). A margin within a few bf16 steps of the top logit is a near tie that a verify
    forward of another shape may round the other way; a wide margin is a bug."""
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    ids = torch.tensor([prompt + plain[:i]], device=model.embed_tokens.weight.device)
    top = model(ids)[0, -1].float().topk(2).values
    return {"index": i, "top1_logit": top[0].item(), "top2_margin": (top[0] - top[1]).item()}


@contextmanager
def copying_weights(model: Transformer) -> Iterator[Transformer]:
    """Every attention and MLP output projection zeroed in place (restored on exit): no layer adds anything, the
    last hidden state is the current token's embedding, and through tied embeddings the greedy next token is the
    current token again (its logit is ~d x std, every other ~sqrt(d) x std). A step costs what it did (dense
    products of zeros), and a copying speculator's drafts match: the speculative loop where drafts are
    accepted, which random weights never give (they do not copy their prompt)."""
    if not model.config.tie_word_embeddings:
        raise ValueError("copying_weights needs tied embeddings (the head must read the embedding rows)")
    weights = [w for layer in model.layers for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
    saved = [w.detach().clone() for w in weights]
    try:
        with torch.no_grad():
            for w in weights:
                w.zero_()  # in place: compiled graphs and the CPU step read these tensors, not copies
        yield model
    finally:
        with torch.no_grad():
            for w, s in zip(weights, saved):
                w.copy_(s)


def sec_speculation(c: Check) -> dict:
    """n-gram speculation on the 1B shape: on random weights (acceptance ~0: the loop's overhead; greedy
    identity in bf16 up to near ties, see first_divergence) and on copying weights (drafts accepted: the bar)."""
    out: dict = {}
    setup = spec_setup(c, c.compile)
    spec_case(c, out, "ngram", NgramSpeculator(k=15), setup)  # steps of <= 16 tokens: one graph (bucket 16)
    with copying_weights(setup[0]):
        spec_case(c, out, "ngram_copying", NgramSpeculator(k=15), spec_setup(c, c.compile))
    copying = out["ngram_copying"]
    c.record["ngram_speedup"] = copying["speedup"] if copying["identical"] else 0.0
    return out


def sec_speculation_more(c: Check) -> dict:
    """Draft-model speculation (a layer-skip draft: the first 4 of 16 layers) and the quantized self-draft (int4),
    k = 4; then the verify-cost curve."""
    out: dict = {}
    setup = spec_setup(c, c.compile_more)
    model = setup[0]
    methods = [f"draft:layers={max(1, model.config.num_layers // 4)},k=4"]
    if c.left() > 60 or c.smoke:
        methods.append("quant-draft:bits=4,k=4")
    for method in methods:  # recorded under the speculator's name: draft, quant-draft
        spec_case(c, out, method.partition(":")[0], build(method, model), setup)
    out["verify_cost"] = verify_cost_curve(c, model, c.compile_more)
    return out


def verify_cost_curve(c: Check, model: Transformer, mode: str) -> dict:
    """One forward of T = 1..32 new tokens over a 192-token cache (48 in smoke), eager and compiled, ms. The
    cache is the 256-slot one the decode section compiled for, so buckets already captured are reused."""
    ctx = 48 if c.smoke else 192
    decoder = compiled_decoder(model, 1, ctx, mode) if mode != "off" else None
    cache = (
        decoder.cache
        if decoder is not None
        else KVCache(model.config, 1, ctx + BUCKETS[-1], model.compute_dtype, c.device)
    )
    prompt = torch.tensor([c.tokens(ctx, 40, model.config.vocab_size)], device=c.device)
    model(prompt, AttentionMetadata.contiguous(1, 0, ctx, c.device), cache, hidden_only=True)
    curve = {}
    for T in BUCKETS:
        toks = prompt[:, :T]
        meta = AttentionMetadata.contiguous(1, ctx, T, c.device)
        positions = torch.arange(ctx, ctx + T, device=c.device)[None]

        def eager(toks=toks, meta=meta):
            model(toks, meta, cache, hidden_only=True)

        def compiled(toks=toks, positions=positions):
            decoder(toks, positions)

        eager()
        point = {"eager_ms": 1e3 * min(c.timed(eager) for _ in range(5))}
        if decoder is not None and (c.left() > 40 or c.smoke):
            compiled()  # compiles this bucket if no section did
            point["compiled_ms"] = 1e3 * min(c.timed(compiled) for _ in range(5))
        curve[T] = point
        c.row("verify cost", f"T={T} ms (eager / compiled)", " / ".join(f"{v:.3g}" for v in point.values()))
    return curve


def sec_engine(c: Check) -> dict:
    model = c.model("llama-1b", torch.bfloat16)
    n_req, n_new = (8, 8) if c.smoke else (64, 128)
    gen = torch.Generator().manual_seed(50)
    lengths = torch.randint(32, 256 if not c.smoke else 48, (n_req,), generator=gen).tolist()
    prompts = [c.tokens(L, 60 + i, model.config.vocab_size) for i, L in enumerate(lengths)]
    params = [SamplingParams(max_tokens=n_new, ignore_eos=True)] * n_req
    out = {}
    for policy in ("continuous", "static", "continuous", "static"):  # interleaved, best of two
        cfg = EngineConfig(kv_cache_bytes=(64 << 20) if c.smoke else (8 << 30), max_num_seqs=n_req, policy=policy)
        engine = LLMEngine(model, config=cfg)
        t = c.timed(lambda engine=engine: engine.generate(prompts, params))
        tok_s = n_req * n_new / t
        out[policy] = max(out.get(policy, 0.0), tok_s)
    out["ratio"] = out["continuous"] / out["static"]
    c.record["continuous_vs_static"] = out["ratio"]
    c.row("engine", f"{n_req} requests tok/s continuous / static", f"{out['continuous']:.4g} / {out['static']:.4g}")
    return out


def sec_paged(c: Check) -> dict:
    if not c.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return {"status": "skipped: the Triton kernel needs CUDA (or TRITON_INTERPRET=1)"}
    from evals.speed.paged_decode_ops import OpCase, op_case

    cases = []
    grid = [(1, 64), (2, 64)] if c.smoke else [(1, 512), (1, 4096), (16, 512), (16, 4096), (64, 512), (64, 4096)]
    shape = "tiny" if c.smoke else "llama-8b"
    for dtype in ("bf16", "fp32"):
        for batch, ctx in grid:
            r = op_case(OpCase(shape, dtype, batch, ctx), 16, c.device, 5 if c.smoke else 50, c.args.seed)
            if r["ms_kernel"] is not None:
                faster = "triton" if r["ms_kernel"] < r["ms_gather_sdpa"] else "torch"
                rule = (
                    "triton"
                    if triton_decode_wins({"bf16": torch.bfloat16}.get(dtype, torch.float32), batch, ctx)
                    else "torch"
                )
                r.update(faster=faster, rule_picks=rule, rule_right=faster == rule)
                c.row("paged decode", f"{dtype} b{batch} ctx{ctx}: kernel/sdpa ms, rule", f"{r['ms_kernel']:.3g} / "
                      f"{r['ms_gather_sdpa']:.3g}, {'right' if faster == rule else 'WRONG'}")  # fmt: skip
            cases.append(r)
    return {"cases": cases, "all_correct": all(r["ok"] for r in cases)}


SECTIONS = [  # (name, function, seconds of budget it needs left to start): the bars' measurements first
    ("bandwidth", sec_bandwidth, 5),
    ("exactness", sec_exactness, 30),
    ("decode", sec_decode, 60),
    ("quant", sec_quant, 60),
    ("speculation", sec_speculation, 60),
    ("engine", sec_engine, 40),
    ("paths", sec_paths, 30),
    ("paged", sec_paged, 20),
    ("decode_more", sec_decode_more, 60),
    ("quant_more", sec_quant_more, 60),
    ("speculation_more", sec_speculation_more, 60),
]


def run(c: Check, only: list[str] | None) -> None:
    for name, fn, need in SECTIONS:
        if only and name not in only:
            continue
        if c.left() < need and not c.smoke:
            c.record["sections"][name] = {"status": "skipped", "reason": f"time budget: {c.left():.0f}s left"}
            c.row(name, "status", "skipped (time budget)")
            continue
        t = time.perf_counter()
        try:
            result = fn(c)
            c.record["sections"][name] = {"status": "ok", "seconds": time.perf_counter() - t, **result}
        except Exception as err:  # one failure is recorded; the other sections still run
            c.record["sections"][name] = {
                "status": "error",
                "seconds": time.perf_counter() - t,
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc()[-3000:],
            }
            c.row(name, "ERROR", f"{type(err).__name__}: {str(err)[:100]}")
        if c.cuda:
            torch.cuda.empty_cache()


def bars(c: Check) -> list[dict]:
    out = []
    for key, text, threshold in BARS:
        value = c.record.get(key)
        if value is None:
            status = "unmeasured"
        elif isinstance(threshold, bool):
            status = "met" if value is threshold else "not met"
        else:
            status = "met" if value >= threshold else "not met"
        if c.smoke and status != "unmeasured":
            status += " (smoke: not a GPU measurement)"
        out.append({"bar": text, "value": value, "status": status})
    return out


def table(c: Check) -> str:
    lines = ["| section | measurement | value |", "| --- | --- | --- |"]
    lines += [f"| {s} | {w} | {v} |" for s, w, v in c.rows]
    lines += ["", "| bar (issue 13) | measured | status |", "| --- | --- | --- |"]
    for b in c.record["bars"]:
        v = b["value"]
        lines.append(f"| {b['bar']} | {v if not isinstance(v, float) else f'{v:.3g}'} | {b['status']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.speed.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: seconds); checks the code, not speed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=450.0, help="global time budget; later sections are skipped")
    ap.add_argument("--sections", default=None, help="comma-separated subset of: " + ",".join(n for n, *_ in SECTIONS))
    ap.add_argument("--out", default="gpu_check.json", help="JSON record path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    only = args.sections.split(",") if args.sections else None
    unknown = set(only or []) - {n for n, *_ in SECTIONS}
    if unknown:
        ap.error(f"unknown sections: {sorted(unknown)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --smoke on CPU)")
    torch.manual_seed(args.seed)
    c = Check(args)
    c.record.update(
        provenance(seed=args.seed),
        smoke=args.smoke,
        compile=c.compile,
        coordinate_descent_tuning=coordinate_descent() if c.cuda else None,
        budget_s=args.budget_s,
        shapes={k: v.to_dict() for k, v in c.shapes.items()},
    )
    if c.cuda:
        c.record["gpu"] = torch.cuda.get_device_name()
    c.record.setdefault("copy_bandwidth_gb_s", None)
    t0 = time.perf_counter()
    with torch.inference_mode():
        run(c, only)
    c.record["seconds"] = time.perf_counter() - t0
    c.record["bars"] = bars(c)
    text = table(c)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(c.record, indent=1, default=str))
    print(f"\n[gpu_check] {c.record['seconds']:.0f}s, record: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
