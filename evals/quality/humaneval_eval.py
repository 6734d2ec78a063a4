"""One HumanEval evaluation: greedy (or speculative) completions from qspec's decoding loop, cached per checkpoint
and generation settings, each run in the sandbox (evals.quality.humaneval_sandbox). evals.quality.humaneval is the
command.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from evals.quality.humaneval_problems import (
    CHAT_INSTRUCTION,
    CHAT_MAX_NEW_TOKENS,
    CHAT_RESPONSE_PREFIX,
    CHAT_STOP,
    CHAT_VERSION,
    PROMPT_STYLES,
    STOP_SEQUENCES,
    Problem,
    build_program,
    chat_answer,
    prompt_ids,
    truncate,
    wilson_interval,
)
from evals.quality.humaneval_sandbox import MAX_WORKERS, STATUSES, Limits, Outcome, run_programs, short_digest
from runtime.decoding import generate
from runtime.paths import qspec_home, write_atomic
from runtime.sampling import SamplingParams
from speculate.base import Speculator, SpeculatorError
from speculate.generate import speculative_generate
from speculate.registry import BuildContext, build, check_method

# ---- completions and their cache ------------------------------------------------------------------------


@dataclass(frozen=True)
class GenSettings:
    """Everything besides the checkpoint that decides a completion (the cache key)."""

    max_new_tokens: int = 384
    stop: tuple[str, ...] = STOP_SEQUENCES
    prompting: str = "raw"  # raw: the prompt as code, no chat template; chat: the chat protocol (module docstring)
    dtype: str = "auto"  # the --dtype asked for (auto is decided by the checkpoint, itself in the key)
    device: str = "cpu"
    batch_size: int = 1  # batched rows are the same math as batch 1, not bit-identical (docs/methodology.md)
    # a lossless draft speculator generating the completions ("" = plain decoding): its own cache key, so its
    # completions can be compared with plain decoding's (greedy speculation equals plain greedy on the CPU step)
    draft: str = ""  # e.g. "int4+qwen2.5-coder-0.5b,k=8,conf=0.4" (draft_method: the registry's draft options)

    @classmethod
    def for_style(cls, style: str = "completion", max_new_tokens: int | None = None, **kwargs) -> GenSettings:
        """The settings of a --prompt-style: completion is the defaults; chat stops at the closing fence and
        defaults to CHAT_MAX_NEW_TOKENS."""
        if style == "completion":
            return cls(max_new_tokens or cls.max_new_tokens, **kwargs)
        if style != "chat":
            raise ValueError(f"prompt style {style!r}: choose one of {sorted(PROMPT_STYLES)}")
        return cls(max_new_tokens or CHAT_MAX_NEW_TOKENS, stop=CHAT_STOP, prompting="chat", **kwargs)

    @property
    def style(self) -> str:
        return "completion" if self.prompting == "raw" else self.prompting

    def key(self) -> str:
        """The digest of the fields; with chat prompts also of the protocol's texts and version (a raw key is the
        digest of the fields alone, as it was before the chat style existed: its cache entries stay valid)."""
        fields = asdict(self)
        if not self.draft:
            del fields["draft"]  # keys of plain decoding stay what they were before speculation existed here
        if self.prompting != "raw":
            fields["protocol"] = [CHAT_VERSION, CHAT_INSTRUCTION, CHAT_RESPONSE_PREFIX]
        return short_digest(fields)


def checkpoint_identity(path: Path) -> str:
    """The resolved checkpoint directory with the size and mtime of each file in it: changes with the weights, the
    config or the tokenizer, and costs no read of the weights. (experiments.artifacts.model_files_hash hashes file
    contents instead, but evals may not import experiments.)"""
    path = Path(path).resolve()
    files = sorted(f for f in path.iterdir() if f.is_file())
    state = [str(path), *[(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]]
    return f"{path.name}-{short_digest(state)}"


@dataclass(frozen=True)
class Cache:
    """One directory per (checkpoint, settings): a completion per problem, and per Limits an execution result."""

    root: Path
    limits_key: str

    @classmethod
    def for_run(cls, checkpoint: str, settings: GenSettings, limits: Limits, base: Path | None = None) -> Cache:
        base = base if base is not None else qspec_home() / "humaneval"
        return cls(base / f"{checkpoint}-{settings.key()}", limits.key())

    def completion_path(self, task_id: str) -> Path:
        return self.root / f"{task_id.replace('/', '_')}.json"

    def result_path(self, task_id: str) -> Path:
        return self.root / f"exec-{self.limits_key}" / f"{task_id.replace('/', '_')}.json"

    def read(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # absent, or unreadable: recomputed
            return None

    def write(self, path: Path, data: dict) -> None:
        write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))


def _end_of_turn(model, tokenizer, prompting: str) -> list[int]:
    """With chat prompts, the tokenizer's EOS (its end of turn) where the model's config does not list it."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if prompting == "chat" and eos is not None and eos not in model.config.eos_token_ids else []


def draft_method(text: str) -> str:
    """--draft 'SPEC[,k=K][,conf=C][,lookup=N]' as the registry's method draft:model=SPEC,...; checked without loading
    anything (ValueError naming the problem)."""
    spec = text.split(",")[0]
    if not spec or "=" in spec:
        raise ValueError(f"--draft {text!r}: a draft model spec comes first (e.g. int4+qwen2.5-coder-0.5b,k=8)")
    method = f"draft:model={text}"
    try:
        check_method(method)
    except SpeculatorError as err:
        raise ValueError(f"--draft {text!r}: {err}") from None
    return method


