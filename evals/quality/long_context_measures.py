"""What evals.quality.long_context measures of a KV cache (runtime.kv_policy), as functions other layers call:
perplexity through the cache, passkey retrieval, greedy agreement, and the engine's capacity under a memory budget
(the command's docstring describes each).
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evals.quality.fidelity import token_match
from runtime.data import token_windows, wiki_text
from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.kv_policy import MAX_CHUNK, KVCacheSpec
from runtime.model import AttentionMetadata
from runtime.paged_cache import PagedKVCache
from runtime.sampling import SamplingParams

NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nThe pass key is"  # completed by copying: "What is the pass key?" first defeats this model at any cache
FILLER_START = 100_000  # retrieval filler comes from later in the eval text than the perplexity windows


def log(msg: str) -> None:
    print(f"[qspec] {msg}", file=sys.stderr, flush=True)


def parse_spec(text: str) -> KVCacheSpec:
    """'auto', 'int8', 'fp8_e4m3', 'int4', 'sink-window' (4 + 1020), 'sink-window:0+1024', 'int8+sink-window:4+252'."""
    dtype, policy = "auto", text
    if "+sink-window" in text:
        dtype, policy = text.split("+", 1)
    if not policy.startswith("sink-window"):
        return KVCacheSpec(text)
    sizes = policy.partition(":")[2] or "4+1020"
    try:
        sinks, window = (int(x) for x in sizes.split("+"))
    except ValueError:
        raise ValueError(f"{text!r}: sink-window sizes are SINKS+WINDOW, e.g. sink-window:4+1020") from None
    return KVCacheSpec(dtype, "sink-window", sinks, window)


# ---- perplexity --------------------------------------------------------------------------------------


@torch.inference_mode()
def stream_nll(model, window: list[int], kv: KVCacheSpec, chunk: int = 256) -> tuple[float, int, int]:
    """(summed NLL of window[1:], tokens predicted, cache bytes) with the window fed through kv's cache."""
    device = model.inv_freq.device
    tokens = torch.tensor([window], device=device)
    cache = kv.build(model, 1, len(window))
    chunk = min(chunk, getattr(cache, "max_chunk", chunk))
    total = 0.0
    for start in range(0, len(window) - 1, chunk):
        n = min(chunk, len(window) - start)
        meta = AttentionMetadata.contiguous(1, start, n, device)
        logits = model(tokens[:, start : start + n], meta, cache)[0]  # [n, V]
        targets = tokens[0, start + 1 : start + n + 1]
        total += float(F.cross_entropy(logits[: targets.numel()].float(), targets, reduction="sum"))
    return total, len(window) - 1, cache.nbytes()


def cache_perplexity(model, windows: list[list[int]], kv: KVCacheSpec, chunk: int = 256) -> dict:
    nll = tokens = 0
    cache_bytes = 0
    for w in windows:
        s, n, cache_bytes = stream_nll(model, w, kv, chunk)
        nll, tokens = nll + s, tokens + n
    return {"perplexity": math.exp(nll / tokens), "mean_nll": nll / tokens, "windows": len(windows),
            "tokens": tokens, "cache_bytes": cache_bytes}  # fmt: skip


# ---- retrieval ---------------------------------------------------------------------------------------


def passkey_prompt(tokenizer, filler: list[int], length: int, depth: float, key: str) -> list[int]:
    """`length` tokens: filler with the needle inserted at `depth` (0 = start, 1 = just before the question)."""
    needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    room = length - len(needle) - len(question)
    if room < 1 or len(filler) < room:
        raise ValueError(f"no room for {length} tokens of passkey prompt")
    at = round(depth * room)
    return filler[:at] + needle + filler[at:room] + question


def retrieval(
    model, tokenizer, kv: KVCacheSpec, length: int, depths: list[float], trials: int, seed: int = 0
) -> dict[str, dict]:
    """Per depth: exact-match accuracy of the greedy answer (8 tokens) over `trials` keys and filler texts."""
    ids = tokenizer(wiki_text("eval"), add_special_tokens=False).input_ids
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = {}
    for depth in depths:
        hits, answers = 0, []
        for t in range(trials):
            key = str(rng.randrange(10_000, 100_000))
            filler = ids[FILLER_START + t * length : FILLER_START + (t + 1) * length]
            prompt = passkey_prompt(tokenizer, filler, length, depth, key)
            answer = tokenizer.decode(generate(model, [prompt], params, kv_cache=kv).tokens[0])
            hits += key in answer
            answers.append(answer)
        out[f"{depth:g}"] = {"accuracy": hits / trials, "trials": trials, "answers": answers}
    return out


# ---- greedy agreement --------------------------------------------------------------------------------


