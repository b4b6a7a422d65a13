"""`condmem bench lookup --smoke`: the benchmark's code path runs on CPU at a tiny size (times mean nothing)."""

from __future__ import annotations

import argparse
import json

import pytest

from condmem.cli import main


def test_bench_lookup_smoke(tmp_path, capsys):
    rc = main(["bench", "lookup", "--smoke", "--table-gib", "0.002", "--batch-tokens", "1", "16",
               "--text-batches", "2", "--text-warmup", "1", "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "lookup.json").read_text().splitlines()]
    assert any(r["bench"] == "cpu_gather" for r in rows)
    # Every tier x stream x batch size had its rows compared with a plain gather of the table.
    assert {(r["tier"], r["stream"], r["tokens"], r["cache"]) for r in rows if r["bench"] == "lookup_exact"} == {
        ("host", s, t, s == "text") for s in ("uniform", "text") for t in (1, 16)}
    rows = [r for r in rows if r["bench"] == "lookup"]
    assert {(r["tier"], r["stream"], r["tokens"]) for r in rows} == {
        ("host", s, t) for s in ("uniform", "text") for t in (1, 16)}
    assert all(r["effective_gbps"] > 0 for r in rows)


def test_bench_lookup_disk_tier_smoke(tmp_path):
    rc = main(["bench", "lookup", "--smoke", "--tiers", "disk", "--disk-gib", "0.002", "--dram-cache-gib", "0.0005",
               "--disk-dir", str(tmp_path), "--streams", "uniform", "--batch-tokens", "4", "--repeats", "1",
               "--out", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "lookup.json").read_text().splitlines()]
    assert [r["tier"] for r in rows if r["bench"] == "lookup"] == ["disk"]
    assert [r["tier"] for r in rows if r["bench"] == "lookup_exact"] == ["disk"]
    assert not list(tmp_path.glob("condmem-bench-*"))   # the temporary table file is gone


def test_pipeline_timeline_plot_from_rows(tmp_path):
    """The pipeline diagnostic's rows (GPU-only to produce) draw a timeline PNG."""
    pytest.importorskip("matplotlib")
    from condmem.bench.lookup_diagnostics import plot_pipeline

    rows = []
    for label in ("uniform cpu 0.7", "text cpu 1.0"):
        for i in range(4):
            t = 5.0 * i
            rows.append({"bench": "pipeline_timeline", "stream": label, "batch": i, "tokens": 16384,
                         "host_ms": {"called": t, "planned (dedup, probe)": t + 1.0, "cpu ids on host": t + 1.2,
                                     "first chunk gathered": t + 3.0, "last chunk gathered": t + 4.5},
                         "gpu_ms": {"planned": t + 0.9, "zero_copy_done": t + 3.5, "ready": t + 5.2}})
    path = plot_pipeline(rows + [{"bench": "lookup"}], tmp_path / "pipeline.png")
    assert path is not None and path.stat().st_size > 10_000
    assert plot_pipeline([{"bench": "lookup"}], tmp_path / "none.png") is None


def test_text_stream_hashed_in_chunks_equals_hashed_at_once():
    """The text stream is hashed chunk by chunk (bounded memory); each chunk carries the previous
    one's last N-1 tokens, so the row ids are exactly those of hashing the text in one piece."""
    import torch

    from condmem.bench.lookup_setup import N_COLS, text_row_ids

    whole, source = text_row_ids(100_003, 3000, chunk_tokens=1 << 20)
    chunked, _ = text_row_ids(100_003, 3000, chunk_tokens=677)
    assert whole.shape == (3000, N_COLS)
    assert torch.equal(whole, chunked), source


def test_bench_lookup_engine_variants_are_measured_in_turn(tmp_path):
    """--engines A B --engine-rounds 2 measures A, B, A, B on the same table, rows tagged by engine."""
    rc = main(["bench", "lookup", "--smoke", "--table-gib", "0.002", "--batch-tokens", "16", "--streams", "uniform",
               "--repeats", "1", "--diagnostics", "--engines", "graphs", "eager@3+pysend", "--engine-rounds", "2",
               "--out", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "lookup.json").read_text().splitlines()]
    variants = [r["variant"] for r in rows if r["bench"] == "lookup"]
    assert variants == ["graphs", "eager@3+pysend", "graphs", "eager@3+pysend"]
    with pytest.raises(SystemExit, match="graphs|eager"):
        main(["bench", "lookup", "--smoke", "--engines", "fast", "--out", str(tmp_path)])


def test_bench_lookup_plan_diagnostic_times_plan_and_admission_per_engine(tmp_path):
    rc = main(["bench", "lookup", "--smoke", "--table-gib", "0.002", "--batch-tokens", "16", "--streams", "uniform",
               "--text-batches", "3", "--text-warmup", "2", "--repeats", "1", "--diagnostics", "plan",
               "--engines", "graphs", "eager@3+pysend", "--out", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "lookup.json").read_text().splitlines()]
    costs = {(r["variant"], r["stream"]) for r in rows if r["bench"] == "plan_cost"}
    assert costs == {(v, f"text {s}") for v in ("graphs", "eager@3+pysend") for s in ("plan", "admit")}


def test_engine_variants_parse_and_bad_ones_say_the_grammar():
    from condmem.bench.lookup import engine_options, parse_variant

    v = parse_variant("graphs@3+pysend+c16384+z64/torch")
    assert (v["graphs"], v["max_in_flight"], v["native_send"], v["staging_chunk_rows"], v["cache_backend"],
            v["zero_copy_programs"]) == (True, 3, False, 16384, "torch", 64)
    assert v["staging_ring"] is None
    v = parse_variant("eager")
    assert (v["graphs"], v["max_in_flight"], v["native_send"], v["staging_chunk_rows"], v["cache_backend"]) == \
        (False, None, True, None, "auto")
    v = parse_variant("graphs+r8+c4096+gatherexp+yield+w8")
    assert (v["staging_ring"], v["staging_chunk_rows"], v["expand_on_caller"], v["zero_copy_yields"],
            v["zero_copy_word_bytes"]) == (8, 4096, False, True, 8)
    assert parse_variant("graphs")["expand_on_caller"]
    assert not parse_variant("graphs")["zero_copy_yields"]
    # The zero-copy cap: the engine's default unless +zN or +zfull (no cap) says otherwise.
    args = argparse.Namespace(staging_chunk_rows=None)
    assert "zero_copy_programs" not in engine_options(parse_variant("graphs"), args)
    assert engine_options(parse_variant("graphs+z32"), args)["zero_copy_programs"] == 32
    assert engine_options(parse_variant("graphs+zfull"), args)["zero_copy_programs"] is None
    assert engine_options(parse_variant("graphs+t12"), args)["cpu_threads"] == 12
    assert "cpu_threads" not in engine_options(parse_variant("graphs"), args)
    for bad in ("graph", "graphs+tail", "graphs+c", "graphs+c1+c2", "graphs+z0", "graphs+z1+z2", "graphs@x",
                "graphs+z8+zfull", "graphs+t0", "graphs+t4+t8",
                "graphs/cuda", "graphs+r1", "graphs+r4+r8", "graphs+barrier", "graphs+gate", "graphs+inline"):
        with pytest.raises(SystemExit, match=r"graphs\|eager\[@in_flight\]\[\+pysend\]\[\+gatherexp\]"):
            parse_variant(bad)
