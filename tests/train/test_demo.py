"""The demo pipeline end to end on a tiny corpus (well under a minute)."""

from __future__ import annotations

import importlib.util
import json
import time

from condmem.cli import main


def test_demo_pipeline_on_a_tiny_corpus(tiny_corpus, tmp_path, capsys):
    out = tmp_path / "demo"
    start = time.perf_counter()
    rc = main(["demo", "--preset", "tiny", "--corpus", str(tiny_corpus), "--vocab-size", "320", "--steps", "6",
               "--out", str(out), "--device", "cpu", "--max-new-tokens", "12", "--no-progress"])
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
    assert summary["data"]["tokenizer"]["compressed_vocab_size"] == summary["config"]["engram"]["engram"]["compressed_vocab_size"]
    gates = json.loads((out / "gates.json").read_text())
    assert len(gates["pieces"]) == len(gates["gates"]["1"]) > 10
    assert (out / "sample.txt").read_text().startswith("# prompt")
    assert (out / "tokenizer.json").is_file()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loss_curves.png").stat().st_size > 1000
        assert (out / "gates.png").stat().st_size > 1000
    # The demo's Engram checkpoint serves `condmem generate`.
    assert main(["generate", "--checkpoint", str(out / "engram"), "--prompt", "import ", "--max-new-tokens", "4",
                 "--device", "cpu"]) == 0
