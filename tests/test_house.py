"""Issue 40's bars, read off the tree: short functions and mains (scripts/function_lengths.py), commands not
imported as libraries, no dated work logs in notes/, and documentation links that resolve."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


function_lengths = load_script("function_lengths")
import_graph = load_script("import_graph")

# Library modules that also keep a small command of their own: the command is a thin front door over the
# algorithm the module defines (``python -m quantize.gptq``, the documented way to run it), so the library
# stays where its command is. Every other module with a ``__main__`` block is a command and nothing imports it.
LIBRARIES_WITH_A_COMMAND = {
    "quantize.rtn",  # quantize_model: the in-place RTN that quantize.int8 builds on
    "quantize.gptq",  # the GPTQ solver that AWQ and FP8-GPTQ reuse
    "quantize.awq",  # scale search and folding that int8 (SmoothQuant-style) reuses
    "quantize.fp8",  # FP8 / FP4 configs and quantize_model
    "runtime.data",  # the datasets every layer reads; its command prints and caches them
    "experiments.report",  # the table renderer; its command re-renders a results directory
}
# evals/ is grouped by what it measures; a group may use another's libraries only along these directions.
EVALS_GROUPS = ("quality", "speculation", "serving", "speed")
EVALS_GROUP_IMPORTS = {("speculation", "quality")}  # fidelity and the HumanEval problems
DOCS = ("README.md", "notes/README.md", "docs/*.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_no_function_over_100_lines():
    long = function_lengths.over(function_lengths.FUNCTION_LIMIT)
    assert long == [], "functions over 100 lines (split them into named helpers):\n" + "\n".join(map(str, long))


def test_command_line_mains_are_short():
    long = function_lengths.over(function_lengths.MAIN_LIMIT, mains_only=True)
    assert long == [], "mains over 60 lines (parse, one call, print):\n" + "\n".join(map(str, long))


def command_modules(graph) -> set[str]:
    return {name for name, path in graph.modules.items() if import_graph.has_main_block(ast.parse(path.read_text()))}


def test_no_module_imports_a_command():
    graph = import_graph.build()
    commands = command_modules(graph) - LIBRARIES_WITH_A_COMMAND
    assert len(commands) > 20  # the checker saw the real tree
    bad = sorted({f"{i.source}:{i.line} -> {i.target}" for i in graph.imports if i.target in commands})
    assert bad == [], "imports of command modules (move the helper into a library module):\n" + "\n".join(bad)


def test_the_allowed_libraries_still_have_their_commands():
    graph = import_graph.build()
    assert LIBRARIES_WITH_A_COMMAND <= command_modules(graph)  # a stale entry would hide nothing: drop it


def evals_group(module: str) -> str | None:
    """The group of an evals module (evals.quality.perplexity: quality); None outside evals or at its top level."""
    parts = module.split(".")
    return parts[1] if parts[0] == "evals" and len(parts) > 2 else None


def test_evals_is_grouped_by_what_it_measures():
    graph = import_graph.build()
    evals = [name for name in graph.modules if name.startswith("evals.")]
    assert len(evals) > 30  # the checker saw the real tree
    ungrouped = [name for name in evals if name.split(".")[1] not in EVALS_GROUPS]
    assert ungrouped == [], "evals modules outside quality / speculation / serving / speed: " + ", ".join(ungrouped)
    for group in EVALS_GROUPS:  # each group's docstring says what it measures and lists its commands
        doc = ast.get_docstring(ast.parse(graph.modules[f"evals.{group}"].read_text())) or ""
        listed = set(re.findall(rf"evals\.{group}\.(\w+)", doc))
        commands = {name.rsplit(".", 1)[1] for name in command_modules(graph) if evals_group(name) == group}
        assert commands and commands <= listed, f"evals.{group}'s docstring does not list {sorted(commands - listed)}"
    crossing = {(evals_group(i.source), evals_group(i.target), i.source, i.target) for i in graph.imports}
    bad = sorted(
        f"{source} -> {target}"
        for a, b, source, target in crossing
        if a and b and a != b and (a, b) not in EVALS_GROUP_IMPORTS
    )
    assert bad == [], "imports between evals groups against their direction:\n" + "\n".join(bad)


def test_notes_hold_no_dated_work_logs():
    assert sorted(p.name for p in (ROOT / "notes").glob("session-*.md")) == []


def relative_links(path: Path) -> list[str]:
    links = [m.group(1) for m in LINK.finditer(path.read_text(encoding="utf-8"))]
    return [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link) and not link.startswith("#")]


def test_every_relative_documentation_link_resolves():
    pages = sorted({p for pattern in DOCS for p in ROOT.glob(pattern)})
    assert ROOT / "README.md" in pages and len(pages) >= 5
    broken = [
        f"{page.relative_to(ROOT)}: {link}"
        for page in pages
        for link in relative_links(page)
        if not (page.parent / link.split("#")[0]).exists()
    ]
    assert broken == [], "links that do not resolve:\n" + "\n".join(broken)


def test_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [web](https://example.org) [anchor](#x) [gone](missing.md#part)\n")
    assert relative_links(page) == ["page.md", "missing.md#part"]
