"""A newcomer's mistakes and Ctrl-C: every CLI turns an expected error into one line on stderr and exit code 2,
before any model loads; Ctrl-C exits quickly with one line, keeping what finished (GPTQ layers, resumable to the
same result) and never leaving a directory that loads as a checkpoint.

In-process cases run each CLI's main through runtime.cliutil.run (what its ``__main__`` does) with model
loading replaced by a failure, so "before any model load" is checked, not assumed. A few cases run the real
``python -m`` commands in subprocesses and check that transformers was not even imported. SIGINT cases run
quantize.gptq / quantize.rtn on a tiny random checkpoint in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch

from quantize import awq, gptq, int8, rtn
from quantize.cli import EXPECTED_ERRORS
from runtime import cliutil
from runtime.loader import ModelSpecError, check_model_spec, is_checkpoint_dir, load_model, save_checkpoint
from runtime.model import random_model
from tests.conftest import patch_everywhere
from tests.tiny_models import tiny_model_config

REPO = Path(__file__).resolve().parent.parent
VOCAB = 97
TINY = tiny_model_config(vocab_size=VOCAB, eos_token_ids=[], max_position_embeddings=64)


class WordTokenizer:
    """Whitespace tokenizer with hashed ids (the real one takes seconds to load)."""

    name_or_path = "word-tokenizer"

    def __call__(self, text, add_special_tokens=True):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=[zlib.crc32(w.encode()) % VOCAB for w in text.split()])

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)

    def __len__(self):
        return VOCAB


def never_load(*args, **kwargs):
    raise AssertionError("a model was loaded before the arguments were checked")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative --out paths land here
    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    ckpt = save_checkpoint(random_model(TINY, seed=0), tmp_path / "ckpt")
    patch_everywhere(monkeypatch, "runtime.loader.load_tokenizer", lambda spec: WordTokenizer())
    patch_everywhere(monkeypatch, "runtime.loader.load_model", never_load)
    (tmp_path / "half.partial").mkdir()
    (tmp_path / "half.partial" / "config.json").write_text("{}")
    return ckpt


def main_of(name: str):
    import importlib

    return importlib.import_module(name).main


def run_cli(name: str, argv: list[str], capsys) -> str:
    """Run `python -m name argv` in-process (cliutil.run, as its __main__ does); return the one stderr line."""
    expected = EXPECTED_ERRORS if name.startswith("quantize.") else ()
    with pytest.raises(SystemExit) as exc:
        cliutil.run(main_of(name), argv, expected=expected)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    return lines[0]


WORDS_70 = " ".join(f"w{i}" for i in range(70))  # beyond TINY's 64 positions
MISSING = "/nonexistent/qspec/out"


@pytest.mark.parametrize(
    "name,argv,message",
    [
        ("runtime.generate", ["--model", "no-such-model", "--prompt", "hi"], "unknown model spec 'no-such-model'"),
        ("runtime.generate", ["--model", MISSING, "--prompt", "hi"], f"no such directory: {MISSING}"),
        ("runtime.generate", ["--model", "{partial}", "--prompt", "hi"], "is an unfinished save"),
        ("runtime.generate", ["--model", "{ckpt}", "--prompt", ""], "--prompt is empty"),
        ("runtime.generate", ["--model", "{ckpt}", "--prompt", "  "], "--prompt is empty"),
        ("runtime.generate", ["--model", "{ckpt}", "--prompt", WORDS_70], "beyond the model's context of 64"),
        ("runtime.generate", ["--model", "{ckpt}", "--prompt", "a b", "--max-tokens", "63"], "that is 65, beyond"),
        ("runtime.generate", ["--model", "{ckpt}", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be"),
        ("evals.quality.perplexity", ["--model", "{ckpt}", "--max-windows", "0"], "--max-windows must be >= 1"),
        ("evals.quality.perplexity", ["--model", MISSING], f"no such directory: {MISSING}"),
        ("evals.quality.perplexity", ["--model", "{ckpt}", "--seqlen", "65"], "beyond the model's context of 64"),
        ("evals.quality.perplexity", ["--model", "{ckpt}", "--data", "nofile.txt"], "neither a text name"),
        ("quantize.rtn", ["--model", MISSING, "--out", "x"], f"no such directory: {MISSING}"),
        ("quantize.rtn", ["--model", "{ckpt}", "--group-size", "48", "--out", "x"], "has no fast kernel"),
        ("quantize.gptq", ["--model", "{ckpt}", "--group-size", "16", "--out", "x"], "has no fast kernel"),
        ("quantize.awq", ["--model", "{ckpt}", "--group-size", "7", "--out", "x"], "--group-size 7 has no fast kernel"),
        ("quantize.int8", ["--model", "no-such-model", "--out", "x"], "unknown model spec"),
        ("quantize.gptq", ["--model", "{ckpt}", "--resume", "--eval", "wiki"], "--resume continues"),
        ("evals.quality.tasks", ["--model", MISSING, "--tasks", "qspec_wiki"], "no such directory"),
        ("evals.quality.tasks", ["--model", "{ckpt}", "--tasks", "qspec_wiki", "--limit", "0"], "--limit must be > 0"),
        ("speculate.medusa.train", ["--model", "{ckpt}", "--seqlen", "0"], "--seqlen must be >= 1"),
        ("speculate.medusa.train", ["--model", MISSING], "no such directory"),
        ("evals.serving.loadgen", ["--model", MISSING], "no such directory"),
        ("evals.speed.bench_decode", ["--model", MISSING], "no such directory"),
        ("evals.speed.bench_quant", ["--model", MISSING], "no such directory"),
        ("evals.speculation.bench_spec", ["--model", MISSING], "no such directory"),
        ("evals.serving.bench_serving", ["--model", MISSING], "no such directory"),
        ("experiments.run", ["configs/no-such-config.yaml"], "no-such-config.yaml"),
    ],
)
def test_expected_errors_are_one_line_before_any_model_load(tiny, tmp_path, capsys, name, argv, message):
    argv = [a.format(ckpt=tiny, partial=tmp_path / "half.partial") for a in argv]
    line = run_cli(name, argv, capsys)
    assert message in line, line
    assert not list(tmp_path.glob("x*")), "a refused command left files behind"


def test_unsupported_architecture_is_one_line(tmp_path, capsys):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"")
    line = run_cli("runtime.generate", ["--model", str(tmp_path / "gpt2"), "--prompt", "hi"], capsys)
    assert "unsupported architecture ['GPT2LMHeadModel']" in line and "LlamaForCausalLM" in line


def test_group_size_with_a_kernel_is_accepted(tiny, capsys):
    # 64 leaves TINY's 96-wide down_proj a partial last group, as 128 does on 576: the kernels run it in memory,
    # while no saved format holds a ragged group, so --out refuses it before anything loads, naming what works
    for args in (["--group-size", "32", "--out", "x"], ["--group-size", "64", "--eval", "wiki:1"]):
        with pytest.raises(AssertionError, match="a model was loaded"):  # past every check, into the load
            cliutil.run(rtn.main, ["--model", str(tiny), *args], expected=EXPECTED_ERRORS)
    with pytest.raises(SystemExit):
        cliutil.run(rtn.main, ["--model", str(tiny), "--group-size", "64", "--out", "x"], expected=EXPECTED_ERRORS)
    err = capsys.readouterr().err
    assert "ragged last group" in err and "--group-size 16, 32 or -1" in err


def test_partial_directory_never_loads(tmp_path):
    out = save_checkpoint(random_model(TINY, seed=0), tmp_path / "ok")
    partial = out.rename(tmp_path / "ok.partial")  # a complete-looking directory still being written
    assert not is_checkpoint_dir(partial)
    with pytest.raises(ModelSpecError, match="unfinished save"):
        load_model(str(partial))
    with pytest.raises(ModelSpecError, match="unfinished save"):  # OUT missing while OUT.partial exists
        check_model_spec(str(tmp_path / "ok"))


def test_save_replaces_a_checkpoint_but_never_a_foreign_directory(tmp_path):
    model = random_model(TINY, seed=0)
    save_checkpoint(model, tmp_path / "a")
    save_checkpoint(random_model(TINY, seed=1), tmp_path / "a")  # replaced whole
    assert not (tmp_path / "a.partial").exists() and not (tmp_path / "a.old.partial").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(cliutil.UsageError, match="is not a checkpoint directory"):
        save_checkpoint(model, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# ---- the real commands, in subprocesses -----------------------------------------------------------------

PROBE = """
import atexit, json, runpy, sys
import runtime.loader
def never(*a, **k):
    raise SystemExit("MODEL LOADED")
