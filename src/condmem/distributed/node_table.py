"""One host copy of a table per node, shared by the node's ranks.

Local rank 0 creates ``/dev/shm/<name>`` (its space checked and reserved first), fills it,
and only then writes ``<name>.ready`` holding the table's fingerprint and size; the other
local ranks wait at a barrier and map the file read-only (a write through their mapping is
a segmentation fault, never a change). The file outlives its writer so that restarted
ranks can map it; `remove_node_table` deletes it. A writer killed while filling leaves no ``.ready``:
readers refuse the file instead of serving half a table. A reader that dies changes
nothing; a restarted one maps the same file again. Ranks must agree on the fingerprint
(the layout and tokenizer the rows were made for), checked before anything is written.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from condmem.tables.host_memory import HostBuffer, HostMemoryError, allocate_host

SHM = Path("/dev/shm")


class NodeTableError(ValueError):
    """The shared table cannot be set up: ranks disagree, /dev/shm is too small, the file is incomplete."""


def _shm_hint(nbytes: int) -> str:
    return (
        f"{nbytes / 2**30:.2f} GiB asked. Containers give /dev/shm 64 MiB by default: start them with "
        f"--shm-size={max(1, -(-nbytes // 2**30))}g (docker) or mount a larger tmpfs there, or use "
        "per_rank=True (one private copy per rank)"
    )


def node_shared_table(
    name: str,
    nbytes: int,
    fill: Callable[[torch.Tensor], None],
    *,
    fingerprint: str,
    local_rank: int,
    group=None,
    per_rank: bool = False,
) -> HostBuffer:
    """The node's copy of a table: written once by local rank 0, mapped read-only by the others.

    Args:
        name: file name under /dev/shm (one per table and layer).
        nbytes: table size in bytes.
        fill: writes the table into the uint8 tensor it is given (rank 0 only).
        fingerprint: what the rows were made for (layout + tokenizer); all ranks must agree.
        local_rank: this process's rank on its node (``LOCAL_RANK`` under torchrun).
        group: a process group of the node's ranks (default: the world, one node).
        per_rank: every rank builds its own private copy instead (no /dev/shm).

    Returns:
        A `HostBuffer`; on readers its tensor is a read-only mapping.
    """
    fingerprints = [None] * dist.get_world_size(group)
    dist.all_gather_object(fingerprints, (fingerprint, nbytes), group=group)
    if len(set(fingerprints)) != 1:
        detail = ", ".join(f"rank {r}: {f[0][:16]} ({f[1]:,} B)" for r, f in enumerate(fingerprints))
        raise NodeTableError(f"ranks disagree on the table {name!r} (fingerprint, size): {detail}")
    if per_rank:
        buf = allocate_host(nbytes, "mmap_register")
        fill(buf.tensor)
        return buf
    path, ready = SHM / name, SHM / f"{name}.ready"
    failure = None
    buf = None
    if local_rank == 0:
        try:
            ready.unlink(missing_ok=True)
            path.unlink(missing_ok=True)  # a stale or half-written copy from an earlier run
            buf = allocate_host(nbytes, "shared", shared_name=name, persist=True)
            fill(buf.tensor)
            buf._mmap.flush()
            tmp = SHM / f".{name}.ready.{os.getpid()}"
            tmp.write_text(json.dumps({"fingerprint": fingerprint, "nbytes": nbytes}))
            os.replace(tmp, ready)
        except HostMemoryError as exc:
            failure = f"{exc}; {_shm_hint(nbytes)}"
        except OSError as exc:
            failure = f"writing {path} failed ({exc}); {_shm_hint(nbytes)}"
    failures = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, failure, group=group)
    bad = next((f for f in failures if f), None)
    if bad:
        raise NodeTableError(f"the node's shared table {name!r} could not be written: {bad}")
    if local_rank == 0:
        return buf
    return map_shared_table(name, nbytes, fingerprint)


def map_shared_table(name: str, nbytes: int, fingerprint: str) -> HostBuffer:
    """Map an existing, complete node table read-only (what a non-writer or a restarted rank does)."""
    path, ready = SHM / name, SHM / f"{name}.ready"
    if not ready.is_file():
        raise NodeTableError(
            f"{path} is not complete (no {ready.name}): its writer did not finish; restart the writer (local rank 0)"
        )
    meta = json.loads(ready.read_text())
    if meta.get("fingerprint") != fingerprint or meta.get("nbytes") != nbytes:
        raise NodeTableError(
            f"{path} holds another table ({meta}); expected fingerprint {fingerprint[:16]}, {nbytes:,} bytes"
        )
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise NodeTableError(f"{path} has {os.fstat(fd).st_size:,} bytes, expected {nbytes:,}")
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch notes the buffer is read-only: that is the point
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
    return HostBuffer(tensor, "shared", pinned=False, _mmap=mm)


def remove_node_table(name: str) -> None:
    """Delete a node table and its ``.ready`` file (mappings still open stay valid until closed)."""
    (SHM / f"{name}.ready").unlink(missing_ok=True)
    (SHM / name).unlink(missing_ok=True)
