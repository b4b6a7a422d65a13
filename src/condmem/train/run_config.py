"""`RunConfig`: one `condmem train` run as a file (TOML or JSON), validated key by key.

A run config starts from a preset (``preset = "cpu"``; none given: ``gpu`` with CUDA, else
``cpu``) and replaces any of its values in the preset's four sections (``[model]`` with
``[model.moe]``, ``[engram]``, ``[train]``, ``[data]``: the layout of the study's config
files, checked by the same functions of `condmem.train.presets`). Its top-level keys say what
the run trains beside the sizes: the seed, the tokenizer, the baseline instead of Engram,
where the tables train. ``condmem/configs/train/example.toml`` lists every key.

`condmem train --config FILE` reads one; ``--set KEY=VALUE`` and the command's few flags
replace keys of it (`RunConfig.with_values`, dotted keys: ``train.lr``, ``model.moe.top_k``).
Every key is checked when read: an unknown key, a value of the wrong type or out of its
domain is a `ConfigError` naming the key (and the file).
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from condmem.config import ConfigError
from condmem.train.presets import (
    PRESETS,
    SECTIONS,
    Preset,
    check_int,
    get_preset,
    nested,
    renamed_errors,
    read_config_file,
    section_fields,
    validate_preset,
)

_CHOICES = {
    "preset": (None, *PRESETS),
    "table_tier": ("module", "host"),
    "host_state": ("fp32", "bf16"),
    "host_adam": ("host", "device"),
}

RESUMABLE = ("train.steps", "train.eval_every", "train.checkpoint_every", "train.log_every")
"""The preset keys a resumed run may change: when it stops, how often it evaluates, checkpoints and logs."""

FIXED_ON_RESUME = ("preset", "tokenizer", "no_engram", "iso_flop")
"""Top-level keys a resumed run keeps from its checkpoint (as it keeps every other preset key)."""


@dataclass
class RunConfig:
    """One `condmem train` run: a preset, the values replaced in it, and how the run trains."""

    preset: Literal["cpu", "gpu", "tiny"] | None = None
    """The preset the sections' values replace (None: ``gpu`` with CUDA, else ``cpu``)."""
    seed: int = 0
    """Seeds the data preparation, the initialization and the batch order."""
    tokenizer: str | None = None
    """A tokenizer.json, its directory or ``deepseek-v4`` instead of training a BPE on the corpus."""
    no_engram: bool = False
    """Train the plain baseline (no Engram layer)."""
    iso_flop: bool = False
    """With ``no_engram``: widen the MLP of the would-be Engram blocks by the Engram's FLOPs."""
    deterministic: bool = False
    """Deterministic kernels: the same seed and config give bit-identical losses on one machine type."""
    table_tier: Literal["module", "host"] = "module"
    """module: the tables are model parameters on the device; host: tables and their Adam state live
    in (page-locked) host memory, rows fetched each step (exact; docs/training.md)."""
    host_state: Literal["fp32", "bf16"] = "fp32"
    """With ``table_tier = "host"``: Adam moments in fp32 (exact) or bf16 (8 instead of 12 B/parameter)."""
    host_threads: int | None = None
    """With ``table_tier = "host"``: threads of the host Adam and gathers (None: torch's)."""
    host_adam: Literal["host", "device"] = "host"
    """With ``table_tier = "host"``: Adam on the host's threads, or on the device with the host only
    storing rows and state (exact either way)."""
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Preset values replaced, by section (``{"train": {"lr": 1e-3}, "model": {"moe": {...}}}``)."""

    def __post_init__(self) -> None:
        _validate_top(self)
        for section, values in self.sections.items():
            refused = {"seed": "the top-level key seed (--seed)"} if section == "train" else None
            self.sections[section] = section_fields(section, values, refused=refused)
        self.resolve("cpu")  # every value checked now, not after the corpus is read

    def resolve(self, device_type: str) -> Preset:
        """The preset with this config's values (`Preset.override`), every value checked: a
        `ConfigError` names the key (``train.lr``, ``model.moe.top_k``)."""
        name = self.preset or ("gpu" if device_type == "cuda" else "cpu")

        def build() -> Preset:
            p = get_preset(name, self.sections)
            validate_preset(p)
            return p

        return renamed_errors(build)

    def with_values(self, values: dict[str, Any], where: str = "run config") -> RunConfig:
        """A copy with dotted keys replaced (``{"train.lr": 1e-3, "seed": 2}``), validated."""
        try:
            data = nested(values, into=self.to_dict())
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return RunConfig.from_dict(data, where=where)

    def to_dict(self) -> dict[str, Any]:
        """The file's layout: top-level keys (None values left out) and the sections given."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sections"}
        out = {k: v for k, v in out.items() if v is not None}
        out.update(copy.deepcopy(self.sections))
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "run config") -> RunConfig:
        """A config from the file's layout; `ConfigError` naming `where` and the key for a bad one."""
        try:
            if not isinstance(data, dict):
                raise ConfigError(f"a run config is a table of keys, got {type(data).__name__}")
            unknown = sorted(set(data) - _TOP - set(SECTIONS))
            if unknown:
                known = ", ".join(sorted(_TOP | set(SECTIONS)))
                raise ConfigError(f"unknown key(s) {', '.join(unknown)}; known: {known}")
            top = {k: data[k] for k in _TOP if k in data}
            return cls(**top, sections={s: data[s] for s in SECTIONS if s in data})
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


