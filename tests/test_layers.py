"""The package layering (runtime <- quantize <- speculate <- evals <- experiments), checked on the source with
ast by scripts/import_graph.py: no import against the order outside entry points, no circle, no project import
hidden inside a function. The checker itself is tested on planted trees, so a broken checker fails here too."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
sys.modules["import_graph"] = import_graph  # dataclasses look their module up
spec.loader.exec_module(import_graph)


def test_repository_keeps_the_layer_order():
    graph = import_graph.build()
    assert len(graph.modules) > 50 and graph.imports  # the checker saw the real tree
    bad = [f"{i.source}:{i.line} -> {i.target}" for i in import_graph.violations(graph)]
    assert bad == [], "imports against the layer order: " + ", ".join(bad)


def test_repository_has_no_import_circle():
    assert import_graph.circles(import_graph.build()) == []


def test_repository_has_no_function_local_project_import():
    local = [f"{i.source}:{i.line} -> {i.target}" for i in import_graph.local_project_imports(import_graph.build())]
    assert local == [], "move these to the top of the module: " + ", ".join(local)


def plant(root: Path, files: dict[str, str]) -> None:
    for layer in import_graph.LAYERS:
        (root / layer).mkdir(parents=True, exist_ok=True)
        (root / layer / "__init__.py").touch()
    for name, body in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))


def test_checker_flags_a_planted_upward_import(tmp_path):
    plant(
        tmp_path,
        {
            "runtime/model.py": "import torch\n",
            "evals/metric.py": "from runtime.model import torch\n",
            "runtime/leaky.py": "def f():\n    from evals.metric import torch\n    return torch\n",
        },
    )
    graph = import_graph.build(tmp_path)
    assert [(i.source, i.target, i.local) for i in import_graph.violations(graph)] == [
        ("runtime.leaky", "evals.metric", True)
    ]
    assert [(i.source, i.target) for i in import_graph.local_project_imports(graph)] == [
        ("runtime.leaky", "evals.metric")
    ]


def test_checker_allows_upward_imports_only_in_entry_points_nobody_imports(tmp_path):
    main_block = 'if __name__ == "__main__":\n    pass\n'
    plant(
        tmp_path,
        {
            "evals/quality/perplexity.py": "X = 1\n",
            "runtime/cli.py": "from evals.quality.perplexity import X\n" + main_block,
            "runtime/imported_cli.py": "from evals.quality.perplexity import X\n" + main_block,
            "runtime/user.py": "from runtime.imported_cli import X\n",
        },
    )
    graph = import_graph.build(tmp_path)
    assert graph.entry_points == {"runtime.cli"}
    assert [i.source for i in import_graph.violations(graph)] == ["runtime.imported_cli"]


def test_checker_finds_a_circle_through_a_local_import(tmp_path):
    plant(
        tmp_path,
        {
            "runtime/a.py": "from runtime.b import Y\nX = 1\n",
            "runtime/b.py": "Y = 2\ndef f():\n    from runtime.a import X\n    return X\n",
            "quantize/c.py": "from runtime import a\n",
        },
    )
    graph = import_graph.build(tmp_path)
    assert import_graph.circles(graph) == [["runtime.a", "runtime.b"]]
    assert ("quantize.c", "runtime.a") in {(i.source, i.target) for i in graph.imports}
