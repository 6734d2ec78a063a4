"""Render records: a Markdown table and a CSV of the rows, and PNG plots (labelled axes with units, legend)."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
        fid, greedy, speed = res.get("fidelity"), res.get("greedy"), res.get("speed")
        row = {
            "row": r["row"]["name"],
            "class": r["row"]["lossless_class"],
            "status": r["status"],
            "check": res.get("claim_check", r.get("reason", "")),
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
        out.append(row)
    return out


def render_table(cfg, records: list[dict], out_dir: Path) -> list[Path]:
    rows = table_rows(records)
    tasks = sorted({k.split(":", 1)[1] for r in rows for k in r if k.startswith("acc:")})
    seqlen, n = cfg.evals.fidelity_seqlen, cfg.evals.fidelity_sequences
    head = ["row", "lossless class", "check", "greedy match %", "max abs Δ log-prob", "perplexity (Δ)"]
    head += [f"{TASK_SHORT.get(t, t)} acc ± se" for t in tasks] + ["speedup (vs)", "tok/s", "weights MB"]
    lines = [
        f"# {cfg.name}",
        "",
        cfg.description.strip(),
        "",
        f"Perplexity: wiki eval split, {n} windows x {seqlen} tokens, teacher-forced through the row's path, Δ vs "
        "the fp32 reference on the same tokens (engine rows, which emit tokens only, are scored on their own greedy "
        "outputs with the logits their sampler saw: [own outputs]). "
        f"Greedy match: {cfg.evals.greedy_prompts} prompts x {cfg.evals.greedy_tokens} new tokens vs plain fp32 "
        f"decoding (tokens before the first divergence). Tasks: lm-eval, {cfg.evals.task_limit} documents each. "
        f"Speedup: median of {cfg.bench.repeats} interleaved runs against the baseline named, same run.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|",
    ]
    for r in rows:
        if r["status"] != "ok":
            cells = [r["row"], r["class"], f"{r['status']}: {r['check']}"] + ["—"] * (len(head) - 3)
        else:
            ppl = fmt(r["perplexity"], ".3f")
            if r["perplexity_delta"] is not None:
                ppl += f" ({r['perplexity_delta']:+.3f})"
            if r["scored_on"] == "engine greedy outputs":
                ppl += " [own outputs]"
            cells = [
                r["row"],
                r["class"],
                r["check"],
                fmt(r["greedy_match_pct"], ".1f"),
                fmt(r["max_abs_dlogprob"], ".2e"),
                ppl,
            ]
            for t in tasks:
                v, se = r.get(f"acc:{t}"), r.get(f"acc_stderr:{t}")
                cells.append("—" if v is None else f"{v:.3f} ± {se:.3f}" if se is not None else f"{v:.3f}")
            sp = "—" if r["speedup"] is None else f"{r['speedup']:.2f}x ({r['baseline']})"
            cells += [sp, fmt(r["tokens_per_s"], ".1f"), fmt(r["weight_mb"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    md = out_dir / "table.md"
    md.write_text("\n".join(lines) + "\n")
    csv_path = out_dir / "table.csv"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    paths = [md, csv_path]
    plot = plot_table(cfg, rows, out_dir / "speedup_vs_quality.png")
    if plot:
        paths.append(plot)
    return paths


def plot_table(cfg, rows: list[dict], path: Path) -> Path | None:
    done = [r for r in rows if r["status"] == "ok" and r["speedup"] is not None and r["perplexity"] is not None]
    if not done:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for cls, color in CLASS_COLORS.items():
        pts = [r for r in done if r["class"] == cls]
        if not pts:
            continue
        ax1.scatter([r["speedup"] for r in pts], [r["perplexity"] for r in pts], c=color, label=cls, s=40)
        for r in pts:
            ax1.annotate(
                r["row"], (r["speedup"], r["perplexity"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    ax1.axvline(1.0, color="gray", lw=0.8, ls="--")
    ax1.set_xlabel("speedup over the row's baseline (x, same run)")
    ax1.set_ylabel(f"perplexity (wiki eval, {cfg.evals.fidelity_seqlen}-token windows)")
    ax1.set_title("speed vs quality")
    ax1.legend(title="lossless class")
    names = [r["row"] for r in done]
    mb = [r["weight_mb"] or 0 for r in done]
    ax2.barh(names, mb, color=[CLASS_COLORS.get(r["class"], "gray") for r in done], label="weights")
    ax2.set_xlabel("weight memory (MB, 10^6 bytes)")
    ax2.set_title("weight memory per row")
    ax2.legend()
    ax2.invert_yaxis()
    fig.suptitle(f"{cfg.name}: {cfg.model.spec}")
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
