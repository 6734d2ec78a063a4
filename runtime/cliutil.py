"""What every ``python -m`` CLI shares: one-line errors with exit code 2, and Ctrl-C without a traceback.

Kept free of torch and of other project modules, so a CLI can parse and check its arguments with it before
anything heavy is imported or any model is loaded.

    if __name__ == "__main__":
        cliutil.run(main)  # UsageError -> "error: ..." (exit 2); Ctrl-C -> "[qspec] interrupted" (exit 130)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C'd command


class UsageError(ValueError):
    """An expected, user-fixable error (a bad argument, a missing file): one line on stderr, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error: argparse's own prints the whole usage block first (``--help`` has it)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def one_line(message: object) -> str:
    text = str(message).strip()
    if isinstance(message, KeyError) and len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]  # KeyError quotes its message
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def require(ok: bool, message: str) -> None:
    """Raise a UsageError with `message` unless ok (for argument checks that read as a list)."""
    if not ok:
        raise UsageError(message)


def run(main: Callable, argv: list[str] | None = None, expected: tuple[type[BaseException], ...] = ()):
    """Run a CLI's main: UsageError (and `expected` error types) -> one line on stderr and exit code 2;
    KeyboardInterrupt -> one line and exit code 130. A main that keeps partial results catches
    KeyboardInterrupt itself, saves, says where in one line, and re-raises."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        interrupted()
    except BrokenPipeError:  # `... | head` closed the pipe: not an error of the command
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
    except (UsageError, *expected) as err:
        sys.stdout.flush()
        print(f"error: {one_line(err)}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def interrupted(what: str = "") -> None:
    """Exit quietly after a Ctrl-C: one line (saying what was kept, if anything), exit code 130."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while exiting must not print a traceback
    sys.stdout.flush()
    print(f"\n[qspec] interrupted{': ' + what if what else ''}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED)
