"""Helpers shared by subcommands: load a config in any dialect (a file, or a shipped config by
name), check flags, print JSON and notes."""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from condmem.cli import UsageError
from condmem.config import ConfigError, EngramConfig


def add_config_argument(parser, required: bool = True) -> None:
    parser.add_argument(
        "--config",
        required=required,
        metavar="CONFIG.json",
        help="Engram config: a condmem config, a DeepSeek-V4.1 config.json (engram_* keys) "
        "or the official demo's keys; the dialect is detected. A shipped config by name: "
        f"{', '.join(shipped_configs())}",
    )


def shipped_configs() -> list[str]:
    """The names of the Engram configs shipped with condmem (``condmem/configs/<name>.json``)."""
    folder = resources.files("condmem").joinpath("configs")
    return sorted(f.name[: -len(".json")] for f in folder.iterdir() if f.name.endswith(".json"))


def resolve_config(value: str, flag: str = "--config") -> Path:
    """The file a ``--config`` value names: a path that exists, else a shipped config's name (with or
    without ``.json``); a bare name that is neither is a `ConfigError` listing the shipped ones."""
    path = Path(value)
    if path.exists():
        return path
    if len(path.parts) != 1:
        if path.suffix == ".json" and path.stem in shipped_configs():
            raise ConfigError(f"{flag}: {value}: no such file; the shipped config of that name is --config {path.stem}")
        return path
    name = value[: -len(".json")] if value.endswith(".json") else value
    if name in shipped_configs():
        return Path(str(resources.files("condmem").joinpath("configs", f"{name}.json")))
    raise ConfigError(f"{flag}: {value}: no such file, nor a shipped config (shipped: {', '.join(shipped_configs())})")


def load_config(path: str, flag: str = "--config", **kw) -> EngramConfig:
    """`EngramConfig.load` of the file or shipped config `path` names (`resolve_config`), its errors
    prefixed with the flag that named it."""
    try:
        return EngramConfig.load(resolve_config(path, flag), **kw)
    except ConfigError as exc:
        raise ConfigError(exc.args[0] if str(exc).startswith(f"{flag}: ") else f"{flag}: {exc}") from None


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


def check_int(value: int | None, flag: str, minimum: int = 1, maximum: int | None = None, why: str = "") -> None:
    """Refuse `value` of `flag` (None: not given) outside ``minimum..maximum`` (a `UsageError`, exit 2)."""
    if value is None:
        return
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum:,}" if maximum is None else f"in {minimum:,}..{maximum:,}"
        raise UsageError(f"{flag} must be {bound}{why}, got {value:,}")


def check_vocab_size(value: int | None, flag: str = "--vocab-size") -> None:
    """The bounds of a byte-level BPE's vocabulary (`condmem.train.bpe`), checked before any corpus is read."""
    from condmem.train.bpe import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE

    why = " (256 byte tokens, the special tokens and a merge at least; the BPE trainer reserves ~70 B per id)"
    check_int(value, flag, MIN_VOCAB_SIZE, MAX_VOCAB_SIZE, why=why)


def device_flag(value: str, flag: str = "--device"):
    """The torch device `flag` names (``auto``: CUDA when available); a name torch does not know or
    a device it cannot see is a `UsageError`."""
    from condmem.train.build import resolve_device

    try:
        return resolve_device(value)
    except ValueError as exc:
        raise UsageError(str(exc).replace("--device", flag)) from None


def note(command: str, text: str) -> None:
    """One line on stderr telling the user what was changed for them (a value capped, input cut)."""
    print(f"condmem {command}: note: {text}", file=sys.stderr, flush=True)