_TOP = {f.name for f in dataclasses.fields(RunConfig)} - {"sections"}


def _validate_top(c: RunConfig) -> None:
    for key, choices in _CHOICES.items():
        if getattr(c, key) not in choices:
            shown = ", ".join(str(x) for x in choices if x is not None)
            raise ConfigError(f"{key} must be one of {shown}, got {getattr(c, key)!r}")
    check_int("seed", c.seed, 0)
    if c.host_threads is not None:
        check_int("host_threads", c.host_threads, 1)
    for key in ("no_engram", "iso_flop", "deterministic"):
        if not isinstance(getattr(c, key), bool):
            raise ConfigError(f"{key} must be true or false, got {getattr(c, key)!r}")
    if c.tokenizer is not None and (not isinstance(c.tokenizer, str) or not c.tokenizer):
        raise ConfigError(f"tokenizer must be a path or a name, got {c.tokenizer!r}")
    if c.iso_flop and not c.no_engram:
        raise ConfigError("iso_flop widens the baseline: it needs no_engram = true (--no-engram)")
    if c.no_engram and c.table_tier == "host":
        raise ConfigError('table_tier = "host" needs Engram tables; drop no_engram (--no-engram)')
    if not isinstance(c.sections, dict):
        raise ConfigError(f"sections must be a table of sections, got {c.sections!r}")


def given_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys a config's layout gives (``train.lr``, ``model.moe.top_k``, ``seed``)."""
    keys = []
    for key, value in data.items():
        if isinstance(value, dict) and (prefix or key in SECTIONS):
            keys += given_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def parse_assignment(text: str, flag: str = "--set") -> tuple[str, Any]:
    """``KEY=VALUE`` as (key, value): VALUE read as a TOML value (``3e-4``, ``true``, ``[1, 2]``,
    ``"text"``), else kept as the text itself (``data.corpus=/path/to/texts``)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{flag} {text!r}: expected KEY=VALUE (e.g. {flag} train.lr=3e-4)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def train_config_path(name: str):
    """The shipped train config ``condmem/configs/train/<name>.toml`` (a package resource)."""
    return resources.files("condmem").joinpath("configs", "train", f"{name}.toml")


def shipped_train_configs() -> list[str]:
    folder = resources.files("condmem").joinpath("configs", "train")
    return sorted(f.name[: -len(".toml")] for f in folder.iterdir() if f.name.endswith(".toml"))


def load_run_config(value: str | Path) -> tuple[RunConfig, list[str]]:
    """The config a file (``.toml`` or ``.json``) or a shipped config's name holds, and the dotted
    keys it gives; errors name the file and the key."""
    path = Path(value)
    if not path.exists() and len(path.parts) == 1 and str(value) in shipped_train_configs():
        path = Path(str(train_config_path(str(value))))
    data = read_config_file(path)
    config = RunConfig.from_dict(data, where=str(path))
    return config, given_keys(data)
