"""`StudyConfig`: one `condmem study` sweep as a file (TOML or JSON), validated key by key.

A study config is the backbone at rho = 1 and its Engram geometry, the training and data
settings (the four sections of a `Preset`: ``[model]`` with ``[model.moe]``, ``[engram]``,
``[train]``, ``[data]``) plus the sweep's own keys at the top level (grids, steps or tokens,
seeds, controls, the validation cap, the deterministic mode). The shipped presets (``tiny``,
``cpu``, ``gpu``) are such files, package data under ``condmem/configs/study/``.

Every key is checked when the file is read: an unknown key, a value of the wrong type or out
of its domain (a negative width, a rho outside (0, 1]) is a `ConfigError` naming the key
(``model.dim``, ``rhos[2]``) and the file. `StudyConfig.to_dict` / `from_dict` round-trip; the
study saves the resolved config beside its results.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from condmem.config import ConfigError
from condmem.models.config import MoEConfig
from condmem.train.loop import TrainConfig
from condmem.train.presets import (
    SECTIONS,
    Preset,
    check_int,
    check_number,
    read_config_file,
    renamed_errors,
    section_fields,
    validate_preset,
)

KINDS = ("allocation", "slots", "tokens")

CONTROLS = ("no_table", "tiny_table", "random_address", "dense")
"""Controls of the allocation sweep (docs/study-guide.md#controls), run beside every rho < 1:
``no_table``: the same experts without an Engram (its FLOPs on the shared expert);
``tiny_table``: the same Engram module and FLOPs with a table of at most ~1K rows per head;
``random_address``: the same table and FLOPs, each token's row ids drawn afresh every step;
and once, beside pure MoE: ``dense``: no routed experts, the same active parameters and FLOPs."""

# Training keys a sweep sets per run: a study config that gives them is refused (the sweep's key is named).
_SET_BY_SWEEP = {
    "steps": "allocation_steps / slots_steps (or allocation_tokens / slots_tokens)",
    "seed": "seed (the top-level key)",
    "max_minutes": "minutes (the top-level key)",
}


@dataclass
class StudyConfig:
    """One `condmem study` configuration: the backbone, training and data (`base`) and the sweep."""

    base: Preset
    """The pure-MoE backbone (model.moe at rho = 1), the Engram's geometry (its table size is
    derived per point), training and data settings."""
    rhos: list[float]
    """Allocation grid: share of the sparse parameters left to routed experts, each in (0, 1]
    (1.0 = pure MoE, always run)."""
    table_sizes: list[int]
    """Slot sweep: bucket range per (order, head); rows are about n_cols times this."""
    allocation_steps: int
    """Training steps of every allocation run (capped at ``max_passes`` over the training split)."""
    slots_steps: int
    """Training steps of every slot run."""
    allocation_tokens: int | None = None
    """Training tokens of every allocation run instead of ``allocation_steps`` (rounded up to whole steps)."""
    slots_tokens: int | None = None
    """Training tokens of every slot run instead of ``slots_steps``."""
    tokens_grid: list[int] | None = None
    """Token sweep: training tokens of every run at each budget (rounded up to whole steps, at most
    ``max_passes`` over the training split); None: no token sweep."""
    tokens_rhos: list[float] | None = None
    """Token sweep: the rhos trained at each budget (None: ``rhos``); each rho < 1 with its
    ``no_table`` control."""
    slots_seeds: int | None = None
    """Seeds of the slot sweep (None: ``seeds``)."""
    seeds: int = 1
    """Seeds per point: seed index k trains with initialization and data-order seed ``seed + k``."""
    seed: int = 0
    """First seed of the runs."""
    split_seed: int = 0
    """Seed of the data preparation (train/validation split, tokenizer and training samples): one
    prepared data set for every run of the sweep."""
    minutes: float | None = None
    """Wall-clock budget of one sweep: when the runs would not fit, the step count is cut up front
    (from a measured probe) and every run states it. None: no budget."""
    max_passes: float = 1.0
    """At most this many passes over the training split (steps are capped, the cap recorded)."""
    val_tokens: int | None = None
    """Final validation of each run on at most this many held-out tokens (windows spread evenly
    over the deduplicated split); None: every held-out token."""
    controls: list[str] = field(default_factory=list)
    """Controls run beside every rho < 1 of the allocation sweep (`CONTROLS`)."""
    deterministic: bool = True
    """`torch.use_deterministic_algorithms` during the runs: the same run gives the same losses."""
    cpu_threads: int | None = None
    """Intra-op threads on a CPU device (None: torch's default). Small models train faster on one
    thread, and far faster on a machine other jobs share."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def name(self) -> str:
        return self.base.name

    def validate(self, where: str = "study config") -> None:
        """Raise `ConfigError` naming the key (``model.dim``, ``rhos[1]``) of the first bad value."""
        try:
            _validate(self)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def steps_for(self, kind: str) -> int:
        """Training steps of every run of `kind` (tokens converted to whole steps)."""
        if kind == "tokens":
            return max(self.token_steps())
        tokens = self.allocation_tokens if kind == "allocation" else self.slots_tokens
        if tokens is not None:
            per_step = self.base.train.batch_size * self.base.train.seq_len
            return max(1, -(-tokens // per_step))
        return self.allocation_steps if kind == "allocation" else self.slots_steps

    def token_steps(self) -> list[int]:
        """Steps of each budget of ``tokens_grid`` (whole steps, ascending, distinct); `ConfigError` without one."""
        if self.tokens_grid is None:
            raise ConfigError("the token sweep needs tokens_grid (the config's) or --tokens-grid")
        per_step = self.base.train.batch_size * self.base.train.seq_len
        steps = sorted({max(1, -(-tokens // per_step)) for tokens in self.tokens_grid})
        if len(steps) < 2:
            raise ConfigError(f"tokens_grid {self.tokens_grid} gives one step count ({steps[0]}): two budgets or more")
        return steps

    def override(self, where: str = "study config", **values: Any) -> StudyConfig:
        """A copy with top-level keys replaced (None: kept), validated."""
        given = {k: v for k, v in values.items() if v is not None}
        unknown = sorted(set(given) - _TOP)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
        try:
            return dataclasses.replace(self, **given)  # __post_init__ validates
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def with_base(self, **sections: dict[str, Any] | None) -> StudyConfig:
        """A copy whose `base` has some section values replaced (`Preset.override`), validated."""
        return dataclasses.replace(self, base=self.base.override(**sections))

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        """The file's layout: top-level sweep keys and the four sections (None values kept)."""
        out = {"name": self.base.name}
        out.update({f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "base"})
        base = self.base.to_dict()
        base.pop("name")
        train = base["train"]
        for key in _SET_BY_SWEEP:
            train.pop(key)
        out.update(base)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "study config") -> StudyConfig:
        """A config from the file's layout; `ConfigError` naming `where` and the key for a bad one."""
        try:
            return cls._from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> StudyConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"a study config is a table of keys, got {type(data).__name__}")
        unknown = sorted(set(data) - _TOP - set(SECTIONS) - {"name"})
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_TOP | set(SECTIONS)))}")
        name = data.get("name", "custom")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name must be a non-empty string, got {name!r}")
        sections = {}
        for section, cls_ in SECTIONS.items():
            values = data.get(section)
            if not isinstance(values, dict):
                raise ConfigError(f"[{section}] is missing or not a table of keys")
            sections[section] = _section(section, cls_, values)
        missing = sorted(k for k in ("rhos", "table_sizes", "allocation_steps", "slots_steps") if k not in data)
        if missing:
            raise ConfigError(f"missing key(s) {', '.join(missing)}")
        top = {k: data[k] for k in _TOP if k in data}
        return cls(Preset(name, **sections), **top)

    def save(self, path: str | Path, within: str | Path | None = None) -> Path:
        """Write the config as JSON (atomically, inside `within` when given); `load_study_config` reads
        it back equal."""
        from condmem.utils.atomic import atomic_write_text

        path = Path(path)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n", within=within)
        return path


_TOP = {f.name for f in dataclasses.fields(StudyConfig)} - {"base"}
_SET_BY_SWEEP_KEYS = {key: f"the sweep: use {where}" for key, where in _SET_BY_SWEEP.items()}


def _section(section: str, cls_, values: dict[str, Any]):
    """One section's dataclass from its keys; unknown keys and the sweep's own keys are refused by name."""
    values = section_fields(section, values, refused=_SET_BY_SWEEP_KEYS if section == "train" else None)
    if section == "model" and values.get("moe") is not None:
        moe = values["moe"]
        if "n_experts" not in moe:
            raise ConfigError("model.moe.n_experts is missing")
        values["moe"] = renamed_errors(lambda: MoEConfig(**moe))
    if section == "train":
        return renamed_errors(lambda: TrainConfig(steps=1, **values))
    try:
        return cls_(**values)
    except TypeError as exc:  # a required key missing
        raise ConfigError(f"[{section}]: {exc}") from None


def _rhos(name: str, value: Any) -> None:
    """A non-empty list of rhos, each in (0, 1]."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{name} must be a non-empty list, got {value!r}")
    for i, rho in enumerate(value):
        check_number(f"{name}[{i}]", rho, positive=False)
        if not 0 < rho <= 1:
            raise ConfigError(f"{name}[{i}]: rho must be in (0, 1], got {rho}")


def _validate(c: StudyConfig) -> None:
    validate_preset(c.base)
    if c.base.model.moe is None:
        raise ConfigError("model.moe is missing: the study's backbone has routed experts")
    _rhos("rhos", c.rhos)
    if not isinstance(c.table_sizes, list) or not c.table_sizes:
        raise ConfigError(f"table_sizes must be a non-empty list, got {c.table_sizes!r}")
    for i, size in enumerate(c.table_sizes):
        check_int(f"table_sizes[{i}]", size, 2)
    for key in ("allocation_steps", "slots_steps"):
        check_int(key, getattr(c, key), 1)
    for key in ("allocation_tokens", "slots_tokens", "val_tokens"):
        if getattr(c, key) is not None:
            check_int(key, getattr(c, key), 1)
    check_int("seeds", c.seeds, 1)
    if c.slots_seeds is not None:
        check_int("slots_seeds", c.slots_seeds, 1)
    if c.tokens_grid is not None:
        if not isinstance(c.tokens_grid, list) or len(set(c.tokens_grid)) < 2:
            raise ConfigError(f"tokens_grid must list two token budgets or more, got {c.tokens_grid!r}")
        for i, tokens in enumerate(c.tokens_grid):
            check_int(f"tokens_grid[{i}]", tokens, 1)
    if c.tokens_rhos is not None:
        _rhos("tokens_rhos", c.tokens_rhos)
    check_int("seed", c.seed, 0)
    check_int("split_seed", c.split_seed, 0)
    if c.minutes is not None:
        check_number("minutes", c.minutes)
    check_number("max_passes", c.max_passes)
    if not isinstance(c.controls, list):
        raise ConfigError(f"controls must be a list of {list(CONTROLS)}, got {c.controls!r}")
    for i, control in enumerate(c.controls):
        if control not in CONTROLS:
            raise ConfigError(f"controls[{i}]: unknown control {control!r}; choose from {list(CONTROLS)}")
    if len(set(c.controls)) != len(c.controls):
        raise ConfigError(f"controls has duplicates: {c.controls}")
    if c.cpu_threads is not None:
        check_int("cpu_threads", c.cpu_threads, 1)
    if not isinstance(c.deterministic, bool):
        raise ConfigError(f"deterministic must be true or false, got {c.deterministic!r}")
    c.base.train.validate()


def load_study_config(path: str | Path) -> StudyConfig:
    """A `StudyConfig` from a TOML or JSON file; errors name the file and the key."""
    return StudyConfig.from_dict(read_config_file(path), where=str(path))


PRESET_NAMES = ("tiny", "cpu", "gpu")


def preset_path(name: str):
    """The shipped preset file ``condmem/configs/study/<name>.toml`` (a package resource)."""
    return resources.files("condmem").joinpath("configs", "study", f"{name}.toml")


def study_preset(name: str) -> StudyConfig:
    """The shipped preset `name`; `ValueError` naming the choices for an unknown one."""
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown study preset {name!r}; choose one of {list(PRESET_NAMES)}")
    source = preset_path(name)
    data = tomllib.loads(source.read_text(encoding="utf-8"))
    return StudyConfig.from_dict(data, where=f"preset {name!r} ({source})")
