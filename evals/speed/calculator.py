"""Back-of-envelope serving arithmetic from a config.json: parameters, weight and KV bytes, rooflines, capacity.

Everything is exact integer arithmetic on the config's shapes (no measurement). Conventions:
- parameters count tied embeddings once (the lm_head shares the embedding matrix);
- KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element; a quantized KV cache
  (--kv-dtype int8, fp8 / fp8_e4m3, int4) counts its real bytes, codes plus scales, as runtime.kv_quant stores
  them (int8 / fp8: one fp16 scale per token and KV head; int4: fp16 scale and min per value token and per key
  channel over 64 tokens); int4's per-sequence residual of open key groups is not per token and not counted;
- GB = 10^9 bytes and GiB = 2^30 bytes, always labelled; bandwidths and FLOP rates are decimal (GB/s, TFLOPS);
- decode roofline: one decode step reads every weight byte once (plus the KV of every sequence), so
  tokens/s <= batch x bandwidth / bytes per step, and <= the compute rate / FLOPs per token;
- quantized configs (``quantization_config`` with ``bits`` and ``group_size``): decoder linear layers cost
  bits/8 bytes per weight plus one fp16 scale and one ``bits``-wide zero point per group (the GPTQ/AWQ
  layout; ``sym`` drops nothing, as those formats store zeros either way), plus an int32 g_idx per input
  column with act-order; embeddings, norms and (unless ``lm_head`` is set) the lm_head keep the base dtype.
  A quantized lm_head of a tied model is also the embedding (qspec's QuantEmbedding reads its rows), stored once.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime.cliutil import ArgumentParser, run
from runtime.kv_quant import bytes_per_token_head
from runtime.loader import REGISTRY, resolve

DTYPE_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0}
DTYPE_BYTES.update({"fp8": 1.0, "int8": 1.0, "int4": 0.5})

KV_FORMATS = {"int8": "int8", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "int4": "int4"}  # -> runtime.kv_quant
KV_INT4_GROUP = 64  # tokens per int4 key scale (the runtime's default block size for int4 KV)

UNIT_SCALE = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "KI": 2**10, "MI": 2**20, "GI": 2**30}
UNIT_SCALE["TI"] = 2**40


class CalculatorError(ValueError):
    """A config or an argument the calculator cannot use; the message names the problem."""


def parse_quantity(text: str | float | int, unit: str) -> float:
    """'1000GB/s' -> 1e12 (unit 'B/s'); '100TFLOPS' -> 1e14 (unit 'FLOPS'); '24GiB' -> 24 * 2^30 (unit 'B')."""
    if isinstance(text, int | float):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtTpP]i?)?\s*(.*?)\s*", text)
    suffix = (m.group(3) if m else "").replace("/S", "/s")
    if not m or suffix.lower() not in ("", unit.lower()):
        raise CalculatorError(f"cannot read {text!r} as a quantity in {unit} (e.g. 1000G{unit}, 80Gi{unit})")
    prefix = (m.group(2) or "").upper()
    return float(m.group(1)) * UNIT_SCALE[prefix]


@dataclass
class Shapes:
    """The shapes that determine parameters and bytes (read leniently from any Llama-style config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> Shapes:
        text = hf.get("text_config")
        hf = {**hf, **text} if isinstance(text, dict) else hf  # multimodal wrappers nest the decoder config
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in hf]
        if missing:
            raise CalculatorError(f"config is missing {', '.join(missing)} (need a Llama-style config.json)")
        heads = int(hf["num_attention_heads"])
        model_type = str(hf.get("model_type", "")).lower()
        archs = " ".join(hf.get("architectures") or []).lower()
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3" or "qwen3" in archs,
            max_position_embeddings=hf.get("max_position_embeddings"),
        )


@dataclass
class ParamCounts:
    embedding: int
    lm_head: int  # 0 when tied
    attention: int  # q/k/v/o weights (+ biases) over all layers
    mlp: int  # gate/up/down over all layers
    norms: int  # RMSNorm weights (layer norms, q/k norms, final norm)

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.norms

    @property
    def linear(self) -> int:
        """Weights of the decoder's linear layers (what weight quantizers quantize)."""
        return self.attention + self.mlp


def count_params(s: Shapes) -> ParamCounts:
    d, hd = s.hidden_size, s.head_dim
    q, kv = s.num_heads * hd, s.num_kv_heads * hd
    attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if s.attention_bias else 0)
    mlp = 3 * d * s.intermediate_size
    norms = 2 * d + (2 * hd if s.qk_norm else 0)
    embed = s.vocab_size * d
    return ParamCounts(
        embedding=embed,
        lm_head=0 if s.tie_word_embeddings else embed,
        attention=s.num_layers * attn,
        mlp=s.num_layers * mlp,
        norms=s.num_layers * norms + d,
    )


