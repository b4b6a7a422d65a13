"""The lookup path's, the sparse Adam's and the MoE step's Triton kernels compile for sm_90 under the
installed Triton, without a GPU.

CPU runs execute kernels in the interpreter, which never calls the compiler; a kernel the
compiler rejects (as Triton 3.6 rejected one of ours) would otherwise pass CI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_kernels_compile_for_sm90():
    try:
        from triton.backends import backends
    except ImportError:  # pragma: no cover - very old Triton
        pytest.skip("this Triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = Path(__file__).resolve().parents[2] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "condmem.ops.compile_check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    summary = [line for line in proc.stdout.splitlines() if line.startswith(("ok", "FAILED", "triton"))]
    assert proc.returncode == 0, "\n".join(summary) or proc.stderr[-2000:]
    counted = re.search(r"(\d+) of (\d+) variants failed", proc.stdout)
    assert counted, proc.stdout[-2000:]
    # every variant compiled, and none dropped: the lookup path's and the sparse Adam's 11, the MoE step's 8
    assert sum(line.startswith("ok") for line in summary) == int(counted.group(2)) >= 19
