"""Render records: a Markdown table and a CSV of the rows, and PNG plots (labelled axes with units, legend)."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from evals.speculation.lossless import deterministic_class
from experiments.config import ExperimentConfig, expand_grid, from_dict

CLASS_COLORS = {"exact": "tab:green", "same math": "tab:blue", "same distribution": "tab:purple"}
CLASS_COLORS["approximate"] = "tab:red"
TASK_SHORT = {"qspec_wiki_topic": "topic", "qspec_wiki_title": "title", "qspec_wiki_lastword": "last word"}


def fmt(x, spec: str, missing: str = "—") -> str:
    return missing if x is None else format(x, spec)


def table_rows(records: list[dict]) -> list[dict]:
    """One flat dict per record: the table's columns (None where not measured)."""
    out = []
    for r in records:
        res = r.get("results", {})
        fid, greedy, speed = res.get("fidelity"), res.get("greedy"), res.get("speed") or suite_speed(res)
        row = {
            "row": r["row"]["name"],
            "class": r["row"]["lossless_class"],
            "status": r["status"],
            "check": res.get("claim_check", r.get("reason", "")),
            "verdict": measured_class(r["row"]["lossless_class"], res),
            "greedy_match_pct": None if greedy is None else 100 * greedy["match_rate"],
            "max_abs_dlogprob": None if fid is None else fid["max_abs_dlogprob"],
            "mean_kl": None if fid is None else fid["mean_kl"],
            "top1_agreement_pct": None if fid is None else 100 * fid["top1_agreement"],
            "perplexity": None if fid is None else fid["test_perplexity"],
            # Δ against the reference on the same sequences (engine rows score their own greedy outputs)
            "perplexity_delta": None if fid is None else fid["test_perplexity"] - fid["ref_perplexity"],
            "scored_on": None if fid is None else fid.get("sequences"),
            "speedup": None if speed is None else speed["speedup"],
            "baseline": None if speed is None else speed["baseline"],
            "tokens_per_s": None if speed is None else speed["variant_tokens_per_s"],
            "weight_mb": None if "weight_bytes" not in res else res["weight_bytes"] / 1e6,
        }
        for task, metrics in (res.get("tasks") or {}).items():
            acc = metrics.get("acc")
            if acc:
                row[f"acc:{task}"] = acc["value"]
                row[f"acc_stderr:{task}"] = acc["stderr"]
        if "humaneval" in res:
            row.update(humaneval_columns(res["humaneval"], r["row"]["kind"] == "reference"))
        out.append(row)
    return humaneval_deltas(out)


def humaneval_columns(he: dict, reference: bool) -> dict:
    """A record's HumanEval figures as flat columns: pass@1, its 95% Wilson interval, passed / problems, and a note
    where the row carries the reference's figure (lossless) or none."""
    lo, hi = he.get("ci95") or (None, None)
    note = "same as reference (lossless)" if he.get("same_as_reference") else he.get("not_measured", "")
    return {
        "humaneval_pass_at_1": he.get("pass_at_1"),
        "humaneval_ci95_lo": lo,
        "humaneval_ci95_hi": hi,
        "humaneval_passed": he.get("passed"),
        "humaneval_problems": he.get("problems"),
        "humaneval_delta": None,
        "humaneval_reference": reference,
        "humaneval_note": note,
    }


def humaneval_deltas(rows: list[dict]) -> list[dict]:
    """Each measured row's pass@1 minus the reference row's (kind reference), on the same problems."""
    ref = next((r for r in rows if r.get("humaneval_reference") and r["humaneval_pass_at_1"] is not None), None)
    for r in rows:
        if ref is not None and r.get("humaneval_pass_at_1") is not None and r is not ref:
            if r["humaneval_problems"] == ref["humaneval_problems"]:
                r["humaneval_delta"] = r["humaneval_pass_at_1"] - ref["humaneval_pass_at_1"]
    return rows


def humaneval_cell(r: dict, ref: dict | None) -> str:
    """pass@1 [95% CI] (passed/problems), Δ vs the reference; a lossless row's is the reference's."""
    if r.get("humaneval_pass_at_1") is not None:
        cell = (
            f"{r['humaneval_pass_at_1']:.3f} [{r['humaneval_ci95_lo']:.2f}, {r['humaneval_ci95_hi']:.2f}] "
            f"({r['humaneval_passed']}/{r['humaneval_problems']})"
        )
        return cell if r["humaneval_delta"] is None else f"{cell}, Δ {r['humaneval_delta']:+.3f}"
    if r.get("humaneval_note") == "same as reference (lossless)":
        ref_p = None if ref is None else ref["humaneval_pass_at_1"]
        return "same as reference (lossless)" + ("" if ref_p is None else f": {ref_p:.3f}")
    return "not measured ²" if "humaneval_note" in r else "—"


