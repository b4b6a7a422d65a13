"""CUDA graphs of Engram's share of an HF `generate()` decode step: the hash and table reads
before decoder layer 0, and each Engram layer's projection and gate.

An eager decode step of a Hugging Face model is host-bound: the GPU waits while Python
queues a few hundred small kernels. Engram's share of a step is its own dozens of ops
(hash, a lookup per layer, projection, gate, views, checks), each host work with no GPU
work to hide it. Replayed from graphs, that share is a few copies and replays::

    base pre-hook:   ids, mask ──copy──► [graph: hash ─► every layer's row vectors (table read)]
    layer k hook:    hidden ──copy──► [graph: run_engram: wkv ─► gate + residual] ──clone──► layer k

The graphs are captured at the first decode step of a batch shape and replayed while it
lasts (the next generate() of the same shape replays them too). They run the very kernels
of the eager path on the same inputs, so a step's result is the same bit for bit
(tested against the eager path). A graph reads the tensors it was captured with in place:
weights updated in place are read as they are then; a replaced parameter, another memory
or another shape makes a new capture.

Used only where a graph is exact and safe: one new token a row inside generate() (its
look-back is generate's own sequences), no autograd, no ShortConv (its state advances per
step), tables the GPU reads in place (module tables, or an `EngramMemory` in HBM or
page-locked host memory, not sharded), and not inside another capture or a compiled
region. Everything else takes the eager path. The token ids a graph hashes are the
prompt's (range-checked by the eager prefill) and tokens the model sampled, inside its
vocabulary: graphs are used only while that vocabulary lies inside the hasher's ids.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch import nn

from condmem.models.context import ForwardContext, run_engram
from condmem.utils.graph_capture import warm_and_capture

MAX_SHAPES = 4  # batch shapes whose graphs are kept (least recently used dropped)


@dataclass
class _LayerGraph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # static input
    out: torch.Tensor  # static output
    weights: tuple  # (parameter, data_ptr) pairs read in place


@dataclass
class StepGraphs:
    """The graphs of one batch shape: the front (hash + rows) and, captured at first use, each layer's."""

    ids: torch.Tensor  # static int64 [B, N-1+1]: the look-back and the new token
    valid: torch.Tensor | None  # static bool [B, N-1+1]
    graph: torch.cuda.CUDAGraph
    row_ids: torch.Tensor  # int64 [B, 1, n_layers, n_cols], written by the front graph
    row_vectors: dict[int, torch.Tensor]  # per layer: bf16 row vectors read by the front graph (a memory's tables)
    memory: object
    pool: tuple
    layers: dict[int, _LayerGraph] = field(default_factory=dict)


