"""`condmem bench all --smoke`: the benchmark code runs end to end (CPU, Triton interpreter, tiny sizes)."""

from __future__ import annotations

import json

import pytest

from condmem.cli import main
from kernel_helpers import INTERPRET


@pytest.mark.skipif(not INTERPRET, reason="the smoke run uses the Triton interpreter (TRITON_INTERPRET=1)")
def test_bench_all_smoke(tmp_path, capsys):
    assert main(["bench", "all", "--smoke", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for op in ("hash", "gather", "gate"):
        lines = (tmp_path / f"kernels_{op}.json").read_text().splitlines()
        rows = [json.loads(x) for x in lines]
        # On the CPU no ceiling is measured: no copy bandwidth, no fraction of one.
        assert rows and all(r["op"] == op and "machine" in r and "d2d_gbps" not in r for r in rows)
        assert not any("hbm_fraction" in r or "d2d_fraction" in r for r in rows)
        assert f"== {op}" in printed
    hash_rows = [json.loads(x) for x in (tmp_path / "kernels_hash.json").read_text().splitlines()]
    assert {"triton", "torch (cpu)", "numpy-demo-cpu"} <= {r["impl"] for r in hash_rows}
    # Labelled as what ran: no GPU name (None), no 0 GB/s ceiling, no row or column named for a GPU.
    assert printed.startswith("no GPU: --smoke on the CPU"), printed[:200]
    assert "None" not in printed and "D2D copy" not in printed
    assert "gpu" not in printed.lower().replace("no gpu", ""), "a CPU row or column labelled as the GPU's"
    assert "HBM frac" not in printed and "x D2D" not in printed
