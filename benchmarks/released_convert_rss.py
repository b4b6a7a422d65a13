"""Peak memory of ``condmem convert --released`` on a synthetic checkpoint of many GiB.

Writes a synthetic released checkpoint (`released_synth`: two V4.1-geometry layers,
three shards + index, original tensor names, config.json in the folder), runs the CLI
on it in a child process, reads the child's peak resident set (``ru_maxrss``), checks a
sample of converted rows byte for byte against the source, writes one JSON result and
deletes both files.

    python benchmarks/released_convert_rss.py --dir /work/tmp-convert --table-gib 8.2 \
        --out benchmarks/results/released_convert_rss.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from released_synth import write_synthetic_checkpoint  # noqa: E402

from condmem.tables.released import ReleasedCheckpoint  # noqa: E402
from condmem.tables.table_file import EngramTableFile  # noqa: E402
from condmem.utils.code_version import short_commit  # noqa: E402


def peak_rss_kib(cmd: list[str]) -> int:
    """Run `cmd` in a child of its own and return its peak resident set (KiB, GNU time's %M)."""
    proc = subprocess.run(["/usr/bin/time", "-f", "PEAK_KIB %M", *cmd], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{cmd[:4]} failed:\n{proc.stderr[-3000:]}")
    return int(proc.stderr.rsplit("PEAK_KIB", 1)[1].split()[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="scratch folder (needs about twice --table-gib free)")
    p.add_argument("--table-gib", type=float, default=8.2)
    p.add_argument("--to", default="fp8_interleaved")
    p.add_argument("--out", required=True)
    p.add_argument("--keep", action="store_true", help="keep the files")
    args = p.parse_args()
    scratch = Path(args.dir)
    free = shutil.disk_usage(scratch.parent if not scratch.exists() else scratch).free
    if free < 2.2 * args.table_gib * 2**30:
        sys.exit(f"{free / 2**30:.1f} GiB free; need about {2.2 * args.table_gib:.1f}")
    src, dst = scratch / "ckpt", scratch / "tables.safetensors"
    try:
        t0 = time.perf_counter()
        info = write_synthetic_checkpoint(src, args.table_gib, [1, 14], shards=3, dialect="original")
        t_write = time.perf_counter() - t0
        cmd = [
            sys.executable,
            "-m",
            "condmem",
            "convert",
            "--released",
            str(src),
            str(dst),
            "--to",
            args.to,
            "--no-progress",
        ]
        t0 = time.perf_counter()
        peak_kib = peak_rss_kib(cmd)
        seconds = time.perf_counter() - t0
        # The same interpreter importing the converter and doing nothing: the floor of any run.
        floor_kib = peak_rss_kib([sys.executable, "-c", "import condmem.cli.convert, condmem.tables.released"])
        # Exactness: a sample of rows, byte for byte against the source tensors.
        ckpt = ReleasedCheckpoint(src)
        out = EngramTableFile(dst, layout=ckpt.layout())
        exact = True
        gen = torch.Generator().manual_seed(0)
        for lid, rows in ckpt.tables().items():
            ids = torch.randint(0, rows.num_rows, (200_000,), generator=gen).sort().values
            got = out.layer(lid).weight.index_select(0, ids)
            exact &= torch.equal(got[:, :256], rows.weight.view(torch.uint8).index_select(0, ids))
            exact &= torch.equal(got[:, 256:], rows.scales.index_select(0, ids))
        result = {
            "what": "condmem convert --released, synthetic V4.1-geometry checkpoint (2 layers, 3 shards + index, "
            "original tensor names), peak RSS of the converting process",
            "date": datetime.date.today().isoformat(),
            "commit": short_commit(),
            "command": " ".join(["condmem"] + cmd[3:]),
            "machine": f"{os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} "
            "GiB RAM",
            "source_gib": info["bytes"] / 2**30,
            "output_gib": dst.stat().st_size / 2**30,
            "rows": ckpt.layout().num_embeddings,
            "to": args.to,
            "write_synthetic_s": round(t_write, 1),
            "convert_s": round(seconds, 1),
            "convert_gib_per_s": round(info["bytes"] / 2**30 / seconds, 3),
            "peak_rss_mib": round(peak_kib / 1024, 1),
            "import_only_peak_rss_mib": round(floor_kib / 1024, 1),
            "peak_rss_above_import_mib": round((peak_kib - floor_kib) / 1024, 1),
            "sampled_rows_exact": bool(exact),
            "rows_sampled_per_layer": 200_000,
        }
        print(json.dumps(result, indent=1))
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
