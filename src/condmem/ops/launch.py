"""Launching our Triton kernels at the cost of the launch: the eager hot path (hash, gate, gather).

``kernel[grid](*args)`` spends tens of microseconds of host time before the GPU sees the
kernel: Triton binds the arguments by name, specializes each one, formats a cache key,
re-reads the kernel's globals, builds launch metadata and calls the launch hooks. Our small
kernels run for a few microseconds, so an eager call was host-bound several times over.

`FastLaunch` keeps what Triton's launch returns (its ``CompiledKernel``) under a key we
compute ourselves, and later calls with the same key go straight to the compiled kernel's
launcher with the calling convention of ``JITFunction.run`` (Triton 3.6 to 3.9 alike)::

    compiled.run(grid0, grid1, grid2, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, enter_hook, exit_hook, *every_argument)

The key holds everything a compiled kernel is specialized on (`_key`): each scalar's type;
a tensor's dtype and whether its address is a multiple of 16; an int's ``== 1`` (Triton
makes it a constant), its divisibility by 16 and its width (i32, i64, u64); the constexprs'
values and types; ``num_warps``; the current device; and the Triton knobs that enter its
compile options. Floats are specialized on their type only. A key may split what Triton
would share (``do_not_specialize`` arguments still enter it): that costs one more normal
launch, never a wrong kernel.

The normal launch is used instead where the shortcut cannot be shown equal: in the
interpreter (``TRITON_INTERPRET=1``), on a Triton version whose launch was not read (outside
3.6 to 3.9) or whose objects lack what the shortcut calls, while a launch hook, pre-run hook
or stage-inspection hook is set (profilers such as proton), and for arguments of other types
than tensors, ints, floats, bools and None. ``CONDMEM_FAST_LAUNCH=0`` (read at the first launch) turns
the shortcut off everywhere.
"""

from __future__ import annotations

import operator
import os

import torch

_KNOWN_VERSIONS = ((3, 6), (3, 7), (3, 8), (3, 9))  # read: jit.py run(), CompiledKernel, the CUDA launcher
# Triton knobs JITFunction.run folds into the compile options on every launch (those a version lacks are left out).
_KNOB_NAMES = ("runtime.debug", "compilation.instrumentation_mode", "compilation.fpsan_homomorphic_casts")
_MAX_ENTRIES = 512  # compiled kernels kept per launcher; past that (a key driven by shapes) the cache starts over


def _version(text: str) -> tuple[int, int]:
    try:
        major, minor = text.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def _has(obj, dotted: str) -> bool:
    try:
        operator.attrgetter(dotted)(obj)
    except AttributeError:
        return False
    return True


class Runtime:
    """What the shortcut reads besides the compiled kernel: Triton's knobs, the current device and stream."""

    __slots__ = ("device", "inspects", "knob_values", "knobs", "stream")

    def __init__(self, knobs, device, stream):
        self.knobs = knobs
        self.knob_values = operator.attrgetter(*[n for n in _KNOB_NAMES if _has(knobs, n)])
        self.inspects = _has(knobs, "runtime.add_stages_inspection_hook")
        self.device = device
        self.stream = stream

    def hooks_set(self, kernel) -> bool:
        """A hook Triton's own launch would call (a profiler's, e.g. proton): then only the normal launch runs."""
        runtime = self.knobs.runtime
        try:  # launch hooks are HookChains, empty when unused
            return bool(
                runtime.launch_enter_hook.calls
                or runtime.launch_exit_hook.calls
                or kernel.pre_run_hooks
                or (self.inspects and runtime.add_stages_inspection_hook is not None)
            )
        except AttributeError:  # a hook of another kind (or a kernel without pre-run hooks): Triton's launch decides
            return True


def _runtime() -> Runtime | None:
    """The `Runtime` where the shortcut may run in this process, else None (every launch the normal one)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or os.environ.get("CONDMEM_FAST_LAUNCH") == "0":
        return None
    try:
        import triton
        from triton import knobs
    except ImportError:
        return None
    device = getattr(torch._C, "_cuda_getDevice", None)
    stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if _version(triton.__version__) not in _KNOWN_VERSIONS or device is None or stream is None:
        return None
    if not (_has(knobs, "runtime.launch_enter_hook") and _has(knobs, "runtime.launch_exit_hook")):
        return None
    if not torch.cuda.is_available():
        return None
    return Runtime(knobs, device, stream)


_UNSET = object()
RUNTIME = _UNSET
"""The `Runtime`, read at every launch; None: the normal launch only. Worked out at the first launch
(importing this module imports no Triton). Tests and the host-only benchmark put a stand-in here."""


def runtime() -> Runtime | None:
    """The `Runtime` the shortcut runs with in this process; None where every launch is Triton's own."""
    return _runtime_now() if RUNTIME is _UNSET else RUNTIME


def _runtime_now() -> Runtime | None:
    global RUNTIME
    RUNTIME = _runtime()
    return RUNTIME


