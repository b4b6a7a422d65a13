"""Integrity of table files: every byte a tier serves is checked against a checksum recorded at write time.

A flipped bit in a table's rows would otherwise be served as a row, silently. Writers record,
in the header metadata key ``integrity``, one of two records:

* **block CRCs** (table files, `write_table_file`): a CRC32C for every ``block_bytes`` block
  (4 KiB) of every tensor, on the file's absolute grid (block boundaries at multiples of
  ``block_bytes``; a tensor's first and last blocks are clipped to its bytes), stored as a
  companion uint32 tensor ``<name>.crc32c`` whose own sha256 the header records::

      {"algo": "crc32c", "block_bytes": 4096, "header": <sha256 of the rest of the header>,
       "sums": {name: "<name>.crc32c"}, "sums_sha256": {"<name>.crc32c": <sha256>}}

  A 4 KiB block is what a cold read fetches anyway (a page, an O_DIRECT unit), so the disk
  tier checks every block it reads for the cost of a CRC of 4 KiB (the SSE4.2 instruction's:
  a small part of a cold read of that block); the host tier checks every block as it loads
  the table.
* **chunk digests** (files written before the block CRCs, and other safetensors files of
  `StreamingWriter`): a sha256 for every ``chunk_bytes`` piece of every tensor, relative to
  the tensor's first byte::

      {"algo": "sha256", "chunk_bytes": N, "header": <sha256>, "tensors": {name: [<sha256>, ...]}}

  Tiers check such a file chunk by chunk: the host tier every chunk as it loads, the disk
  tier a whole chunk at its first read (`TensorChecks`).

Digests are written as zeros first and filled in when the last byte is in, so a temp file
of an interrupted write is recognizably incomplete. `TensorChecks` describes how one
tensor's bytes are checked; `read_checked` reads a byte range of it with `os.preadv` (never
through a mapping, so a file truncated under the reader is a short read, not a SIGBUS) and
checks every block it returns; `read_spans` does that in parallel threads (the CRCs and
hashes release the GIL).

The CRC32C runs in the native library (``checksum.c``: SSE4.2 where the CPU has it); without
it, `google_crc32c` computes the same numbers.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from condmem import native

KEY = "integrity"
CRC_ALGO = "crc32c"
DIGEST_ALGO = "sha256"
BLOCK_BYTES = 4096
"""Bytes per recorded CRC32C: a page and an O_DIRECT unit, what a cold random read fetches anyway."""
DEFAULT_CHUNK_BYTES = 16 * 2**20
"""Bytes per sha256 of a chunk-digest record."""
SUMS_SUFFIX = ".crc32c"
PIECE_BYTES = 4 * 2**20
"""Bytes one thread reads and checks at a time when it loads a whole tensor (small enough to stay in its cache)."""
_EMPTY = "0" * 64


class IntegrityMismatch(Exception):
    """Bytes that differ from their recorded checksum (or an integrity record that is malformed);
    callers turn it into their own error type, naming the file."""


class FileChanged(IntegrityMismatch):
    """The file ended before bytes it must hold (truncated, or rewritten, since it was opened)."""


# --------------------------------------------------------------------------- CRC32C
def crc32c(data, crc: int = 0) -> int:
    """CRC32C of the bytes of `data` (a contiguous buffer), continuing from `crc`."""
    got = native.crc32c(data, crc)
    if got is not None:
        return got
    import google_crc32c

    return google_crc32c.extend(crc, _as_array(data)) if crc else google_crc32c.value(_as_array(data))


def block_crcs(data, first: int, block: int, expected=None) -> Any:
    """CRC32C of consecutive blocks of `data` (the first `first` bytes, then `block` each).

    Without `expected`: numpy uint32, one per block. With it: the index of the first block
    whose CRC differs from `expected`, or -1.
    """
    got = native.crc32c_blocks(data, first, block, expected)
    if got is not None:
        return got
    view = memoryview(data).cast("B")
    bounds = _block_bounds(len(view), first, block)
    sums = np.fromiter((crc32c(view[lo:hi]) for lo, hi in bounds), np.uint32, len(bounds))
    if expected is None:
        return sums
    bad = np.nonzero(sums != np.asarray(expected, np.uint32)[: len(sums)])[0]
    return int(bad[0]) if bad.size else -1


def _block_bounds(n: int, first: int, block: int) -> list[tuple[int, int]]:
    if n <= 0:
        return []
    edges = [0, *range(min(first, n), n, block), n]
    return list(itertools.pairwise(edges))


def _as_array(data) -> np.ndarray:
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


def sums_name(name: str) -> str:
    """The companion tensor that holds `name`'s block CRCs."""
    return name + SUMS_SUFFIX


