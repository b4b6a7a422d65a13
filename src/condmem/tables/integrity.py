"""Integrity of table files: a sha256 per fixed-size chunk of every tensor, and one over the header.

A flipped bit in a table's rows would otherwise be served as a row, silently. The
writer hashes each tensor's bytes in ``chunk_bytes`` pieces as they stream past
(`ChunkHasher`: no second read) and records, in the header metadata key ``integrity``:

    {"algo": "sha256", "chunk_bytes": N, "header": <sha256 of the rest of the header>,
     "tensors": {name: [<sha256 of chunk 0>, ...]}}

The header is written first with all-zero digests of the same length and rewritten in
place when the last byte is in, so a temp file of an interrupted write is recognizably
incomplete. Readers check the header digest at open, a few random chunks per tensor
(`verify_chunks` with ``sample``), or every chunk (``condmem inspect --verify``); a
streaming reader checks what it consumes (`ChunkVerifier`).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Iterable, Mapping

from condmem.utils.progress import Progress

KEY = "integrity"
ALGO = "sha256"
DEFAULT_CHUNK_BYTES = 16 * 2**20
_EMPTY = "0" * 64


class IntegrityMismatch(Exception):
    """Raised inside this module; callers turn it into their own error type."""


def header_digest(metadata: Mapping[str, str], tensors: Mapping[str, tuple[str, list[int], int, int]]) -> str:
    """sha256 of the header's content except the ``integrity`` key itself.

    Args:
        tensors: {name: (safetensors dtype name, shape, begin, end)}.
    """
    canon = {"metadata": {k: v for k, v in sorted(metadata.items()) if k != KEY},
             "tensors": {k: [v[0], list(v[1]), int(v[2]), int(v[3])] for k, v in sorted(tensors.items())}}
    return hashlib.sha256(json.dumps(canon, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def n_chunks(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def placeholder(sizes: Mapping[str, int], chunk_bytes: int, header: str) -> dict[str, Any]:
    """The integrity record before any byte is written: every chunk digest zero."""
    return {"algo": ALGO, "chunk_bytes": chunk_bytes, "header": header,
            "tensors": {name: [_EMPTY] * n_chunks(n, chunk_bytes) for name, n in sizes.items()}}


def encode(record: Mapping[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"))


class ChunkHasher:
    """sha256 of consecutive `chunk_bytes` pieces of one byte stream, fed in any-sized writes."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.digests: list[str] = []
        self._h = hashlib.new(ALGO)
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
        self._h = hashlib.new(ALGO)
        self._filled = 0

    def finish(self) -> list[str]:
        """All digests; a partial last chunk counts as a chunk."""
        if self._filled:
            self._emit()
        return self.digests


class ChunkVerifier(ChunkHasher):
    """A `ChunkHasher` that compares each chunk with its recorded digest as soon as it is complete."""

    def __init__(self, name: str, expected: list[str], chunk_bytes: int):
        super().__init__(chunk_bytes)
        self.name = name
        self.expected = expected

    def _emit(self) -> None:
        k = len(self.digests)
        super()._emit()
        if k >= len(self.expected) or self.digests[k] != self.expected[k]:
            raise IntegrityMismatch(f"tensor {self.name!r}, chunk {k} (bytes {k * self.chunk_bytes}.."
                                    f"{(k + 1) * self.chunk_bytes}) does not match its recorded sha256: the file is "
                                    "corrupted")


def parse(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The integrity record of a header (None when the file has none); raises `IntegrityMismatch` when malformed."""
    raw = metadata.get(KEY)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        ok = (record["algo"] == ALGO and isinstance(record["chunk_bytes"], int) and record["chunk_bytes"] > 0
              and isinstance(record["header"], str) and isinstance(record["tensors"], dict))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise IntegrityMismatch("its integrity record is malformed")
    return record


def check_header(record: Mapping[str, Any], metadata: Mapping[str, str],
                 tensors: Mapping[str, tuple[str, list[int], int, int]]) -> None:
    """Raise `IntegrityMismatch` for an incomplete write or a header that differs from the one written."""
    if any(d == _EMPTY for digests in record["tensors"].values() for d in digests):
        raise IntegrityMismatch("it is an incomplete write (a temp file of an interrupted write, or a copy of one)")
    if record["header"] != header_digest(metadata, tensors):
        raise IntegrityMismatch("its header does not match its recorded sha256: the header is corrupted")
    for name, (_, _, begin, end) in tensors.items():
        digests = record["tensors"].get(name)
        if digests is None or len(digests) != n_chunks(end - begin, record["chunk_bytes"]):
            raise IntegrityMismatch(f"tensor {name!r} has no chunk hashes of the right count")


def verify_chunks(buffer, spans: Mapping[str, tuple[int, int]], record: Mapping[str, Any], sample: int | None = None,
                  progress: bool = False, label: str = "verify") -> int:
    """Hash chunks of `buffer` (a mapping of the whole file) and compare; returns the bytes checked.

    Args:
        spans: {tensor name: (absolute start, nbytes)}.
        sample: chunks checked per tensor, chosen at random (None: every chunk).
    """
    size = record["chunk_bytes"]
    plan: list[tuple[str, int]] = []
    for name, (start, nbytes) in spans.items():
        chunks = range(n_chunks(nbytes, size))
        picked: Iterable[int] = chunks if sample is None or sample >= len(chunks) else \
            sorted(random.sample(chunks, sample))
        plan.extend((name, k) for k in picked)
    total = sum(min(size, spans[n][1] - k * size) for n, k in plan)
    bar = Progress(total, label, enabled=progress, unit="B", unit_scale=True)
    view = memoryview(buffer)
    try:
        for name, k in plan:
            start, nbytes = spans[name]
            lo, hi = start + k * size, start + min(nbytes, (k + 1) * size)
            if hashlib.new(ALGO, view[lo:hi]).hexdigest() != record["tensors"][name][k]:
                raise IntegrityMismatch(f"tensor {name!r}, chunk {k} (bytes {k * size}..{min(nbytes, (k + 1) * size)}) "
                                        "does not match its recorded sha256: the file is corrupted")
            bar.update(hi - lo)
    finally:
        view.release()
        bar.close()
    return total
