"""THE calibration pass that GPTQ and AWQ hook into.

1. Capture the inputs of decoder layer 0 (and its rope / attention arguments) on the calibration windows:
   the model runs until layer 0 is called, then stops.
2. Go layer by layer. Inside a layer the forward is split at each linear (stages, in forward order):
   ``qkv_proj -> o_proj -> gate_up_proj -> down_proj``; each stage's input is collected over all windows and
   handed to the algorithm *after* the preceding stages were quantized (true-sequential, like the GPTQ
   reference), then the forward continues through the stage's (now quantized) linear.
3. The quantized layer's outputs become the next layer's inputs. The lm_head, when quantized, is the last
   stage, fed with the final norm of the last layer's outputs; a tied embedding then reads the quantized
   head's rows (quantize.qembedding), so no full-precision copy of the table is left.

Only one layer's activations are alive at a time: [N, T, H] residual inputs plus one stage's inputs.
With a ``ShardedCheckpoint`` as the layer source, the decoder layers start on the meta device and are read
from their safetensors shards one at a time, quantized and released, so only one full-precision layer is
in memory at a time (plus the embeddings and the quantized layers already done).

Every sub-forward reuses runtime.model's own modules: a stage's input is captured with a forward pre-hook
on its linear that stops the forward there (the same trick as the reference's layer-0 "Catcher").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from quantize.qembedding import tie_quantized_embedding
from quantize.qlinear import QuantizedWeight, QuantLinear, set_module
from runtime.cliutil import UsageError
from runtime.config import ModelConfig
from runtime.layout import fused_layer_state
from runtime.loader import ModelSpecError, is_checkpoint_dir
from runtime.model import DecoderLayer, Transformer, rope_inv_freq
from runtime.paths import write_atomic


class _StopForward(Exception):
    pass


def capture_input(target: nn.Module, run: Callable[[], object]) -> tuple:
    """Positional args of target's first call during run(); the forward stops right there."""
    captured: list[tuple] = []

    def hook(module, args):
        captured.append(args)
        raise _StopForward

    handle = target.register_forward_pre_hook(hook)
    try:
        run()
    except _StopForward:
        pass
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(target).__name__} was not called by the forward")
    return captured[0]


@dataclass
class Stage:
    """One linear layer's turn in the calibration pass."""

    layer_idx: int  # -1 for the lm_head
    name: str  # leaf name: qkv_proj | o_proj | gate_up_proj | down_proj | lm_head
    owner: nn.Module  # the module holding the linear (a DecoderLayer, or the Transformer for lm_head)
    path: str  # dotted path of the linear inside owner
    inputs: list[Tensor]  # per batch of windows: [B, T, in_features], the linear's inputs
    block: Callable[[int, Tensor], Tensor]  # (batch index, inputs) -> output of the block the stage feeds
    # (the attention for qkv_proj, the MLP for gate_up_proj, the linear itself otherwise): AWQ's loss target

    @property
    def linear(self) -> nn.Module:
        return self.owner.get_submodule(self.path)

    @property
    def full_name(self) -> str:
        return self.path if self.layer_idx < 0 else f"layers.{self.layer_idx}.{self.path}"


class LayerAlgorithm:
    """What an algorithm plugs into the pass. Defaults: nothing to prepare, nothing quantized."""

    def prepare_layer(self, layer_idx: int, layer: DecoderLayer, xs: list[Tensor], rope: list[tuple]) -> None:
        """Called with the float layer and its inputs before any of its stages (AWQ scales and clips here)."""

    def quantize_stage(self, stage: Stage) -> None:
        """Replace stage.linear in stage.owner (quantize.qlinear.set_module), typically using stage.inputs."""

    def stats_mark(self):
        """Where this algorithm's per-layer stats stand before a layer (stats_since takes the layer's share)."""
        return len(getattr(self, "stats", []))

    def stats_since(self, mark) -> list[dict]:
        """The stats recorded since stats_mark(): what LayerStore keeps with a finished layer."""
        return getattr(self, "stats", [])[mark:]

    def restore_layer(self, layer_idx: int, layer: DecoderLayer, stats: list[dict]) -> None:
        """A layer kept by an interrupted run (LayerStore) was restored instead of quantized: take its stats."""
        if isinstance(getattr(self, "stats", None), list):
            self.stats.extend(stats)


