"""The one table of speculators: a name -> a builder, one method-string syntax, one build function.

    NAME[:key=value,...]        e.g. ngram:k=8  draft:layers=8,k=3  draft:model=qwen2.5-coder-0.5b  eagle:tree=8

NAME is a built-in (the table below), a name registered by ``register`` or by an installed package's entry point
in the group ``qspec.speculators`` (``name = "my_pkg.mod:attr"``), or a plug-in given as ``module:attr``
(``my_pkg.lookahead:LookaheadSpeculator:k=4``: the first ``:`` after a name that is not registered separates the
module from the attribute, the next one starts the options). Option values may hold ``:`` but not ``,``.

A plug-in attribute is a Speculator class (built as ``Cls(target, **options)``, or ``Cls.from_options(target,
context, **options)`` when it defines that classmethod) or a builder ``fn(target, context, **options)``. Its
options are the keyword parameters after those, typed by their annotations (int, float, bool, str) or defaults;
a ``**kwargs`` builder takes any option. ``check_method`` checks a method (name, plug-in contract, options) without
a model, so a CLI refuses a bad one in one line before it loads anything; ``build`` checks it and builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantize.qlinear import FAST_CPU_BITS
from runtime import plugins
from runtime.speculation import CandidateTree
from speculate.base import Speculator, SpeculatorError, check_k
from speculate.draft import DraftModelSpeculator, check_draft_spec, layer_skip_draft, parse_draft_spec, quantized_draft
from speculate.draft_vocab import subset_head
from speculate.eagle.head import EagleCheckpointError, EagleConfig, EagleHead, load_eagle
from speculate.eagle.speculator import EagleSpeculator
from speculate.lookup_first import LookupFirstSpeculator
from speculate.medusa.heads import MedusaCheckpointError, MedusaConfig, MedusaHeads, load_medusa
from speculate.medusa.speculator import MedusaSpeculator, build_tree
from speculate.ngram import NgramSpeculator
from speculate.training import head_dir

ENTRY_POINT_GROUP = "qspec.speculators"
TREE_SIZE = 8  # candidate-tree nodes when tree= is not given: EAGLE's, and Medusa's when k= is not given either
SMOKE_GROUP_SIZE = 32  # quant-draft groups on the tiny smoke model (its rows are shorter than the usual 128)
# what the generation loops call on a speculator (runtime.speculation.Speculator); speculate.base.Speculator
# supplies all but propose and max_tokens_per_step
REQUIRED_METHODS = ("propose", "max_tokens_per_step", "verify", "prefill", "release", "describe")


@dataclass
class BuildContext:
    """What a builder may need besides its options."""

    target_path: Path | str | None = None  # the target's checkpoint: default heads dirs, a draft's tokenizer check
    heads: dict[str, Path | str | None] = field(default_factory=dict)  # explicit heads dirs by kind (medusa, eagle)
    smoke: bool = False  # the tiny random smoke model: random heads, small quantization groups

    def heads_dir(self, kind: str) -> Path:
        if self.heads.get(kind):
            return Path(self.heads[kind])
        if self.target_path is None:
            raise SpeculatorError(f"no {kind} heads given (train them with `python -m speculate.{kind}.train`)")
        return head_dir(kind, self.target_path)


@dataclass(frozen=True)
class Method:
    """A speculator name and the options given for it (typed once checked)."""

    name: str
    options: dict = field(default_factory=dict)

    def __str__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}:{opts}" if opts else self.name


@dataclass(frozen=True)
class Entry:
    """A registered speculator: build(target, context, **options) and the options it takes."""

    build: Callable[..., Speculator]
    options: dict[str, type | None] | None  # option -> type (None: untyped); None: any option (a **kwargs builder)
    check: Callable[..., None] | None = None  # check(**options): refuse bad values before any model loads


# ---- the built-ins ---------------------------------------------------------------------------------------


def check_counts(**options) -> None:
    """Every count a built-in takes (k, layers, tree, depth, ...) is >= 1."""
    for key, value in options.items():
        if key == "k":
            check_k(value)
        elif type(value) is int and value < 1:
            raise SpeculatorError(f"option {key} must be >= 1, got {value}")


def build_ngram(target, context: BuildContext, *, k: int = 4, fixed: bool = False) -> Speculator:
    """Prompt lookup: up to k drafts, as many as 2**(match length) unless fixed (then always k)."""
    return NgramSpeculator(k=k, scaled=not fixed)


def check_draft(*, layers: int | None = None, model: str | None = None, vocab: int | None = None, **counts) -> None:
    check_counts(layers=layers, vocab=vocab, **counts)
    if layers is not None and model is not None:
        raise SpeculatorError("a draft is layers=L (the target's first L layers) or model=SPEC, not both")
    check_draft_spec(model)


def build_draft(
    target,
    context: BuildContext,
    *,
    k: int = 4,
    layers: int | None = None,
    model: str | None = None,
    conf: float | None = None,
    lookup: int | None = None,
    vocab: int | None = None,
) -> Speculator:
    """A draft model: layers=L (layer skip), or model= any --draft-model spec (layers:N, int4, int8, int4+layers:N, a
    checkpoint, int4+SPEC); neither: the draft measured best for this target, else int4. conf: dynamic k.
    lookup=N: prompt lookup first (a row whose last N tokens occurred before drafts what followed them; the draft
    model drafts the other rows, speculate.lookup_first). vocab=V: the draft's head over the V most frequent tokens
    only (speculate.draft_vocab; still lossless)."""
    spec = f"layers:{layers}" if layers is not None else model
    draft, label = parse_draft_spec(spec, target, context.target_path or None)
    head = None
    if vocab is not None:
        if not context.target_path:
            raise SpeculatorError("vocab= ranks the target's tokenizer: give the target as a checkpoint")
        try:
            head = subset_head(draft, context.target_path, vocab)
        except ValueError as err:
            raise SpeculatorError(str(err)) from None
        label += f",vocab={vocab}"
    speculator = DraftModelSpeculator(target, draft, k=k, name=f"draft({label})", min_confidence=conf, head=head)
    return lookup_first(speculator, lookup)


def lookup_first(spec: DraftModelSpeculator, lookup: int | None) -> Speculator:
    return spec if lookup is None else LookupFirstSpeculator(spec, min_ngram=lookup)


def check_quant_draft(*, bits: int = 4, **counts) -> None:
    check_counts(**counts)
    if bits not in FAST_CPU_BITS:  # a draft must be cheaper than the target: fast kernels only
        raise SpeculatorError(f"quant-draft supports {' or '.join(map(str, FAST_CPU_BITS))} bits, got {bits}")


def build_quant_draft(
    target,
    context: BuildContext,
    *,
    k: int = 4,
    bits: int = 4,
    layers: int | None = None,
    group: int | None = None,
    conf: float | None = None,
    lookup: int | None = None,
) -> Speculator:
    """The target's own RTN copy (of its first L layers with layers=), in groups of `group` columns; lookup=N:
    prompt lookup first (as draft's)."""
    base = target if layers is None else layer_skip_draft(target, layers)
    if group is None and context.smoke:
        group = SMOKE_GROUP_SIZE
    label = f"int{bits}" + ("" if layers is None else f"+layers:{layers}")
    draft = quantized_draft(base, bits, group)
    return lookup_first(
        DraftModelSpeculator(target, draft, k=k, name=f"quant-draft({label})", min_confidence=conf), lookup
    )


def check_medusa(*, acceptance: str = "rejection", **counts) -> None:
    check_counts(**counts)
    if acceptance not in ("rejection", "typical"):
        raise SpeculatorError(f"Medusa acceptance is rejection (lossless) or typical (APPROXIMATE), got {acceptance!r}")


def build_medusa(
    target, context: BuildContext, *, k: int | None = None, tree: int | None = None, acceptance: str = "rejection"
) -> Speculator:
    """tree=N: the N most likely candidate paths of the heads' accuracy table; k=K without tree=: a top-1 chain of
    K (at most the heads); neither: tree=8. acceptance=typical is Medusa's APPROXIMATE rule."""
    if context.smoke:
        config = MedusaConfig(num_heads=3, hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size)
        heads = random_weights(MedusaHeads(config))
        accuracy = [[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    else:
        try:
            heads = load_medusa(context.heads_dir("medusa"), target)
        except MedusaCheckpointError as err:
            raise SpeculatorError(str(err)) from None
        accuracy = heads.config.accuracy
    if tree is None and k is not None:
        candidates = CandidateTree.chain(min(k, heads.config.num_heads))
    elif not accuracy:
        raise SpeculatorError("the Medusa checkpoint has no accuracy table to build a tree from; retrain it")
    else:
        candidates = build_tree(accuracy, TREE_SIZE if tree is None else tree, paths=heads.config.paths)
    return MedusaSpeculator(target, heads, candidates, acceptance=acceptance)


def build_eagle(
    target,
    context: BuildContext,
    *,
    tree: int = TREE_SIZE,
    depth: int = 4,
    topk: int = 4,
    frontier: int = 4,
) -> Speculator:
    """EAGLE's dynamic tree: `tree` nodes chosen from `depth` draft steps of `topk` candidates, `frontier` expanded."""
    if context.smoke:
        head = random_weights(EagleHead(EagleConfig.for_model(target)))
    else:
        try:
            head = load_eagle(context.heads_dir("eagle"), target)
        except EagleCheckpointError as err:
            raise SpeculatorError(str(err)) from None
    return EagleSpeculator(target, head, depth=depth, topk=topk, frontier=frontier, tree_size=tree)


def random_weights(module: torch.nn.Module) -> torch.nn.Module:
    """Small seeded random weights: untrained heads for the smoke model."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return module.eval()


# ---- names, plug-ins, options ----------------------------------------------------------------------------


def entry_points() -> dict[str, str]:
    """Installed plug-ins: entry-point name -> "module:attr" (read each time, so a new install is seen)."""
    return plugins.entry_points(ENTRY_POINT_GROUP)


def speculator_names() -> list[str]:
    """Every name a method may start with: the table's, then installed entry points'."""
    return [*REGISTRY, *(name for name in entry_points() if name not in REGISTRY)]


def unknown(name: str, text: str) -> SpeculatorError:
    where = "" if text == name else f" in method {text!r}"
    return SpeculatorError(
        f"unknown speculator {name!r}{where}; choose from {', '.join(speculator_names())} or a plug-in module:attr"
    )


def resolve(name: str, text: str | None = None) -> Entry:
    """The entry of a registered name, an entry-point name or a module:attr plug-in, its contract checked."""
    if not isinstance(name, str) or not name:
        raise unknown(name, text or repr(name))
    found = REGISTRY.get(name)
    if found is None:
        found = entry_points().get(name)
    if found is None:
        if ":" not in name:
            raise unknown(name, text or name)
        found = name
    if isinstance(found, Entry):
        return found
    obj = load_attribute(name, found) if isinstance(found, str) else found
    return plugin_entry(name, obj)


def load_attribute(name: str, ref: str):
    """The object that "module:attr" names; one SpeculatorError line when the module or attribute is missing."""
    return plugins.load_attribute(name, ref, SpeculatorError)


def missing_members(obj) -> list[str]:
    """What a Speculator class (or instance) lacks of the contract the generation loops use."""
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(obj, m, None))]
    if not isinstance(getattr(obj, "name", None), str):
        missing.append("name (a str)")
    if not hasattr(obj, "acceptance"):
        missing.append("acceptance ('rejection': verified by the one verifier)")
    if not hasattr(obj, "lossless"):
        missing.append("lossless (whether its output is distributed as the target's)")
    return missing


def plugin_entry(name: str, obj) -> Entry:
    """A plug-in class or builder function as a table entry."""
    if isinstance(obj, type):
        missing = missing_members(obj)
        if missing:
            raise SpeculatorError(
                f"plug-in {name!r}: class {obj.__qualname__} is not a speculator: it lacks {', '.join(missing)} "
                "(subclass speculate.base.Speculator and define propose, max_tokens_per_step and name)"
            )
        factory = getattr(obj, "from_options", None)
        if factory is not None:
            return Entry(lambda target, context, **o: factory(target, context, **o), builder_options(factory, 2, name))
        return Entry(lambda target, context, **o: obj(target, **o), builder_options(obj, 1, name))
    if callable(obj):
        return Entry(obj, builder_options(obj, 2, name))
    raise SpeculatorError(f"plug-in {name!r}: {obj!r} is neither a Speculator class nor a builder function")


def builder_options(fn: Callable, skip: int, name: str = "") -> dict[str, type | None] | None:
    """The options a builder takes: its keyword parameters after the first `skip` (target, context), typed by
    annotation or default; None when it takes **kwargs."""
    wanted = "(target, context, **options)" if skip == 2 else "(target, **options)"
    return plugins.builder_options(fn, skip, name, SpeculatorError, wanted)


def typed(value, kind: type | None, key: str, text: str):
    """An option's value as its type (kind None: untyped): a method string's text is parsed, a value is checked."""
    return plugins.typed(value, kind, key, text, SpeculatorError)


# ---- the table -------------------------------------------------------------------------------------------


def entry(builder: Callable, check: Callable | None = check_counts) -> Entry:
    return Entry(builder, builder_options(builder, skip=2), check)


# The one table: name -> entry. register() adds to it; entry points and module:attr plug-ins resolve beside it.
REGISTRY: dict[str, Entry | Callable | str] = {
    "ngram": entry(build_ngram),
    "draft": entry(build_draft, check_draft),
    "medusa": entry(build_medusa, check_medusa),
    "quant-draft": entry(build_quant_draft, check_quant_draft),
    "eagle": entry(build_eagle),
}
SPECULATORS = tuple(REGISTRY)  # the built-ins, in the CLIs' order


def register(name: str, speculator: Entry | Callable | str) -> None:
    """Register a Speculator class, a builder fn(target, context, **options) or a "module:attr" under name."""
    if ":" in name or "," in name:
        raise SpeculatorError(f"a speculator name holds no ':' or ',', got {name!r}")
    REGISTRY[name] = speculator


# ---- methods ---------------------------------------------------------------------------------------------


def split_method(text: str) -> tuple[str, str]:
    """(name, options text) of NAME[:key=value,...]; a NAME that is not registered may be module:attr."""
    return plugins.split_method(text, lambda name: name in REGISTRY or name in entry_points())


def check_method(method: str | Method) -> Method:
    """A method checked without a model: its name resolves (a plug-in imports and meets the contract), every
    option is one it takes, of its type, with a valid value. Returns it with typed options; a problem is one
    SpeculatorError line."""
    if isinstance(method, Method):
        name, given, text = method.name, dict(method.options), str(method)
    else:
        text = str(method).strip()
        name, opts = split_method(text)

        def bad(item: str) -> SpeculatorError:
            return SpeculatorError(f"bad option {item!r} in method {text!r}; {takes(name, resolve(name, text))}")

        given = plugins.parse_options(opts, bad)
    found = resolve(name, text)
    options = {}
    for key, value in given.items():
        if found.options is not None and key not in found.options:
            raise SpeculatorError(f"unknown option {key!r} in method {text!r}; {takes(name, found)}")
        options[key] = typed(value, None if found.options is None else found.options[key], key, text)
    if found.check is not None:
        found.check(**options)
    return Method(name, options)


def takes(name: str, found: Entry) -> str:
    if found.options is None:
        return f"{name} takes any key=value option"
    return f"{name} takes " + (", ".join(f"{key}=" for key in found.options) or "no options")


def options_of(name: str) -> dict[str, type | None] | None:
    """The options a speculator takes (None: any); an unknown name is a SpeculatorError."""
    return resolve(name).options


def build(method: str | Method, target, context: BuildContext | None = None) -> Speculator:
    """The speculator a method describes, for this target: checked first, so bad input fails before any work."""
    method = check_method(method)
    spec = resolve(method.name).build(target, context or BuildContext(), **method.options)
    missing = missing_members(spec)
    if missing:
        raise SpeculatorError(f"plug-in {method.name!r} built {spec!r}, which lacks {', '.join(missing)}")
    return spec
