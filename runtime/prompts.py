"""Chat-templated task prompts built offline from the shipped wiki summaries: the workload categories of
``evals.specbench`` (summarization, passage QA, rewriting, translation, multi-turn chat, continuation).

One builder serves both sides of a split: the suite draws its prompts from the *evaluation* split (documents
< 5000), and the draft-head trainers draw theirs from the *training* split (``speculate.training``'s
self-distillation data), so a head learns from the same kinds of answers it is measured on, never the same
documents.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from runtime.data import wiki_docs, wiki_split

CATEGORIES = ("summarization", "qa", "rewriting", "translation", "chat", "continuation")
# Rewriting / translation passages: SmolLM2's tokenizer averages 4.7 characters per token on the extracts (the
# most in 400 documents: 6.7; typos split words: 4.1), so 7 characters per token keep the passage longer than
# the answer.
COPY_CHARS_PER_TOKEN = 7.0


class SuiteError(ValueError):
    pass


@dataclass
class SuitePrompt:
    category: str
    title: str
    messages: list[dict]
    reference: str = ""
    language: str = "en"


# ---- the prompts -----------------------------------------------------------------------------------------


def add_typos(text: str, seed: str, every: int = 6) -> str:
    """The 'rewriting' input: about one word in ``every`` (of 4+ letters) with two inner letters swapped, seeded
    by the document; correcting them is an editing task whose output copies most of its input."""
    rng = random.Random(seed)

    def swap(m: re.Match) -> str:
        w = m.group(0)
        if rng.randrange(every):
            return w
        i = rng.randrange(1, len(w) - 2)
        return w[:i] + w[i + 1] + w[i] + w[i + 2 :]

    return re.sub(r"[A-Za-z]{4,}", swap, text)


def first_sentences(text: str, n: int) -> str:
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return " ".join(parts[:n])


def build_suite(
    per_category: int,
    seed: int = 0,
    min_chars: int = 300,
    max_chars: int = 900,
    copy_tokens: int = 128,
    split: str = "eval",
    strict: bool = True,
    categories: tuple[str, ...] = CATEGORIES,
) -> list[SuitePrompt]:
    """per_category prompts of each of ``categories``, documents drawn with a fixed seed from ``split`` (each
    document used once). strict: a category the split cannot fill is a SuiteError; otherwise it gets what there is.

    Rewriting and translation answers are as long as their passage, so their passages hold at least
    ``copy_tokens`` tokens (COPY_CHARS_PER_TOKEN characters each): a shorter passage ends the answer early and
    the rest of a fixed-length generation is the model inventing a new conversation after its end-of-turn,
    which measures neither task."""
    if per_category < 1:
        raise SuiteError(f"per_category must be >= 1, got {per_category}")
    unknown = set(categories) - set(CATEGORIES)
    if unknown:
        raise SuiteError(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")
    evaluation = wiki_split(split)
    docs = [d for d in evaluation if min_chars <= len(d.extract) <= max_chars]
    copy_min = int(copy_tokens * COPY_CHARS_PER_TOKEN)
    long_docs = [d for d in evaluation if len(d.extract) >= copy_min]
    rng = random.Random(seed)
    rng.shuffle(docs)
    rng.shuffle(long_docs)
    parallel = {lang: {d.title: d for d in wiki_docs(lang)} for lang in ("fr", "es")}
    out: list[SuitePrompt] = []
    used: set[str] = set()

    def take(category: str, pred, pool=docs) -> list:
        picked = []
        if category not in categories:
            return picked
        for d in pool:
            if d.title not in used and pred(d):
                picked.append(d)
                used.add(d.title)
                if len(picked) == per_category:
                    return picked
        if not strict:
            return picked
        if pool is long_docs:
            raise SuiteError(
                f"the {split} split has too few passages of >= {copy_min} characters (~{copy_tokens} tokens) for "
                f"{per_category} rewriting/translation prompts; lower --max-tokens (its longest passage: "
                f"{max(len(d.extract) for d in evaluation)} characters)"
            )
        raise SuiteError(f"the {split} split has too few documents for {per_category} prompts per category")

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    for d in take("summarization", lambda d: bool(d.description)):
        out.append(
            SuitePrompt(
                "summarization",
                d.title,
                user(f"Summarize the following passage in one sentence.\n\n{d.extract}"),
                reference=d.description,
            )
        )
    for d in take("qa", lambda d: True):
        out.append(
            SuitePrompt(
                "qa",
                d.title,
                user(
                    f"Answer the question using only the passage.\n\nPassage: {d.extract}\n\n"
                    f"Question: What is {d.title}, and what is it known for?"
                ),
            )
        )
    for d in take("rewriting", lambda d: True, long_docs):
        out.append(
            SuitePrompt(
                "rewriting",
                d.title,
                user(
                    "Rewrite the following passage with its spelling mistakes corrected. Change nothing else.\n\n"
                    f"{add_typos(d.extract, d.title)}"
                ),
                reference=d.extract,
            )
        )
    for i, d in enumerate(
        take("translation", lambda d: d.title in parallel["fr"] or d.title in parallel["es"], long_docs)
    ):
        lang = "fr" if d.title in parallel["fr"] and (i % 2 == 0 or d.title not in parallel["es"]) else "es"
        name = {"fr": "French", "es": "Spanish"}[lang]
        out.append(
            SuitePrompt(
                "translation",
                d.title,
                user(f"Translate the following passage into {name}.\n\n{d.extract}"),
                reference=parallel[lang][d.title].extract,
                language=lang,
            )
        )
    for d in take("chat", lambda d: True):
        out.append(
            SuitePrompt(
                "chat",
                d.title,
                [
                    {"role": "user", "content": f"Tell me about {d.title}."},
                    {"role": "assistant", "content": d.extract},
                    {"role": "user", "content": "Thanks! Can you explain that again in simpler words, for a child?"},
                ],
            )
        )
    for d in take("continuation", lambda d: len(re.split(r"(?<=[.!?])\s+", d.extract)) >= 3):
        out.append(
            SuitePrompt(
                "continuation", d.title, user(f"Continue the following text.\n\n{first_sentences(d.extract, 2)}")
            )
        )
    return out


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
