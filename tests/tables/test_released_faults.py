"""Released checkpoints under faults: a shard truncated or copied over under a live disk-tier reader is a
clear `StorageError` naming it (never a SIGBUS, never changed rows); index entries and links leading out of
the checkpoint folder are refused before anything is read; NaN / inf table scales are refused by convert,
the loaders and the disk tier's reads, and ``condmem inspect`` exits 1 on them; ``inspect --full`` checks
every row it reads (block CRCs of table files) and exits 1 on a damaged table. Each fault has its negative
control: the old path (rows read through the mapping, paths taken as listed, scales unchecked) passes it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from condmem import Engram, EngramLayout, NgramHasher
from condmem.cli import main
from condmem.ops.block_fp8 import dequantize_block_fp8
from condmem.serving import EngramMemory
from condmem.tables import released
from condmem.tables.released import ReleasedCheckpoint, ReleasedCheckpointError
from condmem.tables.errors import StorageError
from condmem.tables.storage import place_layer
from condmem.tables.table_file import EngramTableFile
from fault_harness import flip_byte, report, spread_offsets
from released_fixtures import (
    E8M0,
    engram_config,
    make_tensors,
    rows_f64,
    tensor_names,
    write_checkpoint,
)

CMD = "scripts/test tests/tables/test_released_faults.py -q"
SHARD = "model.safetensors"


def _hasher():
    return NgramHasher(EngramLayout(engram_config()))


def _env():
    src = str(Path(__file__).parents[2] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


# --------------------------------------------------------------------------- a live disk-tier reader
_LIVE = r"""
import dataclasses, sys, torch
sys.path.insert(0, sys.argv[2])
from condmem import Engram, EngramLayout, NgramHasher
from condmem.ops.block_fp8 import dequantize_block_fp8
from condmem.serving import EngramMemory
from condmem.tables.released import ReleasedCheckpoint
from condmem.tables.storage import place_layer
from released_fixtures import engram_config
mode, folders = sys.argv[1], sys.argv[3:]
hasher = NgramHasher(EngramLayout(engram_config()))
def open_memory(folder):
    if mode == "served":
        return EngramMemory.from_released(folder, hasher, tier="disk", progress=False)
    ckpt = ReleasedCheckpoint(folder)  # the old path: rows read through the shard's mapping
    stores = {lid: place_layer(dataclasses.replace(ckpt.table(lid, hasher.layout), source=None), "disk",
                               progress=False) for lid in hasher.layer_ids}
    return EngramMemory(hasher, stores)
ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
memories = [open_memory(f) for f in folders]
want = [m.prepare(ids).rows(5).clone() for m in memories]
print("ready", flush=True)
sys.stdin.readline()  # the faults are made
for m, w in zip(memories, want):
    try:
        got = m.prepare(ids).rows(5)
    except Exception as exc:
        print("ERROR", type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
        continue
    print("SAME ROWS" if torch.equal(got, w) else "CHANGED ROWS", flush=True)
"""


def _cp_preserving_times(src: Path, dst: Path) -> None:
    """New bytes in place, then dst's old mtime put back (``cp -p`` / ``rsync --inplace --times``)."""
    st = dst.stat()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert dst.stat().st_mtime_ns == st.st_mtime_ns and dst.stat().st_size == st.st_size


FAULTS = {
    "truncate to half": lambda shard, other, bigger: os.truncate(shard, shard.stat().st_size // 2),
    "truncate to 0": lambda shard, other, bigger: os.truncate(shard, 0),
    "cp, same size": lambda shard, other, bigger: subprocess.run(["cp", str(other), str(shard)], check=True),
    "cp, another size": lambda shard, other, bigger: subprocess.run(["cp", str(bigger), str(shard)], check=True),
    "cp, same size, mtime restored": lambda shard, other, bigger: _cp_preserving_times(other, shard),
}


def _live_run(tmp_path, mode: str, faults: list[str]):
    folders = []
    for i, _ in enumerate(faults):
        folders.append(tmp_path / f"ck{i}")
        write_checkpoint(folders[-1], "original", 1, "flat", seed=0)
    write_checkpoint(tmp_path / "other", "original", 1, "flat", seed=9)
    other = tmp_path / "other" / SHARD
    bigger = tmp_path / "bigger.safetensors"
    bigger.write_bytes(other.read_bytes() + b"\0" * 4096)
    assert other.stat().st_size == (folders[0] / SHARD).stat().st_size
    child = subprocess.Popen(
        [sys.executable, "-c", _LIVE, mode, str(Path(__file__).parents[1]), *map(str, folders)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        for folder, fault in zip(folders, faults):
            FAULTS[fault](folder / SHARD, other, bigger)
        out, err = child.communicate("go\n", timeout=120)
    finally:
        child.kill()
    return folders, child.returncode, out.strip().splitlines(), err


def test_truncate_and_cp_over_a_served_shard_are_clear_errors(tmp_path):
    faults = list(FAULTS)
    folders, code, lines, err = _live_run(tmp_path, "served", faults)
    assert code not in (-7, 135), "killed by SIGBUS"
    assert code == 0 and len(lines) == len(faults), (code, lines, err[-2000:])
    for folder, fault, line in zip(folders, faults, lines):
        assert line.startswith("ERROR StorageError "), (fault, line)
        assert f"{folder / SHARD} changed under this reader" in line, (fault, line)
    assert "size went from" in lines[0] and "to 0 bytes" in lines[1]
    assert "mtime moved" in lines[2] and "size went from" in lines[3] and "ctime moved" in lines[4], lines
    seen = Counter(line.split("reader: ")[1].split(" (")[0].split(" since")[0].split(" while")[0] for line in lines)
    report("truncate / cp over a shard served by from_released(tier='disk')", len(faults), seen, CMD + " -k served")


def test_negative_control_the_mapped_disk_tier_serves_changed_rows_then_dies_with_sigbus(tmp_path):
    # What from_released(tier="disk") did before: rows read through the shard's mapping.
    _, code, lines, err = _live_run(tmp_path, "mapped", ["cp, same size, mtime restored", "cp, same size"])
    assert code == 0 and lines == ["CHANGED ROWS", "CHANGED ROWS"], (code, lines, err[-2000:])
    _, code, lines, _ = _live_run(tmp_path / "t", "mapped", ["truncate to 0"])
    assert code == -7 and lines == [], (code, lines)  # SIGBUS (exit 135 in a shell)


def test_rows_served_from_disk_are_exact_until_the_shard_changes(tmp_path):
    truth = write_checkpoint(tmp_path, "hf", 3, "flat", scale_dtype="float32")
    memory = EngramMemory.from_released(tmp_path, _hasher(), tier="disk", progress=False)
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(2))
    p = memory.prepare(ids)
    for lid in (2, 5):
        t = truth[lid]
        assert torch.equal(p.rows(lid), rows_f64(t["embed"], t["embed_exponents"])[p.row_ids(lid)].bfloat16())
    for shard in tmp_path.glob("*.safetensors"):
        os.chmod(shard, 0o400)  # the inode's status only: its ctime moves too, and the reader stops
    with pytest.raises(StorageError, match="ctime moved"):
        memory.prepare(ids).rows(2)
    memory.close()


# --------------------------------------------------------------------------- paths out of the folder
def _index_pointing_at(folder: Path, target: str) -> str:
    """A 3-shard checkpoint whose index lists the first shard's tensors under `target`; returns a tensor moved."""
    write_checkpoint(folder, "original", 3, "flat")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    moved = [k for k, v in data["weight_map"].items() if v.startswith("model-00001")]
    data["weight_map"].update({k: target for k in moved})
    index.write_text(json.dumps(data))
    return moved[0]


def _outside(tmp_path: Path) -> Path:
    """A safetensors file outside the checkpoint folder (a real shard: the old path would read it whole)."""
    (tmp_path / "outside").mkdir(exist_ok=True)
    write_checkpoint(tmp_path / "src", "original", 3, "flat")
    target = tmp_path / "outside" / "x.safetensors"
    shutil.copy(tmp_path / "src" / "model-00001-of-00003.safetensors", target)
    return target


def _recording_read_header(monkeypatch):
    opened = []
    real = released.read_header

    def record(path):
        opened.append(Path(path).resolve())
        return real(path)

    monkeypatch.setattr(released, "read_header", record)
    return opened


OUT_OF_FOLDER = ["../outside/x.safetensors", "/etc/passwd", "symlink to ../outside/x.safetensors"]


@pytest.mark.parametrize("entry", OUT_OF_FOLDER)
def test_index_paths_leaving_the_folder_are_refused_before_anything_is_read(tmp_path, monkeypatch, capsys, entry):
    outside = _outside(tmp_path)
    folder = tmp_path / "ck"
    if entry.startswith("symlink"):
        write_checkpoint(folder, "original", 3, "flat")
        link = folder / "model-00001-of-00003.safetensors"
        link.unlink()
        link.symlink_to(os.path.relpath(outside, folder))
        target = outside
    else:
        _index_pointing_at(folder, entry)
        target = Path(entry) if entry.startswith("/") else outside
    size = f"{target.stat().st_size}"
    opened = _recording_read_header(monkeypatch)
    with pytest.raises(
        ReleasedCheckpointError, match="outside the checkpoint folder|leaves the checkpoint|absolute"
    ) as e:
        ReleasedCheckpoint(folder)
    assert "model.safetensors.index.json" in str(e.value) and size not in str(e.value).replace(str(tmp_path), "")
    assert opened == [], opened  # no shard opened, the outside file least of all
    for argv in (
        ["convert", "--released", str(folder), str(tmp_path / "t.safetensors"), "--to", "fp8"],
        ["inspect", str(folder)],
    ):
        assert main([*argv, "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert "checkpoint folder" in err and size not in err.replace(str(tmp_path), ""), err
    assert not (tmp_path / "t.safetensors").exists() and opened == []
    # Negative control: the old rule (entries taken as listed) opens the outside file, and for a file that is
    # not safetensors prints its size.
    monkeypatch.setattr(released, "_shard_path", lambda root, name, listed_by: root / name)
    try:
        ReleasedCheckpoint(folder)
    except ValueError as exc:
        if entry == "/etc/passwd":
            assert size in str(exc), exc
    assert target.resolve() in opened


def test_a_symlink_out_of_a_folder_without_index_is_refused(tmp_path):
    outside = _outside(tmp_path)
    folder = tmp_path / "single"
    folder.mkdir()
    (folder / SHARD).symlink_to(outside)
    with pytest.raises(ReleasedCheckpointError, match=f"{SHARD}.*outside the checkpoint folder"):
        ReleasedCheckpoint(folder)


def test_links_inside_the_folder_and_into_the_hub_cache_blobs_are_accepted(tmp_path):
    # Inside the folder: a shard moved into a subfolder and linked back.
    folder = tmp_path / "ck"
    write_checkpoint(folder, "original", 3, "flat")
    (folder / "sub").mkdir()
    shard = folder / "model-00002-of-00003.safetensors"
    shard.rename(folder / "sub" / shard.name)
    shard.symlink_to(Path("sub") / shard.name)
    assert len(ReleasedCheckpoint(folder).files) == 3
    # The Hugging Face hub cache: <repo>/snapshots/<rev>/<file> -> ../../blobs/<hash>.
    repo = tmp_path / "models--deepseek-ai--x"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    write_checkpoint(tmp_path / "plain", "hf", 3, "flat")
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted((tmp_path / "plain").iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    ckpt = ReleasedCheckpoint(snap)
    assert len(ckpt.files) == 3 and ckpt.config is not None


# --------------------------------------------------------------------------- NaN / inf scales
BAD_ROW = 7


def _nan_scale_checkpoint(folder: Path, scale_dtype: str = "e8m0", value: float = float("nan")) -> str:
    """A checkpoint whose layer-5 table has one bad scale at row BAD_ROW; returns the scale tensor's name."""
    tensors, _ = make_tensors("original", scale_dtype=scale_dtype)
    name = tensor_names(5, "original")["embed_scale"]
    s = tensors[name].clone()
    if scale_dtype == "float32":
        s[BAD_ROW, 1] = value
    else:
        s.view(torch.uint8)[BAD_ROW, 1] = 0xFF  # e8m0's NaN
    tensors[name] = s
    write_checkpoint(folder, "original", 3, "flat", tensors=tensors)
    return name


BAD_SCALES = [("e8m0", float("nan")), ("uint8", float("nan")), ("float32", float("nan")), ("float32", float("inf"))]


@pytest.mark.parametrize("dtype,value", BAD_SCALES, ids=[f"{d}-{v}" for d, v in BAD_SCALES])
def test_nan_and_inf_scales_are_refused_by_convert_load_and_inspect(tmp_path, capsys, dtype, value):
    name = _nan_scale_checkpoint(tmp_path / "ck", dtype, value)
    out = tmp_path / "t.safetensors"
    row = f"row {BAD_ROW}"
    assert main(["convert", "--released", str(tmp_path / "ck"), str(out), "--to", "fp8", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert name in err and row in err and ("NaN" in err or "not finite" in err), err
    assert not out.exists()
    for argv in ([], ["--full"]):
        assert main(["inspect", str(tmp_path / "ck"), "--no-progress", *argv]) == 1
        text = capsys.readouterr()
        assert name in text.out and row in text.out and "error:" in text.out, text.out
    with pytest.raises(ReleasedCheckpointError, match=rf"{name}.*{row}\b"):
        EngramMemory.from_released(tmp_path / "ck", _hasher(), tier="host", progress=False)


def test_a_nan_scale_is_never_served_by_the_disk_tier(tmp_path):
    name = _nan_scale_checkpoint(tmp_path)
    truth = make_tensors("original")[1]
    memory = EngramMemory.from_released(tmp_path, _hasher(), tier="disk", progress=False)
    store = memory.stores[5]
    good = torch.tensor([0, 3, BAD_ROW + 1, 100])
    got = store.gather_raw(good)
    assert torch.equal(got[:, 64:], truth[5]["embed_exponents"][good])  # other rows served exact
    with pytest.raises(StorageError, match=rf"{name}.*row {BAD_ROW}\b.*0xFF.*not served"):
        store.gather_raw(torch.tensor([4, BAD_ROW, 9]))
    memory.close()


def test_negative_control_unchecked_scales_convert_and_inspect_a_nan_scale_silently(tmp_path, monkeypatch, capsys):
    _nan_scale_checkpoint(tmp_path / "ck")
    monkeypatch.setattr(released, "check_scale_bytes", lambda e, what, rows=0: e)  # the old readers
    out = tmp_path / "t.safetensors"
    assert main(["convert", "--released", str(tmp_path / "ck"), str(out), "--to", "fp8", "--no-progress"]) == 0
    assert int(EngramTableFile(out).layer(5).scales[BAD_ROW, 1]) == 0xFF
    assert main(["inspect", str(tmp_path / "ck"), "--full", "--no-progress"]) == 0
    assert "with NaN 1" in capsys.readouterr().out


def test_float32_nan_scales_were_mapped_to_the_nan_byte(tmp_path):
    # The value the test plants is NaN in the file (the input is bad), and e8m0's byte for it is 0xFF.
    name = _nan_scale_checkpoint(tmp_path, "float32")
    header = ReleasedCheckpoint(tmp_path).headers[name]
    from condmem.tables.safetensors_io import mmap_tensor

    assert torch.isnan(mmap_tensor(header, name)[BAD_ROW, 1])
    if E8M0 is not None:
        assert torch.isnan(torch.tensor([0xFF], dtype=torch.uint8).view(E8M0).float()).all()


WKV_BAD = [("e8m0", None), ("float32", float("nan")), ("float32", float("inf"))]


@pytest.mark.parametrize("dtype,value", WKV_BAD, ids=["e8m0-0xFF", "float32-nan", "float32-inf"])
def test_a_nan_or_inf_wkv_block_scale_is_refused(tmp_path, dtype, value):
    tensors, _ = make_tensors("original", wkv_scale_dtype=dtype)
    name = tensor_names(5, "original")["wkv_scale"]
    good = tensors[name].clone()
    if value is None:
        tensors[name].view(torch.uint8)[1, 2] = 0xFF
    else:
        tensors[name][1, 2] = value
    write_checkpoint(tmp_path / "bad", "original", 1, "flat", tensors=tensors)
    with pytest.raises(ReleasedCheckpointError, match=rf"{name}.*block scale \[1, 2\]"):
        Engram.from_released(tmp_path / "bad", 5)
    # Negative control: the same checkpoint with that scale restored loads, and the planted one makes NaN weights.
    w = tensors[tensor_names(5, "original")["wkv"]]
    assert not torch.isfinite(dequantize_block_fp8(w, tensors[name], torch.float32)).all()
    tensors[name] = good
    write_checkpoint(tmp_path / "good", "original", 1, "flat", tensors=tensors)
    assert torch.isfinite(Engram.from_released(tmp_path / "good", 5).wkv.weight).all()


# --------------------------------------------------------------------------- inspect --full on damaged table files
def _table_file(tmp_path: Path) -> Path:
    write_checkpoint(tmp_path / "ck", "original", 1, "flat")
    out = tmp_path / "table.safetensors"
    assert (
        main(["convert", "--released", str(tmp_path / "ck"), str(out), "--to", "fp8_interleaved", "--no-progress"]) == 0
    )
    return out


def _inspect_exits(path: Path, capsys) -> int:
    code = main(["inspect", str(path), "--full", "--no-progress"])
    capsys.readouterr()
    return code


def _sweep(tmp_path: Path, table: Path, capsys) -> tuple[list[int], Counter]:
    offsets = spread_offsets(table.stat().st_size, 48, seed=3, head=8)
    outcomes, codes = Counter(), []
    damaged = tmp_path / "damaged.safetensors"
    for off in offsets:
        shutil.copy(table, damaged)
        flip_byte(damaged, off, 0x10)
        codes.append(_inspect_exits(damaged, capsys))
        outcomes[f"exit {codes[-1]}"] += 1
    return codes, outcomes


def test_inspect_full_exits_nonzero_on_every_damaged_table(tmp_path, capsys):
    table = _table_file(tmp_path)
    assert _inspect_exits(table, capsys) == 0
    codes, outcomes = _sweep(tmp_path, table, capsys)
    assert codes == [1] * len(codes), outcomes
    report("one flipped bit in a table file, then `condmem inspect --full`", len(codes), outcomes, CMD + " -k damaged")


def test_negative_control_inspect_full_through_the_mapping_passes_damaged_rows(tmp_path, capsys, monkeypatch):
    # The old statistics read the rows through the mapping, unchecked: the same sweep, some damaged files pass.
    table = _table_file(tmp_path)
    real_layer = EngramTableFile.layer
    monkeypatch.setattr(
        EngramTableFile, "layer", lambda self, lid: dataclasses.replace(real_layer(self, lid), source=None)
    )
    codes, outcomes = _sweep(tmp_path, table, capsys)
    assert 0 < codes.count(0) < len(codes), outcomes
    report(
        "the same, statistics read through the mapping (negative control)", len(codes), outcomes, CMD + " -k mapping"
    )


def test_inspect_full_exits_zero_on_undamaged_checkpoints(tmp_path, capsys):
    write_checkpoint(tmp_path / "ck", "hf", 3, "nested", scale_dtype="float32")
    assert main(["inspect", str(tmp_path / "ck"), "--full", "--no-progress"]) == 0
    assert "ok: the loaders accept it" in capsys.readouterr().out
    ck = ReleasedCheckpoint(tmp_path / "ck")
    assert place_layer(ck.table(2), "disk", progress=False).num_rows == ck.table(2).num_rows