def draft_speculator(model, text: str, target_path: Path | str | None = None) -> Speculator:
    """The --draft speculator; target_path (the target's checkpoint) checks a separate draft's tokenizer and lets
    vocab=N rank the target's tokenizer."""
    return build(draft_method(text), model, BuildContext(target_path=target_path))


def iter_completions(model, tokenizer, problems: list[Problem], settings: GenSettings) -> Iterator[tuple]:
    """(problem, completion cut at the first stop, finish reason) per problem, greedy, batch by batch, through
    the shared decoding loop (runtime.decoding.generate). With chat prompts the completion is the response after
    CHAT_RESPONSE_PREFIX (the code, cut before its closing fence)."""
    context = model.config.max_position_embeddings
    extra_stop_ids = _end_of_turn(model, tokenizer, settings.prompting)
    speculator = draft_speculator(model, settings.draft) if settings.draft else None
    for start in range(0, len(problems), settings.batch_size):
        batch = problems[start : start + settings.batch_size]
        prompts = [prompt_ids(tokenizer, p, settings.prompting) for p in batch]
        params = [
            SamplingParams(temperature=0.0, max_tokens=max(1, min(settings.max_new_tokens, context - len(ids))),
                           stop=list(settings.stop), stop_token_ids=list(extra_stop_ids))
            for ids in prompts
        ]  # fmt: skip
        if speculator is None:
            out = generate(model, prompts, params, tokenizer=tokenizer)
        else:
            out = speculative_generate(model, prompts, params, speculator, tokenizer=tokenizer)
        for problem, tokens, reason in zip(batch, out.tokens, out.finish_reasons):
            yield problem, truncate(tokenizer.decode(tokens, skip_special_tokens=True), settings.stop), reason


# ---- one evaluation -------------------------------------------------------------------------------------


@dataclass
class ProblemResult:
    task_id: str
    status: str
    detail: str
    completion: str
    finish_reason: str
    seconds: float  # the program's run time
    cached: bool = False  # its execution result came from the cache


@dataclass
class Evaluation:
    results: list[ProblemResult] = field(default_factory=list)
    generated: int = 0  # completions generated by this run (the rest came from the cache)
    executed: int = 0  # programs run by this run

    @property
    def passed(self) -> int:
        return sum(r.status == "passed" for r in self.results)

    def summary(self) -> dict:
        n, k = len(self.results), self.passed
        lo, hi = wilson_interval(k, n)
        counts = Counter(r.status for r in self.results)
        return {"problems": n, "passed": k, "pass_at_1": k / n if n else 0.0, "ci95": [lo, hi],
                "statuses": {s: counts.get(s, 0) for s in STATUSES}}  # fmt: skip


def evaluate(
    problems: list[Problem],
    cache: Cache,
    load: Callable[[], tuple],
    settings: GenSettings,
    limits: Limits,
    workers: int = MAX_WORKERS,
    log: Callable[[str], None] = lambda msg: None,
) -> Evaluation:
    """Complete (load() -> (model, tokenizer), called only if some completion is not cached) and execute every
    problem, reading and filling the cache; each completion and result is cached as soon as it exists."""
    completions = {p.task_id: cache.read(cache.completion_path(p.task_id)) for p in problems}
    missing = [p for p in problems if completions[p.task_id] is None]
    ev = Evaluation(generated=len(missing))
    if missing:
        model, tokenizer = load()
        for i, (problem, text, reason) in enumerate(iter_completions(model, tokenizer, missing, settings), 1):
            completions[problem.task_id] = {"task_id": problem.task_id, "completion": text, "finish_reason": reason}
            cache.write(cache.completion_path(problem.task_id), completions[problem.task_id])
            log(f"completed {i}/{len(missing)} {problem.task_id} ({reason}, {len(text)} chars)")
    outcomes = {p.task_id: cache.read(cache.result_path(p.task_id)) for p in problems}
    todo = [p for p in problems if outcomes[p.task_id] is None]
    ev.executed = len(todo)
    ran = {p.task_id for p in todo}

    def done(i: int, outcome: Outcome) -> None:
        task_id = todo[i].task_id
        outcomes[task_id] = asdict(outcome)
        cache.write(cache.result_path(task_id), outcomes[task_id])
        log(f"ran {task_id}: {outcome.status} {outcome.detail}".rstrip())

    sources = [build_program(p, completions[p.task_id]["completion"], settings.prompting) for p in todo]
    run_programs(sources, limits, workers, done)
    for p in problems:
        c, o = completions[p.task_id], outcomes[p.task_id]
        ev.results.append(ProblemResult(p.task_id, o["status"], o["detail"], c["completion"], c["finish_reason"],
                                        o["seconds"], cached=p.task_id not in ran))  # fmt: skip
    return ev


def evaluate_canonical(
    problems: list[Problem], limits: Limits, workers: int = MAX_WORKERS, style: str = "completion"
) -> Evaluation:
    """The reference solutions through the same runner: every one should pass (a check of the sandbox). With the
    chat style each is answered as a chat answer (chat_answer) and goes through extract_code and chat_program."""
    chat = style == "chat"
    answers = [chat_answer(p, p.canonical_solution) if chat else p.canonical_solution for p in problems]
    sources = [build_program(p, a, "chat" if chat else "raw") for p, a in zip(problems, answers)]
    outcomes = run_programs(sources, limits, workers)
    results = [ProblemResult(p.task_id, o.status, o.detail, a, "canonical", o.seconds)
               for p, a, o in zip(problems, answers, outcomes)]  # fmt: skip
    return Evaluation(results=results, executed=len(problems))