runtime.loader.load_model = never
marker, module = sys.argv[1], sys.argv[2]
atexit.register(lambda: open(marker, "w").write(json.dumps({"transformers": "transformers" in sys.modules})))
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    "module,argv,message",
    [
        ("runtime.generate", ["--prompt", ""], "--prompt is empty"),
        ("runtime.generate", ["--model", MISSING, "--prompt", "hi"], "no such directory"),
        ("runtime.generate", ["--prompt", "hi", "--speculator", "eagel"], "unknown speculator 'eagel'; choose from"),
        ("evals.quality.perplexity", ["--max-windows", "0"], "--max-windows must be >= 1"),
        ("quantize.rtn", ["--model", "./not-here", "--out", "x"], "no such directory: ./not-here"),
    ],
)
def test_python_m_errors_before_heavy_imports(tmp_path, module, argv, message):
    marker = tmp_path / "marker.json"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(marker), module, *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(marker.read_text()) == {"transformers": False}  # checked before transformers was imported


# ---- Ctrl-C ----------------------------------------------------------------------------------------------

DRIVER = """
import sys, time, zlib
from types import SimpleNamespace
import torch
import runtime.data, runtime.loader, evals.quality.perplexity
from quantize import awq, gptq, plugin, registry, rtn
from quantize.cli import EXPECTED_ERRORS
from runtime import cliutil

VOCAB = 97
class WordTokenizer:
    name_or_path = "word-tokenizer"
    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[zlib.crc32(w.encode()) % VOCAB for w in text.split()])
    def __len__(self):
        return VOCAB
gen = torch.Generator().manual_seed(0)
text = " ".join(f"w{i}" for i in torch.randint(0, 300, (4000,), generator=gen).tolist())
originals = (runtime.loader.load_tokenizer, runtime.data.wiki_text)
for mod in list(sys.modules.values()):  # every module's own binding (from-imports copy the name)
    if getattr(mod, "__name__", "").split(".")[0] in ("runtime", "quantize", "evals"):
        if getattr(mod, "load_tokenizer", None) is originals[0]:
            mod.load_tokenizer = lambda spec: WordTokenizer()
        if getattr(mod, "wiki_text", None) is originals[1]:
            mod.wiki_text = lambda split="eval", lang="en": text
mode, argv = sys.argv[1], sys.argv[2:]
if mode == "slow-gptq":  # slow enough to be interrupted mid-pass
    quantize_stage = gptq.GPTQ.quantize_stage
    def slow(self, stage):
        quantize_stage(self, stage)
        time.sleep(0.15)
    gptq.GPTQ.quantize_stage = slow
if mode == "slow-save":  # the interrupt lands while the safetensors file is being written
    import safetensors.torch
    save_file = safetensors.torch.save_file
    def slow_save(*args, **kwargs):
        save_file(*args, **kwargs)
        print("[test] safetensors written", file=sys.stderr, flush=True)
        time.sleep(60)
    safetensors.torch.save_file = slow_save
if mode == "slow-awq":
    prepare_layer = awq.AWQ.prepare_layer
    def slow_awq(self, *args):
        prepare_layer(self, *args)
        time.sleep(0.15)
    awq.AWQ.prepare_layer = slow_awq
if mode.endswith("plugin"):  # the worked example's calibrated quantizer, from its own package
    sys.path.insert(0, "examples")
if mode == "slow-plugin":
    plugin_stage = registry.CalibrationStages.quantize_stage
    def slow_plugin(self, stage):
        plugin_stage(self, stage)
        time.sleep(0.05)
    registry.CalibrationStages.quantize_stage = slow_plugin
main = {"gptq": gptq.main, "awq": awq.main, "plugin": plugin.main}.get(mode.split("-")[-1], rtn.main)
cliutil.run(main, argv, expected=EXPECTED_ERRORS)
"""

