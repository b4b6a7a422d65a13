"""`--reuse`: a sweep copies in another sweep's finished runs whose configuration equals a planned
run's (a token sweep's budget that an allocation sweep trained) instead of training them again."""

from __future__ import annotations

import json

import pytest

from condmem.apps.study import sweep as study
from condmem.apps.study.runs import ReusableRuns
from condmem.cli import main

GRID = ["256", "512", "2048"]  # the tiny preset's 2, 4 and 16 steps; its allocation trains 16


def _run(kind, tiny_corpus, out, *extra):
    common = ["--preset", "tiny", "--corpus", str(tiny_corpus), "--out", str(out), "--no-progress", "--device", "cpu"]
    return main(["study", kind, *common, *extra])


@pytest.fixture
def trained(monkeypatch):
    """The ids of the runs this test's sweeps trained (rather than copied)."""
    ids, real = [], study.train_run
    monkeypatch.setattr(study, "train_run", lambda spec, *a, **k: ids.append(spec.run_id) or real(spec, *a, **k))
    return ids


def test_a_token_sweep_copies_the_allocation_runs_of_its_budget(tiny_corpus, tmp_path, trained):
    allocation = tmp_path / "allocation"
    assert _run("allocation", tiny_corpus, allocation, "--only", "seed=0", "--controls", "no_table") == 0
    del trained[:]
    tokens = tmp_path / "tokens"
    only = ["--only", "tokens=2048,seed=0", "--tokens-grid", *GRID]
    assert _run("tokens", tiny_corpus, tokens, *only, "--reuse", str(allocation)) == 0
    assert trained == []  # all three runs of the budget copied, none trained
    for key in ("rho1", "rho0.5000_experts4", "rho0.5000_experts4_no_table"):
        source = json.loads((allocation / "runs" / f"{key}_seed0.json").read_text())
        copy = json.loads((tokens / "runs" / f"tok2048_{key}_seed0.json").read_text())
        assert copy["run_id"] == f"tok2048_{key}_seed0" and copy["label"].startswith("2,048 tok")
        assert copy["reused_from"]["run_id"] == source["run_id"]
        assert copy["val_loss"] == source["val_loss"] and copy["train_losses"] == source["train_losses"]
        assert copy["run_config"]["study"] == "tokens" and copy["run_config"]["point"] == f"tok2048_{key}"
    # negative control: another validation size is another run, trained rather than copied
    other = tmp_path / "tokens_other"
    assert _run("tokens", tiny_corpus, other, *only, "--val-tokens", "4096", "--reuse", str(allocation)) == 0
    assert sorted(trained) == sorted(
        f"tok2048_{k}_seed0" for k in ("rho1", "rho0.5000_experts4", "rho0.5000_experts4_no_table")
    )
    assert not any("reused_from" in json.loads(p.read_text()) for p in (other / "runs").glob("*.json"))


def test_reuse_refuses_a_folder_that_is_not_a_sweep(tmp_path):
    with pytest.raises(ValueError, match="--reuse .*: no runs/ folder there"):
        ReusableRuns([tmp_path])
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json is not a run result"):
        ReusableRuns([tmp_path])