CLASS_ORDER = ("exact", "same math", "same distribution", "approximate")
OWN_OUTPUTS = "engine greedy outputs"  # fidelity "sequences" of rows scored on their own outputs


def short_baseline(text: str | None) -> str:
    """A few words for a row's speed baseline (the table keeps the full wording)."""
    if not text:
        return ""
    rules = (
        ("full recompute", "no KV cache"),
        ("contiguous KV cache", "contiguous cache"),
        ("same engine without prefix", "no prefix cache"),
        ("static batching", "static batching"),
        ("the same prompts one at a time", "one prompt at a time"),
        ("naive attention", "naive attention"),
        ("the unquantized model in bf16", "bf16 model"),
    )
    for prefix, short in rules:
        if text.startswith(prefix):
            return short
    if text.startswith("plain decode (contiguous cache, batch 1, "):  # a model row's baseline: the reference
        return text.removeprefix("plain decode (contiguous cache, batch 1, ").rstrip(")") + " decode"
    if text.startswith("plain decoding"):
        temp = text.rsplit("temperature", 1)[-1].strip()
        return f"plain decoding, T={temp}" if "temperature" in text else "plain decoding"
    return text.split("(")[0].strip()[:28]


def ordered(rows: list[dict]) -> list[dict]:
    """Rows grouped by lossless class (exact first, approximate last), the config's order within a class."""
    rank = {c: i for i, c in enumerate(CLASS_ORDER)}
    return sorted(rows, key=lambda r: rank.get(r["class"], len(rank)))


def quality_cell(r: dict) -> str:
    """Δ perplexity vs the reference, teacher-forced; rows scored on their own outputs are kept apart."""
    if r["perplexity"] is None:
        return "—"
    if r["scored_on"] == OWN_OUTPUTS:
        return "n/a ¹"
    return f"{r['perplexity_delta']:+.3f} ({r['perplexity']:.3f})"


def render_table(cfg, records: list[dict], out_dir: Path) -> list[Path]:
    rows = ordered(table_rows(records))
    tasks = sorted({k.split(":", 1)[1] for r in rows for k in r if k.startswith("acc:")})
    seqlen, n = cfg.evals.fidelity_seqlen, cfg.evals.fidelity_sequences
    head = ["row", "lossless class", "speedup (vs)", "Δ perplexity (ppl)", "greedy match %", "max abs Δ log-prob"]
    head += [f"{TASK_SHORT.get(t, t)} acc ± se" for t in tasks]
    he = any("humaneval_note" in r for r in rows)
    he_ref = next((r for r in rows if r.get("humaneval_reference") and r["humaneval_pass_at_1"] is not None), None)
    head += ["HumanEval pass@1"] * he + ["weights MB", "tok/s", "check"]
    own = [r for r in rows if r["scored_on"] == OWN_OUTPUTS and r["perplexity"] is not None]
    ref = f"{cfg.model.dtype} reference"
    lines = [
        f"# {cfg.name}: what does each speedup cost in quality, and what does it buy?",
        "",
        cfg.description.strip(),
        "",
        f"Speedup: median of {cfg.bench.repeats} interleaved runs against the one baseline named in the cell, same "
        f"run (rows have different baselines: read each against its own). Δ perplexity: wiki eval split, {n} "
        f"windows x {seqlen} tokens, teacher-forced through the row's path, minus the {ref}'s on the same "
        f"tokens. Greedy match: {cfg.evals.greedy_prompts} prompts x {cfg.evals.greedy_tokens} new tokens vs plain "
        f"{cfg.model.dtype} decoding (tokens before the first divergence). Tasks: lm-eval, {cfg.evals.task_limit} "
        "documents each." + (humaneval_legend(cfg) if he else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 3) + ["---"]) + "|",
    ]
    for r in rows:
        if r["status"] != "ok":
            cells = [r["row"], r["class"]] + ["—"] * (len(head) - 3) + [f"{r['status']}: {r['check']}"]
        else:
            cells = row_cells(r, tasks, he_ref if he else False)
        lines.append("| " + " | ".join(cells) + " |")
    if own:
        listed = ", ".join(f"{r['row']} {r['perplexity']:.3f} (Δ {r['perplexity_delta']:+.3f})" for r in own)
        lines += [
            "",
            "¹ Engine rows emit tokens, not logits over the eval text: they are scored on their own greedy outputs "
            f"with the logits their sampler saw, against the {cfg.model.dtype} model on the same tokens. Perplexity "
            f"of a model's own greedy text is far lower and is not comparable with the column: {listed}.",
        ]
    unmeasured = [r for r in rows if r["status"] == "ok" and humaneval_cell(r, he_ref) == "not measured ²"]
    if unmeasured:
        listed = "; ".join(f"{r['row']}: {r['humaneval_note']}" for r in unmeasured)
        lines += ["", f"² HumanEval not measured: {listed}."]
    lines += kv_section(records)
    md = out_dir / "table.md"
    md.write_text("\n".join(lines) + "\n")
    summary = out_dir / "summary.md"
    summary.write_text(render_summary(rows) + "\n")
    csv_path = out_dir / "table.csv"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    paths = [md, summary, csv_path]
    plot = plot_table(cfg, rows, out_dir / "speedup_vs_quality.png", device_words(records))
    if plot:
        paths.append(plot)
    return paths