def n_blocks(start: int, nbytes: int, block: int) -> int:
    """Blocks of the absolute grid that bytes [start, start + nbytes) touch."""
    return 0 if nbytes <= 0 else (start + nbytes - 1) // block - start // block + 1


def n_chunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


class BlockSummer:
    """CRC32C of every block of one tensor's bytes as they stream past in any-sized writes.

    Args:
        start: the tensor's first byte's absolute offset in the file (blocks are on the file's grid).
        nbytes: the tensor's size.
        block: bytes per block.
    """

    def __init__(self, start: int, nbytes: int, block: int):
        self.block = block
        self.first = block - start % block
        self.sums = np.zeros(n_blocks(start, nbytes, block), np.uint32)
        self._k = 0
        self._crc = 0
        self._fill = 0

    def _need(self) -> int:
        return self.first if self._k == 0 else self.block

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if self._fill:
            take = min(len(view), self._need() - self._fill)
            self._crc = crc32c(view[:take], self._crc)
            self._fill += take
            view = view[take:]
            if self._fill < self._need():
                return
            self._emit(self._crc)
        need = self._need()
        if len(view) >= need:
            whole = need + (len(view) - need) // self.block * self.block
            sums = block_crcs(view[:whole], need, self.block)
            self.sums[self._k : self._k + len(sums)] = sums
            self._k += len(sums)
            view = view[whole:]
        if len(view):
            self._crc, self._fill = crc32c(view), len(view)

    def _emit(self, crc: int) -> None:
        self.sums[self._k] = crc
        self._k += 1
        self._crc = self._fill = 0

    def finish(self) -> np.ndarray:
        """Every block's CRC; a partial last block counts as a block."""
        if self._fill:
            self._emit(self._crc)
        if self._k != len(self.sums):
            raise ValueError(f"{self._k} of {len(self.sums)} blocks written")
        return self.sums


class ChunkHasher:
    """sha256 of consecutive `chunk_bytes` pieces of one byte stream, fed in any-sized writes (chunk digests)."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.digests: list[str] = []
        self._h = hashlib.new(DIGEST_ALGO)
        self._filled = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.chunk_bytes - self._filled)
            self._h.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._emit()

    def _emit(self) -> None:
        self.digests.append(self._h.hexdigest())
        self._h = hashlib.new(DIGEST_ALGO)
        self._filled = 0

    def finish(self) -> list[str]:
        """All digests; a partial last chunk counts as a chunk."""
        if self._filled:
            self._emit()
        return self.digests


# --------------------------------------------------------------------------- records
def header_digest(metadata: Mapping[str, str], tensors: Mapping[str, tuple[str, list[int], int, int]]) -> str:
    """sha256 of the header's content except the ``integrity`` key itself.

    Args:
        tensors: {name: (safetensors dtype name, shape, begin, end)}.
    """
    canon = {
        "metadata": {k: v for k, v in sorted(metadata.items()) if k != KEY},
        "tensors": {k: [v[0], list(v[1]), int(v[2]), int(v[3])] for k, v in sorted(tensors.items())},
    }
    return hashlib.sha256(json.dumps(canon, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def placeholder_digests(sizes: Mapping[str, int], chunk_bytes: int, header: str) -> dict[str, Any]:
    """A chunk-digest record before any byte is written: every digest zero."""
    return {
        "algo": DIGEST_ALGO,
        "chunk_bytes": chunk_bytes,
        "header": header,
        "tensors": {name: [_EMPTY] * n_chunks(n, chunk_bytes) for name, n in sizes.items()},
    }


def placeholder_crcs(names: Iterable[str], block_bytes: int, header: str) -> dict[str, Any]:
    """A block-CRC record before any byte is written: every companion tensor's sha256 zero."""
    names = list(names)
    return {
        "algo": CRC_ALGO,
        "block_bytes": block_bytes,
        "header": header,
        "sums": {n: sums_name(n) for n in names},
        "sums_sha256": {sums_name(n): _EMPTY for n in names},
    }


