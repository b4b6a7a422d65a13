"""`condmem bench gate` compares with a peer's figures only from a results file and only on the
card they were measured on: no timing of a particular card lives in the code."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from condmem.bench.gate import PEER_FILE, SHAPES, peer_figures  # noqa: E402


def test_the_checkout_holds_the_peer_figures_of_gate_shapes():
    figures = json.loads(PEER_FILE.read_text())
    got = peer_figures(figures["gpu"])
    assert got and set(got) <= set(SHAPES) and all(ms > 0 for ms in got.values())


def test_no_peer_figures_for_another_card_without_a_card_or_without_the_file(tmp_path):
    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"gpu": "card A", "rows": [{"tokens": 8, "hc": 2, "hidden": 64, "ms": 0.5}]}))
    assert peer_figures("card A", path) == {(8, 2, 64): 0.5}
    assert peer_figures("card B", path) == {}
    assert peer_figures(None, path) == {}
    assert peer_figures("card A", tmp_path / "absent.json") == {}