def row_cells(r: dict, tasks: list[str], he_ref: dict | None | bool) -> list[str]:
    """A finished row's cells; he_ref False: no HumanEval column, else the reference row's figures (or None)."""
    sp = "baseline" if r["speedup"] is None else f"{r['speedup']:.2f}x ({r['baseline']})"
    cells = [r["row"], r["class"], sp, quality_cell(r)]
    cells += [fmt(r["greedy_match_pct"], ".1f"), fmt(r["max_abs_dlogprob"], ".2e")]
    for t in tasks:
        v, se = r.get(f"acc:{t}"), r.get(f"acc_stderr:{t}")
        cells.append("—" if v is None else f"{v:.3f} ± {se:.3f}" if se is not None else f"{v:.3f}")
    if he_ref is not False:
        cells.append(humaneval_cell(r, he_ref))
    return cells + [fmt(r["weight_mb"], ".1f"), fmt(r["tokens_per_s"], ".1f"), r["check"]]


def humaneval_legend(cfg) -> str:
    """The table's sentence on its HumanEval column."""
    he = cfg.evals.humaneval
    if he is None:  # records rendered under a config without the section
        return " HumanEval pass@1: see each record's results.humaneval."
    which = f"the {he.subset} subset" if he.subset else "all problems"
    which += f", first {he.limit}" if he.limit else ""
    return (
        f" HumanEval pass@1: {which} (evals.quality.humaneval), greedy, at most {he.max_new_tokens} new tokens, each "
        "program run in a sandbox; [95% Wilson interval] (passed/problems), Δ vs the reference row on the same "
        "problems (a Δ inside the intervals is noise at this size). Quantized rows decode with their fast kernels in "
        "bf16 (what a user deploys; their perplexity and fidelity score the weights dequantized once). Rows that "
        "change how the model decodes, not the model, are not rerun: a lossless one whose greedy output matched the "
        "reference's carries its pass@1."
    )


def kv_section(records: list[dict]) -> list[str]:
    """KV-cache rows (experiments.rows.kv_row): what each buys in memory and serving capacity, and, where measured,
    what it costs at long context (perplexity change, passkey retrieval, greedy agreement on long prompts)."""
    kv = [r for r in records if r.get("status") == "ok" and "kv_memory" in r.get("results", {})]
    if not kv:
        return []
    lines = [
        "",
        "KV cache rows (all approximate): what each buys, bytes per token in a bf16 model (codes + scales) and the "
        "serving engine's concurrent sequences under one KV budget (its own block sizing; int4 includes its residual "
        "of open key groups), and what it costs at long context (perplexity through the cache vs the full-precision "
        "cache on the same wiki windows; passkey retrieval; greedy agreement on long prompts).",
        "",
        "| row | KV bytes / token (x less than bf16) | engine sequences (bf16 → this) | long-context Δ perplexity "
        "| passkey retrieval by depth | long greedy match |",
        "|---|---:|---:|---|---|---:|",
    ]
    for r in kv:
        res = r["results"]
        mem, lc = res["kv_memory"], res.get("long_context") or {}
        if "kv_tokens_kept" in mem:
            seqs = f"bounded: {mem['kv_tokens_kept']} tokens kept"
        else:
            e = mem["engine_sequences"]
            ratio = e["this"] / e["bf16"] if e["bf16"] else float("nan")
            seqs = f"{e['bf16']} → {e['this']} ({ratio:.2f}x; {e['sequence_tokens']} tokens, {e['budget_mib']:g} MiB)"
        ppl = ", ".join(f"{n}: {x['delta_pct']:+.2f} %" for n, x in lc.get("perplexity", {}).items()) or "—"
        ret = lc.get("retrieval")
        found = "—" if not ret else ", ".join(f"{d}: {x['accuracy']:.2f}" for d, x in ret["depths"].items())
        greedy = lc.get("greedy")
        lines.append(
            f"| {r['row']['name']} | {mem['kv_bytes_per_token']:,.0f} ({mem['kv_memory_vs_bf16']:.2f}x) | {seqs} "
            f"| {ppl} | {found} | {'—' if not greedy else format(greedy['match_rate'], '.3f')} |"
        )
    return lines


def measured_class(claim: str, res: dict) -> str | None:
    """The row's class as evals.speculation.lossless decides it: the record's verdict (experiments.table.row_verdict);
    for a record from before verdicts, a model change's teacher-forced figures classified the same way; None: untested
    (a speculator without a distribution test)."""
    if res.get("verdict"):
        return res["verdict"]["verdict"]
    fid = res.get("fidelity")
    if fid is None or "speculator" in res or "bit_identical" not in fid:
        return None
    return deterministic_class(fid["bit_identical"], fid["max_abs_dlogprob"], claimed=claim != "approximate")


