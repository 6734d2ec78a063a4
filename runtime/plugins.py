"""What every plug-in registry shares (speculate.registry, quantize.registry): naming an object by "module:attr",
installed entry points, and typed key=value options read from a builder's signature. Each registry passes its
own error type, so a problem is one line of the error its CLIs already catch."""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Callable
from importlib import metadata

OPTION_TYPES = (bool, int, float, str)
TYPE_WORDS = {int: "an integer", float: "a number", bool: "0 or 1 (or true/false)", str: "a string"}
BOOL_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def entry_points(group: str) -> dict[str, str]:
    """Installed plug-ins of a group: entry-point name -> "module:attr" (read each time, so a new install is seen)."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=group)}


def load_attribute(name: str, ref: str, error: type[Exception] = ValueError):
    """The object that "module:attr" names; one `error` line when the module or attribute is missing."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise error(f"plug-in {name!r}: {ref!r} is not module:attr")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # any failure to import (missing, syntax, its own imports) is the plug-in's
        raise error(f"plug-in {name!r}: cannot import module {module_name!r} ({err})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"plug-in {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def builder_options(
    fn: Callable, skip: int, name: str = "", error: type[Exception] = ValueError, wanted: str = ""
) -> dict[str, type | None] | None:
    """The options a builder takes: its keyword parameters after the first `skip` positional ones, typed by
    annotation or default; None when it takes **kwargs. `wanted` names the positional signature in the error."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise error(f"plug-in {name!r}: cannot read the signature of {fn!r}") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < skip and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise error(f"plug-in {name!r}: {getattr(fn, '__qualname__', fn)} must take {wanted}")
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    try:  # a class's options are its __init__'s parameters
        hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
    except Exception:  # unresolvable annotations: type by the defaults
        hints = {}
    options = {}
    for p in params[skip:]:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        kinds = [t for t in typing.get_args(hints.get(p.name)) or [hints.get(p.name)] if t in OPTION_TYPES]
        default = p.default if p.default is not p.empty else None
        options[p.name] = kinds[0] if kinds else (type(default) if type(default) in OPTION_TYPES else None)
    return options


def typed(value, kind: type | None, key: str, text: str, error: type[Exception] = ValueError):
    """An option's value as its type (kind None: untyped): a method string's text is parsed, a value is checked."""
    bad = error(f"option {key} of method {text!r} must be {TYPE_WORDS.get(kind)}, got {value!r}")
    if isinstance(value, str) and kind is not str:
        if kind is bool:
            if value.lower() not in BOOL_WORDS:
                raise bad
            return BOOL_WORDS[value.lower()]
        for parse in (int, float) if kind is None else (kind,):
            try:
                return parse(value)
            except ValueError:
                pass
        if kind is None:  # an untyped option that is no number keeps its text
            return value
        raise bad
    if kind is None or type(value) is kind:
        return value
    if kind is float and type(value) is int:
        return float(value)
    if kind is bool and value in (0, 1):  # fixed: 1 in a YAML config
        return bool(value)
    raise bad


def split_method(text: str, known: Callable[[str], bool]) -> tuple[str, str]:
    """(name, options text) of NAME[:key=value,...]; a NAME that is not known may be module:attr."""
    name, sep, rest = text.partition(":")
    attr, _, opts = rest.partition(":")
    if sep and attr and "=" not in attr and not known(name):
        return f"{name}:{attr}", opts
    return name, rest


def parse_options(opts: str, bad: Callable[[str], Exception]) -> dict[str, str]:
    """key=value,... -> {key: text}; bad(item) is the error for a malformed or repeated item."""
    given: dict[str, str] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key or key in given:
            raise bad(item)
        given[key] = value
    return given
