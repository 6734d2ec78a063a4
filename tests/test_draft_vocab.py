"""speculate.draft_vocab's ranking: every token of the default model's tokenizer, most frequent in the corpus
(standard library sources + wiki) first, cached and the same on a second call."""

from __future__ import annotations

import torch

from runtime.loader import load_tokenizer
from speculate.draft_vocab import kept_tokens, token_ranking


def test_ranking_orders_the_whole_vocabulary_by_corpus_frequency():
    tokenizer = load_tokenizer("smollm2-135m")
    ranking = token_ranking(tokenizer)
    n = len(tokenizer)
    assert torch.equal(torch.sort(ranking).values, torch.arange(n))  # a permutation of every id
    position = torch.empty(n, dtype=torch.long)
    position[ranking] = torch.arange(n)
    for common in (" the", "\n", " =", "self"):
        (token,) = tokenizer(common, add_special_tokens=False)["input_ids"]
        assert position[token] < 200, (common, int(position[token]))
    assert torch.equal(token_ranking(tokenizer), ranking)  # from the cache
    kept = kept_tokens(ranking, 4096, n, tokenizer.all_special_ids)
    assert len(kept) == 4096 and set(tokenizer.all_special_ids) <= set(kept.tolist())