VERDICT_WORDS = {
    "bit-identical": "yes (bit-identical)",
    "same math": "yes (same math)",
    "same distribution": "yes (same distribution)",
    "approximate": "no (approximate)",
    "not lossless": "NO: not lossless",
    "inconclusive": "inconclusive",
}


def lossless_words(r: dict) -> str:
    """The "lossless?" column: the class evals.speculation.lossless measured for the row
    (experiments.table.row_verdict), with the row's claim where they differ; a row that was not tested shows its
    claim as a claim."""
    claim = "no (approximate)" if r["class"] == "approximate" else f"yes ({r['class']})"
    if r.get("verdict") is None:
        return f"{claim}, claimed (untested)" if r["class"] != "approximate" else claim
    words = VERDICT_WORDS.get(r["verdict"], r["verdict"])
    agrees = (r["verdict"] == "approximate") == (r["class"] == "approximate") and r["verdict"] in VERDICT_WORDS
    agrees = agrees and r["verdict"] not in ("not lossless", "inconclusive")
    return words if agrees else f"{words} (claimed {r['class']})"


def render_summary(rows: list[dict]) -> str:
    """The short form (README): lossless or not, what it buys here, what it costs. A row measured greedy and
    sampled ("X (greedy)", "X (sampled)") is one line with both speedups."""
    import re

    lines = [
        "| technique | lossless? | speedup here (vs) | quality cost: Δ perplexity, greedy match | weights |",
        "|---|---|---:|---|---:|",
    ]
    ok = [r for r in rows if r["status"] == "ok"]
    paired: dict[int, dict] = {}
    for i, r in enumerate(ok[:-1]):
        m, nxt = re.fullmatch(r"(.*) \(greedy\)", r["row"]), ok[i + 1]
        if m and nxt["row"] == f"{m.group(1)} (sampled)" and nxt["class"] == r["class"]:
            paired[i] = nxt
    skip = {i + 1 for i in paired}
    for i, r in enumerate(ok):
        if i in skip:
            continue
        lossless = lossless_words(r)
        name, sp = (
            r["row"],
            "baseline" if r["speedup"] is None else f"{r['speedup']:.2f}x ({short_baseline(r['baseline'])})",
        )
        if i in paired and r["speedup"] is not None and paired[i]["speedup"] is not None:
            other = paired[i]
            name = r["row"].removesuffix(" (greedy)") + " (greedy / sampled)"
            sp = f"{r['speedup']:.2f}x / {other['speedup']:.2f}x (plain decoding, same temperature)"
        if r["perplexity"] is None:
            cost = "—"
        elif r["scored_on"] == OWN_OUTPUTS:
            cost = f"none measurable; {fmt(r['greedy_match_pct'], '.0f')}% greedy match"
        else:
            cost = f"{r['perplexity_delta']:+.3f}, {fmt(r['greedy_match_pct'], '.0f')}% greedy match"
        if r.get("humaneval_pass_at_1") is not None:
            d = r["humaneval_delta"]
            cost += f"; HumanEval {r['humaneval_pass_at_1']:.3f}" + ("" if d is None else f" (Δ {d:+.3f})")
        lines.append(f"| {name} | {lossless} | {sp} | {cost} | {fmt(r['weight_mb'], '.0f')} MB |")
    return "\n".join(lines)


def device_words(records: list[dict]) -> str:
    dev = (records[0].get("device") or {}) if records else {}
    if not dev:
        return ""
    gpu = dev.get("cuda") or dev.get("gpu")
    return f"{gpu}" if gpu else f"CPU, {dev.get('cpu_count', '?')} cores, {dev.get('torch_threads', '?')} threads"


