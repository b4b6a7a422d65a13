"""The ``condmem`` command line: one subcommand per library concern.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the
parsed namespace, returning an exit code). `SUBCOMMANDS` lists them in help order.

`main` turns every error a user can cause into one line: a flag's value refused before any
work (`UsageError`) exits 2, as argparse's own usage errors do; our ValueErrors and OS errors
naming a path exit 1. SIGTERM unwinds as Ctrl-C does
(`KeyboardInterrupt`: temp files of atomic writes are removed), exit status 128+signal.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading

# Module names under condmem.cli; a module that fails to import (a missing optional
# dependency) is reported when its subcommand is used, not at start-up of the others.
SUBCOMMANDS = [
    "demo",
    "train",
    "study",
    "generate",
    "tokenizer",
    "hash",
    "layout",
    "size",
    "convert",
    "inspect",
    "bench",
]

DESCRIPTION = """\
condmem: Engram conditional memory (hashed n-gram tables) for PyTorch.

Row ids of an Engram table depend only on the token ids, so they are computed for
every Engram layer before the first transformer layer runs; the tables can then live
in host memory or on disk and be prefetched. Subcommands:
"""

EPILOG = """\
examples (deepseek_v41_flash, official_demo: configs shipped with condmem):
  condmem demo                                 # baseline vs Engram on the stdlib source, compared
  condmem layout --config deepseek_v41_flash   # primes, rows and bytes per Engram layer
  condmem hash --tokenizer deepseek-v4 --config deepseek_v41_flash --text "Hello world"
Run 'condmem <subcommand> --help' for each one's options.
"""


class CliParser(argparse.ArgumentParser):
    """An `ArgumentParser` that adds some arguments only when it is used (`defer`), not when it is built.

    A subcommand whose options come from a module that imports torch defers them, so that
    ``condmem --help`` (every parser built, none used) imports none of it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deferred: list = []

    def defer(self, add) -> None:
        """Call ``add(self)`` before this parser first parses or formats its help."""
        self._deferred.append(add)

    def _complete(self) -> None:
        while self._deferred:
            self._deferred.pop(0)(self)

    def parse_known_args(self, args=None, namespace=None):
        self._complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._complete()
        return super().format_help()


class CliError(Exception):
    """An error the user can fix; printed without a traceback (exit status 1)."""


class UsageError(CliError):
    """A flag's value that cannot work, refused before any work: exit status 2, as argparse's usage errors."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds like Ctrl-C."""

    signum = signal.SIGTERM


def _terminate(signum, frame):
    raise Terminated()


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="condmem", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="<subcommand>", parser_class=CliParser)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"condmem.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("condmem.cli."):
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"condmem {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (CliError, ValueError, OSError) as exc:
        # Our validation errors are ValueErrors with messages written for the user; OS errors name their path.
        print(f"condmem {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        print(
            f"\ncondmem {args.command}: interrupted ({signal.Signals(signum).name}); partial outputs were removed",
            file=sys.stderr,
        )
        return 128 + int(signum)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
