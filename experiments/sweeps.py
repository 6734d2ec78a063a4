"""Curves: TTFT/TPOT vs prompt length, the throughput-latency frontier vs concurrency, acceptance and
speedup vs k. Latency statistics come from evals.serving.metrics (the serving benchmarks' definitions)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from evals.serving.metrics import RequestRecord, distribution, summarize
from evals.serving.serving_load import WorkItem, run_load
from experiments.bench import bench_section, log
from experiments.config import ConfigError
from experiments.records import append_jsonl
from experiments.rows import RowUnavailable, speculative_row
from runtime.config import DTYPES
from runtime.data import wiki_text
from runtime.decoding import generate
from runtime.engine import EngineConfig, LLMEngine
from runtime.provenance import provenance
from runtime.sampling import SamplingParams


def prompts_of_length(ctx, length: int, n: int) -> list[list[int]]:
    if ctx.tokenizer is None:
        gen = torch.Generator().manual_seed(ctx.cfg.seed + length)
        return torch.randint(2, ctx.model.config.vocab_size, (n, length), generator=gen).tolist()
    if "eval_ids" not in ctx.cache:  # tokenize the eval split once per run
        ctx.cache["eval_ids"] = ctx.tokenizer(wiki_text("eval"), add_special_tokens=False).input_ids
    ids = ctx.cache["eval_ids"]
    windows = [ids[i * length : (i + 1) * length] for i in range(min(n, len(ids) // length))]
    if len(windows) < n:
        raise ConfigError(f"sweep.values: the wiki eval split has fewer than {n} windows of {length} tokens")
    return windows


def series_model(ctx, series: dict):
    dtype = series.get("dtype", "fp32")
    if dtype not in DTYPES:
        raise ConfigError(f"sweep.series[{series.get('name')}].dtype: {dtype!r} not in {sorted(DTYPES)}")
    if dtype == "fp32":
        return ctx.model
    return copy.deepcopy(ctx.model).set_dtype(DTYPES[dtype], mixed=bool(series.get("mixed", True)))


def prompt_length_point(ctx, series: dict, length: int) -> dict:

    sw = ctx.cfg.sweep
    model = series_model(ctx, series)
    if length + sw.new_tokens > model.config.max_position_embeddings:
        raise ConfigError(f"sweep.values: {length} + {sw.new_tokens} exceeds the model's positions")
    params = SamplingParams(temperature=0.0, max_tokens=sw.new_tokens, ignore_eos=True)
    ttft, tpot = [], []
    with bench_section():
        generate(model, prompts_of_length(ctx, min(length, 16), 1), SamplingParams(max_tokens=2))  # warm up
        for prompt in prompts_of_length(ctx, length, sw.repeats):
            out = generate(model, [prompt], params)
            ttft.append(out.timing.ttft_s)
            tpot.append(out.timing.tpot_s)
    t, p = distribution(ttft), distribution(tpot)
    return {
        "prompt_tokens": length,
        "new_tokens": sw.new_tokens,
        "ttft_ms_p50": 1e3 * t["p50"],
        "ttft_ms_mean": 1e3 * t["mean"],
        "tpot_ms_p50": 1e3 * p["p50"],
        "tpot_ms_mean": 1e3 * p["mean"],
        "decode_tokens_per_s": 1 / p["p50"],
        "runs": len(ttft),
    }


def concurrency_workload(ctx, series: dict, concurrency: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of mixed lengths (64-160 tokens) and mixed output lengths (up to new_tokens): static batching
    waits for the longest in each batch, continuous does not."""
    sw = ctx.cfg.sweep
    n_requests = int(series.get("requests_per_slot", 2)) * concurrency
    lengths = [64 + 32 * (i % 4) for i in range(n_requests)]
    prompts = [prompts_of_length(ctx, n, i + 1)[i] for i, n in enumerate(lengths)]
    return prompts, [max(4, sw.new_tokens // (1 + i % 3)) for i in range(n_requests)]


def latency_results(s: dict) -> dict:
    """Percentiles (ms) of TTFT, TPOT, ITL and E2E and the throughputs of an evals.serving.metrics summary."""
    out = {"output_tokens_per_s": s["output_token_throughput"], "requests_per_s": s["request_throughput"]}
    for key, name in (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("itl_s", "itl"), ("e2e_s", "e2e")):
        out.update({f"{name}_ms_{p}": 1e3 * s[key][p] for p in ("mean", "p50", "p90", "p99")})
    return out


SERVER_SERIES_KEYS = {
    "name",
    "url",
    "endpoint",
    "served_model_name",
    "api_key_env",
    "prompt_format",
    "requests_per_slot",
}


def server_concurrency_point(ctx, series: dict, concurrency: int) -> dict:
    """The same workload against any OpenAI-compatible server (series ``url``), through evals.serving.loadgen: a
    closed loop of `concurrency` streaming requests; metrics as ``vllm bench serve`` defines them."""
    import asyncio
    import os

    unknown = sorted(set(series) - SERVER_SERIES_KEYS)
    if unknown:
        raise ConfigError(f"sweep.series[{series['name']}]: unknown key(s) {unknown} for a server series")
    endpoint = series.get("endpoint", "completions")
    if endpoint not in ("completions", "chat"):
        raise ConfigError(f"sweep.series[{series['name']}].endpoint: {endpoint!r} is not completions or chat")
    if (endpoint == "chat" or series.get("prompt_format") == "text") and ctx.tokenizer is None:
        raise ConfigError(f"sweep.series[{series['name']}]: text prompts need a model spec with a tokenizer")
    prompts, outs = concurrency_workload(ctx, series, concurrency)
    items = [WorkItem(p, n) for p, n in zip(prompts, outs)]
    kwargs = dict(
        endpoint=endpoint,
        mode="concurrency",
        concurrency=concurrency,
        model_name=series.get("served_model_name"),
        api_key=os.environ.get(series["api_key_env"]) if series.get("api_key_env") else None,
        prompt_as_text=series.get("prompt_format", "ids") == "text",
    )
    asyncio.run(run_load(series["url"], [WorkItem(prompts[0], 2)], ctx.tokenizer, **kwargs))  # warm up
    records, duration = asyncio.run(run_load(series["url"], items, ctx.tokenizer, **kwargs))
    s = summarize(records, duration)
    if s["completed"] == 0:
        raise RowUnavailable(f"{series['url']}: no request completed ({records[0].error})")
    return {"concurrency": concurrency, "requests": len(items), "failed": s["failed"], "url": series["url"],
            **latency_results(s), "duration_s": duration}  # fmt: skip


def concurrency_point(ctx, series: dict, concurrency: int) -> dict:

    if series.get("url"):
        return server_concurrency_point(ctx, series, concurrency)
    prompts, outs = concurrency_workload(ctx, series, concurrency)
    n_requests = len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    policy = series.get("policy", "continuous")
    engine = LLMEngine(ctx.model, ctx.tokenizer, EngineConfig(max_num_seqs=concurrency, policy=policy))
    with bench_section():
        engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm up
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        duration = time.perf_counter() - t0
    records = [
        RequestRecord(
            send_time=t0,
            token_times=o.token_times,
            end_time=o.token_times[-1],
            prompt_tokens=o.num_prompt_tokens,
            output_tokens=len(o.output_ids),
        )
        for o in results
    ]
    s = summarize(records, duration)
    return {"concurrency": concurrency, "requests": n_requests, "policy": policy, **latency_results(s),
            "duration_s": duration}  # fmt: skip


def spec_k_point(ctx, series: dict, k: int) -> dict:

    sw = ctx.cfg.sweep
    params = {key: v for key, v in series.items() if key != "name"}
    variant = speculative_row(ctx, {**params, "k": k})
    prompts = ctx.bench_prompts[: ctx.cfg.bench.prompts]
    base = variant.baseline_timed
    times = {"baseline": [], "variant": []}
    with bench_section():
        for r in range(sw.repeats):
            order = [("baseline", base), ("variant", variant.timed)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                fn(prompts, sw.new_tokens)
                times[name].append(time.perf_counter() - t0)
    stats = ctx.spec_stats or {}  # from the last timed speculative run
    ctx.spec_stats = None
    return {
        "k": k,
        "acceptance_rate": stats.get("acceptance_rate", float("nan")),
        "mean_accepted_per_step": stats.get("mean_accepted_per_step", float("nan")),
        "target_forwards_per_token": stats.get("target_forwards_per_token", float("nan")),
        "speedup": min(times["baseline"]) / min(times["variant"]),
        "baseline_s": min(times["baseline"]),
        "variant_s": min(times["variant"]),
    }


POINTS = {"prompt_length": prompt_length_point, "concurrency": concurrency_point, "spec_k": spec_k_point}


def run_sweep(cfg, ctx, series: list[dict], records_path: Path, base: dict) -> list[dict]:

    out = []
    for s in series:
        if "name" not in s:
            raise ConfigError("sweep.series: every series needs a name")
        for x in cfg.sweep.values:
            log(f"{cfg.kind}: {s['name']} at {x}")
            rec = {**base, "series": s["name"], "series_settings": s, "x": x, "status": "ok", "results": {}}
            try:
                rec["results"] = POINTS[cfg.kind](ctx, s, x)
            except RowUnavailable as err:
                rec.update(status="wired, not run", reason=str(err))
            rec.update(provenance(cfg.seed, base["command"], base.get("git_sha")))
            append_jsonl(records_path, rec)
            out.append(rec)
    return out