def plot_table(cfg, rows: list[dict], path: Path, device: str = "") -> Path | None:
    """One line per row, three panels sharing it: what it buys (speedup over its own baseline, named in the
    label), what it costs (Δ perplexity, teacher-forced only; rows scored on their own outputs are marked and
    left off that axis) and what it weighs. Colour = lossless class, one legend entry per class."""
    from matplotlib.lines import Line2D

    done = [r for r in ordered(rows) if r["status"] == "ok"]
    if not done:
        return None
    n = len(done)
    fig, (ax1, ax2, ax3) = plt.subplots(
        1, 3, figsize=(15, 0.36 * n + 2.4), sharey=True, gridspec_kw={"width_ratios": [1.25, 1.25, 0.8]}
    )
    ys = list(range(n))
    labels = []
    for y, r in zip(ys, done):
        color = CLASS_COLORS.get(r["class"], "gray")
        base = short_baseline(r["baseline"])
        labels.append(f"{r['row']}  (vs {base})" if base else f"{r['row']}  (reference)")
        if r["speedup"] is None:  # the reference: its own baseline
            ax1.scatter([1.0], [y], marker="D", facecolors="white", edgecolors=color, s=40, zorder=3)
        else:
            ax1.scatter([r["speedup"]], [y], color=color, s=40, zorder=3)
            ax1.annotate(
                f"{r['speedup']:.2f}x", (r["speedup"], y), fontsize=7, xytext=(5, -3), textcoords="offset points"
            )
        if r["perplexity"] is None:
            continue
        if r["scored_on"] == OWN_OUTPUTS:
            ax2.annotate("own outputs: not comparable", (0, y), fontsize=7, color="gray", xytext=(4, -3),
                         textcoords="offset points")  # fmt: skip
            ax2.scatter([0], [y], marker="o", facecolors="none", edgecolors="gray", s=30, zorder=3)
        else:
            d = r["perplexity_delta"]
            ax2.scatter([d], [y], color=color, s=40, zorder=3)
            if abs(d) > 0.0005:
                ax2.annotate(f"{d:+.2f}", (d, y), fontsize=7, xytext=(5, -3), textcoords="offset points")
        ax3.barh([y], [r["weight_mb"] or 0], color=color, height=0.6)
    for y, r in zip(ys, done):
        if r["weight_mb"]:
            ax3.annotate(f"{r['weight_mb']:.0f}", (r["weight_mb"], y), fontsize=7, xytext=(3, -3),
                         textcoords="offset points")  # fmt: skip
    from matplotlib.ticker import FixedLocator, NullFormatter

    speeds = [r["speedup"] for r in done if r["speedup"]] + [1.0]
    ax1.set_xscale("log")
    ax1.set_xlim(min(speeds) / 1.4, max(speeds) * 1.6)
    ticks = [t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32) if min(speeds) / 1.4 <= t <= max(speeds) * 1.6]
    ax1.xaxis.set_major_locator(FixedLocator(ticks))
    ax1.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax1.xaxis.set_minor_formatter(NullFormatter())
    ax1.axvline(1.0, color="gray", lw=0.8, ls="--")
    ax1.set_xlabel("speedup over the baseline in the label\n(log; right of 1x = faster)", fontsize=9)
    ax1.set_title("what it buys: speed", fontsize=10)
    deltas = [
        r["perplexity_delta"] for r in done if r["perplexity_delta"] is not None and r["scored_on"] != OWN_OUTPUTS
    ]
    ax2.axvline(0.0, color="gray", lw=0.8, ls="--")
    ax2.set_xscale("symlog", linthresh=0.1)
    ax2.set_xlim(min(deltas + [0]) - 0.1, max(deltas + [0.1]) * 3)
    ax2.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g}" if v else "0"))
    ax2.set_xlabel(
        f"Δ perplexity vs {cfg.model.dtype}, teacher-forced on {cfg.evals.fidelity_sequences} x "
        f"{cfg.evals.fidelity_seqlen} wiki tokens\n(symlog; right of 0 = worse)",
        fontsize=9,
    )
    ax2.set_title("what it costs: quality", fontsize=10)
    ax3.set_xlim(0, max(r["weight_mb"] or 0 for r in done) * 1.18)
    ax3.set_xlabel("weights (MB, 10^6 bytes)\n", fontsize=9)
    ax3.set_title("what it weighs: memory", fontsize=10)
    ax1.set_yticks(ys, labels, fontsize=8)
    ax1.set_ylim(n - 0.4, -0.6)  # first row on top
    for ax in (ax1, ax2, ax3):
        ax.grid(axis="x", alpha=0.3)
        for y in range(1, n):  # a rule between lossless classes
            if done[y]["class"] != done[y - 1]["class"]:
                ax.axhline(y - 0.5, color="black", lw=0.6)
    classes = [c for c in CLASS_ORDER if any(r["class"] == c for r in done)]
    handles = [Line2D([], [], marker="o", ls="", color=CLASS_COLORS[c], label=c) for c in classes]
    handles.append(Line2D([], [], marker="o", ls="", markerfacecolor="none", markeredgecolor="gray",
                          label="scored on own outputs"))  # fmt: skip
    fig.legend(handles=handles, title="lossless class (colour)", loc="upper right", ncol=len(handles), fontsize=8,
               title_fontsize=8, frameon=False)  # fmt: skip
    where = f", {device}" if device else ""
    fig.suptitle(
        f"What does each speedup cost in quality, and what does it buy?\n{cfg.model.spec}, {cfg.model.dtype} "
        f"reference{where} (config {cfg.name}); each speedup is against its own baseline",
        x=0.01,
        y=0.995,
        ha="left",
        fontsize=10.5,
    )
    height = 0.36 * n + 2.4
    fig.subplots_adjust(left=0.24, right=0.99, top=1 - 0.95 / height, bottom=0.85 / height, wspace=0.06)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    """Re-render a table config's table, summary and plot from its records (no model is loaded)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=main.__doc__)
    ap.add_argument("records", help="records.jsonl written by python -m experiments.run")
    ap.add_argument("--out", default=None, help="output directory (default: the records' directory)")
    args = ap.parse_args(argv)
    path = Path(args.records)
    if not path.is_file():
        ap.error(f"no such records file: {path}")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        ap.error(f"{path} holds no records")
    latest: dict[str, dict] = {}
    for r in records:  # records append across runs: the latest of each row counts
        latest[r["row"]["name"]] = r
    cfg = from_dict(ExperimentConfig, records[-1]["config"])
    out = Path(args.out) if args.out else path.parent
    out.mkdir(parents=True, exist_ok=True)
    for p in render_table(cfg, list(latest.values()), out) + render_grid(cfg, list(latest.values()), out):
        print(p)


# ---- grids ---------------------------------------------------------------------------------------------


def pareto_front(points: list[tuple[float, float]], maximize: tuple[bool, bool] = (False, False)) -> list[int]:
    """Indices of the points no other point beats on both axes (each axis minimised, or maximised where
    ``maximize`` says so), in increasing x."""
    signed = [(x if not maximize[0] else -x, y if not maximize[1] else -y) for x, y in points]
    front, best = [], float("inf")
    for i in sorted(range(len(signed)), key=lambda i: signed[i]):
        if signed[i][1] < best:
            front.append(i)
            best = signed[i][1]
    return sorted(front, key=lambda i: points[i][0])


def suite_speed(res: dict) -> dict | None:
    """A self-timed speculation row's speed (no timed section of its own): its suite's overall row, which timed
    plain decoding of the same prompts interleaved with it."""
    overall = suite_overall(res)
    if overall is None or overall.get("speedup_vs_plain") is None:
        return None
    return {
        "speedup": overall["speedup_vs_plain"],
        "baseline": "plain decoding of the same suite prompts, interleaved",
        "variant_tokens_per_s": overall.get("tok_per_s"),
    }


def suite_overall(res: dict) -> dict | None:
    """The specbench suite's overall row of a record (one batch size per grid row: the first)."""
    rows = [r for r in res.get("suite") or [] if r.get("category") == "overall"]
    return rows[0] if rows else None