@dataclass
class QuantScheme:
    bits: int
    group_size: int  # input columns per group; -1 / 0 = per output channel (one group per row)
    act_order: bool = False
    lm_head: bool = False
    method: str = "gptq"

    @classmethod
    def from_hf(cls, qc: dict) -> QuantScheme:
        bits = qc.get("bits", qc.get("w_bit"))
        if bits is None:
            raise CalculatorError(f"quantization_config has no 'bits' (keys: {sorted(qc)})")
        return cls(
            bits=int(bits),
            group_size=int(qc.get("group_size", qc.get("q_group_size", -1))),
            act_order=bool(qc.get("desc_act", False)),
            lm_head=bool(qc.get("lm_head", False)),
            method=str(qc.get("quant_method", "gptq")),
        )

    def matrix_bytes(self, rows: int, cols: int) -> float:
        """Bytes of a [rows, cols] (out x in) quantized matrix: codes + fp16 scales + packed zeros (+ g_idx)."""
        group = cols if self.group_size <= 0 else self.group_size
        groups = rows * math.ceil(cols / group)
        return rows * cols * self.bits / 8 + groups * (2 + self.bits / 8) + (4 * cols if self.act_order else 0)


@dataclass
class WeightBytes:
    linear: float
    embedding: float
    lm_head: float  # bytes read by the output projection (the embedding matrix again when tied)
    norms: float

    @property
    def stored(self) -> float:
        """Bytes on disk / in memory (a tied lm_head is not stored twice)."""
        return self.linear + self.embedding + self.norms + (0 if self.lm_head_tied else self.lm_head)

    @property
    def read_per_step(self) -> float:
        """Bytes one decode step reads: every linear weight and the lm_head; one embedding row per token."""
        return self.linear + self.lm_head + self.norms

    lm_head_tied: bool = False


def weight_bytes(s: Shapes, dtype_bytes: float, quant: QuantScheme | None = None) -> WeightBytes:
    p = count_params(s)
    d, hd = s.hidden_size, s.head_dim
    q, kv = s.num_heads * hd, s.num_kv_heads * hd
    if quant is None:
        linear = p.linear * dtype_bytes
    else:
        shapes = [(q + 2 * kv, d), (d, q), (2 * s.intermediate_size, d), (s.intermediate_size, d)]
        per_layer = sum(quant.matrix_bytes(r, c) for r, c in shapes)
        biases = (q + 2 * kv) * dtype_bytes if s.attention_bias else 0
        linear = s.num_layers * (per_layer + biases)
    quantized_head = bool(quant and quant.lm_head)
    head_bytes = quant.matrix_bytes(s.vocab_size, d) if quantized_head else s.vocab_size * d * dtype_bytes
    return WeightBytes(
        linear=linear,
        # tied: one table serves both; a quantized tied head is that table (the embedding reads its rows)
        embedding=head_bytes if s.tie_word_embeddings else p.embedding * dtype_bytes,
        lm_head=head_bytes,
        norms=p.norms * dtype_bytes,
        lm_head_tied=s.tie_word_embeddings,
    )


def kv_element_bytes(kv_dtype: str, head_dim: int) -> float:
    """Bytes per cached K or V element, scales included for the quantized KV formats."""
    if kv_dtype in KV_FORMATS:
        return bytes_per_token_head(KV_FORMATS[kv_dtype], head_dim, 0, KV_INT4_GROUP) / (2 * head_dim)
    if kv_dtype not in DTYPE_BYTES:
        raise CalculatorError(f"unknown kv dtype {kv_dtype!r}; choose from {sorted(DTYPE_BYTES | KV_FORMATS)}")
    return DTYPE_BYTES[kv_dtype]


def kv_bytes_per_token(s: Shapes, kv_dtype_bytes: float) -> float:
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * kv_dtype_bytes


def flops_per_token(s: Shapes, context: int) -> float:
    """Forward FLOPs for one token attending to `context` previous tokens: 2 per matmul weight (lm_head
    included) plus QK^T and PV (2 x 2 x heads x head_dim per attended position per layer)."""
    p = count_params(s)
    matmul = p.linear + s.vocab_size * s.hidden_size
    return 2 * matmul + 4 * s.num_layers * s.num_heads * s.head_dim * context


def prefill_flops(s: Shapes, prompt: int) -> float:
    """Causal prefill of `prompt` tokens: token i attends to i+1 positions, sum = P(P+1)/2."""
    p = count_params(s)
    matmul = p.linear + s.vocab_size * s.hidden_size
    return 2 * matmul * prompt + 4 * s.num_layers * s.num_heads * s.head_dim * prompt * (prompt + 1) / 2


@dataclass
class Report:
    config: str
    dtype: str
    kv_dtype: str
    quantization: dict | None
    params: dict
    params_total: int
    weight_bytes_stored: float
    weight_bytes_read_per_step: float
    kv_bytes_per_token: float
    context: int
    kv_bytes_per_sequence: float
    concurrency: int
    kv_bytes_for_concurrency: float
    total_bytes_for_concurrency: float
    bandwidth_bytes_per_s: float
    flops_per_s: float
    decode_tokens_per_s_batch1_empty: float  # weights only (context 0)
    decode_tokens_per_s_batch1: float  # weights + KV of one full-context sequence
    decode_tokens_per_s_concurrency: float  # aggregate over `concurrency` full-context sequences
    decode_bound_concurrency: str  # "memory" or "compute"
    prefill_flops: float
    prefill_seconds: float
    memory_budget_bytes: float | None
    max_batch_for_budget: int | None
    worksheet: list[dict]


