"""Does a zero-copy gather from host memory slow the HBM work running beside it, and does the
way the host memory is mapped for the GPU change that?

The lead it tests (`docs/serving.md`, "Why decode loses ~1.5% a layer"): a decode step with a
host table is ~1.6% slower than with an HBM table even when nothing waits for the fetch, and
the loss grows with the table's span (0.1% at 0.25 GiB, 1.1% at 2 GiB, 1.6% at 16 GiB), as if
the fetch's address translations crowded out those of the step's own HBM reads.

For each span and each kind of host memory, three timings (CUDA events, medians):

* ``work``: an HBM-bound stand-in for a decode step's key/value reads, random 4 KiB blocks
  gathered from a large HBM tensor (``--hbm-gib``), alone;
* ``fetch``: a zero-copy gather of random 264-byte rows from the host table, alone;
* ``work_beside_fetch``: the work while the fetch runs in a loop on another stream.

Host memory kinds: ``pinned`` (page-locked by ``cudaHostAlloc`` through torch; condmem's
``cudaHostRegister`` of huge pages measured the same in `../shared/reference/h200-host-gather.md`)
and ``vmm_host`` (``cuMemCreate`` with a host location at the driver's recommended
granularity, mapped into the GPU's address space with ``cuMemMap``; the GPU may map it with
large pages). A kind the driver refuses is reported as such.

    PYTHONPATH=src python3 benchmarks/probes/host_translation_probe.py --spans 0.25 2 16 --out $OUT

On the H200 (`benchmarks/results/host_translation_probe_h200.*`) the driver placed ``vmm_host``
at 2 MiB granularity; at 0.25 and 2 GiB both kinds ran, at 16 GiB the gather faulted (illegal
address) and ended the CUDA context, not investigated.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from condmem.bench.harness import event_times_ms

ROW_WORDS = 66  # 264-byte rows (fp8 x 256 + 8 scale bytes), as int32 words


@triton.jit
def _gather_rows(table, ids, out, n, ROW: tl.constexpr, ROW_P: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK + tl.arange(0, BLOCK)
    w = tl.arange(0, ROW_P)
    rm = r < n
    row = tl.load(ids + r, mask=rm, other=0).to(tl.int64)
    mask = rm[:, None] & (w[None, :] < ROW)
    vals = tl.load(table + row[:, None] * ROW + w[None, :], mask=mask, other=0)
    tl.store(out + r[:, None].to(tl.int64) * ROW + w[None, :], vals, mask=mask)


class _Pointer:
    """What a Triton launch needs of a tensor argument: an address and an element type."""

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Loc),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Loc), ("flags", ctypes.c_int)]


class VmmHostBuffer:
    """`nbytes` of host memory from ``cuMemCreate`` (location HOST_NUMA 0, else HOST), mapped
    for device `device` (read/write). Raises RuntimeError naming the call the driver refused."""

    LOC_DEVICE, LOC_HOST, LOC_HOST_NUMA = 1, 2, 3

    def __init__(self, nbytes: int, device: int = 0):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.handle, self.ptr, self.size = ctypes.c_ulonglong(0), ctypes.c_ulonglong(0), 0
        errors = []
        for loc_type in (self.LOC_HOST_NUMA, self.LOC_HOST):
            prop = _Prop(type=1, requestedHandleTypes=0, location=_Loc(loc_type, 0))
            gran = ctypes.c_size_t(0)
            rc = self.cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 1)
            if rc != 0:
                errors.append(f"granularity (location {loc_type}): CUresult {rc}")
                continue
            self.granularity = gran.value
            self.size = -(-nbytes // gran.value) * gran.value
            rc = self.cu.cuMemCreate(
                ctypes.byref(self.handle), ctypes.c_size_t(self.size), ctypes.byref(prop), ctypes.c_ulonglong(0)
            )
            if rc == 0:
                self.location = loc_type
                break
            errors.append(f"cuMemCreate (location {loc_type}): CUresult {rc}")
        else:
            raise RuntimeError("; ".join(errors))
        self._check(
            self.cu.cuMemAddressReserve(
                ctypes.byref(self.ptr),
                ctypes.c_size_t(self.size),
                ctypes.c_size_t(self.granularity),
                ctypes.c_ulonglong(0),
                ctypes.c_ulonglong(0),
            ),
            "cuMemAddressReserve",
        )
        self._check(
            self.cu.cuMemMap(
                self.ptr, ctypes.c_size_t(self.size), ctypes.c_size_t(0), self.handle, ctypes.c_ulonglong(0)
            ),
            "cuMemMap",
        )
        access = _Access(location=_Loc(self.LOC_DEVICE, device), flags=3)
        self._check(
            self.cu.cuMemSetAccess(self.ptr, ctypes.c_size_t(self.size), ctypes.byref(access), ctypes.c_size_t(1)),
            "cuMemSetAccess",
        )

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{call}: CUresult {rc}")

    def close(self) -> None:
        self.cu.cuMemUnmap(self.ptr, ctypes.c_size_t(self.size))
        self.cu.cuMemAddressFree(self.ptr, ctypes.c_size_t(self.size))
        self.cu.cuMemRelease(self.handle)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spans", type=float, nargs="+", default=[0.25, 2.0, 16.0], help="host table GiB")
    p.add_argument("--hbm-gib", type=float, default=16.0, help="span of the HBM work's random blocks")
    p.add_argument("--rows", type=int, default=3072, help="rows a fetch (a 4B decode step's layer)")
    p.add_argument("--blocks", type=int, default=45_000, help="4 KiB blocks the work reads (~180 MB)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    torch.cuda.init()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hbm = torch.empty(int(args.hbm_gib * 2**30) // 4096, 1024, dtype=torch.float32, device=dev)
    hbm.random_(generator=gen)
    work_idx = [torch.randint(0, hbm.shape[0], (args.blocks,), device=dev, generator=gen) for _ in range(4)]
    work_out = torch.empty(args.blocks, 1024, dtype=torch.float32, device=dev)

    def work():
        for idx in work_idx:
            torch.index_select(hbm, 0, idx, out=work_out)

    base_ms = statistics.median(event_times_ms(work, args.repeats)[1:])
    rows = []
    side = torch.cuda.Stream(dev)
    for span in args.spans:
        n_rows = int(span * 2**30) // (ROW_WORDS * 4)
        fetch_ids = [torch.randint(0, n_rows, (args.rows,), device=dev, generator=gen) for _ in range(16)]
        fetch_out = torch.empty(args.rows, ROW_WORDS, dtype=torch.int32, device=dev)
        for kind in ("pinned", "vmm_host"):
            row = {"span_gib": span, "kind": kind, "work_alone_ms": base_ms}
            buf = keep = None
            try:
                # Contents do not matter here, only where the rows are: neither table is filled.
                if kind == "pinned":
                    keep = torch.empty(n_rows * ROW_WORDS, dtype=torch.int32, pin_memory=True)
                    table = _Pointer(keep.data_ptr(), torch.int32)
                else:
                    buf = VmmHostBuffer(n_rows * ROW_WORDS * 4, dev.index or 0)
                    row["granularity"], row["location"] = buf.granularity, buf.location
                    table = _Pointer(buf.ptr.value, torch.int32)

                def fetch(ids):
                    _gather_rows[(triton.cdiv(args.rows, 64),)](
                        table, ids, fetch_out, args.rows, ROW=ROW_WORDS, ROW_P=128, BLOCK=64
                    )

                def fetch_all():
                    for ids in fetch_ids:
                        fetch(ids)

                row["fetch_ms"] = statistics.median(event_times_ms(fetch_all, args.repeats)[1:]) / len(fetch_ids)

                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                times = []
                for _ in range(args.repeats):
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(8):
                            fetch_all()
                    start.record()
                    work()
                    end.record()
                    torch.cuda.current_stream().wait_stream(side)
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                row["work_beside_fetch_ms"] = statistics.median(times[1:])
                row["slowdown"] = row["work_beside_fetch_ms"] / base_ms
            except Exception as exc:  # noqa: BLE001 - a probe: what failed is its result
                row["error"] = str(exc)[:300]
            finally:
                del keep
                if buf is not None:
                    buf.close()
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "host_translation_probe.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'span GiB':>8s} {'kind':>11s} {'fetch ms':>9s} {'work ms':>8s} {'beside':>8s} {'slowdown':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['span_gib']:8.2f} {r['kind']:>11s}  error: {r['error'][:80]}")
            continue
        print(
            f"{r['span_gib']:8.2f} {r['kind']:>11s} {r['fetch_ms']:9.4f} {r['work_alone_ms']:8.3f} "
            f"{r['work_beside_fetch_ms']:8.3f} {r['slowdown']:8.3f}"
        )


if __name__ == "__main__":
    main()
