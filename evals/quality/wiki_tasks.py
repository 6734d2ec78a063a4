"""Offline lm-eval tasks built reproducibly from the wiki package's evaluation split (documents 0..4999).

``build_tasks(out_dir)`` writes one JSONL file and one lm-eval YAML per task, deterministic in the seed:
- ``qspec_wiki_topic``: multiple choice over the package's topics, from the article's opening (title
  included, as an encyclopedia reader sees it);
- ``qspec_wiki_title``: pick the right title among 4 (3 distractors from the same topic) for an extract
  whose mentions of its own title are masked;
- ``qspec_wiki_lastword``: LAMBADA-style, predict the last word of an extract (accuracy = greedy match of the
  whole word, plus perplexity of the word);
- ``qspec_wiki_ppl``: rolling log-likelihood of whole extracts (word/byte perplexity, bits per byte).
The calibration/training split (documents >= 5000) is never read, so quantizers calibrated there and Medusa
heads trained there are scored on unseen text.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

from runtime.data import wiki_split

TASKS = ("qspec_wiki_topic", "qspec_wiki_title", "qspec_wiki_lastword", "qspec_wiki_ppl")
GROUP = "qspec_wiki"
VERSION = 1  # bump when the construction changes, so cached data is rebuilt


def opening(text: str, max_chars: int) -> str:
    """The first sentences of text that fit in max_chars (at least one sentence, cut at a word if needed)."""
    sentences = re.split(r"(?<=[.!?])\s+", text.strip())
    out = sentences[0]
    for s in sentences[1:]:
        if len(out) + 1 + len(s) > max_chars:
            break
        out += " " + s
    if len(out) > max_chars:
        out = out[:max_chars].rsplit(" ", 1)[0] + " ..."
    return out


def topic_docs(seed: int, n: int) -> list[dict]:
    docs = [d for d in wiki_split("eval") if d.topic]
    topics = sorted({d.topic for d in docs})
    rng = random.Random(seed)
    picked = rng.sample(docs, min(n, len(docs)))
    return [
        {
            "text": f"Article: {d.title}. {opening(d.extract, 300)}\nTopic:",
            "choices": topics,
            "label": topics.index(d.topic),
            "title": d.title,
        }
        for d in picked
    ]


def mask_title(text: str, title: str) -> str:
    masked = re.sub(re.escape(title), "___", text, flags=re.IGNORECASE)
    base = re.sub(r"\s*\(.*\)$", "", title)  # "Mercury (planet)" is written "Mercury" in its extract
    if base and base != title:
        masked = re.sub(re.escape(base), "___", masked, flags=re.IGNORECASE)
    return masked


def title_docs(seed: int, n: int) -> list[dict]:
    docs = [d for d in wiki_split("eval") if d.topic]
    by_topic: dict[str, list] = {}
    for d in docs:
        by_topic.setdefault(d.topic, []).append(d)
    rng = random.Random(seed + 1)
    out = []
    for d in rng.sample(docs, min(n, len(docs))):
        pool = [o.title for o in by_topic[d.topic] if o.title != d.title]
        choices = rng.sample(pool, 3) + [d.title]
        rng.shuffle(choices)
        out.append(
            {
                "text": f"Text: {mask_title(opening(d.extract, 300), d.title)}\nTitle of this article:",
                "choices": choices,
                "label": choices.index(d.title),
                "title": d.title,
            }
        )
    return out


def lastword_docs(seed: int, n: int) -> list[dict]:
    out = []
    for d in wiki_split("eval"):
        text = opening(d.extract, 400).removesuffix(" ...")
        m = re.fullmatch(r"(.+\S)\s+([A-Za-z]{3,})\.", text, flags=re.DOTALL)
        if m:  # ends "... word." : the context is everything before the word, the target the word
            out.append({"context": m.group(1), "target": " " + m.group(2), "title": d.title})
    rng = random.Random(seed + 2)
    return rng.sample(out, min(n, len(out)))


def ppl_docs(seed: int, n: int) -> list[dict]:
    return [{"text": d.extract, "title": d.title} for d in wiki_split("eval")[:n]]


def task_yaml(task: str, data_file: Path) -> str:
    head = [
        f"task: {task}",
        f"tag: [{GROUP}]",
        "dataset_path: json",
        "dataset_kwargs:",
        f"  data_files: {{test: {json.dumps(str(data_file))}}}",
        "test_split: test",
    ]
    if task in ("qspec_wiki_topic", "qspec_wiki_title"):
        body = [
            "output_type: multiple_choice",
            'doc_to_text: "{{text}}"',
            'doc_to_choice: "{{choices}}"',
            'doc_to_target: "{{label}}"',
            "metric_list:",
            "  - {metric: acc, aggregation: mean, higher_is_better: true}",
            "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}",
        ]
    elif task == "qspec_wiki_lastword":
        body = [
            "output_type: loglikelihood",
            'doc_to_text: "{{context}}"',
            'doc_to_target: "{{target}}"',
            "metric_list:",
            "  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}",
            "  - {metric: acc, aggregation: mean, higher_is_better: true}",
        ]
    else:
        body = [
            "output_type: loglikelihood_rolling",
            'doc_to_text: ""',
            'doc_to_target: "{{text}}"',
            "metric_list:",
            "  - {metric: word_perplexity}",
            "  - {metric: byte_perplexity}",
            "  - {metric: bits_per_byte}",
        ]
    return "\n".join(head + body + ["metadata:", f"  version: {VERSION}.0", ""])


BUILDERS = {
    "qspec_wiki_topic": topic_docs,
    "qspec_wiki_title": title_docs,
    "qspec_wiki_lastword": lastword_docs,
    "qspec_wiki_ppl": ppl_docs,
}


def build_tasks(out_dir: str | Path, seed: int = 0, n: int = 500) -> Path:
    """Write <task>.jsonl + <task>.yaml for every offline task (n documents each) and a manifest; reuse a
    previous build with the same seed, n and version. Returns the directory for TaskManager(include_path=)."""
    out = Path(out_dir) / f"wiki-v{VERSION}-seed{seed}-n{n}"
    manifest = out / "manifest.json"
    if manifest.is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    summary = {"version": VERSION, "seed": seed, "n": n, "split": "eval (documents 0..4999)", "tasks": {}}
    for task, builder in BUILDERS.items():
        rows = builder(seed, n)
        data = out / f"{task}.jsonl"
        payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        data.write_text(payload, encoding="utf-8")
        (out / f"{task}.yaml").write_text(task_yaml(task, data))
        summary["tasks"][task] = {"docs": len(rows), "sha256": hashlib.sha256(payload.encode()).hexdigest()}
    manifest.write_text(json.dumps(summary, indent=2))
    return out