SIX_LAYERS = tiny_model_config(vocab_size=VOCAB, num_layers=6, eos_token_ids=[])


def start(tmp_path, mode: str, argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "QSPEC_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1", "QSPEC_CPU_STEP": "0"}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DRIVER), mode, *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a terminal's Ctrl-C reaches the CLI with SIGINT's default disposition; a suite started in the background
        # of a non-interactive shell inherits it ignored, and Python then installs no KeyboardInterrupt handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def interrupt_when(proc: subprocess.Popen, needle: str, timeout: float = 120) -> tuple[float, str]:
    """Read stderr until a line contains needle, send SIGINT; (seconds until exit, the rest of stderr)."""
    seen = []
    deadline = time.time() + timeout
    for line in proc.stderr:
        seen.append(line)
        if needle in line:
            break
        assert time.time() < deadline, "".join(seen)
    else:
        raise AssertionError(f"never saw {needle!r}:\n{''.join(seen)}")
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    rest = proc.communicate(timeout=30)[1]
    return time.time() - t0, "".join(seen) + rest


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


CALIBRATED_RUNS = {
    "gptq": ["--act-order"],
    "awq": ["--search-windows", "2", "--grid", "4"],
    "awq+gptq": ["--gptq", "--search-windows", "2", "--grid", "4"],  # the GPTQ stats inside AWQ's kept layers
    "plugin": ["--method", "qspec_plugin_example.clipsearch:ClipSearch:steps=4"],  # a calibrated plug-in
}


