"""The ``condmem`` command line: one subcommand per library concern.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the
parsed namespace, returning an exit code). `SUBCOMMANDS` lists them in help order.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Module names under condmem.cli; a module that fails to import (a missing optional
# dependency) is reported when its subcommand is used, not at start-up of the others.
SUBCOMMANDS = ["demo", "train", "generate", "hash", "layout", "convert", "inspect", "bench"]

DESCRIPTION = """\
condmem: Engram conditional memory (hashed n-gram tables) for PyTorch.

Row ids of an Engram table depend only on the token ids, so they are computed for
every Engram layer before the first transformer layer runs; the tables can then live
in host memory or on disk and be prefetched. Subcommands:
"""

EPILOG = """\
examples:
  condmem demo                                  train baseline vs Engram on the stdlib source, compare
  condmem layout --config config.json           primes, rows and bytes per Engram layer
  condmem hash --tokenizer deepseek-v4 --config config.json --text "Hello world"
Run 'condmem <subcommand> --help' for each one's options.
"""


class CliError(Exception):
    """An error the user can fix; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="condmem", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="<subcommand>")
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
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as exc:
        # Our validation errors are ValueErrors with messages written for the user.
        print(f"condmem {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