def _key(ptrs: tuple, ints: tuple, floats: tuple) -> tuple:
    """The per-argument part of a key; raises AttributeError / TypeError for an argument it does not cover.

    Addresses: dtype and the address mod 16. Ints: their types, and for an int in 2..2**31-1 (sizes,
    strides) its divisibility by 16, for any other int (1 becomes a constant; 0, negatives and the i64 and
    u64 widths) the value itself (kept apart from the bools of the first case: 0 and 1 map below -2**40).
    Floats: their types (Triton passes a float as fp32 whatever its value); anything else passed as
    a float (an int is specialized on its value) is not covered.
    """
    if any(type(f) is not float for f in floats):
        raise TypeError("a non-float in the floats")
    return (
        tuple([p.dtype for p in ptrs]),
        tuple([p.data_ptr() % 16 for p in ptrs]),
        tuple(map(type, ints)),
        tuple([a % 16 == 0 if 1 < a <= 2147483647 else (a if a > 1 else a - 1099511627776) for a in ints]),
        tuple(map(type, floats)),
    )


class FastLaunch:
    """Launches of one ``@triton.jit`` kernel: ``launcher(grid, ptrs, ints, floats, num_warps, **constexprs)``.

    The kernel's arguments in the order of its signature: `ptrs` (tensors, or objects with ``dtype``
    and ``data_ptr()``), `ints`, `floats`, then the constexprs as keywords. Same effect as
    ``kernel[grid](*ptrs, *ints, *floats, num_warps=num_warps, **constexprs)``, which runs on a key's
    first call and wherever the shortcut is refused (module docstring).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        # key -> (launcher, function handle, packed metadata, the CompiledKernel: held so that its module stays
        # loaded, Triton >= 3.9 unloads it when the object goes, e.g. once Triton's own cache is cleared)
        self._compiled: dict[tuple, tuple] = {}
        self.launches = [0, 0]  # [normal, shortcut], read by tests and benchmarks

    def __call__(self, grid: tuple, ptrs: tuple, ints: tuple, floats: tuple, num_warps: int, **constexprs) -> None:
        rt = RUNTIME
        if rt is _UNSET:
            rt = _runtime_now()
        if rt is None or rt.hooks_set(self.kernel):
            self._normal(grid, ptrs, ints + floats, num_warps, constexprs)
            return
        device = rt.device()
        try:
            # Constexprs by value and type (True == 1 == 1.0 in Python, not in a compiled kernel).
            consts = (tuple(constexprs.items()), tuple(map(type, constexprs.values())))
            key = (_key(ptrs, ints, floats), consts, num_warps, device, rt.knob_values(rt.knobs))
        except (AttributeError, TypeError):  # an argument of a kind the key does not cover
            self._normal(grid, ptrs, ints + floats, num_warps, constexprs)
            return
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self._normal(grid, ptrs, ints + floats, num_warps, constexprs)
            if self._in_order(len(ptrs) + len(ints) + len(floats), constexprs):
                self._remember(key, compiled)
            return
        self.launches[1] += 1
        run, function, metadata, _ = entry
        n = len(grid)
        # No launch metadata and no hooks: only launch hooks read them, and none is set (`Runtime.hooks_set`).
        run(
            grid[0],
            grid[1] if n > 1 else 1,
            grid[2] if n > 2 else 1,
            rt.stream(device),
            function,
            metadata,
            None,
            None,
            None,
            *ptrs,
            *ints,
            *floats,
            *constexprs.values(),
        )

    def _normal(self, grid, ptrs, scalars, num_warps, constexprs):
        self.launches[0] += 1
        return self.kernel[grid](*ptrs, *scalars, num_warps=num_warps, **constexprs)

    def _in_order(self, n_args: int, constexprs: dict) -> bool:
        """The call gave the kernel's runtime arguments, then every constexpr in the signature's order
        (the shortcut passes all of them by position, as Triton's own launch does)."""
        names = getattr(self.kernel, "arg_names", None)
        constexpr_at = getattr(self.kernel, "constexprs", None)
        if names is None or constexpr_at is None:
            return False
        return list(constexpr_at) == list(range(n_args, len(names))) and tuple(constexprs) == tuple(names[n_args:])

    def _remember(self, key: tuple, compiled) -> None:
        """Keep what the normal launch returned, if it is a compiled kernel with what the shortcut calls."""
        entry = (*(getattr(compiled, name, None) for name in ("run", "function", "packed_metadata")), compiled)
        if any(e is None for e in entry):
            return
        if len(self._compiled) >= _MAX_ENTRIES:
            self._compiled.clear()
        self._compiled[key] = entry


class HostPointer:
    """A page-locked host tensor at a kernel launch: Triton reads ``data_ptr()`` and ``dtype`` only (and the
    shortcut's key the same), and its launcher turns the address into the device address of that memory."""

    __slots__ = ("dtype", "tensor")

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()
