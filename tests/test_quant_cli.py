"""The quantizer CLIs: --help, one clear error per bad input, and a record with config and provenance.

A tiny checkpoint and a word-level stand-in tokenizer keep these fast (the real tokenizer and the wiki splits
take minutes to load and tokenize on the shared CPU machine); the default model runs in the slow tests."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from quantize import awq, gptq, int8, rtn
from quantize.config import DECODER_LINEARS
from quantize.qlinear import QuantLinear, quant_linear, set_module
from quantize.rotation import HadamardMLP, RotatedRMSNorm
from runtime.loader import load_model
from runtime.model import random_model
from tests.conftest import patch_everywhere
from tests.tiny_models import tiny_model_config

VOCAB = 97
TINY = tiny_model_config(vocab_size=VOCAB, eos_token_ids=[])
WORDS = [f"w{i}" for i in range(300)]


class WordTokenizer:
    """Whitespace tokenizer with hashed ids: enough for windows and perplexity."""

    name_or_path = "word-tokenizer"

    def __call__(self, text, add_special_tokens=True):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=[zlib.crc32(w.encode()) % VOCAB for w in text.split()])

    def __len__(self):
        return VOCAB


@pytest.fixture
def tiny_checkpoint(tmp_path, monkeypatch):
    from runtime.loader import save_checkpoint

    monkeypatch.setenv("QSPEC_HOME", str(tmp_path / "home"))
    patch_everywhere(monkeypatch, "runtime.loader.load_tokenizer", lambda spec: WordTokenizer())
    gen = torch.Generator().manual_seed(0)
    text = " ".join(WORDS[i] for i in torch.randint(0, 300, (3000,), generator=gen).tolist())
    patch_everywhere(monkeypatch, "runtime.data.wiki_text", lambda split="eval", lang="en": text)
    return save_checkpoint(random_model(TINY, seed=0), tmp_path / "ckpt")


def run_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("module", [rtn, int8, gptq, awq])
def test_help(module, capsys):
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--model" in out and "--out" in out and "--eval" in out


@pytest.mark.parametrize(
    "main,argv,message",
    [
        (gptq.main, ["--bits", "5"], "unsupported bit width 5"),
        (rtn.main, ["--bits", "1"], "unsupported bit width 1"),
        (gptq.main, ["--group-size", "0"], "group size must be -1"),
        (
            gptq.main,
            ["--group-size", "128"],
            "group size 128 is larger than layers.0.self_attn.qkv_proj's input width 64",
        ),
        (awq.main, ["--group-size", "97"], "group size 97 is larger than layers.0.self_attn.qkv_proj"),
        (gptq.main, ["--nsamples", "0"], "--nsamples must be at least 1, got 0"),
        (gptq.main, ["--seqlen", "1"], "--seqlen must be at least 2"),
        (
            gptq.main,
            ["--seqlen", "100000", "--group-size", "32"],
            "calibration data: calibration text has 3000 tokens, fewer than one window",
        ),
        (gptq.main, ["--damp-percent", "0"], "damp_percent must be in (0, 1)"),
        (int8.main, ["--bits", "4"], "quantize.int8 is 8-bit per-channel"),
        (int8.main, ["--smooth", "0.5"], "--smooth smooths activations for W8A8; give --w8a8 too"),
        (int8.main, ["--w8a8", "--smooth", "1.5"], "--smooth ALPHA must lie in [0, 1], got 1.5"),
        (gptq.main, ["--modules", "q_proj"], "unknown module names ['q_proj']"),
    ],
)
def test_bad_input_is_one_clear_error(tiny_checkpoint, capsys, main, argv, message):
    err = run_error(main, ["--model", str(tiny_checkpoint), "--eval", "wiki", *argv], capsys)
    assert message in err, err


def test_model_path_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = run_error(gptq.main, ["--model", str(tmp_path / "empty"), "--eval", "wiki"], capsys)
    assert "is not a checkpoint: config.json is missing" in err
    (tmp_path / "file.bin").write_bytes(b"x")
    err = run_error(rtn.main, ["--model", str(tmp_path / "file.bin"), "--eval", "wiki"], capsys)
    assert "is a file, not a checkpoint directory" in err


def test_nothing_to_do_is_an_error(tiny_checkpoint, capsys):
    err = run_error(rtn.main, ["--model", str(tiny_checkpoint)], capsys)
    assert "nothing to do" in err


def test_gptq_cli_records_config_and_provenance(tiny_checkpoint, tmp_path, capsys):
    record_path = tmp_path / "results.jsonl"
    argv = [
        "--model",
        str(tiny_checkpoint),
        "--bits",
        "3",
        "--group-size",
        "32",
        "--act-order",
        "--nsamples",
        "4",
        "--seqlen",
        "64",
        "--batch-size",
        "2",
        "--eval",
        "wiki:2",
        "--record",
        str(record_path),
    ]
    gptq.main(argv)
    record = json.loads(record_path.read_text().splitlines()[-1])
    qc = record["quant_config"]
    assert qc["bits"] == 3 and qc["group_size"] == 32 and qc["desc_act"] is True and qc["quant_method"] == "gptq"
    assert qc["nsamples"] == 4 and qc["seqlen"] == 64 and qc["seed"] == 0
    assert record["command"].startswith("python -m quantize.gptq --model")
    assert len(record["git_sha"].removesuffix("-dirty")) == 40 and record["versions"]["torch"] == torch.__version__
    assert len(record["stats"]["layers"]) == 2 * 4
    assert len(record["window_nlls"]["wiki"]) == 2
    assert 1 < record["perplexity"]["wiki"] < 10 * VOCAB
    # tokenized splits were cached for the next run
    assert list((tmp_path / "home" / "token_cache").glob("*.pt"))


def test_save_and_reload_through_formats(tiny_checkpoint, tmp_path):
    from runtime.loader import load_model

    out = tmp_path / "q"
    rtn.main(
        [
            "--model",
            str(tiny_checkpoint),
            "--bits",
            "4",
            "--group-size",
            "32",
            "--out",
            str(out),
            "--dense-dtype",
            "fp32",
        ]
    )
    model, _, _ = load_model(str(out))
    record = json.loads((out / "qspec_quantize.json").read_text())
    assert record["quant_config"]["bits"] == 4 and record["format"] == "gptq" and record["dense_dtype"] == "fp32"
    reference = rtn.quantize_model(random_model(TINY, seed=0), rtn.QuantConfig(bits=4, group_size=32))
    for name, mod in reference.named_modules():
        if isinstance(mod, QuantLinear):
            saved, ours = model.get_submodule(name).qweight(), mod.qweight()
            assert torch.equal(saved.codes, ours.codes) and torch.equal(saved.zeros, ours.zeros), name
            assert torch.equal(saved.scales, ours.scales), name  # fp16 on disk: quantize.grid rounds them first
            model.get_submodule(name).set_path("reference")
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():  # the same tensors on the same path
        assert torch.equal(model(tokens), reference(tokens))


@pytest.mark.parametrize("main", [gptq.main, awq.main])
def test_layer_by_layer_cli_equals_in_memory(tiny_checkpoint, tmp_path, main):
    from runtime.loader import save_checkpoint

    sharded = save_checkpoint(random_model(TINY, seed=0), tmp_path / "sharded", max_shard_bytes=30_000)
    records = tmp_path / "r.jsonl"
    common = [
        "--bits",
        "4",
        "--group-size",
        "32",
        "--nsamples",
        "4",
        "--seqlen",
        "32",
        "--batch-size",
        "2",
        "--eval",
        "wiki:1",
        "--record",
        str(records),
    ]
    main(["--model", str(tiny_checkpoint), *common])
    main(["--model", str(sharded), "--layer-by-layer", *common])
    a, b = (json.loads(line) for line in records.read_text().splitlines())
    assert a["window_nlls"]["wiki"] == pytest.approx(b["window_nlls"]["wiki"], rel=1e-6)


def test_smoothed_w8a8_cli_records_and_saves_the_folded_model(tiny_checkpoint, tmp_path):
    from runtime.data import token_windows, wiki_text
    from runtime.scoring import window_nlls

    out, records = tmp_path / "q", tmp_path / "r.jsonl"
    argv = ["--model", str(tiny_checkpoint), "--w8a8", "--smooth", "0.5", "--nsamples", "4", "--seqlen", "32"]
    int8.main([*argv, "--batch-size", "2", "--eval", "wiki:2", "--record", str(records), "--out", str(out)])
    record = json.loads(records.read_text())
    qc = record["quant_config"]
    assert qc["quant_method"] == "w8a8" and qc["act_quant"] and qc["smooth_alpha"] == 0.5 and qc["nsamples"] == 4
    assert len(record["stats"]["smooth_layers"]) == 2 * 3  # qkv, gate_up, down (o_proj not under GQA)
    # the checkpoint holds the folded norms (bf16, as measured) and smoothed weights: reloaded and run on its own
    # fast path, it scores what was measured bit for bit
    model, _, _ = load_model(str(out))
    assert record["dense_dtype"] == "bf16" and all(m.act_quant for m in model.modules() if isinstance(m, QuantLinear))
    windows = token_windows(WordTokenizer(), wiki_text("eval"), 512, 2)
    assert window_nlls(model, windows) == record["window_nlls"]["wiki"]


def test_gptq_per_channel_act_order_saves_and_reloads(tiny_checkpoint, tmp_path):
    """Per-channel act-order leaves no g_idx (one group per row): the checkpoint must say desc_act False."""
    out = tmp_path / "q"
    argv = ["--model", str(tiny_checkpoint), "--bits", "4", "--group-size", "-1", "--act-order"]
    gptq.main([*argv, "--nsamples", "4", "--seqlen", "64", "--batch-size", "2", "--out", str(out)])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["desc_act"] is False and qc["group_size"] == -1
    model, _, _ = load_model(str(out))
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()


@pytest.mark.parametrize(
    "main,argv,fmt",
    [
        (rtn.main, ["--bits", "4", "--group-size", "32"], "gptq"),
        (rtn.main, ["--bits", "3", "--group-size", "32"], "gptq_v2"),  # v1 cannot hold zero point 0
        (rtn.main, ["--bits", "4", "--group-size", "32", "--format", "compressed-tensors"], "compressed-tensors"),
        (int8.main, [], "gptq"),
        (int8.main, ["--w8a8"], "compressed-tensors"),
        (int8.main, ["--w8a8", "--rotate"], "qspec"),  # online rotations: only qspec's loader re-installs them
        (rtn.main, ["--bits", "4", "--group-size", "32", "--rotate", "--rotation-mode", "residual"], "qspec"),
        (awq.main, ["--bits", "4", "--group-size", "32", "--nsamples", "2", "--seqlen", "32", "--grid", "2"], "awq"),
    ],
)
def test_cli_format_default_is_recorded(tiny_checkpoint, tmp_path, main, argv, fmt):
    out, records = tmp_path / "q", tmp_path / "r.jsonl"
    main(["--model", str(tiny_checkpoint), *argv, "--out", str(out), "--record", str(records)])
    record = json.loads(records.read_text())
    assert record["format"] == fmt and json.loads((out / "qspec_quantize.json").read_text())["format"] == fmt
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    written = qc.get("checkpoint_format") if qc["quant_method"] == "gptq" else qc["quant_method"]
    assert written == fmt
    model, _, _ = load_model(str(out))
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear)


@pytest.mark.parametrize(
    "main,argv,message",
    [
        (
            rtn.main,
            ["--group-size", "64"],
            "in_features 96 is not a multiple of group size 64; gptq would need a ragged last group, which its "
            "loaders reject: use --group-size",
        ),
        (gptq.main, ["--group-size", "32", "--act-order", "--format", "compressed-tensors"], "has no g_idx"),
        (gptq.main, ["--group-size", "32", "--act-order", "--format", "awq"], "AWQ has no g_idx"),
        (awq.main, ["--bits", "3", "--group-size", "32", "--format", "awq"], "AWQ GEMM stores 4-bit codes"),
        (int8.main, ["--w8a8", "--format", "gptq"], "W8A8 (int8 activations) cannot be expressed in a GPTQ"),
        (
            int8.main,
            ["--w8a8", "--rotate", "--format", "compressed-tensors"],
            "compressed-tensors' loaders cannot re-install: use --format qspec",
        ),
        (rtn.main, ["--group-size", "32", "--rotate", "--format", "compressed-tensors"], "use --format qspec"),
        # the default format (gptq v1) packs 8 output rows per word; the head has VOCAB = 97
        (rtn.main, ["--group-size", "32", "--lm-head"], "lm_head: GPTQ packs 4-bit codes 8 at a time"),
        (rtn.main, ["--bits", "8", "--group-size", "32", "--format", "awq"], "AWQ GEMM stores 4-bit codes"),
        (int8.main, ["--w8a8", "--format", "awq"], "AWQ GEMM stores 4-bit codes"),
    ],
)
def test_cli_refuses_what_the_format_cannot_hold_before_loading(
    tiny_checkpoint, tmp_path, capsys, monkeypatch, main, argv, message
):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr("quantize.cli.load_model", no_loading)
    err = run_error(main, ["--model", str(tiny_checkpoint), *argv, "--out", str(tmp_path / "q")], capsys)
    assert message in err, err
    assert not (tmp_path / "q").exists()


def test_rotated_w8a8_saves_and_reloads_to_the_in_memory_perplexity(tiny_checkpoint, tmp_path, capsys):
    """The README's W8A8 recipe, `quantize.int8 --w8a8 --rotate --out DIR` (it exited 2 before saving): qspec's
    format holds int8 activations and the online Hadamards, and `evals.quality.perplexity --model DIR` gives the figure
    the quantizer measured in memory exactly. Nothing is left to a tolerance: the scales are fp16 before any code
    is computed (quantize.grid), the quantizer measures with the unquantized tensors (the rotated embedding, the
    norms) rounded to the --dense-dtype the file stores them in (bf16 here), and the reloaded model's cpu_w8a8
    path (torch._int_mm) sums the same integers as the reference path the quantizer measures on. Each window's
    NLL is equal bit for bit, and so is the printed perplexity. (Before, the reference summed q * dequantized
    weight in float: last-bit differences that the next layer's activation rounding turned into whole int8 steps,
    1.3e-4 in perplexity on Zen 4.)"""
    from evals.quality import perplexity
    from runtime.data import token_windows, wiki_text
    from runtime.scoring import window_nlls

    out, rec = tmp_path / "w8a8-rot", tmp_path / "rec.jsonl"
    argv = ["--model", str(tiny_checkpoint), "--w8a8", "--rotate", "--eval", "wiki:3"]
    int8.main([*argv, "--out", str(out), "--record", str(rec)])
    record = json.loads(rec.read_text())
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert record["format"] == "qspec" and qc["quant_method"] == "qspec" and qc["rotation"]["mode"] == "online"
    assert record["dense_dtype"] == "bf16"
    loaded = load_model(str(out))[0]
    assert isinstance(loaded.layers[0].mlp, HadamardMLP) and isinstance(
        loaded.layers[1].input_layernorm, RotatedRMSNorm
    )
    assert all(m.act_quant for m in loaded.modules() if isinstance(m, QuantLinear))
    windows = token_windows(WordTokenizer(), wiki_text("eval"), 512, 3)
    assert window_nlls(loaded, windows) == record["window_nlls"]["wiki"]
    # the step's integer kernels (bitwise equal to the reference math), not the reference path
    assert {m.path for m in loaded.modules() if isinstance(m, QuantLinear)} == {"cpu"}
    capsys.readouterr()
    perplexity.main(["--model", str(out), "--max-windows", "3"])
    printed = capsys.readouterr().out.split("perplexity ")[1].split()[0]
    assert printed == f"{record['perplexity']['wiki']:.4f}", (printed, record["perplexity"])


def test_rotated_checkpoint_exports_only_where_its_rotations_load(tiny_checkpoint, tmp_path, capsys):
    """quantize.export of an online-rotated (qspec) checkpoint: compressed-tensors is refused (its loaders would
    run the weights without the Hadamards); gptq keeps the rotation record, and reloads to the same logits."""
    from quantize import export

    src = tmp_path / "rot"
    rtn.main(["--model", str(tiny_checkpoint), "--group-size", "32", "--rotate", "--out", str(src)])
    to_ct = ["--model", str(src), "--format", "compressed-tensors", "--out", str(tmp_path / "ct")]
    refused = run_error(export.main, to_ct, capsys)
    assert "compressed-tensors' loaders cannot re-install: use --format qspec" in refused
    export.main(["--model", str(src), "--format", "gptq", "--out", str(tmp_path / "g")])
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():  # the same codes, scales and bf16 dense tensors, run on the same paths
        assert torch.equal(load_model(str(tmp_path / "g"))[0](tokens), load_model(str(src))[0](tokens))


def test_ragged_group_is_fine_in_memory(tiny_checkpoint, tmp_path):
    records = tmp_path / "r.jsonl"
    rtn.main(["--model", str(tiny_checkpoint), "--group-size", "48", "--eval", "wiki:1", "--record", str(records)])
    assert json.loads(records.read_text())["perplexity"]["wiki"] > 1


def test_gptq_static_act_order_exports_to_compressed_tensors(tiny_checkpoint, tmp_path):
    out = tmp_path / "q"
    argv = ["--model", str(tiny_checkpoint), "--group-size", "32", "--act-order", "--static-groups"]
    gptq.main([*argv, "--nsamples", "4", "--seqlen", "64", "--format", "compressed-tensors", "--out", str(out)])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    assert isinstance(load_model(str(out))[0].layers[1].self_attn.o_proj, QuantLinear)


@pytest.mark.parametrize("mode", ["residual", "online"])
def test_rotated_rtn_cli_saves_reloads_and_keeps_the_float_model(tiny_checkpoint, tmp_path, mode):
    """--rotate: the saved checkpoint (online rotations re-installed by the loader; residual mode: untied head)
    gives the in-memory rotated+quantized model's logits; rotating alone leaves the float model's logits."""
    from quantize.rotation import HadamardMLP, RotatedRMSNorm, rotate_model

    out = tmp_path / "rot"
    rec = tmp_path / "rec.jsonl"
    argv = ["--model", str(tiny_checkpoint), "--group-size", "32", "--rotate", "--out", str(out), "--record", str(rec),
            "--dense-dtype", "fp32"]  # fmt: skip
    rtn.main([*argv, "--rotation-mode", mode])
    record = json.loads(rec.read_text())
    assert record["quant_config"]["rotation"]["online_down"] is True
    assert record["quant_config"]["rotation"]["mode"] == mode
    loaded, config, _ = load_model(str(out))
    assert isinstance(loaded.layers[0].mlp, HadamardMLP)
    assert isinstance(loaded.layers[0].input_layernorm, RotatedRMSNorm) == (mode == "online")
    assert config.tie_word_embeddings == (TINY.tie_word_embeddings and mode == "online")
    float_model = random_model(TINY, seed=0)
    reference = rtn.quantize_model(
        rotate_model(random_model(TINY, seed=0), mode=mode), rtn.QuantConfig(bits=4, group_size=32)
    )
    for mod in loaded.modules():
        if isinstance(mod, QuantLinear):
            mod.set_path("reference")  # the in-memory model's path (the cpu kernels sum in another order)
    tokens = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), reference(tokens))
        assert (rotate_model(random_model(TINY, seed=0), mode=mode)(tokens) - float_model(tokens)).abs().max() <= 1e-4


@pytest.mark.parametrize("main", [gptq.main, int8.main])
def test_rotate_with_calibrated_quantizers(tiny_checkpoint, tmp_path, main):
    extra = ["--w8a8", "--smooth", "0.5"] if main is int8.main else ["--group-size", "32", "--act-order"]
    rec = tmp_path / "rec.jsonl"
    argv = ["--model", str(tiny_checkpoint), "--rotate", "--nsamples", "4", "--seqlen", "16", "--eval", "wiki:2"]
    main([*argv, "--record", str(rec), *extra])
    record = json.loads(rec.read_text())
    assert record["quant_config"]["rotation"]["method"] == "hadamard"
    from quantize.cli import evaluate
    from runtime.data import wiki_text

    float_ppl = evaluate(random_model(TINY, seed=0), WordTokenizer(), "wiki:2", 2)["perplexity"]["wiki"]
    assert wiki_text("eval")  # the patched text the CLI scored too
    assert abs(record["perplexity"]["wiki"] / float_ppl - 1) < 0.05  # quantized, still the same model


def test_rotate_layers_cli_rotates_records_and_reloads_only_those_layers(tiny_checkpoint, tmp_path, capsys):
    out, rec = tmp_path / "rot", tmp_path / "rec.jsonl"
    argv = ["--model", str(tiny_checkpoint), "--group-size", "32", "--rotate", "--dense-dtype", "fp32"]
    rtn.main([*argv, "--rotate-layers", "1", "--out", str(out), "--record", str(rec)])
    assert json.loads(rec.read_text())["quant_config"]["rotation"]["layers"] == [1]
    loaded = load_model(str(out))[0]
    assert [isinstance(layer.input_layernorm, RotatedRMSNorm) for layer in loaded.layers] == [False, True]
    assert [isinstance(layer.mlp, HadamardMLP) for layer in loaded.layers] == [False, True]
    argv.extend(["--out", str(tmp_path / "x")])
    plain = [a for a in argv if a != "--rotate"]
    assert "--rotate-layers applies with --rotate" in run_error(rtn.main, [*plain, "--rotate-layers", "1"], capsys)
    assert "a comma list of layer indices" in run_error(rtn.main, [*argv, "--rotate-layers", "a,b"], capsys)
    assert "choose a non-empty subset of 0..1" in run_error(rtn.main, [*argv, "--rotate-layers", "7"], capsys)
    bad_mode = [*argv, "--rotate-layers", "1", "--rotation-mode", "residual"]
    assert "only in mode 'online'" in run_error(rtn.main, bad_mode, capsys)


def test_rotate_with_layer_by_layer_is_an_error(tiny_checkpoint, capsys):
    argv = ["--model", str(tiny_checkpoint), "--eval", "wiki", "--group-size", "32", "--rotate", "--layer-by-layer"]
    assert "--rotate needs the whole float model in memory" in run_error(gptq.main, argv, capsys)


def test_mixed_calibration_takes_each_share_from_its_own_text(tiny_checkpoint, monkeypatch):
    """--calib wiki:0.5,wiki-fr:0.25,wiki-es:0.25 with 8 windows: 4, 2, 2 windows, each from its language's
    calibration text (each language gets its own vocabulary here, so a window shows where it came from)."""
    import argparse

    from quantize import cli

    texts = {lang: " ".join(f"{lang}{i % 50}" for i in range(2000)) for lang in ("en", "fr", "es")}
    monkeypatch.setattr("runtime.data.wiki_text", lambda split="calib", lang="en": texts[lang])

    class LangTokenizer:
        def __call__(self, text, add_special_tokens=True):
            from types import SimpleNamespace

            return SimpleNamespace(
                input_ids=[{"en": 0, "fr": 1, "es": 2}[w[:2]] * 100 + int(w[2:]) for w in text.split()]
            )

    ap = argparse.ArgumentParser()
    args = argparse.Namespace(calib="wiki:0.5,wiki-fr:0.25,wiki-es:0.25", nsamples=8, seqlen=16, seed=0)
    tokens = cli.calibration_tokens(ap, args, LangTokenizer())
    assert tokens.shape == (8, 16)
    langs = [set((row // 100).tolist()) for row in tokens]
    assert langs == [{0}] * 4 + [{1}] * 2 + [{2}] * 2
    args.calib = "wiki,wiki-fr"  # bare names weigh 1 each
    assert [int(r[0]) // 100 for r in cli.calibration_tokens(ap, args, LangTokenizer())] == [0] * 4 + [1] * 4


@pytest.mark.parametrize(
    "calib,message",
    [
        ("wiki:0.5,books:0.5", "calibration text 'books'"),
        ("wiki:x", "calibration weight 'x' of 'wiki' is not a number"),
        ("wiki:0", "calibration weight of 'wiki' must be > 0"),
        ("wiki,wiki", "calibration text 'wiki' is listed twice"),
        ("chat", "calibration text 'chat'"),
    ],
)
def test_bad_calibration_mixture_is_one_clear_error(tiny_checkpoint, capsys, calib, message):
    argv = ["--model", str(tiny_checkpoint), "--eval", "wiki", "--group-size", "32", "--calib", calib]
    err = run_error(gptq.main, argv, capsys)
    assert message in err and "--calib" in err, err


def test_rotate_layers_auto_rotates_the_layers_the_per_layer_loss_chooses(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    """--rotate-layers auto: the recorded layers are exactly those whose rotation lowered the calibration loss in
    an independent check: the model rotated at that one layer (rotate_model(layers=[i])), that layer's linears
    replaced by RTN QuantLinears (quantize.rtn), scored on the same windows."""
    from quantize.cli import AUTO_ROTATE_WINDOWS
    from quantize.rotation import rotate_model
    from runtime.data import mixed_calibration_windows
    from runtime.scoring import window_nlls

    monkeypatch.setenv("QSPEC_CPU_STEP", "0")  # the fixture's fresh QSPEC_HOME would compile the C++ step
    rec = tmp_path / "rec.jsonl"
    argv = ["--model", str(tiny_checkpoint), "--group-size", "32", "--bits", "3", "--rotate", "--rotate-layers"]
    try:
        rtn.main([*argv, "auto", "--out", str(tmp_path / "q"), "--record", str(rec)])
        chosen = json.loads(rec.read_text())["quant_config"]["rotation"]["layers"]
    except SystemExit:  # no layer gains: a one-line error, nothing written
        chosen = None
    err = capsys.readouterr().err
    assert "--rotate-layers auto: RTN of one layer at a time" in err and " window passes, ~" in err  # cost first
    if chosen is None:
        assert "rotating no layer lowers the calibration loss" in err
        chosen = []
    windows = mixed_calibration_windows(WordTokenizer(), "wiki", AUTO_ROTATE_WINDOWS, 512, 0)
    cfg = rtn.QuantConfig(bits=3, group_size=32)

    def loss(model, i):
        for name in [n for n in cfg.targets(model) if n.startswith(f"layers.{i}.")]:
            lin = model.get_submodule(name)
            set_module(model, name, quant_linear(rtn.quantize_weight(lin.weight, cfg, lin.bias), False, lin))
        with torch.no_grad():
            return sum(window_nlls(model, windows, 1))

    expected = []
    for i in range(TINY.num_layers):
        plain = loss(random_model(TINY, seed=0), i)
        rotated = loss(rotate_model(random_model(TINY, seed=0), mode="online", layers=[i]), i)
        if rotated < plain:
            expected.append(i)
    assert chosen == expected


def outlier_checkpoint(path):
    """TINY with one large positive weight in a group whose other weights are small: its most negative weight
    is under half a step, so the asymmetric 4-bit grid puts that group's zero point at 0 (what a real 1.5B
    model's outliers do to a few groups), which GPTQ v1 (zero - 1) cannot store."""
    from runtime.loader import save_checkpoint

    return save_checkpoint(outlier_model(), path)