def greedy_outputs(model, prompts: list[list[int]], kv: KVCacheSpec, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [generate(model, [p], params, kv_cache=kv).tokens[0] for p in prompts]


# ---- capacity ----------------------------------------------------------------------------------------


@dataclass
class Capacity:
    kv_cache_dtype: str
    budget_bytes: int
    sequence_tokens: int
    block_size: int
    max_num_seqs: int  # the engine setting that holds the most sequences (int4's residual grows with it)
    blocks: int  # usable blocks of the pool
    bytes_per_block: int
    residual_bytes: int  # int4: full-precision open key groups of max_num_seqs sequences
    concurrent_sequences: int  # sequences of sequence_tokens that fit at once


def capacity(config, dtype: torch.dtype, kv_cache_dtype: str, budget: int, seq_tokens: int, block_size: int):
    """How many sequences of seq_tokens fit the budget at once, by the engine's own block sizing
    (PagedKVCache.blocks_for_budget). int4 sets its residual aside per admitted sequence (max_num_seqs), so the
    largest max_num_seqs whose sequences still fit the remaining blocks is the answer."""
    per_seq = -(-seq_tokens // block_size)
    per_block = PagedKVCache.bytes_per_block(config, block_size, dtype, kv_cache_dtype)

    def sized(seqs: int) -> Capacity:
        blocks = PagedKVCache.blocks_for_budget(config, budget, block_size, dtype, kv_cache_dtype, seqs)
        residual = PagedKVCache.residual_bytes(config, block_size, dtype, kv_cache_dtype, seqs)
        fits = blocks // per_seq if kv_cache_dtype != "int4" else min(seqs, blocks // per_seq)
        return Capacity(kv_cache_dtype, budget, seq_tokens, block_size, seqs, blocks, per_block, residual, fits)

    if kv_cache_dtype != "int4":  # no per-sequence memory
        return sized(sized(0).concurrent_sequences)
    best = sized(1)
    while (grown := sized(best.max_num_seqs + 1)).concurrent_sequences > best.concurrent_sequences:
        best = grown
    return best


def engine_holds(model, cap: Capacity, prompt_tokens: int, seqs: int, seed: int = 0) -> dict:
    """Run `seqs` requests of prompt_tokens + (sequence_tokens - prompt_tokens) through an engine with cap's budget,
    block size and KV dtype, max_num_seqs = seqs: the most sequences that ran at once and the preemptions it took."""
    config = EngineConfig(
        block_size=cap.block_size, kv_cache_bytes=cap.budget_bytes, max_num_seqs=seqs,  # int4: its residual too
        kv_cache_dtype=cap.kv_cache_dtype, max_num_batched_tokens=max(512, prompt_tokens), enable_prefix_caching=False,
    )  # fmt: skip
    engine = LLMEngine(model, None, config)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=cap.sequence_tokens - prompt_tokens, ignore_eos=True)
    for _ in range(seqs):
        engine.add_request(torch.randint(2, model.config.vocab_size, (prompt_tokens,), generator=gen).tolist(), params)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return {"requests": seqs, "peak_running": peak, "preemptions": engine.scheduler.num_preemptions,
            "pool_blocks": engine.block_manager.num_usable_blocks}  # fmt: skip


# ---- one cache's summary (experiments rows) -----------------------------------------------------------


def scoring_chunk(kv: KVCacheSpec, chunk: int = 256) -> int:
    return min(chunk, MAX_CHUNK) if kv.policy == "sink-window" else chunk


def long_context_summary(
    model,
    tokenizer,
    kv: KVCacheSpec,
    reference: dict,
    lengths: tuple[int, ...] = (2048, 4096, 8192),
    windows: tuple[int, ...] = (8, 4, 2),
    depths: tuple[float, ...] = (0.1, 0.5, 0.9),
    trials: int = 5,
    retrieval_length: int = 2048,
    greedy_prompts: int = 4,
    greedy_length: int = 2048,
    greedy_tokens: int = 64,
    seed: int = 0,
) -> dict:
    """Perplexity per length (with the full-precision cache's on the same windows and the change in %),
    retrieval per depth, and greedy agreement with the full-precision cache, for one cache. `reference` memoises
    the full-precision results across calls (one experiment run scores it once)."""
    text = wiki_text("eval")
    full = KVCacheSpec()
    out: dict = {"kv_cache": kv.label(), "approximate": kv.approximate, "perplexity": {}}
    for length, count in zip(lengths, windows):
        wins = token_windows(tokenizer, text, length, count)
        key = f"perplexity:{length}x{count}"
        if key not in reference:
            reference[key] = cache_perplexity(model, wins, full, scoring_chunk(full))
        res, ref = cache_perplexity(model, wins, kv, scoring_chunk(kv)), reference[key]
        delta = 100 * (res["perplexity"] / ref["perplexity"] - 1)
        out["perplexity"][str(length)] = {**res, "reference_perplexity": ref["perplexity"], "delta_pct": delta}
    if trials:
        found = retrieval(model, tokenizer, kv, retrieval_length, list(depths), trials, seed)
        out["retrieval"] = {"length": retrieval_length, "depths": found}
    if greedy_prompts:
        prompts = token_windows(tokenizer, text, greedy_length, greedy_prompts + 16)[16:]
        key = f"greedy:{greedy_length}x{greedy_prompts}+{greedy_tokens}"
        if key not in reference:
            reference[key] = greedy_outputs(model, prompts, full, greedy_tokens)
        match = token_match(reference[key], greedy_outputs(model, prompts, kv, greedy_tokens))
        out["greedy"] = {"prompt_tokens": greedy_length, **match.to_dict()}
    return out


# ---- the CLI -----------------------------------------------------------------------------------------
