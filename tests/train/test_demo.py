"""The demo pipeline end to end on a tiny corpus (well under a minute)."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from condmem.cli import main
from condmem.apps.demo import DemoConfig, run_demo


def test_demo_pipeline_on_a_tiny_corpus(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "demo"
    start = time.perf_counter()
    rc = main(
        [
            "demo",
            "--preset",
            "tiny",
            "--corpus",
            str(tiny_corpus),
            "--vocab-size",
            "320",
            "--steps",
            "6",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--max-new-tokens",
            "12",
            "--no-progress",
        ]
    )
    elapsed = time.perf_counter() - start
    assert rc == 0
    assert elapsed < 60, f"the tiny demo took {elapsed:.0f} s"
    printed = capsys.readouterr().out
    assert "val loss" in printed and "FLOPs / token" in printed and "prompt + Engram completion" in printed

    summary = json.loads((out / "summary.json").read_text())
    for key in ("baseline", "engram"):
        for field in ("val_loss", "bits_per_byte", "params", "flops_per_token", "train_tokens", "tokens_per_s"):
            assert summary[key][field] is not None and summary[key][field] > 0, (key, field)
    assert summary["baseline"]["train_tokens"] == summary["engram"]["train_tokens"]
    assert abs(summary["comparison"]["flops_per_token_ratio"] - 1) < 0.05
    assert summary["engram"]["table_params"] > 0 and summary["baseline"]["table_params"] == 0
    assert (
        summary["data"]["tokenizer"]["compressed_vocab_size"]
        == summary["config"]["engram"]["engram"]["compressed_vocab_size"]
    )
    gates = json.loads((out / "gates.json").read_text())
    assert len(gates["pieces"]) == len(gates["gates"]["1"]) > 10
    assert (out / "sample.txt").read_text().startswith("# prompt")
    assert (out / "tokenizer.json").is_file()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loss_curves.png").stat().st_size > 1000
        assert (out / "gates.png").stat().st_size > 1000
    # The demo's Engram checkpoint serves `condmem generate`.
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(out / "engram"),
                "--prompt",
                "import ",
                "--max-new-tokens",
                "4",
                "--device",
                "cpu",
            ]
        )
        == 0
    )


def test_demo_caps_steps_at_one_pass_and_says_so(tiny_corpus, tmp_path, capsys):
    """A corpus too small for the requested steps is not repeated silently."""
    out = tmp_path / "capped"
    config = DemoConfig(
        out,
        preset="tiny",
        overrides={"train": {"steps": 10_000, "eval_every": 2}, "data": {"corpus": str(tiny_corpus)}},
        device="cpu",
        max_new_tokens=4,
        progress=False,
        checkpoint=False,
        seeds=2,
    )
    summary = run_demo(config)
    printed = capsys.readouterr().out
    assert "WARNING" in printed and "passes over the" in printed and "Capped at" in printed
    passes = summary["passes"]
    assert passes["capped"] and passes["requested_steps"] == 10_000
    assert passes["passes"] <= 1.0 and passes["steps"] == summary["baseline"]["steps"] < 10_000
    assert summary["baseline"]["passes"] <= 1.0 and summary["engram"]["steps"] == passes["steps"]
    # two seeds, each with both models on the same steps; mean and std of the gap
    assert [r["baseline"]["seed"] for r in summary["seeds"]] == [0, 1]
    gaps = [r["val_loss_gap_pct"] for r in summary["seeds"]]
    assert summary["comparison"]["val_loss_gap_pct"] == pytest.approx(sum(gaps) / 2)
    assert summary["comparison"]["val_loss_gap_pct_std"] == pytest.approx(abs(gaps[0] - gaps[1]) / 2**0.5)
    assert len(summary["curves"]["engram"]) == 2
    # the whole validation split is evaluated, and evaluations during training show the curve
    v = summary["data"]["validation"]
    assert summary["engram"]["val_tokens"] == v["tokens"] - 1
    evals = summary["curves"]["engram"][0]["evals"]
    assert any(not e["full"] for e in evals) and evals[-1]["full"]
    for label in ("baseline", "engram"):
        b = summary["engram"]["buckets"]
        assert b["seen"]["tokens"] + b["unseen"]["tokens"] == summary[label]["val_tokens"]
    assert "+-" in summary["table"]


def test_demo_with_more_passes_allowed_repeats_and_notes_it(tiny_corpus, tmp_path, capsys):
    config = DemoConfig(
        tmp_path / "repeat",
        preset="tiny",
        overrides={"train": {"steps": 1000}, "data": {"corpus": str(tiny_corpus)}},
        device="cpu",
        max_new_tokens=2,
        progress=False,
        checkpoint=False,
        max_passes=2.0,
    )
    summary = run_demo(config)
    assert 1.0 < summary["passes"]["passes"] <= 2.0
    assert "saw its training data" in capsys.readouterr().out
