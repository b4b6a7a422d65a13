"""How the native library is built: the source, flags and digest shared by ``setup.py`` (the
installed build) and the loader's development build, so both make the same library.

Standard library only: ``setup.py`` loads this file by path before condmem's dependencies exist.

The target is the compiler's portable baseline (no ``-march``): an installed build runs on
any CPU of its architecture, and the copies go through libc's ``memcpy``, which picks its
vector width at run time (baseline against ``-march=native``: docs/lookup-engine.md#native-code).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name(name) for name in ("gather.c", "hash.c", "row_server.c", "checksum.c"))
"""The C sources of the one library (row gathers, sends and checked reads; the decode hash; the decode row
server; the CRC32C of table blocks)."""
MODULE = "condmem.native._gather"
"""The installed build's module name (a shared library loaded with ctypes, never imported)."""
COMPILE_ARGS = ("-O3", "-fopenmp")
LINK_ARGS = ("-fopenmp",)


class BuildError(RuntimeError):
    """The development build could not be made (no compiler, or it failed)."""


def source_digest(sources: tuple[Path, ...] = SOURCES) -> str:
    """sha256 prefix of the C sources (names and bytes, in order); compiled into the library
    (`condmem_source_digest`) so the loader can refuse a build made from other sources."""
    h = hashlib.sha256()
    for source in sources:
        h.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def digest_define(digest: str) -> tuple[str, str]:
    """The ``-D`` macro that carries `digest` into the library (name, C string literal)."""
    return "CONDMEM_SOURCE_DIGEST", f'"{digest}"'


def find_compiler() -> str | None:
    """Path of the C compiler (``$CC``, else gcc, else cc), or None."""
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


def compiler_identity(cc: str) -> str:
    """What decides the machine code besides source and flags: the compiler's resolved path,
    its version line and its target triple (the baseline CPU it emits code for)."""

    def ask(flag: str) -> str:
        done = subprocess.run([cc, flag], capture_output=True, text=True, check=False)
        return (done.stdout.strip().splitlines() or [""])[0]

    return "|".join([os.path.realpath(cc), ask("--version"), ask("-dumpmachine"), platform.machine()])


def development_build(cache_dir: Path) -> Path:
    """Compile `SOURCES` into ``cache_dir`` (once; later calls find the file) and return its path.

    The file name is keyed by the source, the flags and `compiler_identity`, so a cache shared
    between machines or compilers never hands one a library built by another's compiler.
    Raises BuildError when there is no compiler or the compile fails.
    """
    cc = find_compiler()
    if cc is None:
        raise BuildError("no C compiler found ($CC, gcc or cc)")
    digest = source_digest()
    name, value = digest_define(digest)
    flags = [*COMPILE_ARGS, "-shared", "-fPIC", f"-D{name}={value}"]
    key = hashlib.sha256("\n".join([digest, compiler_identity(cc), *flags, *LINK_ARGS]).encode()).hexdigest()[:16]
    target = cache_dir / f"gather-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / "gather.so"
        done = subprocess.run(
            [cc, *flags, *map(str, SOURCES), "-o", str(out), *LINK_ARGS], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise BuildError(f"{cc} failed: {done.stderr.strip()[:300]}")
        os.replace(out, target)  # atomic: concurrent processes see a whole file or none
    return target
