"""Draft-model speculation: a smaller model with the target's tokenizer drafts k tokens autoregressively
from its own KV cache; the target verifies them with the draft's probabilities (rejection sampling).

Drafts offline, without a second checkpoint:
- ``layer_skip_draft``: the target's first N decoder layers + its final norm and lm_head (weights shared,
  no copy), an early-exit draft;
- ``quantized_draft``: the target's own int8/int4 RTN copy (``quantize.rtn``), no training.
Any other model spec with the same vocabulary works too (``--draft-model``).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from runtime.kv_cache import KVCache
from runtime.layout import device_of
from runtime.model import AttentionMetadata, Transformer, decode_meta
from runtime.paths import qspec_home
from runtime.sampling import logits_to_probs, sample
from speculate.base import Proposal, SpecState, Speculator, SpeculatorError, check_k
from speculate.medusa.heads import model_fingerprint


def layer_skip_draft(model: Transformer, num_layers: int) -> Transformer:
    """The target's first num_layers decoder layers, final norm and lm_head, sharing the target's weights."""
    total = model.config.num_layers
    if not 1 <= num_layers < total:
        raise SpeculatorError(f"a layer-skip draft needs 1 <= layers < {total} (the target's depth), got {num_layers}")
    with torch.device("meta"):  # no weights allocated: every module below is the target's own
        draft = Transformer(replace(model.config, num_layers=num_layers))
    draft.embed_tokens, draft.norm, draft.lm_head = model.embed_tokens, model.norm, model.lm_head
    draft.layers = nn.ModuleList(model.layers[:num_layers])
    draft.inv_freq = model.inv_freq
    draft.rope_attention_scale, draft.residual_dtype = model.rope_attention_scale, model.residual_dtype
    return draft.eval()


def quantized_draft(model: Transformer, bits: int = 8, group_size: int | None = None) -> Transformer:
    """A quantized copy of the target (RTN from the quant package; decoder linears only, lm_head kept).

    group_size None: the standard layout of each width, int8 symmetric per-channel and int4 group 128 (the
    layouts the fast CPU kernels are built for; int8 with groups runs one kernel per group)."""
    from quantize.config import QuantConfig
    from quantize.qlinear import QuantLinear
    from quantize.rtn import quantize_model

    if group_size is None:
        group_size = -1 if bits == 8 else 128
    draft = copy.deepcopy(model)  # a deepcopy keeps a tied lm_head tied inside the copy
    if draft.compute_dtype == torch.float32:
        # the int kernels run bf16 activations (fp32 ones are several times slower), and a bf16 head reads
        # half the bytes: the draft only proposes, so its precision costs acceptance, never exactness
        draft.set_dtype(torch.bfloat16, mixed=False)
    # int8 symmetric per-channel is quantize.int8's weight-only layout; int4 asymmetric g128 is RTN4's
    quantize_model(draft, QuantConfig(bits=bits, group_size=group_size, sym=bits == 8))
    # quantize_model pins the dequantize-every-forward reference path (exact, for measuring quantization
    # error); a draft exists to be fast, and the verifier keeps the output lossless whatever it proposes:
    # let each layer pick its device's fast path (QuantLinear.auto_path) at its first forward
    for layer in draft.modules():
        if isinstance(layer, QuantLinear):
            layer.auto = True
    return draft.eval()


def check_same_vocab(target: Transformer, draft: Transformer) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise SpeculatorError(
            f"draft model vocabulary ({dv} tokens) differs from the target's ({tv}): a draft must share the "
            "target's tokenizer"
        )


class DraftModelSpeculator(Speculator):
    name = "draft"

    def __init__(self, target: Transformer, draft: Transformer, k: int = 4, name: str = "draft"):
        check_same_vocab(target, draft)
        self.target, self.draft, self.k, self.name = target, draft, check_k(k), name
        self.cache: KVCache | None = None

    def max_tokens_per_step(self) -> int:
        return self.k + 1

    def start(self, state: SpecState) -> None:
        B, capacity = state.tokens.shape
        self.cache = KVCache(self.draft.config, B, capacity, self.draft.compute_dtype, device_of(self.draft))
        # Prefill every committed token but the last two (propose() re-feeds those each step). Padding
        # positions of shorter rows are overwritten before anything reads them (attention is by position).
        T = int(state.lengths.max()) - 2
        if T > 0:
            positions = torch.arange(T, device=device_of(self.draft)).expand(B, -1)
            self.draft(state.tokens[:, :T], AttentionMetadata.causal(positions, kv_len=T), self.cache)

    def propose(self, state: SpecState) -> Proposal:
        L = state.lengths
        rows = torch.arange(L.shape[0], device=L.device)
        # The last two committed tokens: the draft's cache is valid up to L-3 whatever was accepted last step.
        feed = torch.stack([state.tokens[rows, L - 2], state.tokens[rows, L - 1]], 1)  # [B, 2]
        positions = torch.stack([L - 2, L - 1], 1)
        logits = self.draft(feed, AttentionMetadata.causal(positions, kv_len=int(L.max())), self.cache)[:, -1]
        drafts, probs = [], []
        for j in range(self.k):
            if state.params.greedy:
                tok = logits.argmax(-1)
            else:
                q = logits_to_probs(logits, state.params)  # the one sampler, same params as the target
                tok = sample(q, state.generator)
                probs.append(q)
            drafts.append(tok)
            if j < self.k - 1:
                logits = self.draft(tok[:, None], decode_meta(L + j), self.cache)[:, 0]
        tokens = torch.stack(drafts, 1)
        # Greedy drafts are deterministic (q = one-hot of the argmax), so no probabilities are needed.
        return Proposal(tokens=tokens, draft_probs=torch.stack(probs, 1) if probs else None)

    def describe(self) -> dict:
        cfg = self.draft.config
        return {**super().describe(), "k": self.k, "draft_layers": cfg.num_layers, "draft_hidden": cfg.hidden_size}


DEFAULT_DRAFT_DIR = ("spec", "default_draft")  # under $QSPEC_HOME: {fingerprint}.json, written by evals.spec_cost


def default_draft_file(target: Transformer) -> Path:
    return qspec_home().joinpath(*DEFAULT_DRAFT_DIR, f"{model_fingerprint(target)}.json")


def measured_default_draft(target: Transformer) -> str | None:
    """The draft chosen for this model by measured acceptance per cost (``python -m evals.spec_cost choose-draft``),
    or None when it has not been measured."""
    path = default_draft_file(target)
    if not path.is_file():
        return None
    return json.loads(path.read_text())["draft"]


def parse_draft_spec(spec: str | None, target: Transformer) -> tuple[Transformer, str]:
    """--draft-model: 'layers:N' (layer-skip draft of the target), 'int4' / 'int8' (its RTN copy), 'int4+layers:N'
    (both), or a model spec. None: the draft chosen by measurement for this model when there is one
    (evals.spec_cost choose-draft), else layers:N/4."""
    if spec is None:
        spec = measured_default_draft(target) or f"layers:{max(1, target.config.num_layers // 4)}"
    bits, _, rest = spec.partition("+") if spec.startswith("int") else ("", "", spec)
    if bits and bits not in ("int4", "int8"):
        raise SpeculatorError(f"--draft-model {spec!r}: quantized drafts are int4 or int8")
    if bits and not rest:
        return quantized_draft(target, int(bits[3:])), spec
    if rest.startswith("layers:"):
        try:
            n = int(rest.removeprefix("layers:"))
        except ValueError:
            raise SpeculatorError(f"--draft-model {spec!r}: expected layers:N with an integer N") from None
        draft = layer_skip_draft(target, n)
        return (quantized_draft(draft, int(bits[3:])) if bits else draft), spec
    if bits:
        raise SpeculatorError(f"--draft-model {spec!r}: expected int4, int8 or intB+layers:N")
    from runtime.loader import load_model

    draft, _, _ = load_model(spec, dtype=target.compute_dtype, device=device_of(target))
    return draft, spec
