"""Host memory from the CUDA virtual memory API: page-locked DRAM the GPU maps with large pages.

Why: zero-copy gathers from a large pinned table are bound by the GPU's address translation,
~37 ns per translation granule touched (measured on the H200: 64 KiB granules for memory
pinned with ``cudaHostRegister`` / ``cudaHostAlloc``; the host's own huge pages do not
change the GPU's page size). ``cuMemCreate`` with a host location allocates page-locked
DRAM in chunks of the allocation granularity (2 MiB or more), and ``cuMemMap`` maps it
into the unified address space in those chunks, so the GPU may use correspondingly large
pages: a 64 GiB table is then 32K translations instead of 1M.

The mapping is made accessible to the GPU and to the CPU (``cuMemSetAccess`` with a host
location), so one address serves the zero-copy kernel, the CPU gather threads and the
DMA engine. The driver API is reached through ``ctypes`` (``libcuda.so.1``, which every
CUDA install has), after PyTorch has made the device's primary context current.

Needs a driver with host-located VMM allocations (CUDA 12.2+); `VmmHostError` names what
failed otherwise, and callers fall back to ``mmap_register``.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger("condmem.tables")

# CUmemLocationType, CUmemAllocationType, CUmemAccess_flags, CUmemAllocationGranularity_flags.
_LOC_DEVICE, _LOC_HOST, _LOC_HOST_NUMA = 1, 2, 3
_ALLOC_PINNED = 1
_ACCESS_READWRITE = 3
_GRANULARITY_MINIMUM, _GRANULARITY_RECOMMENDED = 0, 1


class VmmHostError(RuntimeError):
    """A host-located CUDA VMM allocation failed (old driver, not enough memory, no CUDA)."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        if not torch.cuda.is_available():
            raise VmmHostError("host VMM allocations need CUDA")
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise VmmHostError(f"cannot load the CUDA driver library: {exc}") from None
        # The runtime creates the primary context lazily; the driver calls below use it.
        torch.zeros(1, device="cuda")
    return _lib


def _check(code: int, what: str) -> None:
    if code == 0:
        return
    msg = ctypes.c_char_p()
    _driver().cuGetErrorString(code, ctypes.byref(msg))
    text = msg.value.decode() if msg.value else "unknown error"
    raise VmmHostError(f"{what} failed: CUDA driver error {code} ({text})")


def driver_version() -> int:
    """The CUDA driver's version (e.g. 12080 for 12.8)."""
    v = ctypes.c_int()
    _check(_driver().cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
    return v.value


def _prop(numa: bool) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOC_PINNED
    prop.location = _Location(_LOC_HOST_NUMA if numa else _LOC_HOST, 0)
    return prop


def host_granularity(numa: bool = True, recommended: bool = True) -> int:
    """Allocation granularity in bytes of a host-located VMM allocation."""
    g = ctypes.c_size_t()
    flag = _GRANULARITY_RECOMMENDED if recommended else _GRANULARITY_MINIMUM
    _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(_prop(numa)), flag),
           "cuMemGetAllocationGranularity")
    return g.value


class _Mapping:
    """Owns one mapped VMM allocation; unmaps and frees it when the last tensor viewing it is gone.

    Held only by the ctypes array that `torch.frombuffer` keeps alive, so no view can outlive
    the memory it reads (freeing explicitly while a view exists would leave a dangling pointer).
    """

    def __init__(self, address: int, size: int, handle: int):
        self.address, self.size, self.handle = address, size, handle

    def __del__(self) -> None:
        try:
            lib = _driver()
            lib.cuMemUnmap(ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
            lib.cuMemRelease(ctypes.c_uint64(self.handle))
            lib.cuMemAddressFree(ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
        except Exception:  # interpreter shutdown: the process exit frees it
            pass


def allocate_vmm_host(nbytes: int, granularity: int | None = None) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` bytes of page-locked host memory, mapped for the GPU and the
    CPU at one address; the memory is freed when the last view of the tensor is gone.

    `granularity`: the mapping's chunk size (default: the driver's recommended granularity
    for host allocations; the size is rounded up to a multiple of it).
    """
    lib = _driver()
    numa = True
    try:
        gran = granularity or host_granularity(numa=True)
    except VmmHostError:
        numa = False
        gran = granularity or host_granularity(numa=False)
    size = -(-nbytes // gran) * gran
    handle = ctypes.c_uint64()
    _check(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(_prop(numa)),
                           ctypes.c_ulonglong(0)), f"cuMemCreate of {size / 2**30:.2f} GiB of host memory")
    ptr = ctypes.c_uint64()
    try:
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(gran),
                                       ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        _check(lib.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)),
               "cuMemMap")
        access = (_AccessDesc * 2)()
        access[0] = _AccessDesc(_Location(_LOC_DEVICE, torch.cuda.current_device()), _ACCESS_READWRITE)
        access[1] = _AccessDesc(_Location(_LOC_HOST_NUMA if numa else _LOC_HOST, 0), _ACCESS_READWRITE)
        _check(lib.cuMemSetAccess(ptr, ctypes.c_size_t(size), access, ctypes.c_size_t(2)),
               "cuMemSetAccess (GPU + CPU)")
    except VmmHostError:
        lib.cuMemRelease(handle)
        raise
    view = (ctypes.c_uint8 * nbytes).from_address(ptr.value)
    view._owner = _Mapping(ptr.value, size, handle.value)
    tensor = torch.frombuffer(view, dtype=torch.uint8)
    log.info("host VMM allocation: %.2f GiB at 0x%x, granularity %d KiB (%s)", size / 2**30, ptr.value,
             gran // 1024, "NUMA node 0" if numa else "host")
    return tensor
