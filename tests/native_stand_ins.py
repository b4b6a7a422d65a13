"""Host stand-ins for the CUDA runtime calls of the native staged send (``native_stand_ins.c``),
compiled here for the tests that run that send without a GPU; never part of the installed library."""

from __future__ import annotations

import atexit
import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

from condmem.native.toolchain import find_compiler

NAMES = ("memcpy", "record", "done_query", "deferred_memcpy", "deferred_record", "query")


@functools.cache
def stand_ins() -> tuple[ctypes.CDLL, dict[str, int]] | None:
    """(library, {name: address of ``condmem_test_<name>``}), or None without a C compiler."""
    cc = find_compiler()
    if cc is None:
        return None
    tmp = tempfile.mkdtemp(prefix="condmem-stand-ins-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    out = Path(tmp) / "stand_ins.so"
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", str(Path(__file__).with_suffix(".c")), "-o", str(out)],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(out))
    return lib, {name: ctypes.cast(getattr(lib, f"condmem_test_{name}"), ctypes.c_void_p).value for name in NAMES}
