"""Load one full-geometry synthetic released layer into page-locked host memory and serve exact rows (GPU machine).

Run by ``scripts/gpu_released_load.sh``. Steps, each timed and written to the JSON as it ends:

1. write a synthetic released checkpoint (`released_synth`: V4.1 Engram geometry, one
   layer, HF tensor names, e8m0 scales) of the largest table the disk allows, up to
   ``--table-gib``, drawing the bytes on the GPU; flush it and drop it from the page
   cache, so the load reads the disk;
2. ``EngramMemory.from_released(..., tier="host")``: rows copied into an anonymous
   mapping (huge pages advised, ``MADV_COLLAPSE`` where coverage is short), page-locked,
   the source's page cache dropped; the huge-page coverage read from smaps;
3. exactness: token batches hashed and looked up on the GPU (the lookup engine's CPU /
   zero-copy split) compared with ``torch.equal`` to the same rows read from the file
   and dequantized on the CPU, plus a sample of raw host rows against the file's bytes;
4. `Engram.from_released` for the same layer, one forward on those rows (finite output).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from released_synth import write_synthetic_checkpoint  # noqa: E402

from condmem import Engram, NgramHasher  # noqa: E402
from condmem.serving import EngramMemory  # noqa: E402
from condmem.fp8 import dequantize_fp8_e8m0, pack_rows  # noqa: E402
from condmem.tables.released import ReleasedCheckpoint  # noqa: E402
from condmem.tables.safetensors_io import drop_page_cache  # noqa: E402
from condmem.tables.storage import advise_random  # noqa: E402
from condmem.utils.code_version import short_commit  # noqa: E402


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")


def meminfo(*keys: str) -> dict[str, float]:
    text = Path("/proc/meminfo").read_text()
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k + "_gib"] = round(int(v.split()[0]) / 2**20, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--table-gib", type=float, default=36.0)
    p.add_argument("--min-gib", type=float, default=32.0)
    p.add_argument("--dir", default=None, help="scratch folder (default: the roomiest of the cwd and /tmp)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Collect()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger().addHandler(logs)
    result: dict = {
        "what": "synthetic released-format V4.1-geometry layer loaded by EngramMemory.from_released into page-locked "
        "host memory, served on the GPU",
        "date": datetime.date.today().isoformat(),
        "commit": short_commit() or os.environ.get("CONDMEM_COMMIT", "unknown"),
        "command": "scripts/gpu_released_load.sh " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU smoke run)",
        "torch": torch.__version__,
        "kernel": os.uname().release,
        "thp": {
            k: Path(f"/sys/kernel/mm/transparent_hugepage/{k}").read_text().strip()
            for k in ("enabled", "defrag")
            if Path(f"/sys/kernel/mm/transparent_hugepage/{k}").exists()
        },
    }

    def save():
        result["log"] = logs.lines[-40:]
        (out / "released_load_h200.json").write_text(json.dumps(result, indent=1) + "\n")

    candidates = [Path(args.dir)] if args.dir else [Path.cwd() / "scratch-released", Path("/tmp/scratch-released")]
    scratch = max(candidates, key=lambda c: shutil.disk_usage(c.parent).free)
    free_gib = shutil.disk_usage(scratch.parent).free / 2**30
    table_gib = min(args.table_gib, free_gib - 4)
    result["scratch"] = {"dir": str(scratch), "free_gib": round(free_gib, 1), "table_gib_asked": round(table_gib, 2)}
    if table_gib < args.min_gib:
        result["error"] = f"only {free_gib:.1f} GiB free: below the {args.min_gib} GiB asked for"
        save()
        sys.exit(1)
    root = scratch / "ckpt"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        t0 = time.perf_counter()
        info = write_synthetic_checkpoint(
            root, table_gib, [1], shards=1, dialect="hf", device=device, chunk_rows=1 << 21
        )
        os.sync()
        for f in info["files"]:
            drop_page_cache(root / f)
        result["write_s"] = round(time.perf_counter() - t0, 1)
        result["file_gib"] = round(info["bytes"] / 2**30, 2)
        result["meminfo_before_load"] = meminfo("MemAvailable", "Cached", "AnonHugePages")
        save()

        ckpt = ReleasedCheckpoint(root)
        layout = ckpt.layout()
        rows_n = layout.layer(1).num_embeddings
        result["rows"] = rows_n
        result["table_gib"] = round(rows_n * 264 / 2**30, 2)
        result["tensor_names"] = ckpt.names.dialect
        hasher = NgramHasher(layout)
        sync()
        t0 = time.perf_counter()
        memory = EngramMemory.from_released(ckpt, hasher, "host", device, host_alloc="mmap_register", progress=False)
        result["load_s"] = round(time.perf_counter() - t0, 1)
        result["load_gib_per_s"] = round(rows_n * 264 / 2**30 / result["load_s"], 2)
        store = memory.stores[1]
        buf = store._buffer
        result["pinned"] = bool(buf.pinned)
        result["huge_page_coverage"] = buf.coverage()
        result["meminfo_after_load"] = meminfo("MemAvailable", "Cached", "AnonHugePages")
        save()

        # Exactness through the lookup engine: hashed batches, rows on the GPU vs the file.
        # The file is cold again (its page cache dropped): random reads, so no read-around.
        source = ckpt.table(1, layout)
        advise_random(source.weight)
        advise_random(source.scales)
        gen = torch.Generator().manual_seed(0)
        checked, exact = 0, True
        t0 = time.perf_counter()
        for _ in range(2):
            ids = torch.randint(0, layout.compressed_vocab_size, (2, 1024), generator=gen)
            prepared = memory.prepare(ids)
            got = prepared.row_vectors(1)
            sync()
            rid = prepared.row_ids(1).cpu().flatten()
            want = dequantize_fp8_e8m0(
                source.weight.index_select(0, rid).contiguous(), source.scales.index_select(0, rid).contiguous()
            )
            exact &= torch.equal(got.cpu().reshape(want.shape[0], -1), want)
            checked += rid.numel()
        result["lookup_rows_checked"] = checked
        result["lookup_rows_exact"] = bool(exact)
        result["lookup_check_s"] = round(time.perf_counter() - t0, 1)
        # Raw host rows against the file's bytes (fp8 bytes then scale bytes), uniformly over the table.
        rid = torch.randint(0, rows_n, (100_000,), generator=gen).sort().values
        raw = store.raw.index_select(0, rid)
        want = pack_rows(source.weight.index_select(0, rid), source.scales.index_select(0, rid))
        result["raw_rows_checked"] = rid.numel()
        result["raw_rows_exact"] = bool(torch.equal(raw, want))
        save()

        module = Engram.from_released(ckpt, 1, device=device)
        hidden = torch.randn(2, 1024, module.hc_mult, module.hidden_size, device=device, dtype=torch.bfloat16)
        y = module(hidden, prepared.row_ids(1), row_vectors=prepared.row_vectors(1))
        result["forward_finite"] = bool(torch.isfinite(y).all())
        result["module"] = {
            "hidden_size": module.hidden_size,
            "hc_mult": module.hc_mult,
            "wkv": list(module.wkv.weight.shape),
        }
        memory.close()
    except Exception as exc:  # keep what was measured
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        save()
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "log"}, indent=1))


if __name__ == "__main__":
    main()