class DecodeGraphs:
    """The adapter's decode graphs (`EngramAdapter.decode_graphs` switches them off)."""

    def __init__(self, adapter):
        self.adapter = adapter
        self._shapes: collections.OrderedDict[tuple, StepGraphs] = collections.OrderedDict()
        self.captures = 0  # graphs captured so far (read by tests)

    def usable(self, input_ids: torch.Tensor) -> bool:
        """Whether this decode step can replay graphs (see the module docstring)."""
        a = self.adapter
        if (
            not input_ids.is_cuda
            or input_ids.shape[1] != 1
            or torch.is_grad_enabled()
            or any(e.short_conv is not None for e in a.engrams.values())
            or not self._samples_in_range()
            or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()
        ):
            return False
        memory = a.memory
        if memory is None:
            return all(not e.table.weight.is_meta for e in a.engrams.values())
        return (
            getattr(memory, "sharded", True) is None
            and not memory.closed
            and all(s.gpu_readable for s in memory.stores.values())
        )

    def _samples_in_range(self) -> bool:
        """Every token the model can sample lies inside the hasher's ids (its output embedding's rows,
        read now: `resize_token_embeddings` may have grown it since `add_engram`)."""
        a = self.adapter
        return _output_vocab(a.model) <= a.hasher.vocab_size

    def front(self, window: torch.Tensor, valid: torch.Tensor | None) -> StepGraphs:
        """Replay (capturing first, for a new shape or memory) the hash and table reads of a step whose
        look-back and new token are `window` [B, N] (its 2-D mask columns `valid`, any dtype: nonzero
        marks a token)."""
        memory = self.adapter.memory
        self.adapter.hasher.raise_pending(block=False)  # a bad prompt id of the eager prefill, once known
        key = (tuple(window.shape), window.device, valid is None, id(memory))
        entry = self._shapes.get(key)
        if entry is None:  # (the entry holds its memory: no other memory can take its id meanwhile)
            entry = self._capture_front(window, valid, memory)
            self._shapes[key] = entry
            if len(self._shapes) > MAX_SHAPES:
                self._shapes.popitem(last=False)
        else:
            self._shapes.move_to_end(key)
            entry.ids.copy_(window)
            if valid is not None:
                entry.valid.copy_(valid)  # (to bool: nonzero is True)
            entry.graph.replay()
        return entry

    def layer(self, entry: StepGraphs, layer_id: int, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden + Engram(hidden)`` of one layer from its graph (captured at first use)."""
        engram = self.adapter.engrams[layer_id]
        lg = entry.layers.get(layer_id)
        if (
            lg is None
            or lg.hidden.shape != hidden.shape
            or lg.hidden.dtype != hidden.dtype
            or not _same_weights(engram, lg.weights)
        ):
            lg = entry.layers[layer_id] = self._capture_layer(entry, layer_id, hidden)
        else:
            lg.hidden.copy_(hidden)
            lg.graph.replay()
        # A fresh tensor: the layer's input must not change under whoever keeps it.
        return lg.out.clone()

    # ------------------------------------------------------------------ capture
    def _capture_front(self, window: torch.Tensor, valid: torch.Tensor | None, memory) -> StepGraphs:
        a = self.adapter
        a.hasher.raise_pending(block=True)  # no check left in flight: a capture may not query its event
        if memory is not None:
            memory.flush()  # a lookup thread's sync would spoil the capture: none may run meanwhile
        ids = window.clone(memory_format=torch.contiguous_format)
        static_valid = None if valid is None else torch.empty(valid.shape, dtype=torch.bool, device=window.device)
        if static_valid is not None:
            static_valid.copy_(valid)
        depth = a.config.max_ngram_size - 1
        row_vectors: dict[int, torch.Tensor] = {}

        def work() -> torch.Tensor:
            blocked = None if static_valid is None else ~static_valid
            row_ids = a.hasher(ids, blocked=blocked, check=False)[:, depth:]
            if memory is not None:
                for lid in a.config.layer_ids:
                    row_vectors[lid] = memory.gather_into(lid, row_ids[:, :, a.layout.layer_index(lid)])
            return row_ids

        pool = torch.cuda.graph_pool_handle()
        graph, row_ids = self._record(work, pool)
        return StepGraphs(ids, static_valid, graph, row_ids, dict(row_vectors), memory, pool)

    def _capture_layer(self, entry: StepGraphs, layer_id: int, hidden: torch.Tensor) -> _LayerGraph:
        a = self.adapter
        engram = a.engrams[layer_id]
        static_hidden = hidden.clone(memory_format=torch.contiguous_format)
        depth = a.config.max_ngram_size - 1
        mask = None if entry.valid is None else entry.valid[:, depth:]
        context = ForwardContext(engram_inputs=_FrontInputs(entry, a.layout), token_mask=mask)

        def work() -> torch.Tensor:
            return run_engram(engram, static_hidden, context)

        graph, out = self._record(work, entry.pool)
        weights = tuple((t, t.data_ptr()) for t in _tensors(engram))
        return _LayerGraph(graph, static_hidden, out, weights)

    def _record(self, work, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`work` warmed up, captured and replayed (this step's result): (the graph, its output)."""
        graph, out = warm_and_capture(work, pool=pool)
        graph.replay()
        self.captures += 1
        return graph, out


class _FrontInputs:
    """A step's Engram inputs as its front graph leaves them: each layer's row ids, and the row
    vectors it read from a memory (None: the module reads its own table)."""

    def __init__(self, entry: StepGraphs, layout):
        self.entry, self.layout = entry, layout

    def row_ids(self, layer_id: int) -> torch.Tensor:
        return self.entry.row_ids[:, :, self.layout.layer_index(layer_id)]

    def row_vectors(self, layer_id: int) -> torch.Tensor | None:
        return self.entry.row_vectors.get(layer_id)


def _output_vocab(model: nn.Module | None) -> int:
    """How many token ids the model can sample: its output embedding's rows (else its config's vocab size)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else 1 << 62


def _tensors(engram) -> tuple[torch.Tensor, ...]:
    """The module's parameters and buffers (e.g. a block-FP8 ``wkv``'s weight and scales)."""
    return (*engram.parameters(), *engram.buffers())


def _same_weights(engram, captured: tuple) -> bool:
    """The module's parameters and buffers are the captured ones, at the same addresses (a graph reads
    them in place)."""
    tensors = _tensors(engram)
    return len(tensors) == len(captured) and all(
        t is c and t.data_ptr() == ptr for t, (c, ptr) in zip(tensors, captured)
    )
