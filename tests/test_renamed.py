"""Renamed public names keep working for one release (`condmem.utils.renamed`): the old keyword
or attribute gives the same result with a `DeprecationWarning` pointing at the caller's line,
and an old and a new keyword together are refused."""

from __future__ import annotations

import pytest
import torch

from condmem.ops.gather import table_format
from condmem.sizing import size_engram
from condmem.tables.inspect import tier_bytes
from condmem.tables.lookup import LookupHandle, LookupStats
from condmem.utils.renamed import renamed_attribute, renamed_keywords


@renamed_keywords(rows="row_ids")
def _take(row_ids=None, scale=1):
    return row_ids * scale


def test_an_old_keyword_gives_the_same_result_with_a_warning_at_the_callers_line():
    with pytest.warns(DeprecationWarning, match=r"_take: the keyword rows= is deprecated.*use row_ids=") as caught:
        assert _take(rows=3, scale=2) == _take(row_ids=3, scale=2) == 6
    assert caught[0].filename == __file__
    with pytest.raises(TypeError, match="pass row_ids= only"):
        _take(rows=3, row_ids=3)
    with pytest.warns(DeprecationWarning, match="tier_bytes: the keyword rows="):
        assert tier_bytes(rows=10, head_dim=64) == tier_bytes(10, 64)


def test_an_old_attribute_reads_the_new_one_with_a_warning():
    class Holder:
        old = renamed_attribute("Holder", "old", "new")

        def __init__(self):
            self.new = 5

    with pytest.warns(DeprecationWarning, match=r"Holder.old is deprecated.*use Holder.new") as caught:
        assert Holder().old == 5
    assert caught[0].filename == __file__
    vectors = torch.zeros(2, 3)
    handle = LookupHandle(vectors, None, None, LookupStats())
    with pytest.warns(DeprecationWarning, match="LookupHandle.rows is deprecated"):
        assert handle.rows is handle.row_vectors is vectors
    fmt = table_format(torch.zeros(7, 4))
    with pytest.warns(DeprecationWarning, match="TableFormat.rows is deprecated"):
        assert fmt.rows == fmt.num_rows == 7
    sizing = size_engram(256, params="1M", layer_ids=[1])
    with pytest.warns(DeprecationWarning, match="Sizing.rows is deprecated"):
        assert sizing.rows == sizing.num_rows == sizing.to_dict()["rows"]
