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
        self.longest_stop = max((len(s) for s in params.stop), default=0)

    def check(self, new_tokens: list[int]) -> str | None:
        if len(new_tokens) < self.params.min_tokens:  # (min_tokens <= max_tokens)
            return None
        if new_tokens and new_tokens[-1] in self.stop_ids:
            return "eos" if new_tokens[-1] not in self.params.stop_token_ids else "stop"
        if self.params.stop and any(s in self.tail_text(new_tokens) for s in self.params.stop):
            return "stop"
        if len(new_tokens) >= self.params.max_tokens:
            return "length"
        return None

    def tail_text(self, tokens: list[int]) -> str:
        """Decoded text of the last tokens, long enough to hold any stop string that ends in the newest
        token: the window doubles from 16 tokens until its text outgrows the longest stop string (plus the
        newest token's text and a partial leading character), so a check costs O(stop length), not O(n)."""
        need = self.longest_stop + len(self.tokenizer.decode(tokens[-1:])) + 1
        n = 16
        while True:
            text = self.tokenizer.decode(tokens[-n:])
            if n >= len(tokens) or len(text) >= need:
                return text
            n *= 2
