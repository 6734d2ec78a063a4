"""Back-of-envelope serving arithmetic from a config.json: parameters, weight and KV bytes, rooflines, capacity.

Everything is exact integer arithmetic on the config's shapes (no measurement). Conventions:
- parameters count tied embeddings once (the lm_head shares the embedding matrix);
- KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element;
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

DTYPE_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0}
DTYPE_BYTES.update({"fp8": 1.0, "int8": 1.0, "int4": 0.5})

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
    for label, value in (("dtype", dtype), ("kv dtype", kv_dtype or dtype)):
        if value not in DTYPE_BYTES:
            raise CalculatorError(f"unknown {label} {value!r}; choose from {sorted(DTYPE_BYTES)}")
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
    kv_pt = kv_bytes_per_token(s, DTYPE_BYTES[kv_dtype])
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


# Measured device profiles (DESIGN.md "Numbers of these machines"): the defaults of --bandwidth / --flops.
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
    from runtime.loader import REGISTRY, resolve

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


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(
        prog="python -m evals.calculator",
        description="Parameters, weight/KV bytes, decode roofline, prefill time and a capacity worksheet "
        "from a config.json (exact arithmetic; GB = 1e9 B and GiB = 2^30 B kept apart).",
    )
    ap.add_argument(
        "--config", required=True, help="an HF config.json, a directory holding one, or a registry name (smollm2-135m)"
    )
    ap.add_argument("--dtype", default="bf16", help=f"weight dtype: {', '.join(sorted(DTYPE_BYTES))}")
    ap.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
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
    args = ap.parse_args(argv)
    device = args.device or default_device()
    bandwidth, flops = profile_rates(device, args.dtype)
    try:
        hf, name = read_config(args.config)
        report = calculate(
            hf,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            context=args.context,
            concurrency=args.concurrency,
            bandwidth=bandwidth if args.bandwidth is None else parse_quantity(args.bandwidth, "B/s"),
            flops=flops if args.flops is None else parse_quantity(args.flops, "FLOPS"),
            memory_budget=None if args.memory is None else parse_quantity(args.memory, "B"),
            contexts=int_list(args.contexts) if args.contexts else None,
            concurrencies=int_list(args.concurrencies) if args.concurrencies else None,
            name=name,
        )
    except (CalculatorError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.json:
        print(json.dumps({**asdict(report), "device_profile": device}, indent=2))
        return
    print(render(report))
    if args.bandwidth is None or args.flops is None:
        print(f"[device profile {device}: {DEVICE_PROFILE_NOTES[device]}; --device / --bandwidth / --flops change it]")


if __name__ == "__main__":
    run(main)