def encode(record: Mapping[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"))


def parse(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The integrity record of a header (None when the file has none); raises `IntegrityMismatch` when malformed."""
    raw = metadata.get(KEY)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        ok = isinstance(record, dict) and isinstance(record.get("header"), str)
        if ok and record.get("algo") == DIGEST_ALGO:
            ok = (
                isinstance(record["chunk_bytes"], int)
                and record["chunk_bytes"] > 0
                and isinstance(record["tensors"], dict)
            )
        elif ok and record.get("algo") == CRC_ALGO:
            ok = (
                isinstance(record["block_bytes"], int)
                and record["block_bytes"] > 0
                and record["block_bytes"] % BLOCK_BYTES == 0
                and isinstance(record["sums"], dict)
                and isinstance(record["sums_sha256"], dict)
            )
        else:
            ok = False
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise IntegrityMismatch("its integrity record is malformed")
    return record


def has_block_crcs(record: Mapping[str, Any] | None) -> bool:
    return record is not None and record["algo"] == CRC_ALGO


def check_header(
    record: Mapping[str, Any], metadata: Mapping[str, str], tensors: Mapping[str, tuple[str, list[int], int, int]]
) -> None:
    """Raise `IntegrityMismatch` for an incomplete write or a header that differs from the one written."""
    digests = (
        record["sums_sha256"].values()
        if has_block_crcs(record)
        else (d for ds in record["tensors"].values() for d in ds)
    )
    if any(d == _EMPTY for d in digests):
        raise IntegrityMismatch("it is an incomplete write (a temp file of an interrupted write, or a copy of one)")
    if record["header"] != header_digest(metadata, tensors):
        raise IntegrityMismatch("its header does not match its recorded sha256: the header is corrupted")
    if has_block_crcs(record):
        sums = set(record["sums"].values())
        for name, (dtype, shape, begin, end) in tensors.items():
            if name in sums:
                continue
            s = record["sums"].get(name)
            if s is None or s not in tensors or s not in record["sums_sha256"]:
                raise IntegrityMismatch(f"tensor {name!r} has no block CRCs")
        return
    for name, (_, _, begin, end) in tensors.items():
        digests = record["tensors"].get(name)
        if digests is None or len(digests) != n_chunks(end - begin, record["chunk_bytes"]):
            raise IntegrityMismatch(f"tensor {name!r} has no chunk hashes of the right count")


def check_digest(name: str, data, expected: str) -> None:
    """Raise `IntegrityMismatch` unless the sha256 of `data` is `expected` (a companion tensor of CRCs)."""
    if hashlib.sha256(memoryview(data).cast("B")).hexdigest() != expected:
        raise IntegrityMismatch(
            f"tensor {name!r} (block CRCs) does not match its recorded sha256: the file is corrupted"
        )


# --------------------------------------------------------------------------- checked reads
@dataclass(frozen=True)
class TensorChecks:
    """How one tensor's bytes are checked: where they lie, their grid of blocks, the recorded values.

    Attributes:
        name: the tensor, for messages.
        start, nbytes: its bytes in the file (absolute offsets).
        block: bytes per block (CRC32C) or chunk (sha256).
        phase: where the grid starts: 0 for block CRCs (the file's grid), `start` for chunk digests.
        crcs: uint32 [blocks] for block CRCs, else None.
        digests: hex sha256 per chunk for chunk digests, else None.
    """

    name: str
    start: int
    nbytes: int
    block: int
    phase: int
    crcs: np.ndarray | None = None
    digests: Sequence[str] | None = None

    @property
    def kind(self) -> str:
        return CRC_ALGO if self.crcs is not None else DIGEST_ALGO

    @property
    def first(self) -> int:
        """Bytes of the first block."""
        return min(self.nbytes, self.block - (self.start - self.phase) % self.block)

    @property
    def count(self) -> int:
        return len(self.crcs) if self.crcs is not None else len(self.digests)

    def index(self, pos: int) -> int:
        """The block holding absolute offset `pos` (inside the tensor)."""
        return (pos - self.phase) // self.block - (self.start - self.phase) // self.block

    def bounds(self, k: int) -> tuple[int, int]:
        """Absolute [lo, hi) of block `k`."""
        base = (self.start - self.phase) // self.block + k
        lo = max(self.start, self.phase + base * self.block)
        return lo, min(self.start + self.nbytes, self.phase + (base + 1) * self.block)

    def check(self, k: int, data) -> None:
        """Compare blocks k, k+1, ... whose bytes `data` holds exactly.

        Raises `IntegrityMismatch` naming the first bad block."""
        view = memoryview(data).cast("B")
        if self.crcs is not None:
            first = self.bounds(k)[1] - self.bounds(k)[0]
            bad = block_crcs(view, first, self.block, self.crcs[k:])
            if bad >= 0:
                raise self.mismatch(k + bad)
            return
        while len(view):
            lo, hi = self.bounds(k)
            if hashlib.sha256(view[: hi - lo]).hexdigest() != self.digests[k]:
                raise self.mismatch(k)
            view = view[hi - lo :]
            k += 1

    def mismatch(self, k: int) -> IntegrityMismatch:
        lo, hi = self.bounds(k)
        what = "block" if self.crcs is not None else "chunk"
        return IntegrityMismatch(
            f"tensor {self.name!r}, {what} {k} (file bytes {lo:,}..{hi:,}) does not match its "
            f"recorded {self.kind.upper()}: the file is corrupted"
        )


def pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` with the file's bytes from `offset`; `FileChanged` when the file ends first."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise FileChanged(
                f"it ends at byte {offset + got:,}, before bytes it held when it was opened: it was "
                "truncated or rewritten since"
            )
        got += n


def read_checked(fd: int, checks: TensorChecks | None, a: int, b: int, out: memoryview) -> None:
    """Absolute bytes [a, b) of one tensor into `out` (writable, b - a bytes), every block checked.

    Whole blocks inside [a, b) are read straight into `out` and checked there; a block that
    [a, b) cuts is read whole into a scratch buffer, checked, and its part copied. With
    `checks` None the bytes are only read (what a benchmark compares against).
    """
    if b <= a:
        return
    if checks is None:
        pread_into(fd, out[: b - a], a)
        return
    k_lo, k_hi = checks.index(a), checks.index(b - 1)
    full_lo = k_lo if checks.bounds(k_lo)[0] == a else k_lo + 1
    full_hi = k_hi if checks.bounds(k_hi)[1] == b else k_hi - 1
    if full_lo <= full_hi:
        lo, hi = checks.bounds(full_lo)[0], checks.bounds(full_hi)[1]
        pread_into(fd, out[lo - a : hi - a], lo)
        checks.check(full_lo, out[lo - a : hi - a])
    for k in sorted({k_lo, k_hi} - set(range(full_lo, full_hi + 1))):
        lo, hi = checks.bounds(k)
        scratch = memoryview(bytearray(hi - lo))
        pread_into(fd, scratch, lo)
        checks.check(k, scratch)
        s, e = max(lo, a), min(hi, b)
        out[s - a : e - a] = scratch[s - lo : e - lo]


def pieces(checks: TensorChecks | None, a: int, b: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """[a, b) cut into pieces of about `piece_bytes` whose inner edges lie on block edges (no block read twice)."""
    step = piece_bytes if checks is None else max(1, piece_bytes // checks.block) * checks.block
    phase = 0 if checks is None else checks.phase
    edges = [a]
    nxt = phase + ((a - phase) // step + 1) * step
    while nxt < b:
        edges.append(nxt)
        nxt += step
    edges.append(b)
    return list(itertools.pairwise(edges))


def parallel(jobs: Sequence[Callable[[], int]], threads: int, progress: Callable[[int], None] | None = None) -> None:
    """Run `jobs` (each returns the bytes it handled, for `progress`) on `threads` threads.

    The first error is raised."""
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            done = job()
            if progress is not None:
                progress(done)
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="condmem-check") as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            for f in futures:
                done = f.result()
                if progress is not None:
                    progress(done)
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def default_threads() -> int:
    """Threads that read and check a table: one per core, at most 32."""
    return max(1, min(32, os.cpu_count() or 1))