def outlier_model():
    model = random_model(TINY, seed=0)
    with torch.no_grad():
        w = model.layers[0].mlp.down_proj.weight
        w[3, 0] = w[3, :32].abs().max() * 40
    return model


@pytest.mark.parametrize(
    "main,extra,exit_code",
    [
        (rtn.main, [], None),  # the default format: written as gptq_v2, exit status 0
        (rtn.main, ["--format", "gptq"], 3),  # asked for: still written (as gptq_v2), exit status 3
        (gptq.main, ["--nsamples", "2", "--seqlen", "16", "--batch-size", "2"], None),
    ],
)
def test_zero_point_0_is_saved_in_a_format_that_holds_it(
    tiny_checkpoint, tmp_path, capsys, monkeypatch, main, extra, exit_code
):
    """The bug report: `quantize.rtn --bits 4 --group-size 64 --out DIR` on a real model quantized for 90 s and
    wrote nothing, because v1 GPTQ (the default) cannot store zero point 0. Now the checkpoint is written as
    gptq_v2, one line says why, and it reloads to exactly the in-memory quantized weights."""
    from quantize import cli

    ckpt = outlier_checkpoint(tmp_path / "outlier")
    saved_models = []

    def save_quantized(model, *args, **kwargs):  # the in-memory quantized model, as the CLI saves it
        saved_models.append(model)
        return cli_save_quantized(model, *args, **kwargs)

    cli_save_quantized = cli.save_quantized
    monkeypatch.setattr(cli, "save_quantized", save_quantized)
    out, records = tmp_path / "q", tmp_path / "r.jsonl"
    argv = ["--model", str(ckpt), "--group-size", "32", "--out", str(out), "--record", str(records), *extra]
    if exit_code is None:
        main(argv)
    else:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == exit_code
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "cannot hold this result" in line]
    assert len(notes) == (1 if exit_code is None else 2), err
    assert "written as gptq_v2" in notes[0] and "zero point 0" in notes[0], notes[0]
    if exit_code is not None:
        assert err.strip().splitlines()[-1].startswith("error: --format gptq cannot hold this result"), err
    record = json.loads(records.read_text())
    assert record["format"] == "gptq_v2" and record["format_requested"] == "gptq" and record["out"] == str(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["checkpoint_format"] == "gptq_v2"
    (in_memory,) = saved_models
    assert float((in_memory.layers[0].mlp.down_proj.zeros == 0).sum()) >= 1  # the case v1 cannot store
    assert_same_quantized_weights(load_model(str(out))[0], in_memory)
    if main is rtn.main:  # and that is RTN's quantization of the float model
        reference = rtn.quantize_model(outlier_model(), rtn.QuantConfig(bits=4, group_size=32))
        assert_same_quantized_weights(in_memory, reference)


def test_out_that_cannot_be_written_is_refused_before_loading(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """runtime.loader.begin_atomic_dir refuses (or mkdir fails on) these only when saving, after the work: the
    quantizers check --out before the model loads."""

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr("quantize.cli.load_model", no_loading)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    cases = [
        (tmp_path / "notes", "exists and is not a checkpoint directory"),
        (tmp_path / "file", "exists and is not a checkpoint directory"),
        (tmp_path / "file" / "sub" / "q", "is not a directory"),
        (tiny_checkpoint, "is the --model checkpoint being quantized"),
    ]
    for out, message in cases:
        for main in (rtn.main, gptq.main):
            err = run_error(main, ["--model", str(tiny_checkpoint), "--group-size", "32", "--out", str(out)], capsys)
            assert message in err, (out, err)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_fp8_refusal_comes_before_loading(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from quantize import fp8

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr("quantize.cli.load_model", no_loading)
    argv = ["--model", str(tiny_checkpoint), "--block-size", "48", "--out", str(tmp_path / "q")]
    assert "scale blocks would straddle its parts" in run_error(fp8.main, argv, capsys)


@pytest.mark.parametrize(
    "fields,modules",
    [
        ({"intermediate_size": 128}, DECODER_LINEARS),  # qkv/gate_up: one group per row; down_proj: two
        ({}, ("qkv_proj", "o_proj", "gate_up_proj")),  # every quantized layer is 64 wide
    ],
)
def test_group_as_wide_as_a_layer_saves_and_reloads(tiny_checkpoint, tmp_path, fields, modules):
    """A group as wide as a layer is per-channel there; the checkpoint's one group_size still describes every
    layer (loaders take one group per row when it is at least the width). The save used to fail after the work."""
    from runtime.loader import save_checkpoint

    config = tiny_model_config(vocab_size=VOCAB, eos_token_ids=[], **fields)
    ckpt = save_checkpoint(random_model(config, seed=0), tmp_path / "c")
    argv = ["--model", str(ckpt), "--group-size", "64", "--modules", ",".join(modules), "--out", str(tmp_path / "q")]
    rtn.main(argv)
    cfg = rtn.QuantConfig(bits=4, group_size=64, modules=modules)
    assert_same_quantized_weights(load_model(str(tmp_path / "q"))[0], rtn.quantize_model(random_model(config), cfg))


def assert_same_quantized_weights(loaded, reference) -> None:
    """Every QuantLinear of reference (in memory) has the same codes, zeros and dequantized weight in loaded."""
    layers = [(name, mod) for name, mod in reference.named_modules() if isinstance(mod, QuantLinear)]
    assert layers
    for name, mod in layers:
        saved, ours = loaded.get_submodule(name).qweight(), mod.qweight()
        assert torch.equal(saved.codes, ours.codes) and torch.equal(saved.zeros, ours.zeros), name
        assert torch.equal(saved.dequantize(), ours.dequantize()), name
