"""`condmem bench e2e --smoke`: the serving benchmark's code path on a tiny model on CPU (times mean nothing)."""

from __future__ import annotations

import json

import torch

from condmem.bench.e2e import backbone_twin, build_models
from condmem.cli import main


def test_bench_e2e_smoke(tmp_path):
    rc = main(["bench", "e2e", "--smoke", "--out", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "e2e.json").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["none", "host_sync", "host_prefetch"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    prefetch = rows[-1]
    assert prefetch["same_tokens_as"] == "host_sync" and prefetch["tokens_equal"] is True
    assert (tmp_path / "e2e.png").exists()


def test_backbone_twin_shares_weights_and_matches_a_model_without_engram():
    model, twin, _ = build_models("tiny", 0.001, 32, "cpu")
    assert twin.cfg.engram is None and twin.blocks[0].mlp is model.blocks[0].mlp
    assert twin.embed.weight.data_ptr() == model.embed.weight.data_ptr()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 9))
    again = backbone_twin(model)
    assert torch.equal(twin(ids), again(ids))
