"""The shipped Engram configs are package data, named on the command line from any folder.

``--config deepseek_v41_flash`` (or ``official_demo``, with or without ``.json``) reads the
config shipped inside the package; a path that exists always wins over a shipped name; the
repository's ``configs/`` still works from its root (its files link to the package's).
"""

from __future__ import annotations

import json
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from condmem.cli import common, main
from condmem.config import ConfigError, EngramConfig

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_configs_are_package_data():
    assert common.shipped_configs() == ["deepseek_v41_flash", "official_demo"]
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.json" in package_data["condmem.configs"], "the configs would be left out of a wheel"
    for name in common.shipped_configs():
        shipped = resources.files("condmem").joinpath("configs", f"{name}.json")
        # The repository's configs/ is the same file (a link), not a second copy to keep in step.
        assert (ROOT / "configs" / f"{name}.json").resolve() == Path(str(shipped)).resolve()


@pytest.mark.parametrize("name", ["deepseek_v41_flash", "official_demo.json"])
def test_a_bare_shipped_name_loads_from_any_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = common.load_config(name)
    assert got == EngramConfig.load(ROOT / "configs" / (name if name.endswith(".json") else f"{name}.json"))


def test_a_bare_name_fails_from_another_folder_without_the_resolver(tmp_path, monkeypatch):
    """The negative control: a plain path lookup does not find the shipped config outside the repository."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "resolve_config", lambda value, flag="--config": Path(value))
    with pytest.raises(ConfigError):
        common.load_config("deepseek_v41_flash")


def test_an_existing_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = json.loads((ROOT / "configs" / "official_demo.json").read_text())
    mine["seed"] = 7
    Path("official_demo").write_text(json.dumps(mine))
    assert common.load_config("official_demo").seed == 7
    assert common.load_config("official_demo.json").seed == 0  # no such file here: the shipped one


def test_an_unknown_name_and_a_missing_repository_path_say_what_to_pass(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["layout", "--config", "nosuch"]) != 0
    err = capsys.readouterr().err
    assert "--config: nosuch: no such file, nor a shipped config (shipped: deepseek_v41_flash, official_demo)" in err
    assert main(["layout", "--config", "configs/deepseek_v41_flash.json"]) != 0
    assert "the shipped config of that name is --config deepseek_v41_flash" in capsys.readouterr().err


def test_the_layout_example_runs_outside_the_repository(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["layout", "--config", "deepseek_v41_flash"]) == 0
    assert "layers [1, 14]" in capsys.readouterr().out
