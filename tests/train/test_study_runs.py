"""`condmem study` runs: reproducible (seeds from the run's own point and seed index, deterministic
mode, a budget decided up front), resumable (one result file per run, finished runs skipped, a
sweep killed with SIGKILL finishes with the same results), splittable (--only halves merged)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from condmem.cli import main
from condmem.apps.study import runs as study_runs
from condmem.apps.study import sweep as study
from condmem.train.optim import lr_factor
from condmem.apps.study.runs import RunSpec, parse_only, select_runs

STEPS = "6"


def _sweep(tiny_corpus, out: Path, *extra: str) -> int:
    return main(
        [
            "study",
            "allocation",
            "--preset",
            "tiny",
            "--corpus",
            str(tiny_corpus),
            "--steps",
            STEPS,
            "--out",
            str(out),
            "--no-progress",
            "--device",
            "cpu",
            "--controls",  # none: the runs' mechanics are the same with them
            *([] if "--seeds" in extra else ["--seeds", "1"]),
            *extra,
        ]
    )


def _runs(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))}


def _same_results(a: dict, b: dict) -> None:
    """Per-step training losses, validation losses and the run configs are equal (timings may differ)."""
    assert a["train_losses"] == b["train_losses"]
    assert a["val_loss"] == b["val_loss"] and a["buckets"] == b["buckets"]
    assert a["run_config"] == b["run_config"]


@pytest.fixture(scope="module")
def whole(tiny_corpus, tmp_path_factory):
    """An uninterrupted sweep: rho 1, 0.75, 0.5, seeds 0 and 1."""
    out = tmp_path_factory.mktemp("whole")
    torch.set_num_threads(1)
    assert _sweep(tiny_corpus, out, "--seeds", "2") == 0
    return out


def test_the_same_run_twice_gives_identical_losses(whole, tiny_corpus, tmp_path):
    assert _sweep(tiny_corpus, tmp_path, "--seeds", "2") == 0
    again, first = _runs(tmp_path), _runs(whole)
    assert sorted(again) == sorted(first) and len(first) == 6
    # file names that every transport carries: letters, digits, '.', '_'
    assert all(re.fullmatch(r"[A-Za-z0-9._]+", run_id) for run_id in first), sorted(first)
    for run_id in first:
        _same_results(again[run_id], first[run_id])
    # negative control: the comparison sees a change of data order
    assert first["rho1_seed0"]["train_losses"] != first["rho1_seed1"]["train_losses"]


def test_a_run_is_the_same_alone_and_inside_a_sweep_in_another_order(whole, tiny_corpus, tmp_path, monkeypatch):
    # rho 0.5 seed 1: 6th run of the whole sweep; here the 2nd of a sweep of rho 1 and 0.5 starting at seed 1
    assert _sweep(tiny_corpus, tmp_path / "alone", "--rhos", "0.5", "--seed", "1") == 0
    run_id = "rho0.5000_experts4_seed1"
    _same_results(_runs(tmp_path / "alone")[run_id], _runs(whole)[run_id])
    # negative control: seeds drawn from the run's position in the sweep (not its seed index) change it
    real = study_runs.plan_runs

    def by_position(points, seeds, seed):
        specs = real(points, seeds, seed)
        return [RunSpec(s.point, s.seed_index, s.init_seed, seed + i) for i, s in enumerate(specs)]

    monkeypatch.setattr(study, "plan_runs", by_position)
    assert _sweep(tiny_corpus, tmp_path / "positional", "--rhos", "0.5", "--seed", "1") == 0
    positional = _runs(tmp_path / "positional")[run_id]
    assert positional["train_losses"] != _runs(whole)[run_id]["train_losses"]


def test_deterministic_mode_is_on_during_runs_recorded_and_restored(tiny_corpus, tmp_path, monkeypatch):
    seen = []
    real = study.train_run

    def spy(*args, **kw):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(*args, **kw)

    monkeypatch.setattr(study, "train_run", spy)
    assert not torch.are_deterministic_algorithms_enabled()
    assert _sweep(tiny_corpus, tmp_path / "on", "--rhos", "0.5") == 0
    assert seen == [True, True] and not torch.are_deterministic_algorithms_enabled()
    s = json.loads((tmp_path / "on" / "study.json").read_text())
    assert s["determinism"]["enabled"] and s["config"]["deterministic"]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == s["determinism"]["cublas_workspace_config"]
    seen.clear()
    assert _sweep(tiny_corpus, tmp_path / "off", "--rhos", "0.5", "--no-deterministic") == 0
    assert seen == [False, False]
    assert json.loads((tmp_path / "off" / "study.json").read_text())["determinism"]["enabled"] is False


def test_a_time_budget_decides_the_steps_up_front(tiny_corpus, tmp_path, monkeypatch, capsys):
    # the probe measures 1 s a step, no time has passed: 1 minute over 2 runs fits 27 steps less validation's
    monkeypatch.setattr(study, "_probe_step_seconds", lambda *a: 1.0)
    monkeypatch.setattr(study, "_since", lambda wall: 0.0)
    out = tmp_path / "budget"
    assert _sweep(tiny_corpus, out, "--rhos", "0.5", "--steps", "1000", "--minutes", "1") == 0
    assert "every run trains" in capsys.readouterr().out
    s = json.loads((out / "study.json").read_text())
    steps = s["budget"]["steps"]
    assert 1 <= steps < 27 and s["budget"]["cut"] and s["steps"] == steps
    train = s["config"]["train"]
    warmup = min(train["warmup_steps"], steps - 1)
    for r in s["runs"]:
        assert r["steps"] == steps == len(r["train_losses"]) and r["run_config"]["train"]["steps"] == steps
        # one schedule over the stated steps: the last step's rate is the cosine's end
        assert r["final_lr"] == pytest.approx(train["lr"] * lr_factor(steps - 1, steps, warmup, train["min_lr_ratio"]))
    # the same command again reuses the recorded step count (no second probe decides another)
    monkeypatch.setattr(study, "_probe_step_seconds", lambda *a: 0.001)
    assert _sweep(tiny_corpus, out, "--rhos", "0.5", "--steps", "1000", "--minutes", "1") == 0
    assert "finished earlier" in capsys.readouterr().out


def test_two_only_halves_merged_equal_the_whole(whole, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "halves"
    assert _sweep(tiny_corpus, out, "--seeds", "2", "--only", "seed=0") == 0
    assert "3 left" in capsys.readouterr().out and not (out / "study.json").exists()
    assert main(["study", "merge", str(out)]) == 1
    assert "3 of 6 runs have no result yet" in capsys.readouterr().err
    assert _sweep(tiny_corpus, out, "--seeds", "2", "--only", "seed=1,rho=1", "--only", "rho=0.5,rho=0.75") == 0
    merged, full = json.loads((out / "study.json").read_text()), json.loads((whole / "study.json").read_text())
    for a, b in zip(merged["runs"], full["runs"], strict=True):
        assert a["run_id"] == b["run_id"]
        _same_results(a, b)
    assert [p["val_loss"]["values"] for p in merged["points"]] == [p["val_loss"]["values"] for p in full["points"]]
    assert merged["finding"] == full["finding"]
    assert main(["study", "merge", str(out)]) == 0  # merge again: the same study.json
    assert json.loads((out / "study.json").read_text())["runs"] == merged["runs"]
    # a run from a sweep of another step count (another machine's --minutes) is refused at the merge
    path = out / "runs" / "rho1_seed1.json"
    record = json.loads(path.read_text())
    record["run_config"]["train"]["steps"] = 5
    path.write_text(json.dumps(record))
    assert main(["study", "merge", str(out)]) == 1
    assert "rho1_seed1.json does not belong to this sweep (its steps 5" in capsys.readouterr().err


def test_a_reused_out_with_another_config_is_refused(whole, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "reuse"
    assert _sweep(tiny_corpus, out, "--rhos", "0.5") == 0
    before = (out / "study.json").read_text()
    assert _sweep(tiny_corpus, out, "--rhos", "0.75") == 1
    err = capsys.readouterr().err
    assert "another configuration" in err and "rhos" in err and "--overwrite" in err
    assert (out / "study.json").read_text() == before  # the finished study is untouched
    # a stored run whose config differs is refused by name (copied in from another sweep)
    run_id = "rho1_seed0"
    record = json.loads((out / "runs" / f"{run_id}.json").read_text())
    record["run_config"]["train"]["lr"] = 1.0
    (out / "runs" / f"{run_id}.json").write_text(json.dumps(record))
    assert _sweep(tiny_corpus, out, "--rhos", "0.5") == 1
    assert "was trained with another configuration (train.lr" in capsys.readouterr().err
    # --overwrite trains it again
    assert _sweep(tiny_corpus, out, "--rhos", "0.5", "--overwrite") == 0
    assert json.loads((out / "runs" / f"{run_id}.json").read_text())["run_config"]["train"]["lr"] != 1.0


def test_only_selects_by_asked_or_realised_rho_and_refuses_what_selects_nothing():
    class P:
        def __init__(self, rho, asked, experts, control=None):
            self.rho, self.rho_asked, self.control, self.key = rho, asked, control, f"k{experts}{control}"
            self.accounting = {"n_experts": experts, "table_size": 10}

    points = [P(1.0, [1.0], 6), P(0.75, [0.8], 5), P(0.75, [0.8], 5, "no_table")]
    specs = study_runs.plan_runs(points, 2, 0)
    pick = select_runs(specs, ["rho=0.8,control=none,seed=1"])
    assert [(s.point.rho, s.init_seed, s.point.control) for s in pick] == [(0.75, 1, None)]
    assert len(select_runs(specs, ["rho=0.75"])) == 4 and len(select_runs(specs, ["seed=0", "seed=1"])) == 6
    with pytest.raises(ValueError, match="selects none"):
        select_runs(specs, ["rho=0.5"])
    assert parse_only(["rho=0.8,rho=0.6,seed=1"]) == [{"rho": ["0.8", "0.6"], "seed": ["1"]}]


@pytest.mark.slow
def test_a_sweep_killed_mid_run_finishes_without_repeating_runs(whole, tiny_corpus, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "condmem", "study", "allocation", "--preset", "tiny", "--corpus", str(tiny_corpus)]
    cmd += ["--steps", STEPS, "--seeds", "2", "--out", str(out), "--no-progress", "--device", "cpu", "--controls"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while len(list((out / "runs").glob("*.json"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    before = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
    assert 2 <= len(before) < 6, "the sweep was not killed mid-way"
    assert not (out / "study.json").exists()
    torch.set_num_threads(1)
    assert _sweep(tiny_corpus, out, "--seeds", "2") == 0
    after = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
    assert len(after) == 6 and all(after[name] == mtime for name, mtime in before.items())  # not trained again
    resumed, full = json.loads((out / "study.json").read_text()), json.loads((whole / "study.json").read_text())
    for a, b in zip(resumed["runs"], full["runs"], strict=True):
        _same_results(a, b)


def test_settings_that_leave_the_result_as_it_is_do_not_make_another_run():
    # a run (or sweep) recorded before `train.cuda_graphs` existed, or with the other value, is the same
    # result; any other key that differs is still named (negative control: compile rounds differently)
    stored = {"study": "allocation", "point": "rho1", "train": {"compile": True, "lr": 1e-3}, "data": "d"}
    for graphs in (False, True):
        wanted = {**stored, "train": {**stored["train"], "cuda_graphs": graphs}}
        assert study_runs.differences(stored, wanted) == []
        assert study_runs.reuse_key(stored) == study_runs.reuse_key(wanted)
    other = {**stored, "train": {"compile": False, "lr": 1e-3, "cuda_graphs": False}}
    assert study_runs.differences(stored, other) == ["train.compile (True -> False)"]
    assert study_runs.reuse_key(stored) != study_runs.reuse_key(other)