def grid_points(records: list[dict], blocks: dict[str, str] | None = None) -> list[dict]:
    """One dict per finished row: its grid labels and block (name template; blocks: row name -> template),
    bytes per weight, perplexity per text, and for speculation rows tokens per step and speedup over plain
    decoding."""
    out = []
    for r in records:
        if r["status"] != "ok":
            continue
        res = r["results"]
        ppl = {t: v["test_perplexity"] for t, v in (res.get("texts") or {}).items()}
        ref = {t: v["ref_perplexity"] for t, v in (res.get("texts") or {}).items()}
        overall = suite_overall(res)
        spec = res.get("speculation_timed") or res.get("speculation") or {}
        out.append(
            {
                "row": r["row"]["name"],
                "grid": r["row"].get("grid") or {},
                "block": (blocks or {}).get(r["row"]["name"], ""),
                "bytes_per_weight": res.get("bytes_per_weight"),
                "weight_mb": res["weight_bytes"] / 1e6 if "weight_bytes" in res else None,
                "perplexity": ppl,
                "ref_perplexity": ref,
                "tokens_per_step": overall.get("tokens_per_step") if overall else spec.get("mean_accepted_per_step"),
                "speedup": overall.get("speedup_vs_plain") if overall else (res.get("speed") or {}).get("speedup"),
            }
        )
    return out


