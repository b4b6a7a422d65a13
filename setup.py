"""Builds condmem's native CPU code (src/condmem/native/gather.c, hash.c, row_server.c) as the
extension `condmem.native._gather`; the package metadata is in pyproject.toml.

The library is loaded with ctypes (it has no Python module init), with the flags of
`condmem/native/toolchain.py`, shared with the loader's development build. The extension is
optional: where it does not compile (no C compiler or no OpenMP), the install goes on and
condmem warns at run time that it uses the slower torch gather. `.ci/run` reports which
build the tests used.
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location("condmem_native_toolchain",
                                               Path(__file__).parent / "src" / "condmem" / "native" / "toolchain.py")
toolchain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(toolchain)

setup(
    ext_modules=[
        Extension(
            toolchain.MODULE,
            sources=[f"src/condmem/native/{source.name}" for source in toolchain.SOURCES],
            define_macros=[toolchain.digest_define(toolchain.source_digest())],
            extra_compile_args=list(toolchain.COMPILE_ARGS),
            extra_link_args=list(toolchain.LINK_ARGS),
            optional=True,
        )
    ],
)