# the resume logic is one (quantize.cli.run_calibration): GPTQ by default, AWQ's two and a plug-in under -m slow
# (~18 s each on an AVX2 machine)
@pytest.mark.parametrize(
    "method", [m if m == "gptq" else pytest.param(m, marks=pytest.mark.slow) for m in CALIBRATED_RUNS]
)
def test_ctrl_c_keeps_layers_and_resume_equals_uninterrupted(tmp_path, method):
    tool = method.split("+")[0]
    ckpt = save_checkpoint(random_model(SIX_LAYERS, seed=0), tmp_path / "ckpt")
    common = ["--model", str(ckpt), "--bits", "4", "--group-size", "32", *CALIBRATED_RUNS[method]]
    common += ["--nsamples", "4", "--seqlen", "32", "--batch-size", "2"]
    # the uninterrupted reference runs beside the interrupted run (one thread each: the two cores)
    ref = start(tmp_path, tool, [*common, "--out", str(tmp_path / "ref"), "--record", str(tmp_path / "ref.json")])
    out = tmp_path / "q"
    seconds, err = interrupt_when(start(tmp_path, f"slow-{tool}", [*common, "--out", str(out)]), "layer 2/6 done")
    ref_err = ref.communicate(timeout=300)[1]
    assert ref.returncode == 0, ref_err
    assert seconds < 5, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = err.strip().splitlines()[-1]
    assert "interrupted" in last and "--resume" in last, err
    assert not out.exists()  # nothing that loads
    kept = sorted((tmp_path / "q.layers.partial").glob("layer_*.pt"))
    assert 2 <= len(kept) < 6, err

    resumed = start(tmp_path, tool, [*common, "--out", str(out), "--resume", "--record", str(tmp_path / "q.json")])
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"--resume: {len(kept)} finished layers kept" in err
    assert err.count("restored from") == len(kept)
    assert not (tmp_path / "q.layers.partial").exists()
    a, b = tensors(tmp_path / "ref"), tensors(out)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ref_stats, resumed_stats = (json.loads((tmp_path / f).read_text())["stats"] for f in ("ref.json", "q.json"))
    for key in set(ref_stats) - {"quantize_seconds"}:  # every layer's stats, restored ones included
        assert [drop_seconds(s) for s in ref_stats[key]] == [drop_seconds(s) for s in resumed_stats[key]], key


def drop_seconds(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "seconds"}


def test_resume_with_other_settings_is_refused(tmp_path):
    from quantize.calibration import LayerStore

    LayerStore(tmp_path / "s", {"bits": 4, "group_size": 32})
    with pytest.raises(cliutil.UsageError, match=r"other settings \(bits\)"):
        LayerStore(tmp_path / "s", {"bits": 3, "group_size": 32}, resume=True)


def test_ctrl_c_during_a_save_leaves_nothing_that_loads(tmp_path):
    ckpt = save_checkpoint(random_model(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "rtn"
    proc = start(tmp_path, "slow-save", ["--model", str(ckpt), "--group-size", "32", "--out", str(out)])
    seconds, err = interrupt_when(proc, "[test] safetensors written")
    assert seconds < 5, err
    assert proc.returncode == cliutil.EXIT_INTERRUPTED
    assert "Traceback" not in err and "interrupted" in err.strip().splitlines()[-1], err
    assert (tmp_path / "rtn.partial" / "model.safetensors").is_file()  # the bytes were written ...
    assert not out.exists() and not is_checkpoint_dir(tmp_path / "rtn.partial")  # ... but nothing loads
    with pytest.raises(ModelSpecError, match="unfinished save"):
        load_model(str(out))
    with pytest.raises(ModelSpecError, match="unfinished save"):
        load_model(str(tmp_path / "rtn.partial"))


def test_awq_and_int8_still_run_through_cliutil(tiny, capsys):
    for main in (awq.main, int8.main, gptq.main):
        with pytest.raises(SystemExit) as exc:
            cliutil.run(main, ["--help"])
        assert exc.value.code == 0