def render_grid(cfg, records: list[dict], out_dir: Path) -> list[Path]:
    """A grid config's table (its axes as columns, perplexity per text, Pareto membership) and plots: perplexity
    against bytes per weight (one panel per text) and speedup against tokens per step, Pareto fronts marked."""
    if not cfg.grid:
        return []
    order = {r.name: i for i, r in enumerate(cfg.rows)}
    records = sorted(records, key=lambda r: order.get(r["row"]["name"], len(order)))  # the config's order
    points = grid_points(records, {row.name: b.name for b in cfg.grid for row in expand_grid(b)})
    axes = list(dict.fromkeys(a for b in cfg.grid for a in b.axes))
    texts = list(cfg.evals.texts)
    quality = [p for p in points if p["bytes_per_weight"] is not None and p["perplexity"]]
    speed = [p for p in points if p["tokens_per_step"] is not None and p["speedup"] is not None]
    on_front: dict[str, list[str]] = {}
    for t in texts:
        pts = [p for p in quality if t in p["perplexity"]]
        for i in pareto_front([(p["bytes_per_weight"], p["perplexity"][t]) for p in pts]):
            on_front.setdefault(pts[i]["row"], []).append(t)
    for i in pareto_front([(p["tokens_per_step"], p["speedup"]) for p in speed], maximize=(True, True)):
        on_front.setdefault(speed[i]["row"], []).append("speedup")
    head = ["row", *axes, "status", "bytes / weight", *[f"ppl {t} (Δ)" for t in texts]]
    if speed:
        head += ["tokens / step", "speedup"]
    head.append("Pareto front")
    lines = [
        f"# {cfg.name}: the grid",
        "",
        cfg.description.strip(),
        "",
        "Bytes / weight: the decoder linears as stored (codes, scales, zeros). Perplexity: teacher-forced on "
        f"{cfg.evals.text_windows} eval-split windows x {cfg.evals.text_seqlen} tokens of each text; Δ against the "
        "unquantized reference on the same windows. Pareto front: no other row is smaller and better on that text "
        "(speed rows: more tokens per step and faster).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * (len(axes) + 2) + "---:|" * (len(head) - len(axes) - 3) + "---|",
    ]
    by_row = {p["row"]: p for p in points}
    for r in records:
        name, grid = r["row"]["name"], r["row"].get("grid") or {}
        cells = [name, *[str(grid.get(a, "")) for a in axes]]
        p = by_row.get(name)
        if p is None:
            cells.append(f"{r['status']}: {r.get('reason', '')}")
            cells += ["—"] * (len(head) - len(cells) - 1) + [""]
        else:
            cells += ["ok", fmt(p["bytes_per_weight"], ".3f")]
            for t in texts:
                v, ref = p["perplexity"].get(t), p["ref_perplexity"].get(t)
                cells.append("—" if v is None else f"{v:.3f} ({v - ref:+.3f})")
            if speed:
                cells += [fmt(p["tokens_per_step"], ".2f"), "—" if p["speedup"] is None else f"{p['speedup']:.2f}x"]
            cells.append(", ".join(on_front.get(name, [])))
        lines.append("| " + " | ".join(cells) + " |")
    md = out_dir / "grid.md"
    md.write_text("\n".join(lines) + "\n")
    paths = [md]
    if quality and texts:
        paths.append(plot_quality_vs_bytes(cfg, quality, texts, out_dir / "quality_vs_bytes.png"))
    if speed:
        paths.append(plot_speedup_vs_acceptance(cfg, speed, out_dir / "speedup_vs_acceptance.png"))
    return paths


def colour_key(point: dict) -> str:
    """What a point's colour says: its grid block, named by its template's text before the first field ("RTN"
    of "RTN{bits} g{group_size}"), or "reference" for a row outside the grid."""
    block = point["block"]
    return (block.split("{")[0].strip(" ,:") or block) if block else "reference"


