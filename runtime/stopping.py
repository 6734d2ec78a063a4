"""Per-row stop conditions, shared by every decoding loop (plain, speculative, the serving engine)."""

from __future__ import annotations

from runtime.sampling import SamplingParams


class StopChecker:
    """Per-row stop conditions: EOS ids, extra stop ids, stop strings, max_tokens."""

    def __init__(self, params: SamplingParams, eos_ids: list[int], tokenizer=None):
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output")
        self.tokenizer = tokenizer

    def check(self, new_tokens: list[int]) -> str | None:
        if new_tokens and new_tokens[-1] in self.stop_ids:
            return "eos" if new_tokens[-1] not in self.params.stop_token_ids else "stop"
        if self.params.stop:
            text = self.tokenizer.decode(new_tokens[-16:])  # a stop string ends in the last few tokens
            if any(s in text for s in self.params.stop):
                return "stop"
        if len(new_tokens) >= self.params.max_tokens:
            return "length"
        return None
