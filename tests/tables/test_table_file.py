"""Table files: streaming writes round-trip exactly, identity checks refuse foreign tables,
damaged files give clear errors, nothing half-written is left behind."""

from __future__ import annotations


import pytest
import torch
from safetensors import safe_open

from condmem import EngramConfig, EngramLayout
from condmem.tables.safetensors_io import StreamingWriter, TableFileError, read_header
from condmem.tables.table_file import EngramTableFile, LayerRows, TableMismatchError, write_table_file


def _layout(**kw):
    cfg = dict(layer_ids=[1, 4], max_ngram_size=3, n_heads=2, head_dim=64, table_size=37, compressed_vocab_size=50)
    cfg.update(kw)
    return EngramLayout(EngramConfig(**cfg))


def _random_layer(fmt: str, rows: int, d: int, gen) -> LayerRows:
    raw = torch.randint(0, 256, (rows, d + d // 32), dtype=torch.uint8, generator=gen)
    if fmt == "bf16":
        return LayerRows("bf16", torch.randn(rows, d, generator=gen).bfloat16())
    if fmt == "fp8":
        return LayerRows("fp8", raw[:, :d].contiguous().view(torch.float8_e4m3fn), raw[:, d:].contiguous())
    return LayerRows("fp8_interleaved", raw)


def _chunks(rows: LayerRows, size: int):
    for s in range(0, rows.num_rows, size):
        yield LayerRows(
            rows.format, rows.weight[s : s + size], None if rows.scales is None else rows.scales[s : s + size]
        )


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_interleaved"])
def test_streamed_file_round_trips_and_is_plain_safetensors(tmp_path, fmt):
    gen = torch.Generator().manual_seed(0)
    layout = _layout()
    tables = {l.layer_id: _random_layer(fmt, l.num_embeddings, 64, gen) for l in layout.layers}
    path = tmp_path / "tables.safetensors"
    write_table_file(path, layout, fmt, {lid: _chunks(t, 17) for lid, t in tables.items()}, tokenizer_fingerprint="abc")
    f = EngramTableFile(path, layout=layout, tokenizer_fingerprint="abc")
    assert f.format == fmt and f.layer_ids == [1, 4] and f.num_embeddings == layout.num_embeddings
    for lid, t in tables.items():
        got = f.layer(lid)
        assert torch.equal(got.weight.view(torch.uint8), t.weight.view(torch.uint8))
        if fmt == "fp8":
            assert torch.equal(got.scales, t.scales)
    # The safetensors library reads our streamed file too.
    with safe_open(str(path), framework="pt") as sf:
        name = {"bf16": "layers.1.weight", "fp8": "layers.1.weight", "fp8_interleaved": "layers.1.rows"}[fmt]
        assert torch.equal(sf.get_tensor(name).view(torch.uint8), tables[1].weight.view(torch.uint8))
        assert sf.metadata()["layout_fingerprint"] == layout.fingerprint


def test_foreign_layout_and_tokenizer_are_refused(tmp_path):
    gen = torch.Generator().manual_seed(1)
    layout = _layout()
    path = tmp_path / "t.safetensors"
    write_table_file(
        path,
        layout,
        "bf16",
        {l.layer_id: [_random_layer("bf16", l.num_embeddings, 64, gen)] for l in layout.layers},
        tokenizer_fingerprint="tok-A",
    )
    with pytest.raises(TableMismatchError, match="another Engram layout.*compressed_vocab_size: file 50 vs yours 51"):
        EngramTableFile(path, layout=_layout(compressed_vocab_size=51))
    with pytest.raises(TableMismatchError, match="another Engram layout.*seed"):
        EngramTableFile(path, layout=_layout(seed=3))
    with pytest.raises(TableMismatchError, match="another tokenizer"):
        EngramTableFile(path, layout=layout, tokenizer_fingerprint="tok-B")
    with pytest.raises(TableFileError, match="holds Engram layers"):
        EngramTableFile(path).layer(2)


def test_truncated_and_foreign_files(tmp_path):
    gen = torch.Generator().manual_seed(2)
    layout = _layout()
    path = tmp_path / "t.safetensors"
    write_table_file(
        path, layout, "fp8", {l.layer_id: [_random_layer("fp8", l.num_embeddings, 64, gen)] for l in layout.layers}
    )
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-10])
    with pytest.raises(TableFileError, match="truncated"):
        EngramTableFile(cut)
    (tmp_path / "junk").write_bytes(b"\x00" * 3)
    with pytest.raises(TableFileError, match="too short"):
        EngramTableFile(tmp_path / "junk")
    (tmp_path / "text").write_bytes(b"hello world, this is not a table")
    with pytest.raises(TableFileError, match="not safetensors|not JSON"):
        EngramTableFile(tmp_path / "text")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(TableFileError, match="not a condmem Engram table"):
        EngramTableFile(tmp_path / "other.safetensors")
    with pytest.raises(TableFileError, match="not found"):
        EngramTableFile(tmp_path / "missing.safetensors")


def test_failed_write_leaves_nothing(tmp_path):
    layout = _layout()
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"old")
    short = {l.layer_id: [LayerRows("bf16", torch.zeros(3, 64, dtype=torch.bfloat16))] for l in layout.layers}
    with pytest.raises(TableFileError, match="rows given"):
        write_table_file(path, layout, "bf16", short)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]  # no temp file left
    with pytest.raises(TableFileError, match="fp8_interleaved chunk for a bf16"):
        write_table_file(
            path,
            layout,
            "bf16",
            {l.layer_id: [LayerRows("fp8_interleaved", torch.zeros(2, 66, dtype=torch.uint8))] for l in layout.layers},
        )


def test_streaming_writer_checks_completeness(tmp_path):
    path = tmp_path / "w.safetensors"
    with pytest.raises(TableFileError, match="incomplete"):
        with StreamingWriter(path, {"a": (torch.uint8, (4, 2)), "b": (torch.uint8, (1, 1))}) as w:
            w.write("a", torch.zeros(4, 2, dtype=torch.uint8))
    assert not path.exists()
    with StreamingWriter(path, {"a": (torch.uint8, (4, 2)), "b": (torch.float32, (1, 3))}, {"k": "v"}) as w:
        w.write("b", torch.ones(1, 3))
        w.write("a", torch.arange(4, dtype=torch.uint8)[:, None].expand(4, 2))
    h = read_header(path)
    assert h.metadata["k"] == "v" and "integrity" in h.metadata and h.tensors["b"].shape == (1, 3)
    with safe_open(str(path), framework="pt") as sf:
        assert torch.equal(sf.get_tensor("b"), torch.ones(1, 3))
        assert sf.get_tensor("a")[3].tolist() == [3, 3]
    with pytest.raises(TableFileError, match="only 8 declared"):
        with StreamingWriter(tmp_path / "x", {"a": (torch.uint8, (4, 2))}) as w:
            w.write("a", torch.zeros(5, 2, dtype=torch.uint8))