@torch.no_grad()
def run_layer(
    layer: DecoderLayer, xs: list[Tensor], rope: list[tuple], on_stage: Callable[[Stage], None], layer_idx: int = 0
) -> list[Tensor]:
    """Forward one decoder layer over all batches, stage by stage; on_stage may replace each stage's linear
    before the forward goes through it. xs: per batch [B, T, H]; rope: per batch (cos, sin, meta)."""
    attn, mlp = layer.self_attn, layer.mlp

    def stage(name: str, path: str, inputs: list[Tensor], block) -> None:
        on_stage(Stage(layer_idx, name, layer, path, inputs, block))

    h = [layer.input_layernorm(x) for x in xs]
    stage("qkv_proj", "self_attn.qkv_proj", h, lambda b, inp: attn(inp, *rope[b], None))
    a = [capture_input(attn.o_proj, lambda b=b, hb=hb: attn(hb, *rope[b], None))[0] for b, hb in enumerate(h)]
    del h
    stage("o_proj", "self_attn.o_proj", a, lambda b, inp: attn.o_proj(inp))
    xs = [x + attn.o_proj(ab) for x, ab in zip(xs, a)]
    del a
    h = [layer.post_attention_layernorm(x) for x in xs]
    stage("gate_up_proj", "mlp.gate_up_proj", h, lambda b, inp: mlp(inp))
    act = [capture_input(mlp.down_proj, lambda hb=hb: mlp(hb))[0] for hb in h]
    del h
    stage("down_proj", "mlp.down_proj", act, lambda b, inp: mlp.down_proj(inp))
    return [x + mlp.down_proj(ab) for x, ab in zip(xs, act)]


@torch.no_grad()
def layer0_inputs(model: Transformer, tokens: Tensor, batch_size: int) -> tuple[list[Tensor], list[tuple]]:
    """Inputs of decoder layer 0 for tokens [N, T], in batches: (hidden states, (cos, sin, meta))."""
    xs, rope = [], []
    for batch in tokens.split(batch_size):
        x, cos, sin, meta, _cache = capture_input(model.layers[0], lambda batch=batch: model(batch))
        xs.append(x)
        rope.append((cos, sin, meta))
    return xs, rope


def check_calibration_tokens(tokens: Tensor, vocab_size: int) -> None:
    if tokens.ndim != 2 or tokens.shape[0] == 0:
        raise ValueError(f"calibration tokens must be a non-empty [nsamples, seqlen] tensor, got {tuple(tokens.shape)}")
    if tokens.shape[1] < 2:
        raise ValueError(f"calibration windows must have at least 2 tokens, got seqlen {tokens.shape[1]}")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"calibration token ids must lie in [0, {vocab_size})")


