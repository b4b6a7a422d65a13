"""The decode row server (``row_server.c``): host threads that gather a step's Engram rows from
host tables into small staging buffers when a flag in host memory asks for them.

The GPU side of the handshake (ids copied in, ``request`` raised, ``done[l]`` waited for and
lowered) is `condmem.serving.staged_fetch`; this module owns the threads and the host buffers
they share with the GPU: the flags, the ids and the staging rows, page-locked (and so mapped
for the GPU) when CUDA is available. Without the native library there is no server
(`RowServerError`).

    server = RowServer([table0, table1], n_ids=3072, threads=4)    # uint8 [rows, row_bytes] tables
    server.start()
    ... the GPU (or a test) writes server.ids, sets server.request[0] = 1, waits for server.done
    server.close()
"""

from __future__ import annotations

import ctypes

import torch

from condmem import native

MAX_LAYERS = 16
MAX_THREADS = 64
SPIN_MS = 20.0
"""How long the threads spin after a request before they nap (20 us naps): decode steps of
a wave come every few ms, and a napping thread would add its wake-up to every step."""


class RowServerError(RuntimeError):
    """The server cannot run, or it was handed ids outside a table."""


class _Server(ctypes.Structure):
    """Mirror of ``condmem_row_server`` (checked against ``condmem_row_server_size``)."""

    _fields_ = [
        ("request", ctypes.c_void_p),
        ("done", ctypes.c_void_p),
        ("ids", ctypes.c_void_p),
        ("n_ids", ctypes.c_int64),
        ("n_layers", ctypes.c_int32),
        ("n_threads", ctypes.c_int32),
        ("src", ctypes.c_void_p * MAX_LAYERS),
        ("dst", ctypes.c_void_p * MAX_LAYERS),
        ("row_bytes", ctypes.c_int64 * MAX_LAYERS),
        ("num_rows", ctypes.c_int64 * MAX_LAYERS),
        ("spin_ns", ctypes.c_int64),
        ("steps", ctypes.c_int64),
        ("bad_ids", ctypes.c_int64),
        ("busy_ns", ctypes.c_int64),
        ("max_ns", ctypes.c_int64),
        ("stop", ctypes.c_int32),
        ("generation", ctypes.c_int64),
        ("next_piece", ctypes.c_int64),
        ("pieces_done", ctypes.c_int64 * MAX_LAYERS),
        ("pieces_per_layer", ctypes.c_int64),
        ("started", ctypes.c_int64),
        ("threads", ctypes.c_ulong * MAX_THREADS),
    ]


class RowServer:
    """Host threads serving one decode step's rows of every layer at a time.

    Args:
        tables: each layer's raw rows, uint8 [rows, row_bytes] on the CPU, contiguous (page-
            locked, memory-mapped or plain: the CPU reads them).
        n_ids: row ids per layer a step (the decode graph's slots x columns).
        threads: the team gathering the rows (one of them also watches the flag).
        spin_ms: how long the team spins after a request before napping.

    Attributes (host tensors the GPU reads and writes through their mapped addresses):
        request: int32 [1]; 1 asks for the rows of the ids in `ids`.
        done: int32 [layers]; the server sets layer l's to 1 once its rows are in `staging[l]`.
        ids: int64 [layers, n_ids].
        staging: per layer, uint8 [n_ids, row_bytes].
    """

    def __init__(self, tables: list[torch.Tensor], n_ids: int, *, threads: int = 4, spin_ms: float = SPIN_MS):
        lib = native.library()
        if lib is None:
            raise RowServerError(
                f"the decode row server needs condmem's native library, which is unavailable ({native.build().reason})"
            )
        if lib.condmem_row_server_size() != ctypes.sizeof(_Server):
            raise RowServerError("row_server.c and its Python mirror disagree on the struct's size: rebuild")
        if not 1 <= len(tables) <= MAX_LAYERS:
            raise ValueError(f"a row server serves 1 to {MAX_LAYERS} tables, got {len(tables)}")
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be in 1..{MAX_THREADS}, got {threads}")
        if n_ids < 1:
            raise ValueError(f"n_ids must be positive, got {n_ids}")
        for i, t in enumerate(tables):
            if t.device.type != "cpu" or t.dtype != torch.uint8 or t.dim() != 2 or not t.is_contiguous():
                raise ValueError(
                    f"table {i} must be a contiguous uint8 [rows, row_bytes] CPU tensor, got "
                    f"{t.dtype} {tuple(t.shape)} on {t.device}"
                )
        self._lib = lib
        self.tables = list(tables)
        self.n_ids, self.threads = int(n_ids), int(threads)
        pin = torch.cuda.is_available()  # page-locked = mapped for the GPU (unified addressing)
        self.request = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self.done = torch.zeros(len(tables), dtype=torch.int32, pin_memory=pin)
        self.ids = torch.zeros(len(tables), n_ids, dtype=torch.int64, pin_memory=pin)
        self.staging = [torch.zeros(n_ids, t.shape[1], dtype=torch.uint8, pin_memory=pin) for t in tables]
        s = self._struct = _Server()
        s.request, s.done, s.ids = self.request.data_ptr(), self.done.data_ptr(), self.ids.data_ptr()
        s.n_ids, s.n_layers, s.n_threads = self.n_ids, len(tables), self.threads
        for i, (t, out) in enumerate(zip(tables, self.staging)):
            s.src[i], s.dst[i] = t.data_ptr(), out.data_ptr()
            s.row_bytes[i], s.num_rows[i] = t.shape[1], t.shape[0]
        s.spin_ns = int(spin_ms * 1e6)
        self._running = False
        self._checked_bad = 0

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> RowServer:
        if not self._running:
            rc = self._lib.condmem_row_server_start(ctypes.byref(self._struct))
            if rc:
                raise RowServerError(f"could not start the row server's {self.threads} threads (code {rc})")
            self._running = True
        return self

    def stop(self) -> None:
        """Stop the threads (a step in progress is finished first). Only once the GPU waits for
        no more rows: a graph waiting for a flag nobody raises never ends."""
        if self._running:
            self._lib.condmem_row_server_stop(ctypes.byref(self._struct))
            self._running = False

    close = stop

    def __enter__(self) -> RowServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):  # the threads read this object's buffers: never outlive them
        try:
            self.stop()
        except Exception:
            pass

    def stats(self) -> dict:
        """Steps served, ids outside their table, and the host time per step (request seen ->
        last layer staged): mean and max in microseconds."""
        s = self._struct
        steps = s.steps
        return {
            "steps": steps,
            "bad_ids": s.bad_ids,
            "threads": self.threads,
            "mean_us": s.busy_ns / steps / 1e3 if steps else 0.0,
            "max_us": s.max_ns / 1e3,
        }

    def check(self) -> None:
        """Raise `RowServerError` if ids outside a table were asked for since the last check
        (their rows were served as zeros)."""
        bad = self._struct.bad_ids
        if bad > self._checked_bad:
            new, self._checked_bad = bad - self._checked_bad, bad
            raise RowServerError(
                f"{new} row id(s) outside their table were asked for (served as zero rows); "
                f"tables have {[t.shape[0] for t in self.tables]} rows"
            )
