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
        assert rows and all(r["op"] == op and "machine" in r and "d2d_gbps" in r for r in rows)
        assert f"== {op}" in printed
    hash_rows = [json.loads(x) for x in (tmp_path / "kernels_hash.json").read_text().splitlines()]
    assert {"triton", "torch-gpu", "numpy-demo-cpu"} <= {r["impl"] for r in hash_rows}
