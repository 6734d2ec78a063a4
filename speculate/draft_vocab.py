"""A draft's head over the most frequent tokens only (FR-Spec: frequency-ranked drafting, Zhao et al. 2025).

A separate draft reads its whole head every drafted token: the 0.5B Qwen2.5-Coder's is 151936 x 896, 28 % of its
bf16 bytes and ~40 % of its W4A8 copy's. ``vocab=V`` keeps the head rows of the V tokens most frequent in a fixed
corpus (Python's own standard library sources and the wiki training split in English, Spanish and French: code and
prose in the languages the suites ask for, none of it a benchmark) and gives every other token the logit -inf.
Speculation stays lossless: the verifier accepts or rejects against the target whatever the draft proposes, and the
draft's distribution q (zero outside the kept tokens) is what its tokens were sampled from, which rejection sampling
needs. The price is acceptance where the target's next token is outside the kept set.

The ranking is counted once per tokenizer and Python version (the corpus is this Python's standard library) and
cached under ``$QSPEC_HOME/draft_vocab``; a speculator's record names the kept set by its digest.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

from quantize.qlinear import QuantizedWeight, QuantLinear
from runtime.data import LANGUAGES, wiki_text
from runtime.loader import load_tokenizer
from runtime.model import Linear, Transformer
from runtime.paths import qspec_home

CORPUS_CODE_BYTES = 8 << 20  # of the standard library's .py sources, in sorted path order
CORPUS_VERSION = 2  # 2: the wiki training split in es and fr too (1: English only, translation drafts fell to 0.94x)


def corpus_texts() -> list[str]:
    """The ranking's corpus: the standard library's Python sources (sorted, up to CORPUS_CODE_BYTES) and the wiki
    training split in every language the texts have (English, Spanish, French)."""
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or size >= CORPUS_CODE_BYTES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
    texts.extend(wiki_text("train", lang) for lang in LANGUAGES)
    return texts


def token_ranking(tokenizer) -> Tensor:
    """Every token id of the tokenizer, most frequent in the corpus first (ties: lower id first); cached."""
    ident = hashlib.sha256(
        json.dumps([CORPUS_VERSION, sys.version_info[:2], len(tokenizer)]).encode()
        + json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()
    ).hexdigest()[:16]
    cache = qspec_home() / "draft_vocab" / f"{ident}.pt"
    if cache.is_file():
        return torch.load(cache)
    counts = torch.zeros(len(tokenizer), dtype=torch.long)
    for text in corpus_texts():
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids, minlength=len(tokenizer))[: len(tokenizer)]
    # stable sort on -count: equal counts keep id order
    ranking = torch.sort(-counts, stable=True).indices
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ranking, cache)
    return ranking


def kept_tokens(ranking: Tensor, size: int, vocab: int, always: list[int]) -> Tensor:
    """The ids a size-token head keeps: the `always` ids (end of sequence, end of turn) and the most frequent others,
    sorted, all below vocab (the head's rows)."""
    if not 0 < size < vocab:
        raise ValueError(f"a draft's vocabulary subset has 1..{vocab - 1} tokens, got {size}")
    always = [t for t in dict.fromkeys(always) if 0 <= t < vocab]
    ranked = ranking[ranking < vocab]
    rest = ranked[~torch.isin(ranked, torch.tensor(always, dtype=torch.long))][: size - len(always)]
    return torch.sort(torch.cat([torch.tensor(always, dtype=torch.long), rest])).values


class SubsetHead:
    """The draft's head restricted to `kept` token ids: logits for those, -inf for every other token."""

    def __init__(self, draft: Transformer, kept: Tensor):
        full = draft.lm_head
        self.digest = hashlib.sha256(kept.to("cpu", torch.int64).numpy().tobytes()).hexdigest()[:12]
        self.dtype = draft.head_dtype
        if isinstance(full, QuantLinear):  # a quantized head keeps its codes: the kept rows, the same layer (an
            # int8 head's rows read half the bytes of their bf16 copy, once per draft token)
            q = full.qweight()
            self.kept = kept.to(q.codes.device)
            rows = QuantizedWeight(q.codes[self.kept], q.scales[self.kept], q.zeros[self.kept], q.bits, q.group_size,
                                   q.g_idx, None if q.bias is None else q.bias[self.kept])  # fmt: skip
            self.head = QuantLinear(rows, act_quant=full.act_quant, compute_dtype=full.compute_dtype)
            self.head.auto = True  # its device's fast path at the first forward, as the full head's
            self.vocab = full.out_features
            return
        weight = full.weight.detach()  # a dense head (an FP8 one dequantizes): the kept rows in its compute dtype
        self.kept = kept.to(weight.device)
        self.vocab = weight.shape[0]
        self.head = Linear(weight.shape[1], len(kept), bias=False).to(device=weight.device, dtype=self.dtype)
        with torch.no_grad():
            self.head.weight.copy_(weight[self.kept].to(self.dtype))

    def logits(self, hidden: Tensor) -> Tensor:
        """Final-norm hidden states [B, H] -> fp32 logits [B, vocab] (as Transformer.logits)."""
        with torch.no_grad():
            part = self.head(hidden.to(self.dtype)).float()
        out = torch.full((*part.shape[:-1], self.vocab), float("-inf"), device=part.device)
        out[..., self.kept] = part
        return out


def subset_head(draft: Transformer, tokenizer_dir: Path | str, size: int) -> SubsetHead:
    """The draft's head over the `size` most frequent tokens of the tokenizer at tokenizer_dir (its special tokens,
    end of sequence and of turn among them, always kept)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    kept = kept_tokens(token_ranking(tokenizer), size, draft.lm_head.weight.shape[0], tokenizer.all_special_ids)
    return SubsetHead(draft, kept)