def plain_log_axis(axis) -> None:
    """Log-scale ticks written as plain numbers (0.5, 20, 30), minor ones too where a decade has few majors."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "2358" else ""))


def plot_front(ax, pts: list[dict], xy, maximize=(False, False)) -> None:
    """Points coloured by colour_key, the Pareto front as a dashed step line with its points circled and named."""
    keys = list(dict.fromkeys(colour_key(p) for p in pts))
    for k, key in enumerate(keys):
        sel = [p for p in pts if colour_key(p) == key]
        marker = "D" if key == "reference" else "o"
        color = "black" if key == "reference" else f"C{k}"
        ax.scatter([xy(p)[0] for p in sel], [xy(p)[1] for p in sel], s=28, marker=marker, color=color, label=key)
    front = [pts[i] for i in pareto_front([xy(p) for p in pts], maximize)]
    fx, fy = [xy(p)[0] for p in front], [xy(p)[1] for p in front]
    ax.step(fx, fy, where="post", ls="--", color="gray", lw=1, label="Pareto front")
    ax.scatter(fx, fy, s=110, facecolors="none", edgecolors="black", lw=1.2, zorder=3)
    for p, x, y in zip(front, fx, fy):
        ax.annotate(p["row"], (x, y), fontsize=7, xytext=(5, 4), textcoords="offset points")


def plot_quality_vs_bytes(cfg, pts: list[dict], texts: list[str], path: Path) -> Path:
    fig, axes = plt.subplots(1, len(texts), figsize=(4.6 * len(texts) + 0.6, 4.6), squeeze=False)
    for ax, t in zip(axes[0], texts):
        sel = [p for p in pts if t in p["perplexity"]]
        plot_front(ax, sel, lambda p, t=t: (p["bytes_per_weight"], p["perplexity"][t]))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain_log_axis(ax.xaxis)
        plain_log_axis(ax.yaxis)
        ax.set_xlabel("bytes per weight, decoder linears as stored (log2)")
        ax.set_ylabel(f"perplexity on {t} (log; lower is better)")
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"{cfg.name}: quality against size, {cfg.model.spec}; {cfg.evals.text_windows} x {cfg.evals.text_seqlen} "
        "tokens per text, teacher-forced; circled: the Pareto front",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedup_vs_acceptance(cfg, pts: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 5))
    plot_front(ax, pts, lambda p: (p["tokens_per_step"], p["speedup"]), maximize=(True, True))
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("tokens per target step (1 + accepted drafts per step)")
    ax.set_ylabel("speedup over plain decoding (x, same run)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{cfg.name}: speedup against acceptance, {cfg.model.spec}; circled: the Pareto front", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- sweeps -------------------------------------------------------------------------------------------


def render_sweep(cfg, records: list[dict], out_dir: Path) -> list[Path]:
    points = [r for r in records if r["status"] == "ok"]
    lines = [f"# {cfg.name}", "", cfg.description.strip(), ""]
    keys = list(dict.fromkeys(k for r in points for k in r["results"] if not isinstance(r["results"][k], dict)))
    lines.append("| series | x | " + " | ".join(keys) + " |")
    lines.append("|---|---:|" + "---:|" * len(keys))
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['series']} | {r['x']} | {r['status']}: {r.get('reason', '')} |")
            continue
        vals = [r["results"].get(k) for k in keys]
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in vals]
        lines.append(f"| {r['series']} | {r['x']} | " + " | ".join(cells) + " |")
    md = out_dir / "table.md"
    md.write_text("\n".join(lines) + "\n")
    csv_path = out_dir / "table.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["series", "x", "status", *keys])
        writer.writeheader()
        for r in records:
            writer.writerow(
                {"series": r["series"], "x": r["x"], "status": r["status"], **{k: r["results"].get(k) for k in keys}}
            )
    paths = [md, csv_path]
    if points:
        paths.append(PLOTTERS[cfg.kind](cfg, points, out_dir))
        if cfg.kind == "concurrency":
            paths.append(plot_concurrency_percentiles(cfg, points, out_dir))
    return paths


def by_series(points: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in points:
        out.setdefault(p["series"], []).append(p)
    return {k: sorted(v, key=lambda p: p["x"]) for k, v in out.items()}


def plot_prompt_length(cfg, points, out_dir: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, pts in by_series(points).items():
        xs = [p["x"] for p in pts]
        ax1.plot(xs, [p["results"]["ttft_ms_p50"] for p in pts], marker="o", label=name)
        ax2.plot(xs, [p["results"]["tpot_ms_p50"] for p in pts], marker="o", label=name)
    for ax, what in ((ax1, "TTFT (ms, median)"), (ax2, "TPOT (ms per output token, median)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_yscale("log")
    fig.suptitle(f"{cfg.name}: {cfg.model.spec}, batch 1")
    fig.tight_layout()
    path = out_dir / "prompt_length.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_concurrency(cfg, points, out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, pts in by_series(points).items():
        xs = [p["results"]["output_tokens_per_s"] for p in pts]
        ys = [p["results"]["tpot_ms_p50"] for p in pts]
        ax.plot(xs, ys, marker="o", label=name)
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"c={p['x']}", (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel("per-token latency TPOT (ms, median)")
    ax.set_title(f"{cfg.name}: throughput-latency frontier over concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_concurrency_percentiles(cfg, points, out_dir: Path) -> Path:
    """TTFT, TPOT and ITL at P50 / P90 / P99 against concurrency, one colour per series."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    styles = {"p50": "-", "p90": "--", "p99": ":"}
    for i, (name, pts) in enumerate(by_series(points).items()):
        color = f"C{i}"
        for ax, metric in zip(axes, ("ttft", "tpot", "itl")):
            for p, style in styles.items():
                key = f"{metric}_ms_{p}"
                if all(key in q["results"] for q in pts):
                    ys = [q["results"][key] for q in pts]
                    ax.plot([q["x"] for q in pts], ys, style, marker="o", color=color, label=f"{name} {p.upper()}")
    for ax, label in zip(axes, ("TTFT", "TPOT (first token excluded)", "ITL")):
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{cfg.name}: latency percentiles over concurrency")
    fig.tight_layout()
    path = out_dir / "concurrency_percentiles.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_spec_k(cfg, points, out_dir: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, pts in by_series(points).items():
        xs = [p["x"] for p in pts]
        ax1.plot(xs, [p["results"]["acceptance_rate"] for p in pts], marker="o", label=name)
        ax2.plot(xs, [p["results"]["speedup"] for p in pts], marker="o", label=name)
    ax1.set_ylabel("acceptance rate (accepted / proposed drafts)")
    ax2.set_ylabel("speedup over plain decoding (x, same run)")
    ax2.axhline(1.0, color="gray", lw=0.8, ls="--")
    for ax in (ax1, ax2):
        ax.set_xlabel("k (draft tokens per step)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{cfg.name}: {cfg.model.spec}")
    fig.tight_layout()
    path = out_dir / "spec_k.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PLOTTERS = {"prompt_length": plot_prompt_length, "concurrency": plot_concurrency, "spec_k": plot_spec_k}


if __name__ == "__main__":
    main()