@torch.no_grad()
def calibrate(
    model: Transformer,
    tokens: Tensor,
    algorithm: LayerAlgorithm,
    batch_size: int = 8,
    lm_head: bool = False,
    source: ShardedCheckpoint | None = None,
    progress: Callable[[str], None] | None = None,
    store: LayerStore | None = None,
) -> Transformer:
    """Run the layer-by-layer pass over calibration tokens [N, T], quantizing the model in place.

    With ``source``, ``model`` is a skeleton from ``source.skeleton()`` whose layers are read one at a time.
    With ``store``, each finished layer is kept on disk, and layers it already holds (an interrupted run's)
    are restored and only run forward, which gives the next layer the same inputs as an uninterrupted pass.
    """
    check_calibration_tokens(tokens, model.config.vocab_size)
    start = time.perf_counter()
    if progress is not None:
        progress(f"capturing decoder-layer-0 inputs of {tokens.shape[0]} windows x {tokens.shape[1]} tokens")
    xs, rope = layer0_inputs(model, tokens, batch_size)
    n_layers = len(model.layers)
    worked, quantized = 0.0, 0  # time spent on, and number of, layers quantized (not restored): the ETA
    for i in range(n_layers):
        t_layer = time.perf_counter()
        if source is not None:
            model.layers[i] = source.layer(i)
        layer = model.layers[i]
        kept = store.load(i) if store is not None else None
        if kept is not None:
            store.restore(layer, kept)
            algorithm.restore_layer(i, layer, kept["stats"])
            xs = run_layer(layer, xs, rope, lambda stage: None, layer_idx=i)
            if progress is not None:
                progress(f"layer {i + 1}/{n_layers} restored from {store.dir}")
            continue
        mark = algorithm.stats_mark()
        algorithm.prepare_layer(i, layer, xs, rope)
        xs = run_layer(layer, xs, rope, algorithm.quantize_stage, layer_idx=i)
        if store is not None:
            store.save(i, layer, algorithm.stats_since(mark))
        worked += time.perf_counter() - t_layer
        quantized += 1
        if progress is not None:
            eta = worked / quantized * (n_layers - i - 1)
            progress(f"layer {i + 1}/{n_layers} done, {time.perf_counter() - start:.1f}s elapsed, ETA {eta:.0f}s")
    if source is not None:
        source.load_head(model)
    if lm_head:
        h = [model.norm(x) for x in xs]
        algorithm.quantize_stage(Stage(-1, "lm_head", model, "lm_head", h, lambda b, inp: model.lm_head(inp)))
        if model.config.tie_word_embeddings and isinstance(model.lm_head, QuantLinear):
            tie_quantized_embedding(model)  # the embedding reads the quantized head's rows: no full-precision copy
    return model


def layer_store_dir(out: str | Path) -> Path:
    """Where a calibration run writing ``out`` keeps its finished layers: ``OUT.layers.partial``."""
    out = Path(out)
    return out.with_name(out.name + ".layers.partial")


def layer_file(directory: Path, i: int) -> Path:
    return directory / f"layer_{i:04d}.pt"


def kept_layer_count(directory: Path) -> int:
    """How many consecutive layers from 0 a LayerStore directory holds (0 when it does not exist): what --resume
    restores, since layer i's inputs need layers 0..i-1."""
    n = 0
    while layer_file(directory, n).is_file():
        n += 1
    return n


