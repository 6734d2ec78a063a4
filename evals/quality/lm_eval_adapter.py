"""Our runtime as an lm-eval 0.4 ``LM``: any in-memory Transformer (fp32, bf16, quantized) scored by lm-eval tasks.

Tokenization follows lm-eval's HF model so scores are comparable: the context and continuation are encoded
together and split where the context's own encoding ends (trailing spaces of the context move to the
continuation); an empty context is conditioned on the BOS (or, without one, the EOS) token. Over-long inputs
keep their last ``max_length`` tokens. Scoring runs through the one model forward, either batched without a
cache (``score_mode="forward"``) or through the KV cache (``"cache"``: prefill the context, then score the
continuations in one cached forward; choices sharing a context share its prefill, which makes multiple-choice
tasks several times cheaper), so systems variants can be checked on task accuracy too.
Registered as ``qspec`` for ``lm_eval --model qspec --model_args model=smollm2-135m,dtype=bf16``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from runtime.config import DTYPES
from runtime.decoding import generate
from runtime.kv_cache import KVCache
from runtime.loader import DEFAULT_MODEL, load_model, load_tokenizer
from runtime.model import AttentionMetadata, prefill_meta
from runtime.sampling import SamplingParams


@register_model("qspec")
class QspecLM(LM):
    def __init__(
        self,
        model=None,
        tokenizer=None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        score_mode: str = "forward",
        name: str | None = None,
        dtype: str = "fp32",
        device: str = "cpu",
        **unused,
    ):
        super().__init__()
        if isinstance(model, str) or model is None:  # built from --model_args: load a model spec
            spec = model or DEFAULT_MODEL
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
            model, _, path = load_model(spec, DTYPES[dtype], device)
            tokenizer = tokenizer or load_tokenizer(str(path))
            name = name or spec
        if tokenizer is None:
            raise ValueError("QspecLM needs a tokenizer with an in-memory model")
        if score_mode not in ("forward", "cache"):
            raise ValueError(f"score_mode must be 'forward' or 'cache', got {score_mode!r}")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size_per_call = int(batch_size) if str(batch_size) != "auto" else 8
        self._max_length = int(max_length or model.config.max_position_embeddings)
        self.max_gen_toks = int(max_gen_toks)
        self.score_mode = score_mode
        self.name = name or "in-memory"
        self._device = model.embed_tokens.weight.device
        cfg = model.config
        prefix = cfg.bos_token_id if cfg.bos_token_id is not None else (cfg.eos_token_ids or [None])[0]
        if prefix is None:
            prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.prefix_token_id = int(prefix)

    # ---- what lm-eval asks of a model ------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "qspec").replace("/", "__")

    @property
    def max_length(self) -> int:
        return self._max_length

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
        whole = self.encode(context + continuation)
        context_enc = self.encode(context)
        return whole[: len(context_enc)], whole[len(context_enc) :]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            if context == "":
                ctx, cont = [self.prefix_token_id], self.encode(continuation)
            else:
                ctx, cont = self.encode_pair(context, continuation)
            pairs.append((ctx, cont))
        return self.score_pairs(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self.score_pairs(windows)
            out.append(sum(s for s, _ in scores))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for idx in groups.values():
            kwargs = dict(requests[idx[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
            params = SamplingParams(
                temperature=temperature,
                top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                top_k=int(kwargs.pop("top_k", 0) or 0),
                seed=int(kwargs.pop("seed", 0)),
                max_tokens=max_new,
                stop=until,
            )
            for start in range(0, len(idx), self.batch_size_per_call):
                chunk = idx[start : start + self.batch_size_per_call]
                prompts = []
                for i in chunk:
                    ids = self.encode(requests[i].args[0]) or [self.prefix_token_id]
                    prompts.append(ids[-(self.max_length - max_new) :])
                gen = generate(self.model, prompts, params, tokenizer=self.tokenizer)
                for i, toks in zip(chunk, gen.tokens):
                    text = self.tokenizer.decode(toks, skip_special_tokens=True)
                    for stop in until:
                        if stop and stop in text:
                            text = text.split(stop)[0]
                    results[i] = text
        return results

    # ---- scoring -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum log p(continuation | context), greedy?) per pair."""
        rows = []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("empty continuation: nothing to score")
            full = (ctx + cont)[-(self.max_length + 1) :]
            rows.append((full[:-1], full[-min(len(cont), len(full) - 1) :]))  # inputs, the tokens they predict
        if self.score_mode == "cache":
            return self.score_cached(rows)
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        # longest first, so a batch pads little and the first batch fails fast if memory is short
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch_size_per_call):
            chunk = order[start : start + self.batch_size_per_call]
            width = max(len(rows[i][0]) for i in chunk)
            batch = torch.zeros(len(chunk), width, dtype=torch.long, device=self._device)
            for b, i in enumerate(chunk):
                batch[b, : len(rows[i][0])] = torch.tensor(rows[i][0], device=self._device)
            hidden = self.model(batch, hidden_only=True)  # the lm_head only where continuations are
            for b, i in enumerate(chunk):
                inp, target = rows[i]
                results[i] = self.score_row(self.model.logits(hidden[b, len(inp) - len(target) : len(inp)]), target)
        return results

    def score_row(self, logits: torch.Tensor, target: list[int]) -> tuple[float, bool]:
        logprobs = F.log_softmax(logits.float(), dim=-1)
        cont = torch.tensor(target, device=self._device)
        return float(logprobs.gather(-1, cont[:, None]).sum()), bool((logprobs.argmax(-1) == cont).all())

    def score_cached(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Through the KV cache: each distinct context is prefilled once, then all continuations sharing it
        (the choices of a multiple-choice question) are scored in one batched cached forward."""
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (inp, target) in enumerate(rows):
            groups.setdefault(tuple(inp[: len(inp) - len(target)]), []).append(i)
        cfg, dtype, dev = self.model.config, self.model.compute_dtype, self._device  # the cache holds layer k/v
        for prefix, members in groups.items():
            p = len(prefix)
            for start in range(0, len(members), self.batch_size_per_call):
                chunk = members[start : start + self.batch_size_per_call]
                width = max(len(rows[i][1]) for i in chunk)
                cache = KVCache(cfg, len(chunk), p + width, dtype, dev)
                if p > 0:
                    self.model(torch.tensor([prefix], device=dev), prefill_meta(1, p, dev), cache, hidden_only=True)
                    cache.k[:, 1:, :, :p] = cache.k[:, :1, :, :p]  # share the prefix with every row
                    cache.v[:, 1:, :, :p] = cache.v[:, :1, :, :p]
                batch = torch.zeros(len(chunk), width, dtype=torch.long, device=dev)
                for b, i in enumerate(chunk):
                    tail = rows[i][0][p:]
                    batch[b, : len(tail)] = torch.tensor(tail, device=dev)
                meta = AttentionMetadata.contiguous(len(chunk), p, width, dev)
                logits = self.model(batch, meta, cache)
                for b, i in enumerate(chunk):
                    results[i] = self.score_row(logits[b, : len(rows[i][1])], rows[i][1])
        return results
