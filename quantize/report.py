"""Tabulate quantizer result records (the JSONL that ``--record`` appends to): perplexity of each record on
the same first N windows of each text (recomputed from the stored per-window NLLs, so runs evaluated on more
windows compare on the common prefix), and the share of the RTN-over-fp32 perplexity gap each method
recovers, against the RTN record with the same grid (bits, group size, symmetry).

    python -m quantize.report results.jsonl [--windows wiki:8,wiki-fr:4] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def label(record: dict) -> str:
    qc = record.get("quant_config")
    if not qc:
        return "fp32"
    method = qc.get("quant_method", "?")
    group = "per-channel" if qc["group_size"] == -1 else f"g{qc['group_size']}"
    parts = [method, f"{qc['bits']}-bit", group, "sym" if qc.get("sym") else "asym"]
    if qc.get("act_order"):
        parts.append("act-order" + ("+static" if qc.get("static_groups") else ""))
    if qc.get("damp_percent") not in (None, 0.01):
        parts.append(f"damp{qc['damp_percent']}")
    if qc.get("mse") or qc.get("mse_clip"):
        parts.append("mse")
    if "smooth_alpha" in qc:
        parts.append(f"smooth{qc['smooth_alpha']}")
    if "nsamples" in qc:
        parts.append(f"n{qc['nsamples']}x{qc['seqlen']}")
    if "awq" in qc:
        parts.append(f"awq-grid{qc['awq']['grid']}-search{qc['awq']['search_windows']}")
    if qc.get("lm_head"):
        parts.append("+lm_head")  # tied models: the embedding shares the quantized head
    return " ".join(parts)


def grid_key(record: dict) -> tuple | None:
    qc = record.get("quant_config")
    if not qc:
        return None
    return qc["bits"], qc["group_size"], bool(qc.get("sym")), bool(qc.get("act_quant")), bool(qc.get("lm_head"))


def prefix_ppl(nlls: list[float], n: int, seqlen: int = 512) -> float:
    return math.exp(sum(nlls[:n]) / (n * (seqlen - 1)))


def tabulate(records: list[dict], windows: dict[str, int] | None = None) -> tuple[list[str], list[list]]:
    records = [r for r in records if r.get("window_nlls")]
    texts = sorted({t for r in records for t in r["window_nlls"]}, key=lambda t: (t != "wiki", t))
    if windows is None:  # the largest prefix every record has
        windows = {t: min(len(r["window_nlls"][t]) for r in records if t in r["window_nlls"]) for t in texts}
    # a record evaluated on fewer windows than asked has no figure for that text (never a shorter prefix)
    ppl = [
        {
            t: prefix_ppl(r["window_nlls"][t], windows[t])
            for t in texts
            if len(r["window_nlls"].get(t, [])) >= windows[t]
        }
        for r in records
    ]
    fp32 = next((p for r, p in zip(records, ppl) if not r.get("quant_config")), None)
    rtn = {grid_key(r): p for r, p in zip(records, ppl) if (r.get("quant_config") or {}).get("quant_method") == "rtn"}
    header = ["method"] + [f"{t} ppl ({windows[t]} win)" for t in texts]
    header += [f"{t} gap recovered" for t in texts] + ["quantize s", "cpu s"]
    rows = []
    for r, p in zip(records, ppl):
        row = [label(r)] + [round(p[t], 4) if t in p else None for t in texts]
        base = rtn.get(grid_key(r))
        for t in texts:
            if fp32 and base and t in p and base[t] != fp32[t] and r["quant_config"]["quant_method"] != "rtn":
                row.append(f"{(base[t] - p[t]) / (base[t] - fp32[t]):+.1%}")
            else:
                row.append("")
        row += [r.get("stats", {}).get("quantize_seconds", ""), r.get("cpu_seconds", "")]
        rows.append(row)
    return header, rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m quantize.report", description=__doc__.splitlines()[0])
    ap.add_argument("records", help="JSONL file written by the quantizer CLIs' --record")
    ap.add_argument("--windows", default=None, help="windows per text, e.g. wiki:8,wiki-fr:4 (default: common)")
    args = ap.parse_args(argv)
    path = Path(args.records)
    if not path.is_file():
        ap.error(f"no such records file: {path}")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    windows = None
    if args.windows:
        windows = {t: int(n) for t, _, n in (item.partition(":") for item in args.windows.split(","))}
    header, rows = tabulate(records, windows)
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join("" if v is None else str(v) for v in row) + " |")


if __name__ == "__main__":
    main()
