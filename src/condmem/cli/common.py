"""Helpers shared by subcommands: load a config in any dialect, print JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

from condmem.config import ConfigError, EngramConfig


def add_config_argument(parser, required: bool = True) -> None:
    parser.add_argument(
        "--config",
        required=required,
        metavar="CONFIG.json",
        help="Engram config: a condmem config, a DeepSeek-V4.1 config.json (engram_* keys) "
        "or the official demo's keys; the dialect is detected",
    )


def load_config(path: str, flag: str = "--config", **kw) -> EngramConfig:
    """`EngramConfig.load`, its errors prefixed with the flag that named the file."""
    try:
        return EngramConfig.load(path, **kw)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")
