"""`condmem bench lookup --smoke`: the benchmark's code path runs on CPU at a tiny size (times mean nothing)."""

from __future__ import annotations

import json

from condmem.cli import main


def test_bench_lookup_smoke(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "lookup",
            "--smoke",
            "--table-gib",
            "0.002",
            "--batch-tokens",
            "1",
            "16",
            "--text-batches",
            "2",
            "--text-warmup",
            "1",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "lookup.json").read_text().splitlines()]
    # Every tier x stream x batch size had its rows compared with a plain gather of the table.
    assert {(r["tier"], r["stream"], r["tokens"], r["cache"]) for r in rows if r["bench"] == "lookup_exact"} == {
        ("host", s, t, s == "text") for s in ("uniform", "text") for t in (1, 16)
    }
    rows = [r for r in rows if r["bench"] == "lookup"]
    assert {(r["tier"], r["stream"], r["tokens"]) for r in rows} == {
        ("host", s, t) for s in ("uniform", "text") for t in (1, 16)
    }
    assert all(r["effective_gbps"] > 0 for r in rows)


def test_bench_lookup_disk_tier_smoke(tmp_path):
    rc = main(
        [
            "bench",
            "lookup",
            "--smoke",
            "--tiers",
            "disk",
            "--disk-gib",
            "0.002",
            "--dram-cache-gib",
            "0.0005",
            "--disk-dir",
            str(tmp_path),
            "--streams",
            "uniform",
            "text",
            "--batch-tokens",
            "4",
            "--repeats",
            "1",
            "--text-batches",
            "2",
            "--text-warmup",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "lookup.json").read_text().splitlines()]
    (row, text) = [r for r in rows if r["bench"] == "lookup"]
    assert row["tier"] == "disk" and row["mode"] == "cold" and row["disk_rows_per_s"] > 0
    if row["direct_io"]:  # O_DIRECT where the file system allows it, probed first
        assert row["probe_reads_per_s"] > 0 and row["x_probe"] > 0
    # The text stream in steady state: the DRAM row cache's own hit rate over the timed batches,
    # and the page cache before and after (Linux).
    assert text["stream"] == "text" and 0.0 <= text["dram_hit_rate"] <= 1.0
    assert "page_cache_gib" in text and "page_cache_gib_before" in text
    assert [r["tier"] for r in rows if r["bench"] == "lookup_exact"] == ["disk", "disk"]
    assert not list(tmp_path.glob("condmem-bench-*"))  # the temporary table file is gone


def test_text_stream_hashed_in_chunks_equals_hashed_at_once():
    """The text stream is hashed chunk by chunk (bounded memory); each chunk carries the previous
    one's last N-1 tokens, so the row ids are exactly those of hashing the text in one piece."""
    import torch

    from condmem.bench.lookup_setup import N_COLS, text_row_ids

    whole, source = text_row_ids(100_003, 3000, chunk_tokens=1 << 20)
    chunked, _ = text_row_ids(100_003, 3000, chunk_tokens=677)
    assert whole.shape == (3000, N_COLS)
    assert torch.equal(whole, chunked), source


def test_bench_lookup_rounds_are_measured_in_turn(tmp_path):
    """--rounds 2 measures each tier and stream twice, rows tagged by round."""
    rc = main(
        [
            "bench",
            "lookup",
            "--smoke",
            "--table-gib",
            "0.002",
            "--batch-tokens",
            "16",
            "--streams",
            "uniform",
            "--repeats",
            "1",
            "--rounds",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "lookup.json").read_text().splitlines()]
    assert [r["round"] for r in rows if r["bench"] == "lookup"] == [1, 2]


def test_lookup_diagnostics_plan_times_plan_and_admission_per_variant(tmp_path):
    """``benchmarks/lookup_diagnostics.py plan`` (outside the package) runs on the CPU at a tiny size."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "lookup_diagnostics.py"
    argv = sys.argv
    sys.argv = [
        str(script),
        "plan",
        "--smoke",
        "--table-gib",
        "0.002",
        "--tokens",
        "16",
        "--text-warmup",
        "2",
        "--plan-variants",
        "graphs",
        "eager/torch",
        "--out",
        str(tmp_path),
    ]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    rows = [json.loads(line) for line in (tmp_path / "lookup_diagnostics.json").read_text().splitlines()]
    costs = {(r["variant"], r["stream"]) for r in rows if r["bench"] == "plan_cost"}
    assert costs == {(v, f"text {s}") for v in ("graphs", "eager/torch") for s in ("plan", "admit")}


def test_a_disk_table_whose_write_fails_leaves_no_file(tmp_path):
    """A write that fails midway (a full disk, say) removes the partial file and raises."""
    import pytest
    import torch

    from condmem.bench.lookup_setup import _file_store

    def chunks():
        yield torch.zeros((4, 264), dtype=torch.uint8)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        _file_store(chunks(), 8, "fp8_interleaved", 264, str(tmp_path))
    assert not list(tmp_path.iterdir())
