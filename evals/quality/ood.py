"""In-domain and out-of-domain quality of quantization recipes: score models on every evaluation text, then
tabulate perplexity and the share of the RTN gap each recipe closes, text by text.

One JSONL file per recipe (its file name is the recipe's label): the quantizer CLIs' ``--record`` and
``score`` below both append records carrying ``perplexity`` and ``window_nlls`` per text; a later record adds
texts (or replaces a text) of the same recipe. ``gap closed = (ppl_RTN - ppl) / (ppl_RTN - ppl_fp32)`` on the
same windows of the same text (100 % = fp32 quality, 0 % = RTN, negative = worse than RTN).

    python -m evals.quality.ood score --model /tmp/gptq4 --eval wiki:8,chat:8 --record notes/results/issue-20/gptq.jsonl
    python -m evals.quality.ood table --dir notes/results/issue-20 --rtn rtn-g64 --held-out chat
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from quantize.cli import CachedTokenizer, evaluate, write_record
from runtime.loader import load_model, load_tokenizer
from runtime.provenance import module_command
from runtime.provenance import provenance as record_provenance


def load_results(path: Path) -> dict:
    """Merge a recipe file's records: {text: {"ppl", "windows", "nlls"}} (later records win per text)."""
    out: dict = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        for text, nlls in (rec.get("window_nlls") or {}).items():
            out[text] = {"ppl": rec["perplexity"][text], "windows": len(nlls), "nlls": nlls}
    return out


def ppl_of(nlls: list[float], seqlen: int = 512) -> float:
    return math.exp(sum(nlls) / (len(nlls) * (seqlen - 1)))


def gap_closed(ppl: float, rtn: float, fp32: float) -> float:
    """Percent of the RTN-to-fp32 perplexity gap a recipe recovers."""
    if rtn == fp32:
        return float("nan")
    return 100.0 * (rtn - ppl) / (rtn - fp32)


def table(
    results: dict[str, dict], rtn: str, fp32: str = "fp32", held_out: str | None = None, delta: bool = False
) -> str:
    """Markdown: one row per recipe, perplexity and gap closed per text, and the mean gap closed out of domain
    (every text but wiki and the held-out one). Windows are cut to the fewest any recipe has for that text.
    delta=True shows the perplexity change vs fp32 instead (8-bit rows), and the worst text's."""
    texts = sorted({t for r in results.values() for t in r}, key=lambda t: (t != "wiki", t == held_out, t))
    common = {t: min(r[t]["windows"] for r in results.values() if t in r) for t in texts}
    ood = [t for t in texts if t not in ("wiki", held_out)]

    def ppl(label: str, text: str) -> float | None:
        r = results.get(label, {}).get(text)
        return None if r is None else ppl_of(r["nlls"][: common[text]])

    last = "worst abs. change vs fp32" if delta else "mean gap closed, OOD"
    head = "| recipe | " + " | ".join(f"{t} ({common[t]}w)" for t in texts) + f" | {last} |"
    lines = [head, "|" + "---|" * (len(texts) + 2)]
    rows = []
    for label in results:
        cells, gaps = [], []
        for t in texts:
            p, base, top = ppl(label, t), ppl(rtn, t), ppl(fp32, t)
            if p is None:
                cells.append("–")
                continue
            if delta and top is not None and label != fp32:
                d = 100.0 * (p / top - 1)
                cells.append(f"{p:.3f} ({d:+.2f} %)")
                gaps.append(-abs(d))
                continue
            if base is None or top is None or label in (rtn, fp32):
                cells.append(f"{p:.3f}")
                continue
            g = gap_closed(p, base, top)
            cells.append(f"{p:.3f} ({g:+.1f} %)")
            if t in ood:
                gaps.append(g)
        if delta:
            mean = min(gaps) if gaps else None  # the worst |change| over every text
        else:
            mean = sum(gaps) / len(gaps) if gaps and len(gaps) == len(ood) else None
        rows.append((label, cells, mean))
    rows.sort(key=lambda r: (r[0] != fp32, r[0] != rtn, -(r[2] if r[2] is not None else -1e9)))
    for label, cells, mean in rows:
        shown = "–" if mean is None else (f"{-mean:.2f} %" if delta else f"{mean:+.1f} %")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {shown} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m evals.quality.ood", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score", help="perplexity of a model on texts, appended to a recipe's JSONL")
    s.add_argument("--model", default="smollm2-135m", help="model spec or a quantized checkpoint dir")
    s.add_argument("--eval", required=True, help="texts: wiki:8,wiki-es:8,wiki-fr:8,wiki-desc:8,chat:8")
    s.add_argument("--eval-windows", type=int, default=8, help="windows of 512 tokens where a text gives no count")
    s.add_argument("--record", default=None, help="append the record to this JSONL (the recipe's file)")
    s.add_argument("--threads", type=int, default=None)
    t = sub.add_parser("table", help="Markdown table of every recipe file in a directory")
    t.add_argument("--dir", required=True, help="directory of <recipe>.jsonl files")
    t.add_argument("--rtn", required=True, help="label of the RTN baseline (same group size)")
    t.add_argument("--fp32", default="fp32", help="label of the float baseline")
    t.add_argument("--held-out", default=None, help="text left out of the out-of-domain mean (reported apart)")
    t.add_argument("--only", default=None, help="comma list of labels to show (default all)")
    t.add_argument("--delta", action="store_true", help="perplexity change vs fp32 instead of gap closed (W8A8)")
    args = ap.parse_args(argv)
    if args.cmd == "score":
        if args.threads:
            torch.set_num_threads(args.threads)
        model, _, path = load_model(args.model, torch.float32)
        tokenizer = CachedTokenizer(load_tokenizer(str(path)))
        try:
            record = {"model": args.model, **evaluate(model, tokenizer, args.eval, args.eval_windows)}
        except ValueError as err:
            ap.error(str(err))
        record.update(record_provenance(command=module_command("evals.quality.ood", argv)))
        write_record(record, args.record)
        return
    files = sorted(Path(args.dir).glob("*.jsonl"))
    results = {f.stem: load_results(f) for f in files}
    if args.only:
        keep = args.only.split(",")
        results = {k: results[k] for k in keep if k in results}
    for needed in (args.rtn, args.fp32):
        if needed not in results:
            ap.error(f"no {needed}.jsonl in {args.dir}")
    print(table(results, args.rtn, args.fp32, args.held_out, args.delta))


if __name__ == "__main__":
    main()
