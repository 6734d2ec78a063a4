"""Speedup of speculative decoding per hardware: measured acceptance x a hardware cost profile.

    speedup = tokens_per_step x (c(1) + o_plain) / (draft_cost + E[c(T)] + o_spec)

c(T): seconds of one target forward over T new tokens per row (c(1) is one plain decode step); T per step
is the histogram of tokens each verify step fed the target (``fed_tokens_hist`` of ``evals.speculation.specbench``:
k + 1 for a chain, the tree size for a tree), so E[c(T)] = sum_T n_T c(T) / sum_T n_T. tokens_per_step and
the T histogram are hardware-independent (measured on the suite); c and draft_cost come from a profile:

- ``measured``: this machine's curve, from ``python -m evals.speculation.spec_cost measure`` (c(T) for T = 1..32 at a
  fixed context, and each draft method's propose() call; ``--tree-Ts``: a second curve for steps that verify a T-node
  candidate tree, which Medusa and EAGLE rows use: on this CPU trees run eager under a tree mask), a JSON file.
  By default (``--timing loop``) c(T) is a step of the real loops (c(1) a plain decoding step, c(T) a
  speculative step feeding T tokens), so their host work is in the curve and o_plain = o_spec = 0;
  ``--timing forward`` times bare forwards and the overheads apart;
- ``roofline``: a named GPU (``h200``: 4.2 TB/s measured copy bandwidth of the 4.8 nominal, 990 TFLOP/s bf16
  dense, a per-forward + per-layer launch overhead) and the model's shapes: c(T) = max(bytes / BW,
  FLOPs / peak) + overhead; ``h200-eager`` uses the launch overhead measured with eager PyTorch
  (docs/methodology.md, machine numbers: ~13 ms per SmolLM2 step, ~0.43 ms per layer);
- ``gpu_check``: a measured GPU curve, the JSON record of ``evals.speed.gpu_check`` (issue 13). Read fields (to be
  agreed with that record): ``verify_curve_s`` {T: seconds} or ``verify_curve_ms`` {T: ms} (T = new tokens
  per row, batch 1, the record's context), optional ``draft_s`` {method label: seconds per propose()} and
  ``device``, ``batch`` (default 1). Anything else is ignored; a record without a curve is an error.

o_plain and o_spec: the host work each loop adds per step beyond its target forward and propose() (sampling,
acceptance, cache bookkeeping, stop checks). ``measure --timing forward`` times both loops for real (plain
decoding, and a speculative loop whose drafts are fixed at k random tokens, so every step feeds T = k + 1) and
subtracts the forward; on this CPU o_spec was ~6 ms, a fifth of c(1), which a forward-only model misses.
Roofline profiles assume 0 (captured steps); a gpu_check record may carry ``decode_overhead_s`` / ``step_overhead_s``.

A step that offered no drafts (an n-gram step without a match: T = 1) costs what the speculative loop's step costs,
not a plain step: ``measure --timing loop`` times it apart (``empty_step_s``); without it such a step is priced
at c(1) + o_spec.

Between measured T the curve is interpolated linearly, beyond the last point extrapolated from the last two.
The prediction is of the decode phase (after the first token), so ``predict`` checks it against the suite's
``decode_speedup_vs_plain``: the prefill is the same for every method (a draft model adds its own) and is no
term of this model.

    python -m evals.speculation.spec_cost measure --out results/cpu_profile.json        # this machine's curve (quiet!)
    python -m evals.speculation.spec_cost predict --suite results/specbench.json --profile results/cpu_profile.json
    python -m evals.speculation.spec_cost predict --suite results/specbench.json --profile h200
    python -m evals.speculation.spec_cost choose-k --suite results/specbench.json --profile results/cpu_profile.json

``choose-k`` cuts each chain speculator of a suite to k = 1 .. the k it ran with: a step's first k drafts are
verified as they were, so the suite's acceptance by position gives the tokens per step at every smaller k, and the
profile's c(T) prices each: where verifying many rows is dear (a compute-bound CPU) the best k is small.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from evals.speculation.specbench_suite import TimedSpeculator, plain_decode
from runtime.kv_cache import KVCache
from runtime.model import prefill_meta
from runtime.sampling import SamplingParams
from runtime.speculation import CandidateTree
from speculate.base import Proposal, SpecState, Speculator, SpeculatorError, check_k
from speculate.generate import chain_metadata, speculative_generate
from speculate.lookup_first import LookupFirstSpeculator
from speculate.registry import BuildContext, build, check_method


class CostError(ValueError):
    pass


@dataclass
class Profile:
    name: str
    kind: str  # "measured" | "roofline" | "gpu_check"
    verify_s: dict[int, float]  # T -> seconds of one target forward over T new tokens per row
    draft_s: dict[str, float] = field(default_factory=dict)  # method label -> seconds per propose() call
    notes: str = ""
    batch: int = 1  # rows per forward the curve was measured at: predictions are for suite rows of this batch
    decode_overhead_s: float = 0.0  # o_plain: a plain decode step's host work beyond c(1)
    step_overhead_s: float = 0.0  # o_spec: a speculative step's host work beyond its forward and propose()
    # T -> seconds of a speculative step that verifies a T-node candidate tree (tree attention mask; the CPU
    # loop runs trees eager where chains use the compiled step); empty: trees cost what chains do (roofline)
    tree_verify_s: dict[int, float] = field(default_factory=dict)
    # seconds of a speculative step that offered no drafts (T = 1: an n-gram step without a match), measured in the
    # real loop: it runs the speculative loop's step, not the plain one; None: c(1) + o_spec
    empty_step_s: float | None = None
    # method label -> tokens drafted per propose() in the run that timed draft_s (measured in the loop): a draft
    # model's propose() runs one forward per drafted token, so a suite row is priced per token it drafted (a
    # dynamic k drafts as many as its confidence allows, on the curve's context and on the suite's alike)
    draft_tokens: dict[str, float] = field(default_factory=dict)
    # method label -> its proposals by source per propose() in the run that timed it (a composite speculator: prompt
    # lookup first, a draft model otherwise); the label + MODEL_PART entry times the draft model alone, so a suite
    # row is priced by its own mix of lookups and drafted tokens (composite_draft_seconds)
    draft_sources: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.verify_s or 1 not in self.verify_s:
            raise CostError(f"profile {self.name!r} needs the cost of a one-token forward (T = 1)")
        for curve in (self.verify_s, self.tree_verify_s):
            if any(t < 1 or s <= 0 for t, s in curve.items()):
                raise CostError(f"profile {self.name!r}: every T must be >= 1 and every cost > 0")
        if self.empty_step_s is not None and self.empty_step_s <= 0:
            raise CostError(f"profile {self.name!r}: the empty step's cost must be > 0")

    def verify(self, T: float, tree: bool = False) -> float:
        """c(T) of a chain (or, with ``tree`` and a tree curve, of a T-node tree): linear between measured points,
        beyond the last one extended along the last two's slope, never below the last point (measured curves
        are noisy: a falling last segment would extrapolate to nothing)."""
        pts = sorted((self.tree_verify_s if tree and self.tree_verify_s else self.verify_s).items())
        if T <= pts[0][0]:
            return pts[0][1]
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if T <= t1:
                return c0 + (c1 - c0) * (T - t0) / (t1 - t0)
        if len(pts) == 1:
            return pts[0][1]
        (t0, c0), (t1, c1) = pts[-2], pts[-1]
        return c1 + max(c1 - c0, 0.0) * (T - t1) / (t1 - t0)

    def step(self, T: int, tree: bool = False) -> float:
        """A speculative step's target cost and loop work beyond propose(), for a step that fed T tokens."""
        if T == 1 and not tree and self.empty_step_s is not None:
            return self.empty_step_s
        return self.verify(T, tree) + self.step_overhead_s


