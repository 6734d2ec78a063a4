"""Functions and methods in qspec's packages that run over a line limit.

    python scripts/function_lengths.py              # every function over 100 lines; exit 1 if any
    python scripts/function_lengths.py --limit 60 --mains   # command-line mains over 60 lines

A function's length is its source span, decorators and docstring included (``end_lineno - lineno + 1``).
tests/test_house.py holds the project to the same limits.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "quantize", "speculate", "evals", "experiments", "scripts")
FUNCTION_LIMIT = 100
MAIN_LIMIT = 60


@dataclass(frozen=True)
class Function:
    path: str  # relative to the repository root
    name: str  # qualified: Class.method, outer.inner
    line: int
    length: int

    def __str__(self) -> str:
        return f"{self.length:4d}  {self.path}:{self.line}  {self.name}"


def package_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    return sorted(path for package in packages for path in (root / package).rglob("*.py"))


def functions(path: Path, root: Path = ROOT) -> list[Function]:
    """Every function and method in ``path``, nested ones included, each with its qualified name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    relative = path.relative_to(root).as_posix()
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append(Function(relative, name, child.lineno, child.end_lineno - first + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def over(limit: int, mains_only: bool = False, root: Path = ROOT) -> list[Function]:
    """Functions longer than ``limit`` lines, longest first; with ``mains_only``, module-level ``main``s."""
    every = (f for path in package_files(root) for f in functions(path, root))
    chosen = [f for f in every if f.length > limit and (not mains_only or f.name == "main")]
    return sorted(chosen, key=lambda f: -f.length)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = f"default {FUNCTION_LIMIT}, {MAIN_LIMIT} with --mains"
    parser.add_argument("--limit", type=int, default=None, help=f"lines ({default})")
    parser.add_argument("--mains", action="store_true", help="only module-level functions named main")
    args = parser.parse_args()
    limit = args.limit if args.limit is not None else (MAIN_LIMIT if args.mains else FUNCTION_LIMIT)
    found = over(limit, args.mains)
    for function in found:
        print(function)
    kind = "mains" if args.mains else "functions"
    print(f"{len(found)} {kind} over {limit} lines in {', '.join(PACKAGES)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
