"""`condmem study tokens` (the allocation's gaps at several token budgets), the slot sweep's n-gram cap,
rows touched and slope claim, and the router-load figure."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from condmem.cli import main
from condmem.config import ConfigError, EngramConfig
from condmem.layout import draw_primes
from condmem.module import EngramTable
from condmem.apps.study import sweep as study
from condmem.apps.plots import plot_router_load
from condmem.apps.study.sweep import STUDY_PRESETS, cap_table_sizes, correct_trends, statistics, token_trend
from condmem.apps.study.stats import slope_over_seeds
from condmem.apps.study.runs import RowsTouched, distinct_ngrams

GRID = ["256", "512", "2048"]  # 2, 4 and 16 steps of the tiny preset's 128 tokens: 8x


def _tokens(tiny_corpus, out, *extra: str) -> int:
    return main(
        ["study", "tokens", "--preset", "tiny", "--corpus", str(tiny_corpus), "--tokens-grid", *GRID]
        + ["--out", str(out), "--no-progress", "--device", "cpu", *extra]
    )


def test_token_sweep_runs_each_budget_as_ordinary_runs_and_pairs_the_gaps(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "tokens"
    # one budget first (--only tokens=...): its runs are ordinary runs, the rest trained by the same command again
    assert _tokens(tiny_corpus, out, "--only", "tokens=2048") == 0
    first = sorted(p.stem for p in (out / "runs").glob("*.json"))
    assert first == sorted(
        f"tok2048_{key}_seed{k}"
        for key in ("rho1", "rho0.5000_experts4", "rho0.5000_experts4_no_table")
        for k in (0, 1)
    )
    assert not (out / "study.json").exists()
    capsys.readouterr()
    assert _tokens(tiny_corpus, out) == 0
    assert capsys.readouterr().out.count("finished earlier") == 6
    s = json.loads((out / "study.json").read_text())
    assert s["study"] == "tokens" and len(s["runs"]) == 18 and len(s["points"]) == 9
    for r in s["runs"]:  # steps scaled with the budget, the budget in the run's id
        assert r["train_tokens"] == r["steps"] * 128 and r["run_id"].startswith(f"tok{r['train_tokens']}_")
        assert len(r["train_losses"]) == r["steps"]
    budgets = s["statistics"]["budgets"]
    assert [b["train_tokens"] for b in budgets] == [256, 512, 2048] and [b["steps"] for b in budgets] == [2, 4, 16]
    for b in budgets:
        active = next(p for p in s["points"] if p["train_tokens"] == b["train_tokens"] and p["rho"] == 1.0)
        assert b["tokens_per_active_param"] == pytest.approx(b["train_tokens"] / active["params"]["active"])
        for entry in (b["vs_pure_moe"]["0.50"], b["table_effect"]["0.50"]):
            d = entry["difference"]
            assert d["n"] == 2 and d["low"] < d["mean"] < d["high"]
            assert entry["claim"] == d["excludes_zero"]
        # the table's own effect is the paired difference against the same budget's no-table runs
        loss = {(r["run_id"].split("_seed")[0], r["seed"]): r["val_loss"] for r in s["runs"]}
        t = b["train_tokens"]
        diffs = [
            loss[(f"tok{t}_rho0.5000_experts4", k)] - loss[(f"tok{t}_rho0.5000_experts4_no_table", k)] for k in (0, 1)
        ]
        assert b["table_effect"]["0.50"]["difference"]["mean"] == pytest.approx(np.mean(diffs))
        # where that effect falls: the same pairs on seen minus on unseen 3-grams
        bucket = {
            (r["run_id"].split("_seed")[0], r["seed"], k): r["buckets"][k]["loss"]
            for r in s["runs"]
            for k in ("seen", "unseen")
        }
        gaps = [
            (
                bucket[(f"tok{t}_rho0.5000_experts4", k, "seen")]
                - bucket[(f"tok{t}_rho0.5000_experts4_no_table", k, "seen")]
            )
            - (
                bucket[(f"tok{t}_rho0.5000_experts4", k, "unseen")]
                - bucket[(f"tok{t}_rho0.5000_experts4_no_table", k, "unseen")]
            )
            for k in (0, 1)
        ]
        falls = b["where_gain_falls"]
        assert falls["difference"]["mean"] == pytest.approx(np.mean(gaps)) and falls["text"] in s["report"]
    assert "tokens per active parameter" in s["report"]
    for contrast in ("vs_pure_moe", "table_effect"):  # the trend over the three budgets, per seed
        trend = s["statistics"]["trend"][contrast]["0.50"]
        assert trend["budgets"] == [256, 512, 2048] and trend["seeds"] == [0, 1] and trend["text"] in s["report"]
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("tokens.png", "tokens_curves.png", "tokens_router.png"):
            assert (out / name).stat().st_size > 1000, name
    # merge checks each run's steps against its own budget's: a run file of another budget is refused
    assert main(["study", "merge", str(out)]) == 0
    # negative control: the one step count of an allocation sweep would refuse two of the three budgets
    sweep = json.loads((out / "sweep.json").read_text())
    assert sum(r["steps"] != sweep["steps"] for r in s["runs"]) == 12
    path = out / "runs" / "tok256_rho1_seed0.json"
    run = json.loads(path.read_text())
    run["run_config"]["train"]["steps"] = 16
    path.write_text(json.dumps(run))
    capsys.readouterr()
    assert main(["study", "merge", str(out)]) == 1
    assert "tok256_rho1_seed0.json does not belong to this sweep (its steps 16" in capsys.readouterr().err


def test_the_token_sweep_refuses_what_it_cannot_do(tiny_corpus, tmp_path, capsys):
    common = ["--preset", "tiny", "--corpus", str(tiny_corpus), "--no-progress", "--out", str(tmp_path / "x")]
    assert main(["study", "tokens", "--steps", "8", *common]) == 1
    assert "--steps: the token sweep's budgets are its tokens_grid" in capsys.readouterr().err
    assert main(["study", "allocation", "--tokens-grid", "256", "2048", *common]) == 1
    assert "--tokens-grid is the token sweep's" in capsys.readouterr().err
    assert main(["study", "tokens", "--tokens-grid", "256", "0", *common]) == 1
    assert "--tokens-grid must be a positive integer, got 0" in capsys.readouterr().err
    assert main(["study", "tokens", "--tokens-grid", "200", "256", *common]) == 1  # both 2 steps of 128
    assert "gives one step count (2)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"tokens_grid\[1\] must be >= 1"):
        STUDY_PRESETS["tiny"].override(tokens_grid=[256, -1])
    with pytest.raises(ConfigError, match="tokens_rhos\\[0\\]: rho must be in \\(0, 1\\]"):
        STUDY_PRESETS["tiny"].override(tokens_rhos=[1.5])


@pytest.mark.parametrize("name", ["tiny", "cpu", "gpu"], ids=["tiny", "cpu", "one-card"])  # "gpu" marks a GPU test
def test_presets_span_8x_of_tokens_and_the_slot_sweep_has_3_seeds(name):
    sc = STUDY_PRESETS[name]
    steps = sc.token_steps()
    assert len(steps) >= 3 and steps[-1] / steps[0] >= 8
    if name != "tiny":
        assert (sc.slots_seeds or sc.seeds) >= 3
    resolved = study.resolve_config(preset=name, kind="slots")
    assert resolved.seeds == (sc.slots_seeds or sc.seeds)
    assert study.resolve_config(preset=name, kind="slots", seeds=1).seeds == 1  # --seeds wins


def _widest(engram: EngramConfig, size: int) -> int:
    return max(max(p) for p in draw_primes(engram.layer_ids, [size] * (engram.max_ngram_size - 1), engram.n_heads))


def test_table_sizes_are_capped_at_the_distinct_ngrams_read():
    engram = EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=8, table_size=500)
    sizes, record = cap_table_sizes(engram, [20, 300, 100_000], 1501)
    assert sizes[:2] == [20, 300] and record["capped"] == [100_000] and "100,000 exceed the 1,501" in record["note"]
    assert _widest(engram, sizes[-1]) <= 1501 < _widest(engram, sizes[-1] + 1)  # the largest that fits
    # negative control: the size asked (the old behaviour) gives columns of more rows than n-grams read
    assert _widest(engram, 100_000) > 1501
    assert cap_table_sizes(engram, [20, 300], 1501)[1]["note"] is None
    with pytest.raises(ValueError, match="two table sizes or more at most"):
        cap_table_sizes(engram, [50_000, 100_000], 1501)


def test_distinct_ngrams_counts_what_a_run_reads(tiny_data):
    stream, steps, batch, seq = tiny_data.train, 5, 4, 32
    seen = set()
    for step in range(steps):
        for row in stream.batch(step, batch, seq, 3).inputs.tolist():
            seen.update(tuple(row[i : i + 3]) for i in range(len(row) - 2))
    assert distinct_ngrams(stream, steps, batch, seq, 3, 3) == len(seen)
    # another data seed reads other windows: the count is the run's, not the split's
    assert distinct_ngrams(stream, steps, batch, seq, 4, 3) != len(seen) or steps * batch * seq > len(stream)


def test_rows_touched_counts_distinct_rows_read_in_training_only():
    model = torch.nn.Module()
    model.table = EngramTable(50, 4)
    touched = RowsTouched(model)
    model.train()
    model.table(torch.tensor([[3, 7, 7], [49, 3, 0]]))
    model.eval()
    model.table(torch.tensor([11, 12, 13]))  # validation reads are not training reads
    assert touched.close() == {"table": {"rows": 50, "touched": 4, "share": 4 / 50}}
    model.train()
    model.table(torch.tensor([20]))  # the hooks are gone after close
    assert RowsTouched(torch.nn.Linear(2, 2)).close() is None


def _slot_runs(losses):
    rows = [100, 1000, 10_000, 100_000]
    return [{"table_rows": r, "val_loss": v, "run_id": f"x{r}_seed0", "init_seed": 0} for r, v in zip(rows, losses)]


def test_the_slot_slope_is_claimed_only_when_its_interval_excludes_zero():
    clean = statistics("slots", [], _slot_runs([3.0, 2.95, 2.90, 2.85]))
    assert clean["claims_slope"] and "falls with log10(rows)" in clean["text"]
    # |slope| = 2.6 standard errors: beyond two (the old rule would claim) but inside the 95% t-interval (df 2)
    noisy = statistics("slots", [], _slot_runs([3.0, 2.93, 2.95, 2.89]))
    se = (noisy["slope_per_decade"]["high"] - noisy["slope_per_decade"]["mean"]) / noisy["slope_per_decade"]["t"]
    assert 2 < abs(noisy["slope_per_decade"]["mean"]) / se < 4.3
    assert not noisy["claims_slope"] and "no slope claimed" in noisy["text"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_router_load_figure_draws_every_run_with_router_statistics(tmp_path):
    layer = {"load": [10, 30, 0, 20], "load_mean": 15.0}
    runs = [
        {"label": "rho=1.00", "router": {"layers": {"blocks.0.moe": layer, "blocks.1.moe": layer}}},
        {"label": "dense", "router": None},
    ]
    summary = {"study": "allocation", "preset": "tiny", "runs": runs}
    path = plot_router_load(summary, tmp_path / "allocation_router.png", within=tmp_path)
    assert path is not None and path.stat().st_size > 1000
    assert plot_router_load({**summary, "runs": runs[1:]}, tmp_path / "none.png", within=tmp_path) is None


def test_the_slot_sweep_counts_the_ngrams_once_per_sweep(tiny_corpus, tmp_path, monkeypatch):
    def sweep(out):
        return main(
            ["study", "slots", "--preset", "tiny", "--corpus", str(tiny_corpus), "--steps", "4", "--seeds", "1"]
            + ["--only", "table_size=20", "--out", str(out), "--no-progress", "--device", "cpu"]
        )

    assert sweep(tmp_path / "a") == 0
    cap = json.loads((tmp_path / "a" / "sweep.json").read_text())["ngram_cap"]
    assert cap["steps"] == 4 and cap["distinct_ngrams"] <= 4 * 128

    def recount(*args):
        raise AssertionError("counted again")

    monkeypatch.setattr(study, "distinct_ngrams", recount)
    assert sweep(tmp_path / "a") == 0  # the same command again: the count is the sweep's, reused
    assert json.loads((tmp_path / "a" / "sweep.json").read_text())["ngram_cap"] == cap
    # negative control: a new sweep counts (the patched counter is called)
    with pytest.raises(AssertionError, match="counted again"):
        sweep(tmp_path / "b")


def test_stop_after_expects_a_larger_budget_to_take_longer(tiny_corpus, tmp_path, monkeypatch, capsys):
    clock = [0.0]  # one second per training step, nothing else

    def fake_run(spec, data, dev, tc, **kw):
        clock[0] += tc.steps
        return {"run_id": spec.run_id}

    monkeypatch.setattr(study.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(study, "train_run", fake_run)
    grid = [int(t) for t in GRID]  # 2, 4, 16 steps: runs in that order for one seed
    status = study.run_study(
        "tokens", tmp_path, preset="tiny", corpus=[str(tiny_corpus)], tokens_grid=grid, seeds=1,
        device="cpu", stop_after=0.5, progress=False,
    )  # fmt: skip
    # after 3 x 2 + 3 x 4 = 18 s the next run (16 steps) would end at 34 s, past the 30 s limit: not started
    assert len(status["runs_left"]) == 3 and all(r.startswith("tok2048_") for r in status["runs_left"])
    assert "--stop-after 0.5: the next run would end after the limit" in capsys.readouterr().out
    # negative control: the mean run so far (18 s / 6 runs) would have started it (18 + 3 < 30)
    assert clock[0] == 18 and clock[0] + clock[0] / 6 < 30


def test_a_minutes_cut_counts_the_ngrams_of_the_steps_trained(tiny_corpus, tmp_path, monkeypatch):
    def sweep(out):
        args = ["study", "slots", "--preset", "tiny", "--corpus", str(tiny_corpus), "--steps", "8", "--seeds", "1"]
        assert main(args + ["--only", "table_size=20", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
        return json.loads((out / "sweep.json").read_text())

    whole = sweep(tmp_path / "whole")
    monkeypatch.setattr(study, "_budgeted_steps", lambda *a: (2, {"cut": True, "steps": 2, "requested_steps": 8}))
    cut = sweep(tmp_path / "cut")
    assert cut["steps"] == 2 and cut["ngram_cap"]["steps"] == 2
    # negative control: the count of the 8 steps planned (before the cut) is larger than the one kept
    assert (
        whole["ngram_cap"]["steps"] == 8 and whole["ngram_cap"]["distinct_ngrams"] > cut["ngram_cap"]["distinct_ngrams"]
    )


def _token_sweep(gap_of, seeds=(0, 1, 2), budgets=(1_000, 4_000, 16_000)):
    """Points and runs of a token sweep whose rho 0.5 - pure MoE and rho 0.5 - no-table differences are
    gap_of(budget, seed) (pure MoE and the no-table control at one loss)."""
    points, runs = [], []
    for t in budgets:
        for key, rho, control in ((f"tok{t}_rho1", 1.0, None), (f"tok{t}_rho0.5", 0.5, None),
                                  (f"tok{t}_rho0.5_no_table", 0.5, "no_table")):  # fmt: skip
            points.append({"key": key, "train_tokens": t, "rho": rho, "control": control})
            for s in seeds:
                loss = 3.0 + (gap_of(t, s) if key.endswith("rho0.5") else 0.0)
                runs.append({"run_id": f"{key}_seed{s}", "init_seed": s, "val_loss": loss})
    return points, runs


def test_the_token_trend_is_a_per_seed_slope_claimed_only_beyond_its_interval():
    noise = {0: 0.004, 1: -0.006, 2: 0.002}
    points, runs = _token_sweep(lambda t, s: -0.1 * np.log10(t) + noise[s] * np.log10(t) ** 2)
    trend = token_trend(points, runs)
    for contrast in ("vs_pure_moe", "table_effect"):
        entry = trend[contrast]["0.50"]
        x = np.log10([1_000, 4_000, 16_000])
        slopes = [np.polyfit(x, -0.1 * x + noise[s] * x**2, 1)[0] for s in (0, 1, 2)]
        half = 4.302652729911275 * np.std(slopes, ddof=1) / np.sqrt(3)  # t(0.975, df 2)
        assert entry["slope_per_decade"]["mean"] == pytest.approx(np.mean(slopes))
        assert entry["slope_per_decade"]["half_width"] == pytest.approx(half)
        assert entry["claim"] and "falls with log10(tokens)" in entry["text"] and entry["seeds"] == [0, 1, 2]
    # negative control: a flat gap whose seeds tilt either way claims nothing
    tilt = {0: 0.05, 1: -0.06, 2: 0.02}
    flat = token_trend(*_token_sweep(lambda t, s: -0.1 + tilt[s] * np.log10(t)))
    assert (
        not flat["vs_pure_moe"]["0.50"]["claim"]
        and "no change with tokens claimed" in flat["vs_pure_moe"]["0.50"]["text"]
    )
    # the sweep's trends are corrected together (Holm): two at p = 0.045 adjust to 0.09 and are withdrawn
    record = correct_trends(trend)
    assert sorted(record["members"]) == ["table_effect rho 0.50", "vs_pure_moe rho 0.50"]
    corrected = [e for by_rho in trend.values() for e in by_rho.values()]
    assert all(e["p"] == pytest.approx(0.0452, abs=1e-4) and not e["claim"] for e in corrected)
    assert all(
        e["holm"]["p_adjusted"] == pytest.approx(2 * e["p"]) and e["text"].endswith("not claimed") for e in corrected
    )
    tight = token_trend(*_token_sweep(lambda t, s: -0.1 * np.log10(t) + noise[s] / 10 * np.log10(t) ** 2))
    correct_trends(tight)  # a tenth of the seeds' spread: both hold
    assert all(e["claim"] and e["holm"]["holds"] for by_rho in tight.values() for e in by_rho.values())
    # a seed missing at one budget leaves the trend to the seeds present at every budget
    points, runs = _token_sweep(lambda t, s: -0.1 * np.log10(t) + noise[s])
    runs = [r for r in runs if r["run_id"] != "tok4000_rho0.5_seed2"]
    assert token_trend(points, runs)["vs_pure_moe"]["0.50"]["seeds"] == [0, 1]


def test_the_slot_slope_with_seeds_is_each_seeds_slope_then_over_seeds():
    rows = [100, 1000, 10_000]
    tilt = {0: -0.05, 1: -0.07, 2: -0.06}
    runs = [{"table_rows": r, "val_loss": 3.0 + s * 0.3 + tilt[s] * np.log10(r), "run_id": f"x{r}_seed{s}",
             "init_seed": s} for s in (0, 1, 2) for r in rows]  # fmt: skip
    st = statistics("slots", [], runs)
    assert st["method"] == "each seed's slope, then over seeds" and st["claims_slope"]
    slope = st["slope_per_decade"]
    assert slope["mean"] == pytest.approx(-0.06) and slope["n"] == 3
    assert slope["half_width"] == pytest.approx(4.302652729911275 * np.std(list(tilt.values()), ddof=1) / np.sqrt(3))
    # negative control: seeds that tilt either way claim no slope
    both = {0: 0.05, 1: -0.07, 2: 0.01}
    for r in runs:
        r["val_loss"] = 3.0 + r["init_seed"] * 0.3 + both[r["init_seed"]] * np.log10(r["table_rows"])
    assert not statistics("slots", [], runs)["claims_slope"]
    with pytest.raises(ValueError, match="seed 0 needs two or more points"):
        slope_over_seeds({0: ([1.0], [2.0])})


def test_slot_tables_are_paired_against_no_table_and_the_next_smaller_under_holm():
    rows = {"none": 0, "t1": 100, "t2": 1000, "t3": 10_000}
    offset = {0: 0.0, 1: 0.3, 2: -0.2}  # seed effects far larger than the table's: pairing removes them
    step = {0: 0.001, 1: -0.002, 2: 0.0015}
    gain = {"none": 0.0, "t1": -0.10, "t2": -0.15, "t3": -0.15}  # falls, then flat from t2 to t3
    points = [{"key": k, "label": k, "table_rows": r} for k, r in rows.items()]
    runs = [{"table_rows": r, "val_loss": 3.0 + offset[s] + gain[k] + (step[s] if k != "none" else 0.0),
             "run_id": f"{k}_seed{s}", "init_seed": s} for k, r in rows.items() for s in offset]  # fmt: skip
    st = statistics("slots", points, runs)
    vs_none = st["vs_no_table"]
    assert list(vs_none) == ["t1", "t2", "t3"] and all(e["claim"] and e["holm"]["holds"] for e in vs_none.values())
    assert vs_none["t2"]["difference"]["mean"] == pytest.approx(-0.15 + np.mean(list(step.values())))
    steps = st["vs_smaller"]
    assert list(steps) == ["t2", "t3"] and steps["t2"]["b"] == "t1"
    assert steps["t2"]["claim"] and steps["t2"]["difference"]["mean"] == pytest.approx(-0.05)
    # negative control: where the curve is flat the step is not claimed (the differences are exactly 0)
    assert not steps["t3"]["claim"] and steps["t3"]["verdict"] != "lower"
    assert st["multiplicity"]["vs_no_table"]["family"] == "the 3 tables against no table"
    assert "Holm over the 2 tables against the next smaller" in steps["t2"]["text"]
    # a sweep without a no-table point has no such family
    bare = statistics("slots", points[1:], [r for r in runs if r["table_rows"] > 0])
    assert bare["vs_no_table"] == {} and "vs_no_table" not in bare["multiplicity"]