def predict_speedup(
    tokens_per_step: float, fed_hist: dict, draft_s: float, profile: Profile, tree: bool = False
) -> float:
    """tokens_per_step x (c(1) + o_plain) / (draft_s + E[c(T)] + o_spec), T distributed as fed_hist {T: steps};
    tree: the steps verify candidate trees (the profile's tree curve where it has one); a step that fed 1 token
    (no drafts offered) costs the profile's empty speculative step where it measured one."""
    steps = sum(fed_hist.values())
    if steps <= 0:
        raise CostError("the fed-token histogram is empty (no speculative steps)")
    mean_step = sum(n * profile.step(int(t), tree) for t, n in fed_hist.items()) / steps
    plain_step = profile.verify(1) + profile.decode_overhead_s
    return tokens_per_step * plain_step / (draft_s + mean_step)


# ---- roofline profiles ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth: float  # bytes/s sustained
    flops: float  # FLOP/s, bf16 dense
    per_forward_s: float  # launch/host overhead per forward
    per_layer_s: float  # and per decoder layer


GPUS = {
    # CUDA graphs / compiled step: a few launches per layer
    "h200": GPU("h200", bandwidth=4.2e12, flops=990e12, per_forward_s=30e-6, per_layer_s=8e-6),
    # eager PyTorch: launch-bound (13 ms per SmolLM2 step measured, docs/methodology.md) ~ 0.43 ms per layer
    "h200-eager": GPU("h200-eager", bandwidth=4.2e12, flops=990e12, per_forward_s=0.1e-3, per_layer_s=0.43e-3),
}


