"""`--stop-after` before the command has finished a run of its own: the estimate comes from the
folder's finished runs, so a call with too little time left starts none, and a folder with none
says that its first run starts regardless; `--parallel`'s workers get the limit less the plan
stage's time."""

from __future__ import annotations

import json

import pytest

from condmem.apps.study import sweep as study
from condmem.apps.study.parallel import worker_options
from condmem.cli import main


def _allocation(tiny_corpus, out, *extra):
    common = ["--preset", "tiny", "--corpus", str(tiny_corpus), "--out", str(out), "--no-progress", "--device", "cpu"]
    return main(["study", "allocation", *common, "--controls", "no_table", *extra])


@pytest.fixture
def trained(monkeypatch):
    ids, real = [], study.train_run
    monkeypatch.setattr(study, "train_run", lambda spec, *a, **k: ids.append(spec.run_id) or real(spec, *a, **k))
    return ids


@pytest.mark.parametrize("stored_seconds", [None, 1e6], ids=["as-trained", "a-day-a-run"])
def test_the_first_run_of_a_call_is_judged_by_the_folders_finished_runs(
    tiny_corpus, tmp_path, trained, capsys, stored_seconds
):
    out = tmp_path / "allocation"
    assert _allocation(tiny_corpus, out, "--only", "seed=0") == 0
    if stored_seconds is not None:
        for path in (out / "runs").glob("*.json"):
            record = json.loads(path.read_text())
            path.write_text(json.dumps({**record, "train_seconds": stored_seconds}))
    del trained[:]
    capsys.readouterr()
    assert _allocation(tiny_corpus, out, "--stop-after", "1") == 0
    if stored_seconds is None:  # negative control: runs as fast as the stored ones fit in a minute
        assert trained
    else:
        assert trained == [] and "--stop-after 1: the next run would end after the limit" in capsys.readouterr().out


def test_a_folder_with_no_finished_run_says_its_first_run_starts_regardless(tiny_corpus, tmp_path, trained, capsys):
    out = tmp_path / "allocation"
    assert _allocation(tiny_corpus, out, "--only", "seed=0,rho=1", "--stop-after", "1") == 0
    said = capsys.readouterr().out
    assert trained and "no finished run here to time yet, so the first run starts whatever it takes" in said
    del trained[:]
    assert _allocation(tiny_corpus, out, "--only", "seed=0,rho=0.5", "--stop-after", "1") == 0
    assert trained and "no finished run here to time yet" not in capsys.readouterr().out  # one to time now


def test_parallel_workers_get_the_limit_less_the_plan_stage():
    assert worker_options({"stop_after": 8.0, "preset": "gpu"}, plan_seconds=90) == {"stop_after": 6.5, "preset": "gpu"}
    assert worker_options({"stop_after": 1.0}, plan_seconds=600) == {"stop_after": 0.0}
    assert worker_options({"stop_after": None}, plan_seconds=90) == {"stop_after": None}
