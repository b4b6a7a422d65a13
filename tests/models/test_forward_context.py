"""`DecoderLM.forward` with a forward context: the dense context it builds is the one it runs, and a
context is not mixed with the arguments it replaces."""

from __future__ import annotations

import pytest
import torch

from tests.model_fixtures import tiny_engram_lm


def test_an_explicit_dense_context_gives_the_same_logits():
    model, _ = tiny_engram_lm("cpu")
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
        got = model(ids, context=model.dense_context(ids))
        cache_a, cache_b = model.new_cache(2, 12), model.new_cache(2, 12)
        model(ids[:, :5], cache=cache_a)
        model(ids[:, :5], context=model.dense_context(ids[:, :5], cache=cache_b))
        cache_b.length += 5  # an explicit context leaves the cache's bookkeeping to its maker
        step_a = model(ids[:, 5:], cache=cache_a)
        step_b = model(ids[:, 5:], cache=cache_b)
    assert torch.equal(got, want)
    assert torch.equal(step_a, step_b)


def test_a_context_with_the_arguments_it_replaces_is_refused():
    model, _ = tiny_engram_lm("cpu")
    ids = torch.randint(0, 50, (1, 4))
    with pytest.raises(ValueError, match="a context or the arguments"):
        model(ids, context=model.dense_context(ids), cache=model.new_cache(1, 8))
