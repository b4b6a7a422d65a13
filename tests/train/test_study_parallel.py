"""`condmem study --parallel K`: the runs dealt to K processes on one device give the same run files
(losses equal, deterministic mode) and the same study.json as one process; a bad K is refused."""

from __future__ import annotations

import json

import pytest

from condmem.apps.study.parallel import deal, run_parallel
from condmem.cli import main


def test_deal_spreads_runs_round_robin_and_drops_empty_shares():
    assert deal(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    assert deal(["a"], 3) == [["a"]]
    assert deal([], 3) == []


def _results(out):
    runs = {p.name: json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))}
    return {name: (r["train_losses"], r["val_loss"]) for name, r in runs.items()}


@pytest.mark.slow
def test_parallel_sweep_equals_one_process(tmp_path):
    common = ["study", "allocation", "--preset", "tiny", "--seeds", "1", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--out", str(tmp_path / "two"), "--parallel", "2"]) == 0
    one, two = _results(tmp_path / "one"), _results(tmp_path / "two")
    assert len(one) == 8 and one == two
    assert sorted(p.name for p in (tmp_path / "two" / "logs").iterdir()) == ["worker-0.log", "worker-1.log"]
    a, b = (json.loads((tmp_path / d / "study.json").read_text()) for d in ("one", "two"))
    assert a["statistics"] == b["statistics"] and a["finding"] == b["finding"]
    # a second command finds nothing left to train and merges again
    assert main([*common, "--out", str(tmp_path / "two"), "--parallel", "2"]) == 0


@pytest.mark.slow
def test_parallel_trains_only_the_selection_and_resumes(tmp_path, capsys):
    out = tmp_path / "sweep"
    common = ["study", "allocation", "--preset", "tiny", "--seeds", "1", "--no-progress", "--out", str(out)]
    assert main([*common, "--only", "control=none", "--parallel", "3"]) == 0
    trained = set(_results(out))
    controls = ("no_table", "tiny_table", "random_address", "dense")
    assert trained and not any(c in n for c in controls for n in trained)
    assert "runs of the sweep are done" in capsys.readouterr().out and not (out / "study.json").exists()
    assert main([*common, "--parallel", "2"]) == 0  # the rest, then the merge
    assert set(_results(out)) > trained and (out / "study.json").exists()


def test_bad_parallel_counts_are_refused(tmp_path, capsys):
    assert main(["study", "allocation", "--preset", "tiny", "--out", str(tmp_path), "--parallel", "0"]) == 1
    assert "--parallel must be 1 or more, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--parallel must be an integer >= 2"):
        run_parallel("allocation", tmp_path, 1)