@dataclass(frozen=True)
class Shapes:
    """What a forward reads and computes (from a ModelConfig)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, cfg) -> Shapes:
        return cls(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.vocab_size,
        )

    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate


def forward_time(
    gpu: GPU,
    s: Shapes,
    T: int,
    context: int,
    layers: int | None = None,
    bytes_per_weight: float = 2.0,
    head_rows: int | None = None,
    batch: int = 1,
) -> float:
    """One forward over T new tokens per row (batch rows, ``context`` cached) of ``layers`` decoder layers and
    the lm_head: max(bytes / bandwidth, FLOPs / peak) + overhead. head_rows: rows through the lm_head
    (default T x batch)."""
    n = s.layers if layers is None else layers
    rows = T * batch
    head_rows = rows if head_rows is None else head_rows
    weight_bytes = n * s.layer_params() * bytes_per_weight + s.vocab * s.hidden * 2.0  # lm_head kept 16-bit
    kv_bytes = 2 * n * s.kv_heads * s.head_dim * (context + T) * batch * 2.0
    flops = 2 * n * s.layer_params() * rows + 4 * n * s.heads * s.head_dim * (context + T) * rows
    flops += 2 * s.vocab * s.hidden * head_rows
    return max((weight_bytes + kv_bytes) / gpu.bandwidth, flops / gpu.flops) + gpu.per_forward_s + gpu.per_layer_s * n


def draft_time(gpu: GPU, s: Shapes, method: dict, context: int) -> float | None:
    """Seconds of one propose() under the roofline, from the suite's speculator description."""
    name = method.get("name", "")
    if name.startswith("ngram"):
        return None  # host-side lookup: the same host work on any device, so the suite's measured seconds
    if "draft" in name.partition("(")[0]:  # draft(...) and quant-draft(...): a draft model's forwards
        k = int(method.get("k", 1))
        layers = int(method.get("draft_layers", s.layers))
        bits = 4.0 if "int4" in name else 8.0 if "int8" in name else 16.0
        bpw = bits / 8 + (2.0 / 128 if bits == 4 else 0.0)  # int4: a 16-bit scale per group of 128
        return forward_time(gpu, s, 2, context, layers, bpw) + (k - 1) * forward_time(gpu, s, 1, context, layers, bpw)
    if name == "medusa":
        heads = int(method.get("num_heads", 3))
        byte = 2.0 * (heads * s.hidden * s.hidden + s.vocab * s.hidden)
        flops = 2.0 * heads * (s.hidden * s.hidden + s.vocab * s.hidden)
        return max(byte / gpu.bandwidth, flops / gpu.flops) + gpu.per_forward_s + gpu.per_layer_s * heads
    if name == "eagle":
        depth, frontier = int(method.get("depth", 4)), int(method.get("frontier", 4))
        one = forward_time(gpu, s, depth, 0, 1, 2.0, head_rows=frontier, batch=frontier)
        fc = 2.0 * 2 * s.hidden * s.hidden / gpu.bandwidth
        return depth * (one + fc)
    raise CostError(f"no roofline draft cost for method {name!r}")


def roofline_profile(gpu_name: str, cfg, context: int = 512, max_T: int = 128) -> Profile:
    if gpu_name not in GPUS:
        raise CostError(f"unknown GPU profile {gpu_name!r}; known: {', '.join(GPUS)}")
    gpu, s = GPUS[gpu_name], Shapes.of(cfg)
    curve = {T: forward_time(gpu, s, T, context) for T in range(1, max_T + 1)}
    return Profile(gpu_name, "roofline", curve, notes=f"{gpu}, context {context}, bf16 weights")


# ---- loading profiles ----------------------------------------------------------------------------------


