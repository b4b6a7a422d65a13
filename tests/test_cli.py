"""The command line: `condmem layout` and `condmem hash` end to end, and their error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from condmem.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture
def v41_config(tmp_path):
    from condmem import EngramConfig

    path = tmp_path / "v41.json"
    EngramConfig.deepseek_v41_flash().save(path, dialect="v4")
    return str(path)


def test_layout_prints_v41_rows(v41_config, capsys):
    assert main(["layout", "--config", v41_config]) == 0
    out = capsys.readouterr().out
    assert "384,006,168" in out and "384,016,682" in out and "196.6B" in out
    assert main(["layout", "--config", v41_config, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_embeddings"] == [384006168, 384016682]


def test_hash_json_matches_the_library(v41_config, capsys):
    import torch

    from condmem import EngramConfig, NgramHasher
    from condmem.tokenizer import CompressedTokenizer

    assert (
        main(["hash", "--tokenizer", "deepseek-v4", "--config", v41_config, "--text", "Hello, World! hello world"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    for key in ("compressed_vocab_size", "layer_ids", "compressed_ids", "bucket_ids", "row_ids"):
        assert key in out
    assert out["compressed_vocab_size"] == 99092 and out["layer_ids"] == [1, 14]
    ctok = CompressedTokenizer.from_any("deepseek-v4")
    hasher = NgramHasher.from_tokenizer(EngramConfig.deepseek_v41_flash(), ctok)
    rows = hasher(torch.tensor([out["token_ids"]]))[0]
    assert out["row_ids"]["14"] == rows[:, 1].tolist()
    T = len(out["token_ids"])
    assert len(out["compressed_ids"]) == T and len(out["row_ids"]["1"]) == T and len(out["row_ids"]["1"][0]) == 24
    # bucket + offset == row
    offsets = hasher.layout.layer(1).offsets
    assert [[b + o for b, o in zip(r, offsets)] for r in out["bucket_ids"]["1"]] == out["row_ids"]["1"]


def test_hash_accepts_ids_and_the_demo_dialect(tmp_path, capsys):
    cfg = {
        "engram_vocab_size": [1000, 2000],
        "max_ngram_size": 3,
        "n_embed_per_ngram": 64,
        "n_head_per_ngram": 4,
        "layer_ids": [1, 5],
        "pad_id": 2,
        "seed": 0,
        "kernel_size": 4,
    }
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(cfg))
    assert main(["hash", "--tokenizer", "deepseek-v4", "--config", str(path), "--ids", "0,15,2024"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["row_ids"]["5"]) == 3 and len(out["row_ids"]["5"][0]) == 8


def test_hash_errors_are_clear(v41_config, tmp_path, capsys):
    assert main(["hash", "--tokenizer", "deepseek-v4", "--config", v41_config, "--ids", "1,999999"]) == 1
    assert "token id 999999 is outside the tokenizer's ids 0..129279" in capsys.readouterr().err
    # A config whose compressed vocab disagrees with the tokenizer is refused.
    bad = json.loads(open(v41_config).read())
    bad["engram_compressed_vocab_size"] = 129280
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert main(["hash", "--tokenizer", "deepseek-v4", "--config", str(path), "--ids", "1"]) == 1
    assert "silently rehashed" in capsys.readouterr().err
    assert main(["hash", "--tokenizer", "deepseek-v4", "--config", v41_config, "--ids", "1,x"]) == 1
    assert "comma-separated" in capsys.readouterr().err


def test_layout_without_a_vocabulary_size_names_the_flags(capsys):
    # The official demo's config states no V' (it enters every hash multiplier).
    assert main(["layout", "--config", str(CONFIGS / "official_demo.json")]) == 1
    err = capsys.readouterr().err
    assert "--tokenizer" in err and "--compressed-vocab-size" in err and "official_demo.json" in err
    assert main(["layout", "--config", str(CONFIGS / "official_demo.json"), "--compressed-vocab-size", "1000"]) == 0


def test_bench_smoke_picks_the_gpu_or_switches_the_triton_interpreter_on_itself(tmp_path):
    # A fresh process without TRITON_INTERPRET (the suite sets it on CPU): the variable must be set before
    # the kernels' modules are imported, which only a new interpreter shows (about 5 s: torch and triton
    # imports). With a GPU the smoke run compiles the kernels and never switches the interpreter on.
    import os
    import subprocess
    import sys

    import torch

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "condmem", "bench", "hash", "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "kernels_hash.json").is_file()
    assert ("TRITON_INTERPRET=1" in done.stderr) == (not torch.cuda.is_available()), done.stderr[-2000:]


def test_tokenizer_train_writes_a_tokenizer_json_engram_reads(tmp_path, capsys):
    import torch
    from tokenizers import Tokenizer

    from condmem import EngramConfig, NgramHasher
    from condmem.tokenizer import CompressedTokenizer

    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.py").write_text("def add(x, y):\n    return x + y\n" * 50)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 20}) + "\n")
    out = tmp_path / "tok" / "tokenizer.json"
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--corpus",
                str(corpus),
                str(tmp_path / "b.jsonl"),
                "--out",
                str(out),
                "--vocab-size",
                "300",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    tok = Tokenizer.from_file(str(out))
    assert tok.get_vocab_size() <= 300 and tok.token_to_id("<|pad|>") == 1 and tok.token_to_id("<|endoftext|>") == 0
    ctok = CompressedTokenizer.from_any(str(out), use_cache=False)
    assert f"pad_id=1 (<|pad|>), compressed_vocab_size={ctok.vocab_size} " in printed
    config = EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=8, table_size=101, pad_id=1)
    ids = torch.tensor([tok.encode("def add(x, y): return x").ids])
    assert NgramHasher.from_tokenizer(config, ctok)(ids).shape == (1, ids.shape[1], 1, 4)
    assert main(["tokenizer", "train", "--corpus", str(corpus), "--out", str(out), "--vocab-size", "100"]) == 2
    assert "--vocab-size must be in 259..1,048,576 (256 byte tokens" in capsys.readouterr().err
