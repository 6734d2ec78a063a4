"""Fetch and convert registry models ahead of their first use (downloads show their progress).

python -m runtime.fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
"""

from __future__ import annotations

from runtime import cliutil
from runtime.loader import REGISTRY, resolve


def main(argv: list[str] | None = None) -> None:
    ap = cliutil.ArgumentParser(prog="python -m runtime.fetch", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+", choices=sorted(REGISTRY), help="registry models to fetch and convert")
    args = ap.parse_args(argv)
    for name in args.names:
        print(f"{name}: {resolve(name)}")


if __name__ == "__main__":
    cliutil.run(main)
