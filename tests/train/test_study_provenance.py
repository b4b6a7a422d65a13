"""A sweep's provenance: how many runs each commit and each device trained, said in the report when
they are several, and said before training when runs left to train join runs of other code; and its
throughput, tokens over the wall time with a run in progress, against a hand computation."""

from __future__ import annotations

import json

import pytest

from condmem.apps.study.provenance import provenance, provenance_text, throughput, throughput_text
from condmem.apps.study.sweep import format_study_table
from condmem.cli import main


def _runs(commits, devices):
    return [{"machine": {"commit": c, "device": "cuda", "gpu": g}} for c, g in zip(commits, devices)]


def test_provenance_counts_commits_and_devices_and_speaks_only_of_a_mix():
    same = provenance(_runs(["a" * 40] * 3, ["H100"] * 3))
    assert same == {"commits": {"a" * 40: 3}, "devices": {"H100": 3}}
    assert provenance_text({"provenance": same}) == ""
    mixed = provenance(_runs(["a" * 40, None, "a" * 40, "b" * 40 + "+dirty"], ["H100", "H100", "H200", "H100"]))
    assert mixed == {
        "commits": {"a" * 40: 2, "unrecorded": 1, "b" * 40 + "+dirty": 1},
        "devices": {"H100": 3, "H200": 1},
    }
    text = provenance_text({"provenance": mixed})
    assert "3 commits (aaaaaaaaaaaa: 2; unrecorded: 1; bbbbbbbbbbbb+dirty: 1 runs)" in text
    assert "2 devices (H100: 3; H200: 1 runs)" in text


def _timed(started, ended, tokens=100, **extra):
    return {"wall_clock": {"started": started, "ended": ended}, "train_tokens": tokens, **extra}


def test_throughput_merges_overlapping_runs_and_leaves_out_gaps_and_copies():
    runs = [
        _timed(0, 10),
        _timed(5, 12),  # overlaps the first: 0-12 busy
        _timed(100, 110),  # after a gap (another device call): 10 s more
        _timed(101, 104),  # inside the third
        _timed(0, 500, reused_from={"path": "elsewhere"}),  # copied in from another sweep: not counted
        {"train_tokens": 100},  # predates the record
    ]
    t = throughput(runs)
    assert t["runs"] == 4 and t["train_tokens"] == 400 and t["busy_seconds"] == pytest.approx(22)
    assert t["tokens_per_s"] == pytest.approx(400 / 22) and t["runs_at_once"] == pytest.approx(30 / 22)
    assert "4 runs trained here, 400 tokens over 22 s" in throughput_text({"throughput": t})
    assert throughput([{"train_tokens": 1}]) is None and throughput_text({"throughput": None}) == ""


def _allocation(tiny_corpus, out, *extra):
    common = ["--preset", "tiny", "--corpus", str(tiny_corpus), "--out", str(out), "--no-progress", "--device", "cpu"]
    return main(["study", "allocation", *common, "--controls", "no_table", *extra])


def test_a_resumed_sweep_says_when_its_finished_runs_come_from_other_code(tiny_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("condmem.apps.study.provenance.code_commit", lambda: "c" * 40)
    monkeypatch.setattr("condmem.train.build.code_commit", lambda: "c" * 40)
    out = tmp_path / "sweep"
    assert _allocation(tiny_corpus, out, "--only", "seed=0,rho=1.0") == 0
    assert _allocation(tiny_corpus, out, "--only", "seed=0,rho=0.5") == 0
    assert "other code" not in capsys.readouterr().out  # negative control: one commit so far
    record = out / "runs" / "rho1_seed0.json"
    run = json.loads(record.read_text())
    assert run["machine"]["commit"] == "c" * 40
    run["machine"]["commit"] = "f" * 40
    record.write_text(json.dumps(run))
    assert _allocation(tiny_corpus, out) == 0
    said = capsys.readouterr().out
    assert "finished runs here come from other code (ffffffffffff: 1); this code is cccccccccccc" in said
    study = json.loads((out / "study.json").read_text())
    assert study["provenance"]["commits"] == {"c" * 40: len(study["runs"]) - 1, "f" * 40: 1}
    assert "2 commits (cccccccccccc:" in study["report"]
    t = study["throughput"]  # every run trained here, one at a time: never more than one at once
    assert t["runs"] == len(study["runs"]) and t["tokens_per_s"] > 0 and t["runs_at_once"] <= 1.0 + 1e-9
    assert "Throughput:" in study["report"]
    assert "tok/s: each run's training rate while other runs" not in study["table"]  # one at a time: no caveat


def test_the_table_says_what_tok_s_means_when_runs_shared_the_device():
    point = {"label": "rho 1", "n_experts": 4, "table_rows": 0, "params": {"total": 10, "active": 5},
             "flops_per_token": 1e6, "val_loss": {"mean": 3.0, "std": None}, "bits_per_byte": {"mean": 1.0},
             "val_loss_seen": 2.0, "val_loss_unseen": 4.0, "tokens_per_s": {"mean": 1000.0}}  # fmt: skip
    alone = format_study_table("allocation", [point])
    shared = format_study_table("allocation", [point], shared=True)
    assert shared.startswith(alone) and "other runs may have shared its device" in shared.splitlines()[-1]
    assert "shared" not in alone
