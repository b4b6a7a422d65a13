"""The Hugging Face example runs end to end (two steps on a small slice of the corpus)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_engram.py"


def test_example_trains_both_models_and_writes_its_table(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--steps",
            "2",
            "--eval-every",
            "1",
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--val-windows",
            "4",
            "--max-bytes",
            "200000",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        # The example runs no Triton kernel: keep the interpreter (the suite's setting) out of it.
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| steps | baseline val loss | Engram val loss | gap |" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["final"]) == {"baseline", "engram"}
    # Step 0: zero-initialized Engram, the same backbone: the same validation loss.
    assert summary["curves"]["baseline"][0] == summary["curves"]["engram"][0]
