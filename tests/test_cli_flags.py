"""Every flag of every subcommand is documented and exercised.

The flags are enumerated from the parser itself (`condmem.cli.build_parser`, nested
subcommands included). Documented: the flag has a help text of its own. Exercised: a test
passes it (the flag appears in a file under ``tests/`` that runs that subcommand), or an example
of its ``--help`` does (``tests/test_cli_examples.py`` runs every example as written).
``condmem train`` keeps its flags few: at most 15 beside ``--config`` (and ``--help``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from condmem.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """{'condmem' or the subcommand path ('demo', 'bench e2e'): its parser, options added}."""
    found = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        parser.format_help()  # adds the options a subcommand defers (CliParser.defer)
        found[path or "condmem"] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}".strip())

    walk(build_parser(), "")
    return found


PARSERS = _parsers()
FLAGS = sorted(
    {
        (path, option, action.help or "")
        for path, parser in PARSERS.items()
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
)


TEST_FILES = {
    p: p.read_text(encoding="utf-8") for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != Path(__file__).name
}


def _examples(path: str) -> str:
    """The ``--help`` examples of the subcommand `path` (each run by tests/test_cli_examples.py)."""
    lines = (PARSERS[path].epilog or "").splitlines()
    return "\n".join(line for line in lines if "condmem" in line)


def _used(flag: str, text: str) -> bool:
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


def _names_command(path: str, text: str) -> bool:
    """Whether a test file runs the subcommand `path`: its last word as an argument (``"e2e"``) or
    ``condmem <path>`` in a command line."""
    word = path.split()[-1]
    return path == "condmem" or f'"{word}"' in text or f"condmem {path}" in text


def exercised(path: str, flag: str) -> bool:
    """A test that runs subcommand `path` passes `flag`, or one of its ``--help`` examples does."""
    if _used(flag, _examples(path)):
        return True
    return any(_used(flag, text) and _names_command(path, text) for text in TEST_FILES.values())


def test_the_flags_are_enumerated():
    commands = {path for path, _, _ in FLAGS}
    assert {"demo", "train", "study", "generate", "bench e2e", "tokenizer train", "inspect"} <= commands
    assert len(FLAGS) > 100


@pytest.mark.parametrize("path, flag, help_text", FLAGS, ids=[f"{p}:{f}" for p, f, _ in FLAGS])
def test_every_flag_is_documented_and_exercised(path, flag, help_text):
    assert help_text.strip() and help_text != argparse.SUPPRESS, f"condmem {path} {flag} has no help text"
    assert exercised(path, flag), f"condmem {path} {flag}: no test or --help example passes it"


def test_train_shows_at_most_15_flags_beside_config():
    help_text = PARSERS["train"].format_help()
    shown = {m for m in re.findall(r"(?<![\w-])--[a-z][\w-]*", help_text.split("examples:")[0])}
    flags = {o for a in PARSERS["train"]._actions for o in a.option_strings if o.startswith("--")}
    assert shown <= flags | {"--config"}
    beside = flags - {"--config", "--help"}
    assert len(beside) <= 15, sorted(beside)