def load_profile(spec: str, cfg=None, context: int = 512) -> Profile:
    """A GPU name (roofline; needs cfg), or a JSON file: a measured profile (``kind`` measured), a specbench record
    holding one (``cost_profile``) or a gpu_check record (``verify_curve_s`` / ``verify_curve_ms``)."""
    if spec in GPUS:
        if cfg is None:
            raise CostError("a roofline profile needs the model's config")
        return roofline_profile(spec, cfg, context)
    path = Path(spec)
    if not path.is_file():
        raise CostError(f"--profile {spec!r} is neither a GPU name ({', '.join(GPUS)}) nor a JSON file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CostError(f"{path} is not JSON: {err}") from err
    raw = raw.get("cost_profile", raw)  # a specbench record that measured its own curve (--cost-Ts)
    if raw.get("kind") == "measured":
        return Profile(
            raw.get("name", path.stem),
            "measured",
            {int(t): float(c) for t, c in raw["verify_s"].items()},
            {k: float(v) for k, v in raw.get("draft_s", {}).items()},
            raw.get("notes", ""),
            int(raw.get("batch", 1)),
            float(raw.get("decode_overhead_s", 0.0)),
            float(raw.get("step_overhead_s", 0.0)),
            {int(t): float(c) for t, c in raw.get("tree_verify_s", {}).items()},
            raw.get("empty_step_s"),
            {k: float(v) for k, v in raw.get("draft_tokens", {}).items()},
            {k: {n: float(c) for n, c in v.items()} for k, v in raw.get("draft_sources", {}).items()},
        )
    if "verify_curve_s" in raw or "verify_curve_ms" in raw:
        scale, curve = (1.0, raw["verify_curve_s"]) if "verify_curve_s" in raw else (1e-3, raw["verify_curve_ms"])
        return Profile(
            raw.get("device", path.stem),
            "gpu_check",
            {int(t): float(c) * scale for t, c in curve.items()},
            {k: float(v) for k, v in raw.get("draft_s", {}).items()},
            batch=int(raw.get("batch", 1)),
            decode_overhead_s=float(raw.get("decode_overhead_s", 0.0)),
            step_overhead_s=float(raw.get("step_overhead_s", 0.0)),
        )
    raise CostError(f"{path} holds no cost curve (expected kind=measured, verify_curve_s or verify_curve_ms)")


# ---- predicting a suite --------------------------------------------------------------------------------


def predict_suite(
    suite: dict, profile: Profile, cfg=None, context: int = 512, draft_from_suite: bool = False
) -> list[dict]:
    """One row per (batch, category, method) of an evals.speculation.specbench record: measured and predicted speedup.

    Draft cost: the profile's draft_s[method] when it has one, the roofline's when the profile is one, else
    (or with draft_from_suite) the suite's own measured draft seconds per step."""
    describe = suite.get("speculators", {})
    rows = []
    for r in suite["rows"]:
        if r["method"] == "plain" or "fed_tokens_hist" not in r or r["batch"] != profile.batch:
            continue
        method = r["method"]
        draft = step_draft_seconds(r, describe, profile, cfg, context, draft_from_suite)
        tree = "tree_size" in describe.get(method, {})  # Medusa / EAGLE: every step verifies a candidate tree
        pred = predict_speedup(r["tokens_per_step"], r["fed_tokens_hist"], draft, profile, tree)
        measured = measured_speedup(r)
        rows.append(
            {
                "batch": r["batch"],
                "category": r["category"],
                "method": method,
                "profile": profile.name,
                "tokens_per_step": r["tokens_per_step"],
                "mean_fed_tokens": r.get("mean_fed_tokens"),
                "draft_s": draft,
                "predicted_speedup": round(pred, 4),
                "measured_speedup": measured if profile.kind == "measured" else None,
                "error": round(pred / measured - 1, 4) if measured and profile.kind == "measured" else None,
            }
        )
    return rows


def measured_speedup(row: dict) -> float | None:
    """The decode phase's speedup: what the model predicts (the prefill is no speculation cost); older records:
    end to end."""
    return row.get("decode_speedup_vs_plain", row.get("speedup_vs_plain"))


def step_draft_seconds(
    row: dict, describe: dict, profile: Profile, cfg=None, context: int = 512, from_suite: bool = False
) -> float:
    """A suite row's propose() seconds per step: the profile's (profile_draft_seconds) where it knows the method
    and from_suite is off, else the suite's own measurement."""
    seconds = None if from_suite else profile_draft_seconds(row, describe, profile, cfg, context)
    return row["draft_s_per_step"] if seconds is None else seconds


def profile_draft_seconds(row: dict, describe: dict, profile: Profile, cfg=None, context: int = 512) -> float | None:
    """A suite row's propose() seconds per step from the profile. A draft model the profile timed: its seconds per
    drafted token (per call / the tokens it drafted per call there) times the tokens this row drafted per step
    (mean fed tokens - 1); for this very method only where the profile counted its drafted tokens (else its
    seconds per call), for the same draft under another k or confidence rule with k drafts per call where it did
    not. Another method the profile timed: its seconds per call; a GPU profile: the roofline's; None when the
    profile does not know the method (the suite's own measurement is used)."""
    method, drafted = row["method"], (row.get("mean_fed_tokens") or 0) - 1
    composite = composite_draft_seconds(row, profile)
    if composite is not None:
        return composite
    if method in profile.draft_s:
        seconds, per_call = profile.draft_s[method], profile.draft_tokens.get(method)
        return seconds / per_call * drafted if per_call and drafted > 0 and same_draft(method, method) else seconds
    if profile.kind == "roofline":
        return draft_time(GPUS[profile.name], Shapes.of(cfg), describe.get(method, {"name": method}), context)
    for other, seconds in profile.draft_s.items():
        k = same_draft(method, other)
        if k and drafted > 0:
            return seconds / profile.draft_tokens.get(other, k) * drafted
    return None


def composite_draft_seconds(row: dict, profile: Profile) -> float | None:
    """A composite row's propose() seconds per step (prompt lookup first, a draft model otherwise), priced by its own
    mix: the tokens the draft model drafted at the model's price per drafted token (the profile's MODEL_PART run)
    and each lookup at what the curve's composite run spent beyond its model tokens per lookup (the lookup and the
    draft's catch-up on the tokens it skipped). The curve's random context is answered by lookup far more often
    than prompts are (1.5 against 4.2 tokens drafted a step on the six categories), so one price per drafted
    token undercharged the suite's model drafts 2x. None when the row or the profile lacks the counts."""
    method, sources = row["method"], row.get("draft_sources")
    model, curve = method + MODEL_PART, profile.draft_sources.get(method)
    if not sources or not curve or model not in profile.draft_s or not profile.draft_tokens.get(model):
        return None
    per_token = profile.draft_s[model] / profile.draft_tokens[model]
    lookups = curve.get("lookup_rows", 0.0)
    beyond_model = max(profile.draft_s[method] - curve.get("model_drafted", 0.0) * per_token, 0.0)
    per_lookup = beyond_model / lookups if lookups else 0.0
    steps = max(row.get("steps") or 1, 1)
    return (sources.get("lookup_rows", 0) * per_lookup + sources.get("model_drafted", 0) * per_token) / steps


def same_draft(method: str, other: str) -> int | None:
    """other's k when both name the same draft (model, layers, bits) and differ only in k or the confidence rule."""
    try:
        a, b = check_method(method), check_method(other)
    except SpeculatorError:
        return None
    loose = ("k", "conf")
    model_a = {x: v for x, v in a.options.items() if x not in loose}  # what names the draft (model, layers, bits)
    model_b = {x: v for x, v in b.options.items() if x not in loose}
    same = a.name == b.name and model_a and model_a == model_b
    return int(b.options.get("k", 0)) or None if same else None


def draft_label(describe: dict) -> str | None:
    """'draft(layers:8)' / 'quant-draft(int4+layers:15)' -> the --draft-model spec ('layers:8', 'int4+layers:15')."""
    name = describe.get("name", "")
    for prefix in ("draft(", "quant-draft("):
        if name.startswith(prefix) and name.endswith(")"):
            return name[len(prefix) : -1]
    return None


def choose_draft(suite: dict, profile: Profile, cfg=None, context: int = 512, batch: int = 1) -> tuple[dict, list]:
    """The draft-model method with the best predicted speedup (measured acceptance per cost) on the suite
    overall at ``batch``: (choice {draft, k, method, predicted_speedup}, every candidate's row)."""
    describe = suite.get("speculators", {})
    rows = [
        r
        for r in predict_suite(suite, profile, cfg, context)
        if r["category"] == "overall" and r["batch"] == batch and draft_label(describe.get(r["method"], {}))
    ]
    if not rows:
        raise CostError(f"the suite has no draft-model method measured overall at batch {batch}")
    best = max(rows, key=lambda r: r["predicted_speedup"])
    d = describe[best["method"]]
    choice = {
        "draft": draft_label(d),
        "k": d.get("k"),
        "method": best["method"],
        "predicted_speedup": best["predicted_speedup"],
        "profile": profile.name,
    }
    return choice, rows


def truncated_to_k(row: dict, k: int) -> tuple[float, dict[int, int]]:
    """(tokens per step, fed-token histogram) a suite row would have had with at most k drafts a step: each
    step's first k drafts are verified exactly as they were (acceptance at depth j depends only on drafts 0..j),
    so accepted_at[j] = per_position_acceptance[j] x (steps offering > j drafts) for j < k, and a step that fed T
    tokens feeds min(T, k + 1). A row of batch 1 or of several (rows are counted per row-step)."""
    hist = {int(t): n for t, n in row["fed_tokens_hist"].items()}
    steps = sum(hist.values())
    if steps <= 0:
        raise CostError(f"{row['method']}: the fed-token histogram is empty (no speculative steps)")
    rates = row.get("per_position_acceptance") or []
    accepted = sum(rates[j] * sum(n for t, n in hist.items() if t - 1 > j) for j in range(min(k, len(rates))))
    fed: dict[int, int] = {}
    for t, n in hist.items():
        fed[min(t, k + 1)] = fed.get(min(t, k + 1), 0) + n
    return 1.0 + accepted / steps, fed


def speedup_by_k(row: dict, draft_s_per_token: float, profile: Profile, ks: list[int]) -> list[dict]:
    """Predicted speedup of a suite row's speculator cut to each k in ks (draft cost: seconds per drafted token x
    the drafts a step makes): the measured acceptance by position against this machine's c(T)."""
    out = []
    for k in ks:
        tokens, fed = truncated_to_k(row, k)
        drafted = sum((t - 1) * n for t, n in fed.items()) / sum(fed.values())
        pred = predict_speedup(tokens, fed, draft_s_per_token * drafted, profile)
        out.append({"k": k, "tokens_per_step": round(tokens, 4), "drafts_per_step": round(drafted, 4),
                    "predicted_speedup": round(pred, 4)})  # fmt: skip
    return out


def choose_k(suite: dict, profile: Profile, cfg=None, context: int = 512, category: str = "overall") -> list[dict]:
    """For each chain speculator measured in the suite (``category``, the profile's batch): the predicted speedup
    at every k up to the one it ran with, and the best k. Trees (Medusa, EAGLE) are sized by their tree, not k."""
    describe = suite.get("speculators", {})
    out = []
    for r in suite["rows"]:
        if r["method"] == "plain" or r["category"] != category or r["batch"] != profile.batch:
            continue
        if "tree_size" in describe.get(r["method"], {}) or "fed_tokens_hist" not in r:
            continue
        k_max = max(int(t) for t in r["fed_tokens_hist"]) - 1
        drafts_per_step = max(r.get("mean_fed_tokens", 1.0) - 1.0, 1e-9)
        per_token = step_draft_seconds(r, describe, profile, cfg, context) / drafts_per_step
        curve = speedup_by_k(r, per_token, profile, list(range(1, k_max + 1)))
        best = max(curve, key=lambda c: c["predicted_speedup"])
        measured = measured_speedup(r)
        out.append({"method": r["method"], "category": category, "batch": r["batch"], "k_run": k_max,
                    "measured_speedup": measured, "draft_s_per_token": per_token, "best_k": best["k"],
                    "best_predicted_speedup": best["predicted_speedup"], "curve": curve})  # fmt: skip
    if not out:
        raise CostError(f"the suite has no chain speculator measured in {category!r} at batch {profile.batch}")
    return out


# ---- measuring this machine ----------------------------------------------------------------------------

OVERHEAD_K = 4  # drafts per step of the overhead run: T = 5, inside the measured curve
# Tokens a timed run generates by default. A curve meant to predict a suite runs as long as the suite's answers
# (specbench --cost-steps): on the EPYC hosts a decode step's time swings 52 <-> 87 ms within one process for tens
# of steps at a time, and the first 8-24 steps of a run read faster than a 256-step run's mean (notes/issue-37.md,
# twenty-ninth session): 24-token runs timed every step ~13 % below the suite's own. Long runs narrowed that gap in
# one HumanEval run of two (7 % against 18 %): not the whole cause.
OVERHEAD_STEPS = 24
FORWARD_CALLS = 3  # bare forwards per sample of --timing forward (a 5 ms forward alone is ~at the clock's noise)
MODEL_PART = "#model"  # a composite draft's label + this: its draft model timed alone (CurveRounds)


class CurveRounds:
    """The in-loop cost curve as rounds that take one sample of every sampler (each T, the empty step, each tree
    size, each draft) in turn: a caller spreads them over a longer run (specbench --cost-Ts: between the suite's
    prompts), so the curve meets the host's phases as the suite did; the profile takes each sampler's median."""

    def __init__(
        self,
        model,
        speculators: dict,
        context: int,
        Ts: list[int],
        batch: int = 1,
        tree_Ts=(),
        steps: int = OVERHEAD_STEPS,
    ):
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(2, model.config.vocab_size, (batch, context), generator=gen)
        self.context, self.batch, self.steps, self.drafted = context, batch, steps, {}
        self.samplers = {("verify", T): loop_step_sampler(model, prompts, T, steps=steps) for T in Ts}
        self.samplers["empty", 1] = loop_step_sampler(model, prompts, 1, empty=True, steps=steps)
        self.samplers.update(
            {("tree", T): loop_step_sampler(model, prompts, T, tree=True, steps=steps) for T in tree_Ts}
        )
        self.sources: dict[str, list[dict]] = {}
        for label, sp in speculators.items():
            self.samplers["draft", label] = loop_draft_sampler(
                model, prompts, sp, self.drafted, label, steps, self.sources
            )
            if isinstance(sp, LookupFirstSpeculator):  # its draft model alone: the price of a drafted token
                part = label + MODEL_PART
                self.samplers["draft", part] = loop_draft_sampler(model, prompts, sp.inner, self.drafted, part, steps)
        self.values = {key: [] for key in self.samplers}

    def round(self) -> None:
        """One sample of every sampler in turn: a slow phase of the host (a busy neighbour, khugepaged collapsing the
        weights' pages after their first copy) then lands on every T alike instead of on whichever was timed during
        it (the twenty-second session's curve had c(1) above c(2..8), timed first)."""
        with torch.inference_mode():
            for key, sample in self.samplers.items():
                self.values[key].append(sample())

    def profile(self, skip: int = 0) -> Profile:
        """The medians of the rounds after the first ``skip`` (warm-up) ones."""
        rounds = len(self.values["empty", 1]) - skip
        if rounds < 1:
            raise CostError(f"the cost curve has no timed round ({skip} warm-up)")
        med = {key: statistics.median(v[skip:]) for key, v in self.values.items()}
        verify, trees, draft = (
            {key: v for (kind, key), v in med.items() if kind == k} for k in ("verify", "tree", "draft")
        )
        notes = (
            f"in-loop runs of {self.steps} tokens from context {self.context}, batch {self.batch}, median of {rounds}"
            " rounds interleaved over every T and draft"
        )
        drafted = {label: statistics.median(counts[skip:]) for label, counts in self.drafted.items()}
        sources = {
            label: {key: statistics.median(run.get(key, 0) for run in runs[skip:]) for key in runs[-1]}
            for label, runs in self.sources.items()
        }
        return Profile(
            "cpu-measured", "measured", verify, draft, notes, self.batch, tree_verify_s=trees,
            empty_step_s=med["empty", 1], draft_tokens=drafted, draft_sources=sources,
        )  # fmt: skip


def measure(
    model,
    speculators: dict,
    context: int,
    Ts: list[int],
    repeats: int,
    batch: int = 1,
    in_loop: bool = True,
    tree_Ts: list[int] = (),
    steps: int = OVERHEAD_STEPS,
) -> Profile:
    """This machine's cost curve at ``batch`` rows and ``context`` cached tokens, and each speculator's propose().

    in_loop (the default): c(T) and propose() are timed inside the real loops, so their host work is inside the
    curve: c(1) is a plain decoding step, c(T > 1) a speculative step whose T - 1 drafts are rejected (FixedDrafts)
    less its propose(), the empty step a speculative step that offers no drafts (the n-gram's steps without a
    match), a draft's cost its propose() per step of a real speculative run; no separate overhead terms;
    tree_Ts: the same for steps that verify a T-node candidate tree (FixedDrafts with a tree); steps: tokens each
    timed run generates (CurveRounds: as long as the runs being predicted). Otherwise c(T) is a
    bare target forward over T new tokens, propose() is called alone, and the loops'
    own overheads are measured apart (loop_overheads)."""
    if in_loop:  # the real loops prefill for themselves
        curve = CurveRounds(model, speculators, context, Ts, batch, tree_Ts, steps)
        for _ in range(repeats + 1):  # a warm-up round, then the timed ones
            curve.round()
        return curve.profile(skip=1)
    gen = torch.Generator().manual_seed(0)
    capacity = context + max(Ts) + 64
    tokens = torch.randint(2, model.config.vocab_size, (batch, capacity), generator=gen)
    prompts = tokens[:, :context]
    with torch.inference_mode():
        cache, hidden = prefill(model, prompts, capacity)  # the drafts' states and the bare forwards read it
        draft = {}
        for label, sp in speculators.items():
            state = SpecState(
                ids=[("spec_cost", label, b) for b in range(batch)],
                token_ids=tokens[:, : context + 1].tolist(),
                hidden=hidden[:, -1],
                params=[SamplingParams(temperature=0.0)] * batch,
                generators=[gen] * batch,
            )
            draft[label] = median_seconds(lambda sp=sp, state=state: sp.propose(state), repeats)
        lengths = torch.full((batch,), context + 1)
        forwards = {
            T: lambda T=T: model.logits(
                model(tokens[:, context : context + T], chain_metadata(lengths, T), cache, hidden_only=True)
            )
            for T in Ts
        }
        verify = interleaved_medians(forwards, repeats)
        notes = f"context {context}, batch {batch}, median of {repeats} rounds interleaved over every T"
        prof = Profile("cpu-measured", "measured", verify, draft, notes, batch)
        prof.decode_overhead_s, prof.step_overhead_s = loop_overheads(model, prompts, prof.verify, repeats)
    return prof


def prefill(model, prompts: torch.Tensor, capacity: int) -> tuple[KVCache, torch.Tensor]:
    """A KV cache of ``capacity`` positions per row holding ``prompts`` [B, n], and their hidden states."""
    batch, n = prompts.shape
    cache = KVCache(model.config, batch, capacity, model.compute_dtype, torch.device("cpu"))
    return cache, model(prompts, prefill_meta(batch, n, torch.device("cpu")), cache, hidden_only=True)


def interleaved_medians(fns: dict, repeats: int, calls: int = FORWARD_CALLS) -> dict:
    """{key: median seconds of one fn() call} over ``repeats`` rounds after a warm-up round, each round timing every
    fn in turn (``calls`` calls back to back): host drift (a busy neighbour) lands on every key alike, so their
    ratios hold where blocks timed one key after another read c(8)/c(1) 1.22 to 1.40 within minutes."""
    samples: dict = {key: [] for key in fns}
    for r in range(repeats + 1):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if r:
                samples[key].append((time.perf_counter() - t0) / calls)
    return {key: upper_median(v) for key, v in samples.items()}


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of fn() over ``repeats`` calls after one warm-up call."""
    return median_of(lambda: _seconds(fn), repeats)


def median_of(value, repeats: int) -> float:
    """Median of value() over ``repeats`` calls after one warm-up call (the upper one of an even count)."""
    value()
    return upper_median([value() for _ in range(repeats)])


def upper_median(values: list[float]) -> float:
    """The median of ``values``, the upper one of an even count (always a measured value)."""
    return sorted(values)[len(values) // 2]


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class FixedDrafts(Speculator):
    """k random drafts per row, every step: the target rejects them almost surely, so each step feeds T = k + 1
    tokens and a timed run shows the speculative loop's own per-step work beside the forward it pays for.
    tree: the drafts as a k-node candidate tree (a chain-shaped CandidateTree), so each step runs the loop's
    tree verification (tree mask, eager) as Medusa and EAGLE steps do. empty: every step offers none of its k
    drafts (num_drafted 0, as an n-gram step without a match), so each step feeds T = 1 through the speculative loop."""

    name = "fixed-drafts"

    def __init__(self, k: int, vocab_size: int, seed: int = 0, tree: bool = False, empty: bool = False):
        if tree and empty:
            raise ValueError("a candidate tree always feeds its nodes: tree and empty exclude each other")
        self.k, self.vocab_size, self.empty = check_k(k), vocab_size, empty
        self.generator = torch.Generator().manual_seed(seed)
        self.tree = CandidateTree.chain(k) if tree else None

    def max_tokens_per_step(self) -> int:
        return self.k + 1

    def propose(self, state: SpecState) -> Proposal:
        B = len(state.ids)
        tokens = torch.randint(2, self.vocab_size, (B, self.k), generator=self.generator).to(state.device)
        if self.tree is not None:
            root = torch.tensor([seq[-1] for seq in state.token_ids], device=state.device)[:, None]
            return Proposal(tokens=torch.cat([root, tokens], 1), tree=self.tree)
        return Proposal(tokens=tokens, num_drafted=torch.full((B,), 0 if self.empty else self.k, device=state.device))


def plain_step(model, rows: list[list[int]], params: SamplingParams) -> float:
    """Seconds per step of plain decoding, all its host work included (the suite's decode clock)."""
    out, decode_s = plain_decode(model, rows, params)
    return decode_s / max(len(out.timing.step_times_s), 1)


def loop_step_seconds(
    model, prompts: torch.Tensor, T: int, repeats: int, tree: bool = False, empty: bool = False
) -> float:
    """Median seconds per step of the real loop (loop_step_sampler) over ``repeats`` runs after a warm-up."""
    return median_of(loop_step_sampler(model, prompts, T, tree=tree, empty=empty), repeats)


def loop_step_sampler(
    model, prompts: torch.Tensor, T: int, tree: bool = False, empty: bool = False, steps: int = OVERHEAD_STEPS
):
    """A function timing one run of the real loop from ``prompts`` (greedy, EOS ignored, ``steps`` steps) and
    returning its seconds per step: T = 1 is a plain decoding step (plain_step), T > 1 a speculative step feeding T
    tokens (T - 1 rejected FixedDrafts; tree: a T-node candidate tree) less the drafts' propose(); empty (T = 1): a
    speculative step whose speculator offered no drafts."""
    rows = prompts.tolist()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    if empty:
        if T != 1 or tree:
            raise CostError(f"a step without drafts feeds 1 token, got T = {T}{' (a tree)' if tree else ''}")
        drafts = FixedDrafts(1, model.config.vocab_size, empty=True)
    elif T == 1 and not tree:
        return lambda: plain_step(model, rows, params)
    elif T < 2:
        raise CostError(f"a candidate tree step feeds at least 2 tokens, got T = {T}")
    else:
        drafts = FixedDrafts(T - 1, model.config.vocab_size, tree=tree)
    state = SpecState(
        ids=list(range(len(rows))), token_ids=rows, hidden=None, params=[params] * len(rows), generators=[None]
    )

    def spec_step() -> float:
        out = speculative_generate(model, rows, params, drafts, compile="off")
        return out.timing.decode_s / max(out.stats.steps, 1) - _seconds(lambda: drafts.propose(state))

    return spec_step


def loop_draft_sampler(
    model,
    prompts: torch.Tensor,
    speculator: Speculator,
    drafted: dict | None = None,
    label=None,
    steps: int = OVERHEAD_STEPS,
    sources: dict | None = None,
):
    """A function timing one real speculative run (greedy, EOS ignored, ``steps`` tokens) and returning its
    seconds of propose() per step: the draft runs between target forwards, as in use, with its catch-up feeds.
    Timed alone it looks cheaper (an int4 self-draft: 45 ms per call alone, 58 ms per step in the suite's loop).
    drafted: each run appends the tokens drafted per step to drafted[label] (what the seconds paid for); sources:
    a composite speculator's proposals by source per step to sources[label]."""
    rows = prompts.tolist()
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)

    def per_step() -> float:
        timed = TimedSpeculator(speculator)
        out = speculative_generate(model, rows, params, timed, compile="off")
        calls = max(sum(timed.fed.values()), 1)
        if drafted is not None:
            drafted.setdefault(label, []).append(sum((t - 1) * n for t, n in timed.fed.items()) / calls)
        counts = timed.sources()
        if sources is not None and counts:
            sources.setdefault(label, []).append({key: n / calls for key, n in counts.items()})
        return timed.draft_s / max(out.stats.steps, 1)

    return per_step


def loop_overheads(model, prompts: torch.Tensor, cost, repeats: int) -> tuple[float, float]:
    """(o_plain, o_spec): seconds per step each real loop spends beyond its forward c(T) = ``cost(T)`` (taken
    from a bare-forward curve)."""
    plain = loop_step_seconds(model, prompts, 1, repeats)
    spec = loop_step_seconds(model, prompts, OVERHEAD_K + 1, repeats)
    return plain - cost(1), spec - cost(OVERHEAD_K + 1)


def parse_Ts(text: str) -> list[int]:
    """A comma list of chain sizes T to time ("1,2,4,8"): sorted, T = 1 (a plain step) among them."""
    try:
        Ts = sorted({int(t) for t in text.split(",")})
    except ValueError:
        raise CostError(f"{text!r}: a comma list of token counts, e.g. 1,2,4,8") from None
    if Ts[0] != 1:
        raise CostError(f"the chain sizes must include T = 1 (a plain step) and no T < 1, got {Ts}")
    return Ts


def speculators(methods: list[str], model, context: BuildContext) -> dict[str, Speculator]:
    """Each method that builds here (one that cannot, for want of heads, is skipped with a line)."""
    sps = {}
    for spec in methods:
        if spec == "plain":
            continue
        try:
            sps[spec] = build(spec, model, context)
        except SpeculatorError as err:
            print(f"[spec_cost] skipping {spec}: {err}", file=sys.stderr)
    return sps


def print_profile(prof: Profile) -> None:
    c1 = prof.verify_s[1]
    print(" ".join(f"T={t}:{c / c1:.2f}" for t, c in prof.verify_s.items()), file=sys.stderr)
    if prof.tree_verify_s:
        print("trees " + " ".join(f"T={t}:{c / c1:.2f}" for t, c in prof.tree_verify_s.items()), file=sys.stderr)
    if prof.empty_step_s is not None:
        print(f"a speculative step without drafts: {prof.empty_step_s / c1:.2f} c(1)", file=sys.stderr)
    print(
        f"c(1) {c1 * 1e3:.1f} ms; loop overhead per step: plain {prof.decode_overhead_s * 1e3:.2f} ms, "
        f"speculative {prof.step_overhead_s * 1e3:.2f} ms",
        file=sys.stderr,
    )


def profile_record(prof: Profile) -> dict:
    """A measured profile as its JSON record's fields (load_profile reads them back)."""
    return {
        "kind": prof.kind,
        "name": prof.name,
        "verify_s": prof.verify_s,
        "tree_verify_s": prof.tree_verify_s,
        "draft_s": prof.draft_s,
        "notes": prof.notes,
        "batch": prof.batch,
        "decode_overhead_s": prof.decode_overhead_s,
        "step_overhead_s": prof.step_overhead_s,
        "empty_step_s": prof.empty_step_s,
        "draft_tokens": prof.draft_tokens,
        "draft_sources": prof.draft_sources,
    }


def print_predictions(rows: list[dict]) -> None:
    """predict_suite's rows as a table on stderr."""
    print(
        f"{'batch':>5s} {'category':14s} {'method':34s} {'tok/step':>8s} {'predicted':>9s} {'measured':>8s} error",
        file=sys.stderr,
    )
    for r in rows:
        meas = "" if r["measured_speedup"] is None else f"{r['measured_speedup']:7.2f}x"
        err = "" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        print(
            f"{r['batch']:5d} {r['category']:14s} {r['method']:34s} {r['tokens_per_step']:8.2f} "
            f"{r['predicted_speedup']:8.2f}x {meas:>8s} {err}",
            file=sys.stderr,
        )
