"""Giving mapped pages back: bounded RSS for streaming readers, the page cache dropped after a host load."""

from __future__ import annotations

import gc
import os

import torch

from condmem import EngramLayout, NgramHasher
from condmem.serving import EngramMemory
from condmem.tables.released import ReleasedCheckpoint
from condmem.tables.safetensors_io import mmap_tensor, read_header, release_pages
from released_fixtures import config_json, engram_config, write_checkpoint
from page_cache import cached_fraction


def test_release_pages_leaves_anonymous_memory_alone():
    t = torch.arange(1 << 20, dtype=torch.int64)
    release_pages(t)
    assert torch.equal(t, torch.arange(1 << 20, dtype=torch.int64))


def test_release_pages_unmaps_a_file_mapping_without_losing_data(tmp_path):
    write_checkpoint(tmp_path, "original", 1, "flat")
    header = read_header(tmp_path / "model.safetensors")
    name = "layers.2.engram.embed.weight"
    t = mmap_tensor(header, name)
    before = t.view(torch.uint8).clone()
    release_pages(t, drop_cache=True)
    assert torch.equal(t.view(torch.uint8), before)  # read back from the file


def test_host_load_drops_the_source_page_cache(tmp_path):
    # 16K rows a layer (1 MiB): page rounding at the tensor's ends is noise.
    write_checkpoint(tmp_path, "hf", 1, config_json("flat", engram_vocab_size=4001), table_size=4001)
    os.sync()  # dirty pages cannot be dropped
    path = tmp_path / "model.safetensors"
    entry = read_header(path).tensors["model.layers.5.engram.embed.weight"]
    hasher = NgramHasher(EngramLayout(engram_config(table_size=4001)))
    with open(path, "rb") as fh:
        fh.read()  # all of it in the page cache
    assert cached_fraction(path, entry.start, entry.nbytes) > 0.9
    kept = EngramMemory.from_released(
        ReleasedCheckpoint(tmp_path), hasher, "host", host_alloc="pageable", progress=False, drop_page_cache=False
    )
    assert cached_fraction(path, entry.start, entry.nbytes) > 0.9
    kept.close()
    del kept
    gc.collect()  # the first load's mappings: mapped pages stay cached whatever is asked
    memory = EngramMemory.from_released(
        ReleasedCheckpoint(tmp_path), hasher, "host", host_alloc="pageable", progress=False
    )
    assert cached_fraction(path, entry.start, entry.nbytes) < 0.1
    memory.close()
