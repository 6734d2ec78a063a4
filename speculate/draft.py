"""Draft-model speculation: a smaller model with the target's tokenizer drafts k tokens autoregressively
from its own paged KV cache (one block table per sequence id, so sequences may come and go); the target
verifies them with the draft's probabilities (rejection sampling).

Drafts offline, without a second checkpoint:
- ``layer_skip_draft``: the target's first N decoder layers + its final norm and lm_head (weights shared,
  no copy), an early-exit draft;
- ``quantized_draft``: the target's own int8/int4 RTN copy (``quantize.fast_copy``), no training.
Any other model spec with the same vocabulary works too (``--draft-model``).
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from quantize.config import QuantConfig
from quantize.fast_copy import INT8_HEAD, fast_quantized_copy
from runtime.grammar import row_masks
from runtime.layout import device_of
from runtime.loader import ModelSpecError, check_model_spec, load_model
from runtime.model import Transformer, current_backend
from runtime.paged_cache import BlockManager, PagedKVCache, paged_metadata
from runtime.paths import qspec_home
from runtime.sampling import logits_to_probs, sample_rows
from speculate.base import Proposal, SpecState, Speculator, SpeculatorError, check_k
from speculate.draft_vocab import SubsetHead
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


def quantized_draft(
    model: Transformer,
    bits: int = 8,
    group_size: int | None = None,
    dtype: torch.dtype | None = None,
    head_bits: int | None = None,
    int8_activations: bool = False,
) -> Transformer:
    """A quantized copy of the target (RTN, quantize.fast_copy; decoder linears, and the lm_head when
    head_bits is given: int8 symmetric per-channel). int8_activations: W4A8 / W8A8 layers (activations int8 per
    token: the integer kernels, prompts included, at some acceptance the draft's own measurement decides).

    group_size None: the standard layout of each width, int8 symmetric per-channel and int4 group 128 (the
    layouts the fast CPU kernels are built for; int8 with groups runs one kernel per group).
    dtype: the copy's compute dtype; None: bf16 for an fp32 target, the target's own otherwise.
    head_bits 8: a large vocabulary's head is most of a small draft's bytes once its layers are int4 (the 0.5B
    Qwen: 136M head parameters against 358M in the layers); int8 halves them and keeps the draft's argmax on
    98.8 % of code tokens (notes/issue-37.md), where an int4 head kept 88 %."""

    if group_size is None:
        group_size = -1 if bits == 8 else 128
    if dtype is None and model.compute_dtype == torch.float32:
        # the int kernels run bf16 activations (fp32 ones are several times slower), and a bf16 head reads
        # half the bytes: the draft only proposes, so its precision costs acceptance, never exactness
        dtype = torch.bfloat16
    if head_bits is not None and head_bits != 8:
        raise SpeculatorError(f"a quantized draft's head is int8 (per channel), got head_bits={head_bits}")
    # int8 symmetric per-channel is quantize.int8's weight-only layout; int4 asymmetric g128 is RTN4's. Mixed
    # dtype: bf16 layers and head over an fp32 residual stream, the shape qspec's CPU step runs in one call (a
    # plain-bf16 copy ran the Python layers: ~2.5x the int4 step's time per draft token). Codes come from the
    # cast copy, as when the drafts' acceptance figures were measured. Each layer takes its device's fast path:
    # a draft exists to be fast, and the verifier keeps the output lossless whatever it proposes.
    cfg = QuantConfig(bits=bits, group_size=group_size, sym=bits == 8)
    head = INT8_HEAD if head_bits is not None else None
    return fast_quantized_copy(
        model, cfg, head=head, dtype=dtype, codes_from_copy=True, int8_activations=int8_activations
    )


def check_same_vocab(target: Transformer, draft: Transformer) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise SpeculatorError(
            f"draft model vocabulary ({dv} tokens) differs from the target's ({tv}): a draft must share the "
            "target's tokenizer"
        )


@dataclass
class _DraftSeq:
    """One sequence's draft KV: its block table in the draft's pool and the tokens whose KV is written."""

    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # BlockManager bookkeeping (prefix caching is off)
    tokens: list[int] = field(default_factory=list)  # KV written for positions 0..len-1 (committed + drafts)
    committed: int = 0  # of those, the tokens known committed (their KV never goes stale)


class DraftModelSpeculator(Speculator):
    """Drafts k tokens per sequence with its own paged KV cache, keyed by sequence id: built lazily (the first
    proposal of a sequence prefills its tokens; later ones feed only what changed since the last, i.e. the
    tokens after the longest prefix of the last drafts that was accepted), freed on release. Every
    sequence's drafts are sampled with its own params and generator, so they do not depend on the batch."""

    name = "draft"

    def __init__(
        self,
        target: Transformer,
        draft: Transformer,
        k: int = 4,
        name: str = "draft",
        block_size: int = 16,
        min_confidence: float | None = None,
        head: SubsetHead | None = None,
    ):
        check_same_vocab(target, draft)
        if min_confidence is not None and not 0.0 < min_confidence < 1.0:
            raise SpeculatorError(f"a draft's confidence threshold is in (0, 1), got {min_confidence}")
        self.target, self.draft, self.k, self.name = target, draft, check_k(k), name
        # dynamic k (HF assisted generation's confidence rule): a row stops drafting after a draft whose
        # probability under the draft (temperature 1) is below this; None: always k drafts
        self.min_confidence = min_confidence
        # the draft's logits: its own head, or a head over its most frequent tokens (speculate.draft_vocab)
        self.subset_head = head
        self.logits = self.draft.logits if head is None else head.logits
        self.block_size = block_size
        self.seqs: dict[Hashable, _DraftSeq] = {}
        self.cache: PagedKVCache | None = None
        self.blocks: BlockManager | None = None

    def max_tokens_per_step(self) -> int:
        return self.k + 1

    def release(self, ids: list[Hashable]) -> None:
        for key in ids:
            row = self.seqs.pop(key, None)
            if row is not None and self.blocks is not None:
                self.blocks.free(row)

    def _reserve(self, rows: list[_DraftSeq], need: list[int]) -> None:
        """KV blocks for need[b] positions of each row. A pool too small is replaced by one at least twice
        the size; every sequence's draft KV is then rebuilt lazily from its tokens (rare, and always correct)."""
        bm = self.blocks
        if bm is not None and sum(bm.blocks_needed(r, n) for r, n in zip(rows, need)) <= bm.num_free_blocks:
            for r, n in zip(rows, need):
                bm.allocate(r, n)
            return
        wanted = sum(-(-n // self.block_size) for n in need) + 1
        num_blocks = max(2 * wanted, 2 * bm.num_blocks if bm is not None else 0)
        device = device_of(self.draft)
        self.cache = PagedKVCache(self.draft.config, num_blocks, self.block_size, self.draft.compute_dtype, device)
        self.blocks = BlockManager(num_blocks, self.block_size, enable_prefix_caching=False)
        for r in self.seqs.values():
            r.block_table, r.block_hashes, r.tokens, r.committed = [], [], [], 0
        for r, n in zip(rows, need):
            self.blocks.allocate(r, n)

    def _forward(self, rows: list[_DraftSeq], feeds: list[list[int]], index: list[list[int]]) -> Tensor:
        """Draft logits [B, V] after each row's last fed token (feeds at sequence positions index).

        A row's drafts are sampled from q by its own generator, so q must not depend on its batch mates: rows
        share one forward only where the backend says that forward is row-independent (the CPU step's kernels:
        the same bits alone or batched); elsewhere a batched call changes the matmuls' row count and padding,
        and so their rounding, which a 16-bit draft turns into q differences of ~3e-2 (notes/issue-28.md), and
        each row runs its own forward."""
        device = self.cache.k.device
        widest = max(len(f) for f in feeds)
        if len(rows) > 1 and current_backend().rows_independent(self.draft, widest, self.cache):
            meta = paged_metadata(index, index, [r.block_table for r in rows], self.block_size, device)
            tokens = torch.tensor([f + [0] * (widest - len(f)) for f in feeds], dtype=torch.long, device=device)
            hidden = self.draft(tokens, meta, self.cache, hidden_only=True)  # [B, T, H]
            last = torch.tensor([len(f) - 1 for f in feeds], device=device)
            return self.logits(hidden[torch.arange(len(rows), device=device), last])
        out = []
        for row, feed, idx in zip(rows, feeds, index):
            meta = paged_metadata([idx], [idx], [row.block_table], self.block_size, device)
            tokens = torch.tensor([feed], dtype=torch.long, device=device)
            hidden = self.draft(tokens, meta, self.cache, hidden_only=True)  # [1, T, H]
            out.append(self.logits(hidden[:, -1]))
        return torch.cat(out)

    def prefill(self, state: SpecState) -> None:
        """The draft's KV of every committed token but the last (which each proposal feeds to start its drafts)."""
        self._prefill([self.seqs.setdefault(key, _DraftSeq()) for key in state.ids], state.token_ids)

    def _prefill(self, rows: list[_DraftSeq], seqs: list[list[int]]) -> None:
        todo = [(r, seq) for r, seq in zip(rows, seqs) if r.committed < len(seq) - 1]
        if not todo:
            return
        self._reserve([r for r, _ in todo], [len(seq) + self.k - 1 for _, seq in todo])
        self._forward(
            [r for r, _ in todo],
            [seq[r.committed : len(seq) - 1] for r, seq in todo],
            [list(range(r.committed, len(seq) - 1)) for r, seq in todo],
        )
        for r, seq in todo:
            r.tokens, r.committed = list(seq[:-1]), len(seq) - 1

    def propose(self, state: SpecState) -> Proposal:
        rows = [self.seqs.setdefault(key, _DraftSeq()) for key in state.ids]
        self._reserve(rows, [len(seq) + self.k - 1 for seq in state.token_ids])
        # rows without draft KV (new, or after a rebuilt pool) are prefilled as the static loop's hook does, so
        # every loop feeds a row's draft the same calls (a one-call lazy prefill would round differently in bf16)
        fresh = [(row, seq) for row, seq in zip(rows, state.token_ids) if not row.tokens]
        self._prefill([row for row, _ in fresh], [seq for _, seq in fresh])
        feeds, index = [], []
        for row, seq in zip(rows, state.token_ids):
            n, limit = row.committed, min(len(row.tokens), len(seq) - 1)
            while n < limit and row.tokens[n] == seq[n]:  # drafts of the last step that were accepted
                n += 1
            n = min(n, len(seq) - 1)  # the last committed token is always fed: its logits start the drafts
            feeds.append(seq[n:])
            index.append(list(range(n, len(seq))))
        logits = self._forward(rows, feeds, index)
        cons = state.constraints  # under a grammar: each draft distribution masked, advancing through the drafts
        cons = None if cons is None or all(c is None for c in cons) else cons
        V = logits.shape[-1]
        advanced = [0] * len(rows)
        drafts, probs, masks = [], [], []
        live = list(range(len(rows)))  # rows still drafting: logits[i] is row live[i]'s
        num = [self.k] * len(rows)
        q_prev = None
        for j in range(self.k):
            mask = None if cons is None else row_masks(cons, V, logits.device)
            q = torch.stack(
                [
                    logits_to_probs(logits[i], state.params[b], None if mask is None else mask[b])
                    for i, b in enumerate(live)
                ]
            )  # the one sampler, with the target's params and mask
            tok = sample_rows(q, [state.params[b] for b in live], [state.generators[b] for b in live])
            if len(live) < len(rows):  # rows that stopped: padding (never verified: num_drafted)
                tok, q = self._pad(tok, q, live, drafts[-1], q_prev)
            drafts.append(tok)
            probs.append(q)
            q_prev = q
            if cons is not None:
                masks.append(mask)
                for b, c in enumerate(cons):  # a row stops advancing at a refused token (past its EOS)
                    if c is not None and advanced[b] == j and num[b] > j and c.accept(int(tok[b])):
                        advanced[b] += 1
            if self.min_confidence is not None:
                keep = [i for i, b in enumerate(live) if self._confident(logits[i], int(tok[b]))]
                for i, b in enumerate(live):
                    if i not in keep:
                        num[b] = j + 1  # this draft is offered; none after it
                live, logits = [live[i] for i in keep], logits[keep]
                if not live:
                    break
            if j < self.k - 1:
                feeds = [[int(tok[b])] for b in live]
                at = [[len(state.token_ids[b]) + j] for b in live]
                logits = self._forward([rows[b] for b in live], feeds, at)
        while len(drafts) < self.k:  # every row stopped early: pad to the proposal's width
            drafts.append(drafts[-1])
            probs.append(probs[-1])
            if cons is not None:
                masks.append(masks[-1])
        if cons is not None:  # the target's mask after the last draft, then back to the committed state
            masks.append(row_masks(cons, V, logits.device))
            for c, n in zip(cons, advanced):
                if c is not None:
                    c.rollback(n)
        tokens = torch.stack(drafts, 1)  # [B, k]
        for row, seq, d, n in zip(rows, state.token_ids, tokens.tolist(), num):
            row.tokens, row.committed = list(seq) + d[: n - 1], len(seq)  # the drafts whose KV was written
        dynamic = self.min_confidence is not None
        return Proposal(
            tokens=tokens.to(state.device),
            num_drafted=torch.tensor(num, dtype=torch.long, device=state.device) if dynamic else None,
            draft_probs=torch.stack(probs, 1).to(state.device),
            masks=torch.stack(masks, 1).to(state.device) if masks else None,
        )

    def _confident(self, logits: Tensor, token: int) -> bool:
        """Whether the draft gave its draft `token` at least min_confidence (softmax of its logits, temperature 1,
        whatever the row's sampling: a greedy row's q is one-hot and says nothing)."""
        return float(torch.softmax(logits.float(), -1)[token]) >= self.min_confidence

    @staticmethod
    def _pad(tok: Tensor, q: Tensor, live: list[int], tok_prev: Tensor, q_prev: Tensor) -> tuple[Tensor, Tensor]:
        """[B] tokens and [B, V] distributions from the live rows' ones, stopped rows repeating their last."""
        full_tok, full_q = tok_prev.clone(), q_prev.clone()
        full_tok[live], full_q[live] = tok, q
        return full_tok, full_q

    def describe(self) -> dict:
        cfg = self.draft.config
        out = {**super().describe(), "k": self.k, "draft_layers": cfg.num_layers, "draft_hidden": cfg.hidden_size}
        if self.subset_head is not None:
            out["draft_head_tokens"], out["draft_head_digest"] = len(self.subset_head.kept), self.subset_head.digest
        return out if self.min_confidence is None else {**out, "min_confidence": self.min_confidence}


# under $QSPEC_HOME: {fingerprint}.json, written by evals.speculation.spec_cost
DEFAULT_DRAFT_DIR = ("spec", "default_draft")


# The draft for a model with no smaller sibling and no measured choice. On SmolLM2 (notes/issue-16.md) its own
# int4 RTN copy at full depth accepted 2.98 tokens per step (k = 3) where a layer-skip draft (layers:8) accepted
# 1.04 and int4 + layers:15 1.10: early layers of a model this size do not predict its next token, so skipping
# layers costs more acceptance than it saves time.
FALLBACK_DRAFT = "int4"


def default_draft_file(target: Transformer) -> Path:
    return qspec_home().joinpath(*DEFAULT_DRAFT_DIR, f"{model_fingerprint(target)}.json")


def measured_default_draft(target: Transformer) -> str | None:
    """The draft chosen for this model by measured acceptance per cost
    (``python -m evals.speculation.spec_cost choose-draft``), or None when it has not been measured."""
    path = default_draft_file(target)
    if not path.is_file():
        return None
    return json.loads(path.read_text())["draft"]


SEPARATE_DRAFT_GROUP = 64  # int4+SPEC: the 0.5B's int4 g64 copy measured 1.66x for the 1.5B (issue 37)
SEPARATE_DRAFT_HEAD_BITS = 8  # int4+SPEC / int8+SPEC: a separate draft's head in int8 too (quantized_draft)
# a quantized draft's prefix: its weight bits and whether its activations are int8 (W4A8 / W8A8)
DRAFT_FORMATS = {"int4": (4, False), "int8": (8, False), "w4a8": (4, True), "w8a8": (8, True)}


def split_draft_spec(spec: str) -> tuple[str, str]:
    """'int4+SPEC' -> ('int4', 'SPEC'); 'int4' -> ('int4', ''); a plain model spec -> ('', spec)."""
    head, _, rest = spec.partition("+")
    if head in DRAFT_FORMATS or (head.startswith("int") and head[3:].isdigit()):
        return head, rest
    return "", spec


def parse_draft_spec(
    spec: str | None, target: Transformer, target_path: Path | str | None = None
) -> tuple[Transformer, str]:
    """--draft-model: 'layers:N' (layer-skip draft of the target), 'int4' / 'int8' (its RTN copy), 'int4+layers:N'
    (both), a model spec (a checkpoint with the target's tokenizer, e.g. qwen2.5-coder-0.5b for the 1.5B, run in
    the target's dtype), or 'int4+SPEC' / 'int8+SPEC' (that model's RTN copy: int4 in groups of 64, int8 per
    channel; its head int8 per channel); 'w4a8' / 'w8a8' in place of 'int4' / 'int8': the same codes with int8
    activations (the integer kernels). None: the draft chosen by measurement for this model when there is one
    (evals.speculation.spec_cost choose-draft), else FALLBACK_DRAFT. target_path: the target's checkpoint, whose
    tokenizer a separate draft's must equal."""
    if spec is None:
        spec = measured_default_draft(target) or FALLBACK_DRAFT
    check_draft_spec(spec)
    fmt, rest = split_draft_spec(spec)
    bits, int8_acts = DRAFT_FORMATS.get(fmt, (0, False))
    if fmt and not rest:
        return quantized_draft(target, bits, int8_activations=int8_acts), spec
    if rest.startswith("layers:"):
        draft = layer_skip_draft(target, int(rest.removeprefix("layers:")))
        return (quantized_draft(draft, bits, int8_activations=int8_acts) if fmt else draft), spec
    draft, _, draft_path = load_model(rest, dtype=target.compute_dtype, device=device_of(target))
    if target_path:
        check_same_tokenizer(Path(target_path), draft_path)
    if not fmt:
        return draft, spec
    group = SEPARATE_DRAFT_GROUP if bits == 4 else None
    head = SEPARATE_DRAFT_HEAD_BITS
    return quantized_draft(draft, bits, group_size=group, head_bits=head, int8_activations=int8_acts), spec


def check_draft_spec(spec: str | None) -> None:
    """parse_draft_spec's syntax, checked without loading anything (None: the default draft)."""
    if spec is None:
        return
    fmt, rest = split_draft_spec(spec)
    if fmt and fmt not in DRAFT_FORMATS:
        raise SpeculatorError(f"--draft-model {spec!r}: quantized drafts are {', '.join(DRAFT_FORMATS)}")
    if fmt and not rest:
        return
    if rest.startswith("layers:"):
        try:
            int(rest.removeprefix("layers:"))
        except ValueError:
            raise SpeculatorError(f"--draft-model {spec!r}: expected layers:N with an integer N") from None
        return
    try:
        check_model_spec(rest)
    except ModelSpecError as err:
        raise SpeculatorError(f"--draft-model {spec!r}: {err}") from None


def tokenizer_identity(path: Path) -> dict | None:
    """What decides how text becomes ids in a checkpoint's tokenizer.json (vocabulary, merges, added tokens), or
    None when the checkpoint has no tokenizer.json."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    tok = json.loads(file.read_text())
    model = tok.get("model", {})
    added = sorted((t["id"], t["content"]) for t in tok.get("added_tokens", []))
    return {"vocabulary": model.get("vocab"), "merges": model.get("merges"), "added tokens": added}


def check_same_tokenizer(target_path: Path, draft_path: Path) -> None:
    """A separate draft model must turn text into the target's ids: its proposals are target token ids."""
    target, draft = tokenizer_identity(target_path), tokenizer_identity(draft_path)
    if target is None or draft is None:
        return  # nothing to compare (the vocabulary sizes were checked)
    for part in target:
        if target[part] != draft[part]:
            raise SpeculatorError(
                f"draft model {draft_path} has another tokenizer than the target {target_path} (its {part} "
                "differ): a draft proposes target token ids, so it must share the target's tokenizer"
            )