class LayerStore:
    """Finished decoder layers of a calibration pass, one file per layer in a directory, so that an
    interrupted run resumes from the first unfinished layer with the same result as an uninterrupted one.

    A kept layer holds its quantized linears (codes, scales, zeros, g_idx, bias) and every other parameter
    (norms, possibly rescaled by AWQ / SmoothQuant, and linears left unquantized), plus the algorithm's stats.
    ``settings`` (the quantizer's arguments) must match to resume; otherwise a UsageError says which differ.
    """

    def __init__(self, directory: str | Path, settings: dict, resume: bool = False):
        import shutil

        self.dir = Path(directory)
        meta = self.dir / "settings.json"
        if resume and meta.is_file():
            kept = json.loads(meta.read_text())
            differ = sorted(k for k in set(kept) | set(settings) if kept.get(k) != settings.get(k))
            if differ:
                raise UsageError(
                    f"{self.dir} holds layers made with other settings ({', '.join(differ)}): rerun without --resume"
                )
            return
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        meta.write_text(json.dumps(settings, indent=2, sort_keys=True))

    def path(self, i: int) -> Path:
        return layer_file(self.dir, i)

    def kept_layers(self) -> int:
        """How many consecutive layers from 0 are kept."""
        return kept_layer_count(self.dir)

    def load(self, i: int) -> dict | None:
        if i >= self.kept_layers():  # only a prefix resumes: layer i's inputs need layers 0..i-1
            return None
        return torch.load(self.path(i), weights_only=True)

    def save(self, i: int, layer: nn.Module, stats: list[dict]) -> None:
        quantized = {}
        for name, m in layer.named_modules():
            if isinstance(m, QuantLinear):
                qw = m.qweight()
                quantized[name] = {
                    "codes": qw.codes.cpu(),
                    "scales": qw.scales.cpu(),
                    "zeros": qw.zeros.cpu(),
                    "bits": qw.bits,
                    "group_size": qw.group_size,
                    "g_idx": None if qw.g_idx is None else qw.g_idx.cpu(),
                    "bias": None if qw.bias is None else qw.bias.cpu(),
                    "act_quant": m.act_quant,
                    "path": m.path,
                }
        params = {name: p.detach().cpu() for name, p in layer.named_parameters()}
        layer_file = {"quantized": quantized, "params": params, "stats": stats}
        write_atomic(self.path(i), lambda tmp: torch.save(layer_file, tmp))  # a layer file is complete or absent

    @staticmethod
    def restore(layer: nn.Module, kept: dict) -> None:
        for name, q in kept["quantized"].items():
            like = layer.get_submodule(name)
            device = next(like.buffers()).device if isinstance(like, QuantLinear) else like.weight.device
            dtype = like.compute_dtype if isinstance(like, QuantLinear) else like.weight.dtype
            qw = QuantizedWeight(q["codes"], q["scales"], q["zeros"], q["bits"], q["group_size"], q["g_idx"], q["bias"])
            module = QuantLinear(qw, act_quant=q["act_quant"], compute_dtype=dtype, path=q["path"])
            set_module(layer, name, module.to(device))
        for name, value in kept["params"].items():
            layer.get_parameter(name).data.copy_(value)

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


class ShardedCheckpoint:
    """Reads an HF-style checkpoint (single file or safetensors shards with an index) tensor by tensor, so
    a model can be quantized one decoder layer at a time without ever holding all its float weights."""

    def __init__(self, path: str | Path):

        self.path = Path(path)
        if not is_checkpoint_dir(self.path):
            raise ModelSpecError(
                f"{self.path} is not a checkpoint: needs config.json and model.safetensors[.index.json]"
            )
        self.config = ModelConfig.from_dir(self.path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            with safe_open(self.path / "model.safetensors", "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118
        self.reads: list[str] = []  # tensor names read so far (tests check the order of reads)

    def tensor(self, name: str) -> Tensor:
        from safetensors import safe_open

        for candidate in (name, name.removeprefix("model.")):
            if candidate in self.weight_map:
                with safe_open(self.path / self.weight_map[candidate], "pt") as f:
                    self.reads.append(candidate)
                    return f.get_tensor(candidate).float()
        raise KeyError(f"checkpoint {self.path} is missing tensor {name!r}")

    def skeleton(self) -> Transformer:
        """A Transformer with real embeddings and rope tables and every other weight on the meta device."""
        with torch.device("meta"):
            model = Transformer(self.config)
        model.embed_tokens = nn.Embedding.from_pretrained(self.tensor("model.embed_tokens.weight"), freeze=True)
        model.inv_freq = rope_inv_freq(self.config)[0]
        return model.eval()

    def layer(self, i: int) -> DecoderLayer:
        """Decoder layer i in fp32, q/k/v and gate/up fused as in Transformer.load_hf_state_dict."""
        state = fused_layer_state(self.config, self.tensor, f"model.layers.{i}.")
        layer = DecoderLayer(self.config, i)
        layer.load_state_dict(state, strict=True)
        return layer.eval()

    def load_head(self, model: Transformer) -> None:
        """Final norm and lm_head (tied to the embeddings when the config says so)."""
        model.norm = type(model.norm)(self.config.hidden_size, self.config.rms_norm_eps)
        model.norm.weight.data = self.tensor("model.norm.weight")
        if self.config.tie_word_embeddings:
            model.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
            model.lm_head.weight = model.embed_tokens.weight
        else:
            model.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
            model.lm_head.weight.data = self.tensor("lm_head.weight")