def decode_rate(s: Shapes, w: WeightBytes, kv_pt: float, batch: int, context: int, bw: float, flops: float):
    """(aggregate tokens/s, bound) of one decode step for `batch` sequences at `context` tokens each."""
    step_bytes = w.read_per_step + batch * context * kv_pt
    t_mem = step_bytes / bw
    t_compute = batch * flops_per_token(s, context) / flops
    return batch / max(t_mem, t_compute), "memory" if t_mem >= t_compute else "compute"


def calculate(
    hf: dict,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    context: int = 4096,
    concurrency: int = 1,
    bandwidth: float = 1e12,
    flops: float = 1e14,
    memory_budget: float | None = None,
    contexts: list[int] | None = None,
    concurrencies: list[int] | None = None,
    name: str = "config",
) -> Report:
    if dtype not in DTYPE_BYTES:
        raise CalculatorError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPE_BYTES)}")
    for label, value in (("context", context), ("concurrency", concurrency)):
        if value < 1:
            raise CalculatorError(f"{label} must be >= 1, got {value}")
    if bandwidth <= 0 or flops <= 0:
        raise CalculatorError("bandwidth and flops must be positive")
    kv_dtype = kv_dtype or dtype
    s = Shapes.from_hf(hf)
    qc = hf.get("quantization_config")
    quant = QuantScheme.from_hf(qc) if qc else None
    p = count_params(s)
    w = weight_bytes(s, DTYPE_BYTES[dtype], quant)
    kv_pt = kv_bytes_per_token(s, kv_element_bytes(kv_dtype, s.head_dim))
    kv_seq = kv_pt * context
    tps_empty, _ = decode_rate(s, w, kv_pt, 1, 0, bandwidth, flops)
    tps_1, _ = decode_rate(s, w, kv_pt, 1, context, bandwidth, flops)
    tps_c, bound = decode_rate(s, w, kv_pt, concurrency, context, bandwidth, flops)
    pf = prefill_flops(s, context)
    max_batch = None
    if memory_budget is not None:
        free = memory_budget - w.stored
        max_batch = max(0, int(free // kv_seq))
    contexts = contexts or sorted({1024, 4096, 8192, 32768, context})
    concurrencies = concurrencies or sorted({1, 4, 16, 64, concurrency})
    worksheet = []
    for ctx in contexts:
        for conc in concurrencies:
            total = w.stored + conc * ctx * kv_pt
            rate, b = decode_rate(s, w, kv_pt, conc, ctx, bandwidth, flops)
            worksheet.append(
                {
                    "context": ctx,
                    "concurrency": conc,
                    "kv_bytes": conc * ctx * kv_pt,
                    "total_bytes": total,
                    "fits": None if memory_budget is None else total <= memory_budget,
                    "decode_tokens_per_s": rate,
                    "bound": b,
                }
            )
    return Report(
        config=name,
        dtype=dtype,
        kv_dtype=kv_dtype,
        quantization=None if quant is None else asdict(quant),
        params=asdict(p),
        params_total=p.total,
        weight_bytes_stored=w.stored,
        weight_bytes_read_per_step=w.read_per_step,
        kv_bytes_per_token=kv_pt,
        context=context,
        kv_bytes_per_sequence=kv_seq,
        concurrency=concurrency,
        kv_bytes_for_concurrency=kv_seq * concurrency,
        total_bytes_for_concurrency=w.stored + kv_seq * concurrency,
        bandwidth_bytes_per_s=bandwidth,
        flops_per_s=flops,
        decode_tokens_per_s_batch1_empty=tps_empty,
        decode_tokens_per_s_batch1=tps_1,
        decode_tokens_per_s_concurrency=tps_c,
        decode_bound_concurrency=bound,
        prefill_flops=pf,
        prefill_seconds=pf / flops,
        memory_budget_bytes=memory_budget,
        max_batch_for_budget=max_batch,
        worksheet=worksheet,
    )


# ---- tensor parallelism and prefill/decode disaggregation ---------------------------------------------
#
# Layout of runtime.tp (Megatron-LM): q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel
# with one all-reduce of [tokens, hidden] after each; heads split by whole GQA groups (KV heads replicated
# when there are fewer than ranks); the embedding and lm_head either vocab-parallel (one more all-reduce
# after the embedding lookup and an all-gather of the fp32 logits, as vLLM does) or replicated (qspec's
# runtime). Per-GPU numbers are those of the largest shard (uneven splits round up). Communication is
# what one GPU sends: a ring all-reduce of M bytes over t ranks sends 2 (t-1)/t M, an all-gather (t-1)/t M.
# A step's time is max(memory, compute) + communication (no overlap) + one link latency per collective.


@dataclass
class Hardware:
    bandwidth: float = 1e12  # per-GPU memory bandwidth, bytes/s
    flops: float = 1e14  # per-GPU compute, FLOP/s
    link_bandwidth: float = 450e9  # per-GPU interconnect, bytes/s each way
    link_latency: float = 5e-6  # seconds per collective
    act_bytes: float = 2.0  # activation dtype of the all-reduces (bf16)


def tp_shard(s: Shapes, tp: int) -> tuple[int, int, int]:
    """(query heads, KV heads, intermediate columns) on the largest of tp shards."""
    if tp < 1:
        raise CalculatorError(f"tensor-parallel size must be >= 1, got {tp}")
    group = s.num_heads // s.num_kv_heads
    if s.num_kv_heads >= tp:
        kv = -(-s.num_kv_heads // tp)
        q = kv * group
    elif tp % s.num_kv_heads == 0 and s.num_heads % tp == 0:
        kv, q = 1, s.num_heads // tp
    else:
        raise CalculatorError(f"cannot split {s.num_heads} query / {s.num_kv_heads} KV heads over {tp} ranks")
    return q, kv, -(-s.intermediate_size // tp)


def tp_weight_bytes_per_gpu(s: Shapes, dtype_bytes: float, tp: int, vocab_parallel: bool = True) -> float:
    """Weight bytes held by one GPU (unquantized)."""
    q, kv, inter = tp_shard(s, tp)
    d, hd = s.hidden_size, s.head_dim
    attn = d * (q + 2 * kv) * hd + q * hd * d + ((q + 2 * kv) * hd if s.attention_bias else 0)
    mlp = 3 * d * inter
    norms = s.num_layers * (2 * d + (2 * hd if s.qk_norm else 0)) + d
    rows = -(-s.vocab_size // tp) if vocab_parallel else s.vocab_size
    tables = rows * d * (1 if s.tie_word_embeddings else 2)
    return (s.num_layers * (attn + mlp) + norms + tables) * dtype_bytes


def tp_kv_bytes_per_token_per_gpu(s: Shapes, kv_dtype_bytes: float, tp: int) -> float:
    return 2 * s.num_layers * tp_shard(s, tp)[1] * s.head_dim * kv_dtype_bytes


def tp_collectives_per_forward(s: Shapes, tp: int, vocab_parallel: bool = True) -> int:
    """All-reduces after every o_proj and down_proj (+ the embedding's and the logits' gather if vocab-parallel)."""
    return 0 if tp == 1 else 2 * s.num_layers + (2 if vocab_parallel else 0)


def tp_comm_bytes_per_token(s: Shapes, tp: int, act_bytes: float = 2.0, vocab_parallel: bool = True) -> float:
    """Bytes one GPU sends per token of a forward."""
    if tp == 1:
        return 0.0
    all_reduces = 2 * s.num_layers + (1 if vocab_parallel else 0)
    gather = (tp - 1) / tp * s.vocab_size * 4 if vocab_parallel else 0.0  # fp32 logits
    return all_reduces * 2 * (tp - 1) / tp * s.hidden_size * act_bytes + gather


def tp_decode_step(
    s: Shapes, dtype: str, kv_dtype: str, tp: int, batch: int, context: int, hw: Hardware, vocab_parallel=True
) -> dict:
    """Seconds of one decode step of `batch` sequences at `context` tokens on one TP group."""
    w = tp_weight_bytes_per_gpu(s, DTYPE_BYTES[dtype], tp, vocab_parallel)
    kv = tp_kv_bytes_per_token_per_gpu(s, kv_element_bytes(kv_dtype, s.head_dim), tp)
    t_mem = (w + batch * context * kv) / hw.bandwidth
    t_compute = batch * flops_per_token(s, context) / tp / hw.flops
    t_comm = batch * tp_comm_bytes_per_token(s, tp, hw.act_bytes, vocab_parallel) / hw.link_bandwidth
    t_comm += tp_collectives_per_forward(s, tp, vocab_parallel) * hw.link_latency
    return {"memory_s": t_mem, "compute_s": t_compute, "comm_s": t_comm, "step_s": max(t_mem, t_compute) + t_comm}


def tp_layouts(
    s: Shapes,
    dtype: str,
    kv_dtype: str,
    gpus: int,
    tps: list[int],
    batches: list[int],
    context: int,
    hw: Hardware,
    memory_per_gpu: float | None = None,
    vocab_parallel: bool = True,
) -> list[dict]:
    """For each total batch: every layout TP=t x DP=gpus/t (each replica decodes ceil(batch / replicas)
    sequences), its per-GPU bytes, TPOT and aggregate throughput; the fitting layout with the highest
    throughput wins (ties: lower TPOT)."""
    rows = []
    for batch in batches:
        cands = []
        for tp in tps:
            if gpus % tp:
                raise CalculatorError(f"TP={tp} does not divide {gpus} GPUs")
            replicas = gpus // tp
            per_replica = -(-batch // replicas)
            step = tp_decode_step(s, dtype, kv_dtype, tp, per_replica, context, hw, vocab_parallel)
            w = tp_weight_bytes_per_gpu(s, DTYPE_BYTES[dtype], tp, vocab_parallel)
            kv = per_replica * context * tp_kv_bytes_per_token_per_gpu(s, kv_element_bytes(kv_dtype, s.head_dim), tp)
            fits = memory_per_gpu is None or w + kv <= memory_per_gpu
            cands.append(
                {
                    "batch": batch,
                    "tp": tp,
                    "dp": replicas,
                    "weight_bytes_per_gpu": w,
                    "kv_bytes_per_gpu": kv,
                    "comm_bytes_per_token": tp_comm_bytes_per_token(s, tp, hw.act_bytes, vocab_parallel),
                    "fits": fits,
                    **step,
                    "tpot_s": step["step_s"],
                    "tokens_per_s": batch / step["step_s"],
                }
            )
        fitting = [c for c in cands if c["fits"]]
        best = min(fitting, key=lambda c: (-c["tokens_per_s"], c["tpot_s"])) if fitting else None
        for c in cands:
            c["wins"] = c is best
        rows += cands
    return rows


def winning_ranges(
    s: Shapes, dtype: str, kv_dtype: str, gpus: int, tps: list[int], max_batch: int, context: int, hw: Hardware,
    memory_per_gpu: float | None = None, vocab_parallel: bool = True,
) -> list[dict]:  # fmt: skip
    """Total batches 1 and every multiple of `gpus` up to max_batch (so every layout's replicas get equal
    shares; in between, rounding up to whole sequences per replica makes the winner flicker), grouped into
    runs won by the same layout: [{tp, from, to}] (tp None where no layout fits)."""
    runs: list[dict] = []
    for b in sorted({1, *range(gpus, max_batch + 1, gpus)}):
        rows = tp_layouts(s, dtype, kv_dtype, gpus, tps, [b], context, hw, memory_per_gpu, vocab_parallel)
        tp = next((r["tp"] for r in rows if r["wins"]), None)
        if runs and runs[-1]["tp"] == tp:
            runs[-1]["to"] = b
        else:
            runs.append({"tp": tp, "from": b, "to": b})
    return runs


def disaggregation(
    s: Shapes,
    dtype: str,
    kv_dtype: str,
    tp: int,
    batches: list[int],
    prompt: int,
    output: int,
    hw: Hardware,
    slo_tpot: float | None = None,
    vocab_parallel: bool = True,
) -> list[dict]:
    """Colocated vs prefill/decode-disaggregated serving on TP groups of `tp` GPUs, per decode batch b.

    Prefill of one prompt takes T_p (compute-bound); a decode step of b sequences T_d(b). In steady state
    b / output new requests enter per decode step. Colocated, their prefills run on the same GPUs between
    decode steps: TPOT = T_d(b) + (b / output) T_p. Disaggregated, prefill GPUs (a fraction
    b T_p / (output T_d(b)) of a decode group each) do it and ship the KV (prompt x KV bytes per token) over
    the link: TPOT = T_d(b), TTFT = T_p + transfer. Tokens per second per GPU are b / (tp (T_d + b T_p /
    output)) in both: disaggregation buys TPOT, not throughput, so it wins at the batches where the SLO
    leaves colocated serving behind."""
    t_prefill = prefill_flops(s, prompt) / tp / hw.flops
    t_prefill += prompt * tp_comm_bytes_per_token(s, tp, hw.act_bytes, vocab_parallel) / hw.link_bandwidth
    t_prefill += tp_collectives_per_forward(s, tp, vocab_parallel) * hw.link_latency
    kv_transfer = prompt * kv_bytes_per_token(s, kv_element_bytes(kv_dtype, s.head_dim)) / (tp * hw.link_bandwidth)

    def tpot(b: int) -> dict:
        t_decode = tp_decode_step(s, dtype, kv_dtype, tp, b, prompt + output, hw, vocab_parallel)["step_s"]
        colocated = t_decode + b / output * t_prefill
        return {"colocated": colocated, "disaggregated": t_decode, "per_gpu": b / (tp * colocated)}

    rows = []
    for b in batches:
        t = tpot(b)
        t_decode, colocated, per_gpu = t["disaggregated"], t["colocated"], t["per_gpu"]
        row = {
            "batch": b,
            "prefill_s": t_prefill,
            "decode_step_s": t_decode,
            "kv_transfer_s": kv_transfer,
            "colocated_tpot_s": colocated,
            "disaggregated_tpot_s": t_decode,
            "colocated_ttft_s": t_prefill,
            "disaggregated_ttft_s": t_prefill + kv_transfer,
            "prefill_gpus_per_decode_gpu": b * t_prefill / (output * t_decode),
            "tokens_per_s_per_gpu": per_gpu,
        }
        rows.append(row)
    if slo_tpot is not None:
        for mode in ("colocated", "disaggregated"):
            best = largest_batch(lambda b, m=mode: tpot(b)[m] <= slo_tpot)
            for row in rows:
                row[f"{mode}_meets_slo"] = tpot(row["batch"])[mode] <= slo_tpot
                row[f"{mode}_max_batch"] = best
                row[f"{mode}_max_batch_tokens_per_s_per_gpu"] = tpot(best)["per_gpu"] if best else 0.0
    return rows


def largest_batch(ok, limit: int = 1 << 20) -> int:
    """The largest b >= 1 with ok(b) for a predicate that holds up to some b and fails after (0 if none)."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:  # ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def render_parallel(
    layouts: list[dict], disagg: list[dict], gpus: int, slo_tpot: float | None, ranges: list[dict] | None = None
) -> str:
    lines = ["", f"tensor parallelism on {gpus} GPUs: TP=t x DP={gpus}/t replicas, total decode batch split evenly", ""]
    lines.append("| batch | TP x DP | weights/GPU | KV/GPU | sent/token/GPU | TPOT ms | tok/s | fits | wins |")
    lines.append("|---:|:---|---:|---:|---:|---:|---:|:---:|:---:|")
    for r in layouts:
        lines.append(
            f"| {r['batch']} | {r['tp']} x {r['dp']} | {fmt_bytes(r['weight_bytes_per_gpu'])} | "
            f"{fmt_bytes(r['kv_bytes_per_gpu'])} | {r['comm_bytes_per_token']:,.0f} B | {r['tpot_s'] * 1e3:,.2f} | "
            f"{r['tokens_per_s']:,.0f} | {'yes' if r['fits'] else 'no'} | {'**yes**' if r['wins'] else ''} |"
        )
    winners: dict[int, list[int]] = {}
    for r in layouts:
        if r["wins"]:
            winners.setdefault(r["tp"], []).append(r["batch"])
    lines.append("")
    lines += [f"TP={tp} wins at total batch {', '.join(map(str, bs))}" for tp, bs in sorted(winners.items())]
    for span in ranges or []:
        who = "no layout fits" if span["tp"] is None else f"TP={span['tp']} x DP={gpus // span['tp']} wins"
        lines.append(f"total batch {span['from']:,}-{span['to']:,}: {who}")
    if disagg:
        lines += ["", "prefill/decode disaggregation (per decode batch; tokens/s per GPU are equal, TPOT is not)", ""]
        lines.append(
            "| batch | colocated TPOT ms | disagg TPOT ms | TTFT ms (+KV transfer) | prefill GPUs per decode GPU "
            "| tok/s/GPU | SLO colocated / disagg |"
        )
        lines.append("|---:|---:|---:|---:|---:|---:|:---:|")
        for r in disagg:
            yes = {True: "yes", False: "no"}
            slo = "-" if slo_tpot is None else f"{yes[r['colocated_meets_slo']]} / {yes[r['disaggregated_meets_slo']]}"
            lines.append(
                f"| {r['batch']} | {r['colocated_tpot_s'] * 1e3:,.2f} | {r['disaggregated_tpot_s'] * 1e3:,.2f} | "
                f"{r['colocated_ttft_s'] * 1e3:,.1f} (+{r['kv_transfer_s'] * 1e3:,.2f}) | "
                f"{r['prefill_gpus_per_decode_gpu']:,.3f} | {r['tokens_per_s_per_gpu']:,.0f} | {slo} |"
            )
        if slo_tpot is not None:
            lines.append("")
            for mode in ("colocated", "disaggregated"):
                b = disagg[0][f"{mode}_max_batch"]
                per_gpu = disagg[0][f"{mode}_max_batch_tokens_per_s_per_gpu"]
                lines.append(
                    f"{mode}: largest decode batch within TPOT {slo_tpot * 1e3:g} ms = {b}"
                    + (f" ({per_gpu:,.0f} tok/s per GPU)" if b else "")
                )
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    """Both decimal and binary units, never mixed up: '1.07 GB (1.00 GiB)'."""
    for dec, binary, div_d, div_b in (("TB", "TiB", 1e12, 2**40), ("GB", "GiB", 1e9, 2**30), ("MB", "MiB", 1e6, 2**20)):
        if n >= div_d:
            return f"{n / div_d:.2f} {dec} ({n / div_b:.2f} {binary})"
    return f"{n / 1e3:.2f} kB ({n / 2**10:.2f} KiB)"


def fmt_flops(f: float) -> str:
    return f"{f / 1e12:,.1f} TFLOPS" if f >= 1e12 else f"{f / 1e9:,.1f} GFLOPS"


def render(r: Report) -> str:
    p = r.params
    q = r.quantization
    lines = [
        f"# {r.config}: weights {r.dtype}, KV cache {r.kv_dtype}"
        + (f", quantized {q['bits']}-bit group {q['group_size']} ({q['method']})" if q else ""),
        "",
        f"parameters           {r.params_total:,} (embedding {p['embedding']:,}, lm_head "
        f"{p['lm_head']:,}{' (tied, counted once)' if p['lm_head'] == 0 else ''}, attention {p['attention']:,}, "
        f"MLP {p['mlp']:,}, norms {p['norms']:,})",
        f"weight bytes         {r.weight_bytes_stored:,.0f} B = {fmt_bytes(r.weight_bytes_stored)} stored; "
        f"{fmt_bytes(r.weight_bytes_read_per_step)} read per decode step",
        f"KV per token         {r.kv_bytes_per_token:,.0f} B",
        f"KV per sequence      {r.kv_bytes_per_sequence:,.0f} B = {fmt_bytes(r.kv_bytes_per_sequence)} "
        f"at {r.context:,} tokens",
        f"KV x {r.concurrency:<15} {r.kv_bytes_for_concurrency:,.0f} B = {fmt_bytes(r.kv_bytes_for_concurrency)}; "
        f"weights + KV = {fmt_bytes(r.total_bytes_for_concurrency)}",
        f"decode roofline      {r.decode_tokens_per_s_batch1_empty:,.1f} tok/s at batch 1, empty context; "
        f"{r.decode_tokens_per_s_batch1:,.1f} tok/s at {r.context:,} tokens; "
        f"{r.decode_tokens_per_s_concurrency:,.1f} tok/s aggregate at concurrency {r.concurrency} "
        f"({r.decode_bound_concurrency}-bound) [bandwidth {r.bandwidth_bytes_per_s / 1e9:,.0f} GB/s, "
        f"{fmt_flops(r.flops_per_s)}]",
        f"prefill compute      {r.prefill_flops:,.3e} FLOPs for {r.context:,} tokens = "
        f"{r.prefill_seconds * 1e3:,.1f} ms at {fmt_flops(r.flops_per_s)} (compute-bound lower bound)",
    ]
    if r.memory_budget_bytes is not None:
        lines.append(
            f"memory budget        {fmt_bytes(r.memory_budget_bytes)}: largest batch of {r.context:,}-token "
            f"sequences = {r.max_batch_for_budget}"
        )
    lines += ["", "capacity worksheet (weights + KV; decode tok/s is the aggregate roofline)", ""]
    lines.append("| context | concurrency | KV | weights + KV | fits | decode tok/s | bound |")
    lines.append("|---:|---:|---:|---:|:---:|---:|:---|")
    for row in r.worksheet:
        fits = "-" if row["fits"] is None else ("yes" if row["fits"] else "no")
        lines.append(
            f"| {row['context']:,} | {row['concurrency']} | {fmt_bytes(row['kv_bytes'])} | "
            f"{fmt_bytes(row['total_bytes'])} | {fits} | {row['decode_tokens_per_s']:,.1f} | {row['bound']} |"
        )
    return "\n".join(lines)


# Measured device profiles (docs/methodology.md, machine numbers): the defaults of --bandwidth / --flops.
# cpu: this project's 2-core Zen 4 machine, streaming read and matmul rate by weight dtype.
# h200: one H200, copy bandwidth and bf16 matmul as measured with qspec's runtime.
DEVICE_PROFILES = {
    "cpu": {"bandwidth": 31e9, "flops": {"fp32": 87e9, "bf16": 189e9, "int8": 325e9}, "default_flops": 189e9},
    "h200": {"bandwidth": 4.2e12, "flops": {"fp32": 60e12, "bf16": 790e12}, "default_flops": 790e12},
}


DEVICE_PROFILE_NOTES = {
    "cpu": "31 GB/s, 87 GFLOP/s fp32 / 189 bf16 / 325 int8, a 2-core Zen 4 as measured here",
    "h200": "4.2 TB/s, 790 TFLOP/s bf16, one H200 as measured with qspec",
}


def default_device() -> str:
    """h200 where an NVIDIA GPU is present (without importing torch), else cpu."""
    return "h200" if Path("/dev/nvidiactl").exists() else "cpu"


def profile_rates(device: str, dtype: str) -> tuple[float, float]:
    prof = DEVICE_PROFILES[device]
    return prof["bandwidth"], prof["flops"].get(dtype, prof["default_flops"])


def read_config(path: str) -> tuple[dict, str]:

    if path in REGISTRY:  # a registry name: its converted checkpoint under $QSPEC_HOME (converted once)
        path = str(resolve(path))
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise CalculatorError(f"config not found: {p}")
    try:
        return json.loads(p.read_text()), p.parent.name if p.name == "config.json" else p.stem
    except json.JSONDecodeError as err:
        raise CalculatorError(f"{p} is not valid JSON: {err}") from err


def int_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * mult))
    return out


def parse_args(argv: list[str] | None):
    ap = ArgumentParser(
        prog="python -m evals.speed.calculator",
        description="Parameters, weight/KV bytes, decode roofline, prefill time and a capacity worksheet "
        "from a config.json (exact arithmetic; GB = 1e9 B and GiB = 2^30 B kept apart).",
    )
    ap.add_argument(
        "--config", required=True, help="an HF config.json, a directory holding one, or a registry name (smollm2-135m)"
    )
    ap.add_argument("--dtype", default="bf16", help=f"weight dtype: {', '.join(sorted(DTYPE_BYTES))}")
    ap.add_argument(
        "--kv-dtype", default=None, help="KV cache dtype (default: --dtype); int8, fp8_e4m3, int4 count their scales"
    )
    ap.add_argument("--context", type=int, default=4096, help="tokens per sequence (default 4096)")
    ap.add_argument("--concurrency", type=int, default=1, help="sequences decoding together (default 1)")
    ap.add_argument(
        "--device",
        choices=sorted(DEVICE_PROFILES),
        default=None,
        help="measured bandwidth/FLOPs profile (default: h200 where an NVIDIA GPU is present, else cpu)",
    )
    ap.add_argument("--bandwidth", default=None, help="memory bandwidth, e.g. 1000GB/s, 31GB/s (default: --device's)")
    ap.add_argument("--flops", default=None, help="compute rate, e.g. 100TFLOPS, 189GFLOPS (default: --device's)")
    ap.add_argument("--memory", default=None, help="memory budget for capacity, e.g. 80GB or 24GiB")
    ap.add_argument("--contexts", default=None, help="worksheet contexts, e.g. 1k,4k,8k,32k")
    ap.add_argument("--concurrencies", default=None, help="worksheet concurrencies, e.g. 1,4,16,64")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    par = ap.add_argument_group("tensor parallelism and disaggregation (shown when --tp is given)")
    par.add_argument("--tp", default=None, help="tensor-parallel sizes to compare, e.g. 1,2,4,8")
    par.add_argument("--gpus", type=int, default=8, help="GPUs shared by TP x DP layouts (default 8)")
    par.add_argument("--batches", default="1,4,16,64,256", help="total decode batches (default 1,4,16,64,256)")
    par.add_argument("--max-batch", type=int, default=2048, help="scan batches 1..N for the winning layouts")
    par.add_argument("--link-bandwidth", default="450GB/s", help="per-GPU interconnect, each way (NVLink ~450GB/s)")
    par.add_argument("--link-latency-us", type=float, default=5.0, help="latency per collective (default 5 us)")
    par.add_argument("--lm-head", choices=["vocab-parallel", "replicated"], default="vocab-parallel")
    par.add_argument("--prompt-tokens", type=int, default=1024, help="disaggregation: prompt length")
    par.add_argument("--output-tokens", type=int, default=256, help="disaggregation: output length")
    par.add_argument("--disagg-tp", type=int, default=1, help="disaggregation: TP size of each instance")
    par.add_argument("--slo-tpot-ms", type=float, default=None, help="disaggregation: TPOT SLO")
    return ap.parse_args(argv)


def reports(args, device: str) -> tuple[Report, dict | None]:
    """The single-device report and, with --tp, the parallel one (CalculatorError / ValueError on bad input)."""
    bandwidth, flops = profile_rates(device, args.dtype)
    hf, name = read_config(args.config)
    if args.bandwidth is not None:
        bandwidth = parse_quantity(args.bandwidth, "B/s")
    if args.flops is not None:
        flops = parse_quantity(args.flops, "FLOPS")
    report = calculate(
        hf,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        context=args.context,
        concurrency=args.concurrency,
        bandwidth=bandwidth,
        flops=flops,
        memory_budget=None if args.memory is None else parse_quantity(args.memory, "B"),
        contexts=int_list(args.contexts) if args.contexts else None,
        concurrencies=int_list(args.concurrencies) if args.concurrencies else None,
        name=name,
    )
    parallel = parallel_report(hf, args, report.memory_budget_bytes, bandwidth, flops) if args.tp else None
    return report, parallel


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device or default_device()
    try:
        report, parallel = reports(args, device)
    except (CalculatorError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.json:
        print(json.dumps({**asdict(report), "device_profile": device, **(parallel or {})}, indent=2))
        return
    print(render(report))
    if parallel:
        print(
            render_parallel(
                parallel["tp_layouts"], parallel["disaggregation"], args.gpus, parallel["slo_tpot_s"],
                parallel["tp_winning_ranges"],
            )
        )  # fmt: skip
    if args.bandwidth is None or args.flops is None:
        print(f"[device profile {device}: {DEVICE_PROFILE_NOTES[device]}; --device / --bandwidth / --flops change it]")


def parallel_report(hf: dict, args, memory_per_gpu: float | None, bandwidth: float, flops: float) -> dict:
    if hf.get("quantization_config"):
        raise CalculatorError("the TP section counts unquantized weights; drop quantization_config")
    for name in ("gpus", "prompt_tokens", "output_tokens", "disagg_tp", "max_batch"):
        if getattr(args, name) < 1:
            raise CalculatorError(f"--{name.replace('_', '-')} must be >= 1")
    s = Shapes.from_hf(hf)
    hw = Hardware(
        bandwidth=bandwidth,
        flops=flops,
        link_bandwidth=parse_quantity(args.link_bandwidth, "B/s"),
        link_latency=args.link_latency_us * 1e-6,
        act_bytes=min(DTYPE_BYTES[args.dtype], 2.0),
    )
    kv_dtype = args.kv_dtype or args.dtype
    vocab_parallel = args.lm_head == "vocab-parallel"
    batches = int_list(args.batches)
    slo = None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3
    layouts = tp_layouts(
        s, args.dtype, kv_dtype, args.gpus, int_list(args.tp), batches, args.context, hw, memory_per_gpu, vocab_parallel
    )
    disagg = disaggregation(
        s, args.dtype, kv_dtype, args.disagg_tp, batches, args.prompt_tokens, args.output_tokens, hw, slo,
        vocab_parallel,
    )  # fmt: skip
    ranges = winning_ranges(
        s, args.dtype, kv_dtype, args.gpus, int_list(args.tp), args.max_batch, args.context, hw, memory_per_gpu,
        vocab_parallel,
    )  # fmt: skip
    return {"hardware": asdict(hw), "tp_layouts": layouts, "tp_winning_ranges": ranges, "disaggregation": disagg,
            "slo_tpot_s": slo}  # fmt: skip


if __name__ == "__main__":
    run(main)
