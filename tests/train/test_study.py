"""`condmem study`: exact parameter / FLOP accounting of every point, the findings' logic, and
the tiny sweeps end to end (well-formed study.json and PNGs). Runs, resume and selection:
test_study_runs.py; config files: test_study_config.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from types import SimpleNamespace

import pytest

from condmem.cli import main
from condmem.models import DecoderLM, forward_flops_per_token
from condmem.train.build import build_model_config
from condmem.apps.study.sweep import (
    STUDY_PRESETS,
    allocation_finding,
    allocation_points,
    slot_points,
    slots_finding,
)


def _base(preset: str):
    """The preset's backbone config, with a stand-in tokenizer (vocab 8192 / 320, V' 90% of it)."""
    p = STUDY_PRESETS[preset].base
    vocab = p.data.vocab_size
    data = SimpleNamespace(
        tokenizer=SimpleNamespace(get_vocab_size=lambda with_added_tokens: vocab),
        pad_id=1,
        ctok=SimpleNamespace(vocab_size=vocab * 9 // 10),
    )
    return build_model_config(p, data)


@pytest.mark.parametrize("preset", ["tiny", "gpu"])
def test_allocation_accounting_is_exact_for_every_rho(preset):
    base = _base(preset)
    sp = STUDY_PRESETS[preset]
    points = allocation_points(base, sp.rhos)
    assert [p.rho_asked for p in points] == [[r] for r in sorted(sp.rhos, reverse=True)]
    ref = points[0]
    d, moe, layers = base.dim, base.moe, base.n_layers
    expert = 3 * d * moe.expert_hidden
    budget = ref.accounting["params"]["total"]
    for p in points:
        a, cfg = p.accounting, p.cfg
        # the formula equals the parameters of the model built (on meta: no memory)
        assert a["params"] == DecoderLM(cfg, device="meta").param_counts(), p.label
        n = cfg.moe.n_experts
        assert n == moe.top_k + round(p.rho_asked[0] * (moe.n_experts - moe.top_k))
        assert p.rho == (n - moe.top_k) / (moe.n_experts - moe.top_k)  # the rho realised
        assert a["idle_expert_params"] == layers * (n - moe.top_k) * expert
        assert a["params"]["tables"] == a["table_rows"] * base.engram.head_dim
        # every point has the budget's total, less than one more step of the table's primes
        assert 0 <= budget - a["params"]["total"] < (a["table_rows"] // 50 + 64) * base.engram.head_dim + 1
        if p.rho < 1:
            assert a["rho_realized"] == pytest.approx(p.rho, abs=0.05)
            assert cfg.engram.table_size > 1 and cfg.ffn_hidden == base.ffn_hidden
        # FLOPs: the same attention and shared expert, top_k experts, only the router and the
        # Engram-vs-wider-shared-expert exchange differ (less than one hidden unit)
        f, f1 = forward_flops_per_token(cfg, base.max_seq_len), forward_flops_per_token(ref.cfg, base.max_seq_len)
        assert f["moe"] == layers * (2 * d * n + moe.top_k * 6 * d * moe.expert_hidden)
        assert f["moe"] - f1["moe"] == layers * 2 * d * (n - moe.n_experts)
        assert abs((f["mlp"] + f["engram"]) - (f1["mlp"] + f1["engram"])) < 6 * d
        assert a["flops_per_token"] == 3 * f["total"]
        # active parameters: the routers' rows and the same exchange
        active_gap = a["params"]["active"] - ref.accounting["params"]["active"]
        assert abs(active_gap - d * layers * (n - moe.n_experts)) < 3 * d + base.engram.kernel_size * d + 4 * d


def test_slot_points_sweep_two_decades_on_a_fixed_backbone():
    base = _base("gpu")
    points = slot_points(base, STUDY_PRESETS["gpu"].table_sizes)
    rows = [p.accounting["table_rows"] for p in points]
    assert rows[0] == 0 and rows[1:] == sorted(rows[1:]) and rows[-1] / rows[1] >= 100
    for p in points:
        assert p.cfg.moe == base.moe
        assert p.accounting["params"] == DecoderLM(p.cfg, device="meta").param_counts()
    flops = {forward_flops_per_token(p.cfg)["total"] for p in points[1:]}
    assert len(flops) == 1 and abs(flops.pop() - forward_flops_per_token(points[0].cfg)["total"]) < 6 * base.dim


def _point(rho, values):
    mean = sum(values) / len(values)
    std = None if len(values) == 1 else (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return {"rho": rho, "val_loss": {"mean": mean, "std": std, "values": values}}


def test_allocation_finding_claims_a_minimum_only_beyond_the_spread():
    u = [_point(1.0, [3.00, 3.02]), _point(0.8, [2.90, 2.91]), _point(0.4, [3.05, 3.07])]
    f = allocation_finding(u)
    assert f["optimum_rho"] == 0.8 and f["beyond_seed_spread"] and f["u_shape"]
    close = [_point(1.0, [3.00, 3.10]), _point(0.8, [2.98, 3.06]), _point(0.4, [3.05, 3.07])]
    f = allocation_finding(close)
    assert f["optimum_rho"] == 0.8 and f["beyond_seed_spread"] is False and not f["u_shape"]
    one = allocation_finding([_point(1.0, [3.0]), _point(0.5, [2.9])])
    assert one["beyond_seed_spread"] is None and not one["u_shape"]
    assert allocation_finding([_point(1.0, [2.8]), _point(0.5, [2.9])])["optimum_rho"] == 1.0


def test_slots_finding_fits_a_line_in_log_rows():
    runs = [{"table_rows": 0, "val_loss": 3.0}] + [
        {"table_rows": r, "val_loss": 3.0 - 0.05 * k} for k, r in enumerate([1e3, 1e4, 1e5])
    ]
    points = [{"table_rows": 0, "val_loss": {"mean": 3.0}}]
    f = slots_finding(points, runs)
    assert f["slope_per_decade"] == pytest.approx(-0.05) and f["slope_stderr"] == pytest.approx(0, abs=1e-9)
    assert f["decades"] == pytest.approx(2) and f["no_engram_val_loss"] == 3.0


def _check_study(path, kind, n_points, seeds):
    s = json.loads((path / "study.json").read_text())
    assert s["study"] == kind and s["same_tokens"] and s["passes"]["passes"] <= 1.0
    assert len(s["runs"]) == n_points * seeds and len(s["points"]) == n_points
    assert s["seeds"] == list(range(seeds)) and s["data_seeds"] == list(range(seeds))
    for r in s["runs"]:
        for key in (
            "total_params",
            "active_params",
            "flops_per_token",
            "train_tokens",
            "val_loss",
            "bits_per_byte",
            "tokens_per_s",
            "passes",
        ):
            assert r[key] is not None and r[key] >= 0, key
        assert r["buckets"]["seen"]["tokens"] + r["buckets"]["unseen"]["tokens"] == r["val_tokens"]
        # every held-out token (deduplicated) when the split is under the cap, as here
        assert r["val_tokens"] == s["data"]["validation"]["tokens"] - 1 and not r["val_capped"]
        assert len(r["train_losses"]) == r["steps"]
    assert "orders of magnitude" in s["report"] and s["scale"]["orders_of_magnitude_below_paper"] > 3
    if importlib.util.find_spec("matplotlib") is not None:
        assert s["figure"] == f"{kind}.png" and (path / s["figure"]).stat().st_size > 1000
        assert (path / s["curves_figure"]).stat().st_size > 1000
    return s


def test_tiny_allocation_study_end_to_end(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "allocation"
    assert (
        main(
            [
                "study",
                "allocation",
                "--preset",
                "tiny",
                "--corpus",
                str(tiny_corpus),
                "--steps",
                "4",
                "--out",
                str(out),
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    # the preset's defaults: 2 seeds, every control (dense once, two per rho < 1: its tables are within the
    # tiny table's bound, so that control would repeat the point and is not run)
    s = _check_study(out, "allocation", 8, 2)
    mains = [r for r in s["runs"] if r["control"] is None]
    assert [r["rho"] for r in mains[:3]] == [1.0, 0.75, 0.5]
    assert mains[0]["table_params"] == 0 and all(r["table_params"] > 0 for r in mains[1:3])
    totals = [r["total_params"] for r in mains]
    assert max(totals) <= totals[0] and min(totals) > 0.99 * totals[0]
    assert s["finding"]["beyond_seed_spread"] is not None
    st = s["statistics"]
    assert sorted(st["controls"]) == ["no_table", "random_address"] and st["dense"]["claim"] in (0, 1)
    assert "tiny_table control of rho=0.75: the same model as the point (not run)" in capsys.readouterr().out
    assert st["optimum"]["grid"] == [0.5, 0.75, 1.0] and len(st["vs_pure_moe"]) == 2
    for r in s["runs"]:  # router statistics of every MoE run
        assert (r["router"] is None) == (r["n_experts"] == 0)
        assert r["router"] is None or r["router"]["dead"] is not None
    assert "Allocation at" in (out / "study.json").read_text()


def test_tiny_slot_study_end_to_end(tiny_corpus, tmp_path):
    out = tmp_path / "slots"
    assert (
        main(
            [
                "study",
                "slots",
                "--preset",
                "tiny",
                "--corpus",
                str(tiny_corpus),
                "--out",
                str(out),
                "--seeds",
                "1",
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    s = _check_study(out, "slots", 4, 1)
    assert s["finding"]["decades"] >= 1.5 and s["runs"][0]["table_rows"] == 0
    assert isinstance(s["finding"]["slope_per_decade"], float)
    # 16 steps x 128 tokens read ~1.5K distinct 3-grams: the preset's 3,000 is capped, and said so
    cap = s["ngram_cap"]
    assert cap["capped"] == [3000] and cap["note"] and "capped at table size" in s["report"]
    for p in s["points"]:
        assert p["table_size"] <= cap["cap"]
    for r in s["runs"]:  # rows read in training, per table: none without Engram, at most the table's rows
        if r["table_rows"] == 0:
            assert r["rows_touched"] is None
        else:
            (t,) = r["rows_touched"].values()
            assert t["rows"] == r["table_rows"] and 0 < t["touched"] <= t["rows"]
    st = s["statistics"]
    assert st["claims_slope"] == st["slope_per_decade"]["excludes_zero"] and "Rows touched" in s["report"]
    if importlib.util.find_spec("matplotlib") is not None:
        (out / "slots.png").unlink()
        assert main(["study", "slots", "--out", str(out), "--replot"]) == 0
        assert (out / "slots.png").stat().st_size > 1000
    assert main(["study", "allocation", "--out", str(out), "--replot"]) == 1


def test_study_refuses_bad_arguments(tiny_corpus, tmp_path, capsys):
    common = ["--preset", "tiny", "--corpus", str(tiny_corpus), "--no-progress", "--out", str(tmp_path / "x")]
    assert main(["study", "allocation", "--rhos", "1.5", *common]) == 1
    assert "rhos[0]: rho must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert main(["study", "allocation", "--rhos", "0", *common]) == 1
    assert "rhos[0]: rho must be in (0, 1]" in capsys.readouterr().err
    assert main(["study", "slots", "--table-sizes", "100", *common]) == 1
    assert "two table sizes" in capsys.readouterr().err
    for flag in ("--seeds", "--steps", "--tokens", "--val-tokens"):
        for value in ("0", "-3"):
            assert main(["study", "allocation", flag, value, *common]) == 1
            assert f"{flag} must be a positive integer, got {value}" in capsys.readouterr().err
    assert main(["study", "allocation", "--minutes", "-1", *common]) == 1
    assert "--minutes must be a positive number" in capsys.readouterr().err
    assert main(["study", "allocation", "--only", "rho", *common]) == 1
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main(["study", "allocation", "--only", "size=3", *common]) == 1
    assert "unknown key 'size'" in capsys.readouterr().err
    assert main(["study", "allocation", "--controls", "no_tabel", *common]) == 1
    assert "controls[0]: unknown control 'no_tabel'" in capsys.readouterr().err


def test_study_presets_are_typed():
    gpu = STUDY_PRESETS["gpu"]
    assert (
        gpu.minutes is None
        and gpu.rhos[0] == 1.0
        and len(gpu.rhos) >= 5
        and gpu.deterministic
        and gpu.base.train.compile
    )
    assert dataclasses.replace(gpu.base.train, seed=3).seed == 3
    assert sorted(STUDY_PRESETS) == ["cpu", "gpu", "tiny"]


def test_points_are_labelled_by_the_rho_realised(tiny_data):
    base = build_model_config(STUDY_PRESETS["tiny"].base, tiny_data)  # 6 experts, top-2: rho steps of 1/4
    points = allocation_points(base, [0.8, 0.75, 0.6])
    assert [(p.rho, p.rho_asked) for p in points] == [(1.0, [1.0]), (0.75, [0.8, 0.75]), (0.5, [0.6])]
    assert [p.label for p in points] == ["rho=1.00 (pure MoE)", "rho=0.75 (asked 0.80, 0.75)", "rho=0.50 (asked 0.60)"]
    # negative control: labelling by the rho asked (the old rule) names a model that was not trained
    assert points[2].accounting["n_experts"] == 4 and round(0.6 * 4) / 4 != 0.6


def test_replot_of_an_empty_study_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "study.json").write_text('{"study": "allocation", "runs": []}')
    assert main(["study", "allocation", "--out", str(tmp_path), "--replot"]) == 1
    assert "holds no runs: nothing to plot" in capsys.readouterr().err
    # negative control: the finding code the old replot called first fails on it with no message
    with pytest.raises((KeyError, StopIteration)):
        allocation_finding(json.loads((tmp_path / "study.json").read_text())["points"])


@pytest.mark.slow
def test_the_tiny_preset_finishes_within_a_minute_from_a_cold_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONDMEM_CACHE_DIR", str(tmp_path / "cache"))  # data prepared from scratch
    out = tmp_path / "tiny"
    assert main(["study", "allocation", "--preset", "tiny", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    s = json.loads((out / "study.json").read_text())
    assert s["wall_seconds"] <= 60, s["wall_seconds"]  # every control, 2 seeds, the statistics
    assert s["statistics"]["controls"] and s["validation"]["capped"] and s["validation"]["tokens"] <= 8192
    printed = capsys.readouterr().out
    assert "validated on at most 8,192 held-out tokens" in printed and "(capped)" in printed
