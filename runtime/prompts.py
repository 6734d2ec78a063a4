"""Chat-templated task prompts built offline from the shipped wiki summaries: the workload categories of
``evals.speculation.specbench`` (summarization, passage QA, rewriting, translation, multi-turn chat, continuation).

One builder serves both sides of a split: the suite draws its prompts from the *evaluation* split (documents
< 5000), and the draft-head trainers draw theirs from the *training* split (``speculate.training``'s
self-distillation data), so a head learns from the same kinds of answers it is measured on, never the same
documents.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

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


@dataclass
class DocPicker:
    """Draws documents for the suite's categories in its seeded order, each document at most once."""

    per_category: int
    categories: tuple[str, ...]
    strict: bool
    split: str
    evaluation: list  # every document of the split
    docs: list  # passages of min_chars..max_chars characters, shuffled
    long_docs: list  # passages long enough to copy copy_tokens tokens from, shuffled
    copy_tokens: int
    copy_min: int  # characters of a long passage
    used: set[str] = field(default_factory=set)

    def take(self, category: str, pred, long: bool = False) -> list:
        """Up to per_category unused documents with pred(d) from the short (or the long) pool; none for a category
        not asked for. strict: fewer than per_category is a SuiteError."""
        picked = []
        if category not in self.categories:
            return picked
        for d in self.long_docs if long else self.docs:
            if d.title not in self.used and pred(d):
                picked.append(d)
                self.used.add(d.title)
                if len(picked) == self.per_category:
                    return picked
        if not self.strict:
            return picked
        if long:
            raise SuiteError(
                f"the {self.split} split has too few passages of >= {self.copy_min} characters (~{self.copy_tokens} "
                f"tokens) for {self.per_category} rewriting/translation prompts; lower --max-tokens (its longest "
                f"passage: {max(len(d.extract) for d in self.evaluation)} characters)"
            )
        raise SuiteError(f"the {self.split} split has too few documents for {self.per_category} prompts per category")


def any_doc(d) -> bool:
    return True


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def summarization_prompts(picker: DocPicker) -> list[SuitePrompt]:
    return [
        SuitePrompt(
            "summarization",
            d.title,
            user(f"Summarize the following passage in one sentence.\n\n{d.extract}"),
            reference=d.description,
        )
        for d in picker.take("summarization", lambda d: bool(d.description))
    ]


def qa_prompts(picker: DocPicker) -> list[SuitePrompt]:
    def question(d) -> str:
        return (
            f"Answer the question using only the passage.\n\nPassage: {d.extract}\n\n"
            f"Question: What is {d.title}, and what is it known for?"
        )

    return [SuitePrompt("qa", d.title, user(question(d))) for d in picker.take("qa", any_doc)]


def rewriting_prompts(picker: DocPicker) -> list[SuitePrompt]:
    task = "Rewrite the following passage with its spelling mistakes corrected. Change nothing else.\n\n"
    return [
        SuitePrompt("rewriting", d.title, user(task + add_typos(d.extract, d.title)), reference=d.extract)
        for d in picker.take("rewriting", any_doc, long=True)
    ]


def translation_prompts(picker: DocPicker, parallel: dict[str, dict]) -> list[SuitePrompt]:
    """Long passages with a French or Spanish twin (alternating where a passage has both)."""
    out = []
    docs = picker.take("translation", lambda d: d.title in parallel["fr"] or d.title in parallel["es"], long=True)
    for i, d in enumerate(docs):
        lang = "fr" if d.title in parallel["fr"] and (i % 2 == 0 or d.title not in parallel["es"]) else "es"
        name = {"fr": "French", "es": "Spanish"}[lang]
        text = f"Translate the following passage into {name}.\n\n{d.extract}"
        out.append(SuitePrompt("translation", d.title, user(text), parallel[lang][d.title].extract, language=lang))
    return out


def chat_prompts(picker: DocPicker) -> list[SuitePrompt]:
    follow_up = "Thanks! Can you explain that again in simpler words, for a child?"
    return [
        SuitePrompt(
            "chat",
            d.title,
            [
                {"role": "user", "content": f"Tell me about {d.title}."},
                {"role": "assistant", "content": d.extract},
                {"role": "user", "content": follow_up},
            ],
        )
        for d in picker.take("chat", any_doc)
    ]


def continuation_prompts(picker: DocPicker) -> list[SuitePrompt]:
    docs = picker.take("continuation", lambda d: len(re.split(r"(?<=[.!?])\s+", d.extract)) >= 3)
    task = "Continue the following text.\n\n"
    return [SuitePrompt("continuation", d.title, user(task + first_sentences(d.extract, 2))) for d in docs]


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
    picker = DocPicker(per_category, categories, strict, split, evaluation, docs, long_docs, copy_tokens, copy_min)
    # in this order: each category takes the documents the ones before it left
    return [
        *summarization_prompts(picker),
        *qa_prompts(picker),
        *rewriting_prompts(picker),
        *translation_prompts(picker, parallel),
        *chat_prompts(picker),
        *continuation_prompts(picker),
    ]


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
