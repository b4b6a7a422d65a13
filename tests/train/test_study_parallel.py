"""`condmem study --parallel K`: K processes on one device taking runs from one queue give the same run
files (losses equal, deterministic mode) and the same study.json as one process; a run claimed by one
process is trained by no other; a bad K is refused."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
import torch

from condmem.apps.study import sweep
from condmem.apps.study.parallel import run_parallel
from condmem.apps.study.runs import claim_run
from condmem.apps.study.sweep import run_study
from condmem.cli import main


def test_a_run_is_claimed_once_across_processes(tmp_path):
    assert claim_run(tmp_path, "rho1_seed0") and not claim_run(tmp_path, "rho1_seed0")
    assert claim_run(tmp_path, "rho1_seed1")  # another run is still free
    with concurrent.futures.ProcessPoolExecutor(4) as pool:  # a race between processes: one winner
        won = list(pool.map(claim_run, [tmp_path] * 8, ["rho0.5_seed0"] * 8))
    assert won.count(True) == 1


def test_a_worker_skips_the_runs_another_has_claimed(tmp_path):
    out, claims = tmp_path / "sweep", tmp_path / "claims"
    claims.mkdir()
    common = {"preset": "tiny", "seeds": 1, "progress": False, "only": ["control=none"]}
    plan = run_study("allocation", out, stage="plan", **common)
    taken = plan["selected_left"][0]
    assert claim_run(claims, taken)  # as if another worker were training it
    run_study("allocation", out, stage="train", claims=claims, **common)
    trained = set(_results(out))
    assert trained == {f"{r}.json" for r in plan["selected_left"][1:]}
    assert sorted(p.name for p in claims.iterdir()) == sorted(plan["selected_left"])


def test_a_run_given_back_out_of_memory_is_taken_by_a_worker_still_running(tmp_path, monkeypatch):
    out, claims = tmp_path / "sweep", tmp_path / "claims"
    claims.mkdir()
    common = {"preset": "tiny", "seeds": 1, "progress": False, "only": ["control=none"]}
    runs = run_study("allocation", out, stage="plan", **common)["selected_left"]
    first = runs[0]
    real = sweep.train_run

    def out_of_memory_on(run_id):
        def train(spec, *args, **kwargs):
            if spec.run_id == run_id:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(spec, *args, **kwargs)

        return train

    # a worker out of memory on the first run gives it back and stops
    monkeypatch.setattr(sweep, "train_run", out_of_memory_on(first))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        run_study("allocation", out, stage="train", claims=claims, **common)
    assert not (claims / first).exists() and not _results(out)
    # another worker took the first run meanwhile and runs out of memory on it too, after this worker
    # has moved past it: this worker comes back for it
    assert claim_run(claims, first)
    taken = []

    def train_then_released(spec, *args, **kwargs):
        taken.append(spec.run_id)
        if len(taken) == 1:
            (claims / first).unlink()
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(sweep, "train_run", train_then_released)
    run_study("allocation", out, stage="train", claims=claims, **common)
    assert taken[:2] == [runs[1], first] and sorted(taken) == sorted(runs)
    assert set(_results(out)) == {f"{r}.json" for r in runs}


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
