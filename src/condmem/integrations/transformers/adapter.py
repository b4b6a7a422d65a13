"""The Engram side of a Hugging Face causal LM: its forward hooks, decode state and helpers.

`condmem.integrations.transformers.attach.add_engram` builds an `EngramAdapter` and puts it on the
model; the hooks then run every forward:

    model(input_ids, attention_mask, cache)
      base model pre-hook ──> row ids of ALL Engram layers from input_ids (once, before layer 0);
                              with an `EngramMemory`, every layer's lookup starts here
      decoder layer k pre-hook ──> hidden += Engram_k(hidden, rows_k)     (Engram layers only)
      base model post-hook ──> the n-gram look-back (and ShortConv inputs) saved under the cache

Nothing of the model is copied or changed: each Engram is a new child module
(``<layer>.engram``) and the hooks add its output to the hidden states the layer receives.
Padding follows the attention mask: a masked position is blocked (a real token's n-gram
never reaches it or anything before it) and its gate is closed.

The Engram layers are ``EngramConfig.layer_ids`` (a differing ``layers=`` is refused); an unstated
``pad_id`` is the tokenizer's pad token. ``print(model)`` opens with `engram_summary`, and a
dense optimizer stepping the sparse tables is refused with condmem's message (`optim`).

Cached decoding hashes each new token against the N-1 tokens before it. Those come from
the state saved under the cache by the previous forward; inside ``generate()`` they are
re-read from generate's own running sequences (so assisted decoding's cache crops and
any reordering are followed), and beam search's cache reorder reorders the state too.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from condmem.config import EngramConfig
from condmem.hashing import NgramHasher, NgramHistory
from condmem.integrations.transformers.decode_graph import DecodeGraphs, StepGraphs
from condmem.integrations.transformers.decode_state import DecodeState, DecodeStates
from condmem.integrations.transformers.families import Family, locate
from condmem.layout import EngramLayout
from condmem.models.context import ConvStates, HashedRowIds, ForwardContext, run_engram
from condmem.module import Engram

logger = logging.getLogger("condmem.integrations.transformers")

CONFIG_KEY = "condmem_engram"
"""Attribute of the model's `PretrainedConfig` (a key of its config.json) holding the Engram section."""
# Methods add_engram replaces on the model instance (remove_engram puts back what was there).
_PATCHED = ("prepare_inputs_for_generation", "_reorder_cache", "save_pretrained", "extra_repr")
_UNSET = object()


class EngramModelError(ValueError):
    """Engram cannot be added to this model, or a forward gives it inputs it cannot hash."""


@dataclass
class _Step:
    """What one forward's Engram layers read (its forward context), and what it leaves for the next."""

    context: ForwardContext | None  # row ids or prefetched rows, padding mask, ShortConv states
    next_state: DecodeState | None  # saved under the returned cache
    graphs: StepGraphs | None = None  # a decode step replayed from CUDA graphs (then no context is read)


class _StepConvStates(ConvStates):
    """Each ShortConv's inputs before a cached forward, handed to the layer as a copy (it advances it in
    place, and the earlier state stays as it was) that becomes the next forward's state."""

    def __init__(self, conv_in: dict[int, torch.Tensor], next_state: DecodeState | None):
        super().__init__(conv_in, 0)
        self.next_state = next_state

    def get(self, layer_id: int) -> torch.Tensor | None:
        state = self.states.get(layer_id)
        if state is None:
            return None
        state = state.clone()
        if self.next_state is not None:
            self.next_state.conv[layer_id] = state
        return state


class EngramAdapter:
    """The Engram side of one Hugging Face model: config, hasher, modules, hooks, decode state.

    Made by `add_engram`; reach it with `get_engram(model)`.

    Attributes:
        config: the `EngramConfig` (``layer_ids`` are decoder-layer indices).
        tokenizer: the `CompressedTokenizer` whose map the hasher uses.
        source_tokenizer: the tokenizer `add_engram` was given (``save_pretrained`` saves it beside the weights).
        hasher: the `NgramHasher` (its layout: `hasher.layout`).
        engrams: {layer id: `Engram`} (each also the child ``engram`` of its decoder layer).
        memory: the `EngramMemory` the tables are read from, or None (tables in the modules).
        last_row_ids: row ids of the latest forward, int64 [B, T, n_layers, n_cols] (of a decode step
            replayed from a graph: the graph's buffer, which the next step overwrites; clone to keep).
        decode_graphs: replay Engram's share of each `generate()` decode step from CUDA graphs
            (`decode_graph`: same results, a fraction of the host work); False: every step eager.
    """

    def __init__(
        self,
        model: nn.Module,
        family: Family,
        base: nn.Module,
        layers: nn.ModuleList,
        config: EngramConfig,
        tokenizer,
        hasher: NgramHasher,
        engrams: dict[int, Engram],
    ):
        self.family = family
        self.config = config
        self.tokenizer = tokenizer
        self.source_tokenizer = tokenizer
        self.hasher = hasher
        self.engrams = engrams
        self.memory = None
        self.last_row_ids: torch.Tensor | None = None
        self.decode_graphs = True
        self._graphs = DecodeGraphs(self)
        self._layer_index = {lid: hasher.layout.layer_index(lid) for lid in config.layer_ids}
        self._model = weakref.ref(model)
        # The base forward's positional parameter names: its arguments are found by name on every
        # forward without inspect's binding (dozens of Python calls a decode step).
        self._positional = tuple(
            name
            for name, p in inspect.signature(base.forward).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
        self._depth = config.max_ngram_size - 1
        self._conv_layers = {lid: e for lid, e in engrams.items() if e.short_conv is not None}
        self._states = DecodeStates()
        self._step: _Step | None = None
        # generate()'s running sequences, 2-D mask and the new tokens it hands the next forward.
        self._generate_inputs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
        self._handles = [
            base.register_forward_pre_hook(self._before_base, with_kwargs=True),
            base.register_forward_hook(self._after_base, with_kwargs=True),
        ]
        for lid in config.layer_ids:
            self._handles.append(layers[lid].register_forward_pre_hook(self._layer_hook(lid), with_kwargs=True))
        self._wrap_generation(model)

    # ------------------------------------------------------------------ hashing
    @property
    def layout(self) -> EngramLayout:
        return self.hasher.layout

    @property
    def model(self) -> nn.Module | None:
        """The model this adapter serves (None once it is gone: the adapter holds it weakly)."""
        return self._model()

    def row_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Row ids [B, T, n_layers, n_cols] of a batch with no cache before it.

        Positions where `attention_mask` is 0 are blocked: no real token's n-gram reaches
        them or anything before them, so each row's real tokens hash as if alone.
        """
        blocked = None if attention_mask is None else ~attention_mask.to(input_ids.device).bool()
        return self.hasher(input_ids, blocked=blocked)

    def _generate_window(self, stash, past: int, new_ids: torch.Tensor) -> torch.Tensor | None:
        """Inside generate(), when this forward's tokens are its running sequences' last ones: those
        sequences from N-1 positions before the new tokens (a view: no copy, no look-back state)."""
        full = stash[0]
        if full.device != new_ids.device:  # (a `.to` that returns the tensor itself still costs a dispatch)
            full = full.to(new_ids.device)
        batch, new = new_ids.shape
        if full.shape != (batch, past + new):
            return None
        # The very tensor generate() prepared for this forward is its sequences' tail (known without
        # reading it: torch.equal would wait for the GPU on every step).
        if new_ids is not stash[2] and not torch.equal(full[:, past:], new_ids):
            return None
        return full[:, past - self._depth :]

    def _lookback(self, batch: int, past: int, new_ids: torch.Tensor, cache, stash) -> NgramHistory:
        """The look-back before the new tokens of a cached forward (slot b: row b)."""
        if stash is not None:
            full, mask = stash[0].to(new_ids.device), stash[1]
            if full.shape == (batch, past + new_ids.shape[1]) and (
                new_ids is stash[2] or torch.equal(full[:, past:], new_ids)
            ):
                # Inside generate(): its running sequences are the truth (beams reordered, crops undone).
                valid = None if mask is None else mask.to(new_ids.device)[:, :past]
                return DecodeState.of_window(self.hasher, full[:, :past], valid, past).history
        state = self._states.get(cache)
        if state is None or state.length != past or state.batch != batch:
            seen = "no Engram state" if state is None else f"state for {state.batch} rows x {state.length} positions"
            raise EngramModelError(
                f"a cached forward of {batch} rows after {past} cached positions, but the cache has {seen}: "
                "Engram hashes each new token with the N-1 tokens before it, so the cache must come from this "
                "model's own forwards (pass the cache the previous call returned), or use generate()"
            )
        return state.history

    def _bind(self, args: tuple, kwargs: dict) -> dict:
        """The base forward's arguments by name (keyword arguments it collects in ``**kwargs`` included)."""
        bound = dict(zip(self._positional, args)) if args else {}
        bound.update(kwargs)
        extra = bound.pop("kwargs", None)
        if isinstance(extra, dict):
            bound.update(extra)
        return bound

    # ------------------------------------------------------------------ hooks
    def _before_base(self, module, args, kwargs):
        """Before decoder layer 0: every Engram layer's row ids for this forward (and their lookups)."""
        bound = self._bind(args, kwargs)
        input_ids = bound.get("input_ids")
        if input_ids is None:
            raise EngramModelError(
                "Engram needs input_ids: its row ids are hashes of token ids, so a forward "
                "from inputs_embeds alone cannot be served"
            )
        if input_ids.dim() != 2:
            raise EngramModelError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        cache = bound.get("cache", bound.get("past_key_values"))
        past = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
        batch, new = input_ids.shape
        device = input_ids.device
        mask = self._mask_2d(bound.get("attention_mask"), batch, past + new)  # 0/1 or bool, as given
        depth = self._depth
        stash, self._generate_inputs = self._generate_inputs, None
        window = self._generate_window(stash, past, input_ids) if stash is not None and past >= depth else None
        if window is not None and self.decode_graphs and self._graphs.usable(input_ids):
            window_mask = None if mask is None else mask[:, past - depth :]
            graphs = self._graphs.front(window, window_mask)
            self.last_row_ids = graphs.row_ids
            next_state, _ = self._next_state(bound, module, cache, past, new, batch, device, window, window_mask)
            self._step = _Step(None, next_state, graphs)
            return
        before = None
        if window is not None:
            # Inside generate(): the look-back and the new tokens are one slice of its sequences.
            ids, valid = window, None if mask is None else _as_valid(mask[:, past - depth :], device)
        elif past == 0:
            ids, valid = input_ids, None if mask is None else _as_valid(mask, device)
        else:  # the new tokens after the look-back the cache's state (or generate) holds
            before = self._lookback(batch, past, input_ids, cache, stash if past < depth else None)
            ids = input_ids
            valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else _as_valid(mask[:, past:], device)
        # Contiguous once here: each Engram layer's gate would otherwise copy the strided slice itself.
        current = None if valid is None else valid[:, valid.shape[1] - new :].contiguous()
        if before is None:
            row_ids = self.hasher(ids, blocked=None if valid is None else ~valid)
            if ids.shape[1] != new:  # the look-back's own row_ids are dropped
                row_ids = row_ids[:, ids.shape[1] - new :]
        else:
            row_ids = self.hasher.hash_ragged(
                input_ids.reshape(-1),
                torch.arange(batch + 1, device=device) * new,
                history=before,
                slots=torch.arange(batch, device=device),
                blocked=(~valid).reshape(-1),
                commit=False,
            )
            row_ids = row_ids.view(batch, new, *row_ids.shape[1:])
        self.last_row_ids = row_ids
        engram_inputs = (
            self._start_lookups(row_ids) if self.memory is not None else HashedRowIds(row_ids, self.config.layer_ids)
        )
        next_state, conv_in = self._next_state(bound, module, cache, past, new, batch, device, ids, valid, before)
        conv = None if conv_in is None else _StepConvStates(conv_in, next_state)
        context = ForwardContext(engram_inputs=engram_inputs, token_mask=current, conv=conv)
        self._step = _Step(context, next_state)

    def _next_state(
        self, bound, module, cache, past: int, new: int, batch: int, device, ids, valid, before=None
    ) -> tuple[DecodeState | None, dict | None]:
        """(DecodeState, ShortConv inputs) kept for the next forward, when this one fills a cache; else Nones.
        The state follows token ids `ids` (`valid`: their padding mask), after look-back `before` if given."""
        use_cache = bound.get("use_cache")
        if use_cache is None:
            use_cache = getattr(getattr(module, "config", None), "use_cache", False)
        if cache is None and not use_cache:
            return None, None
        if before is None:
            next_state = DecodeState.of_window(self.hasher, ids, valid, past + new)
        else:
            next_state = DecodeState.after(self.hasher, before, ids, valid, past + new)
        conv_in = self._conv_inputs(cache, past, batch, device) if self._conv_layers else None
        return next_state, conv_in

    def _conv_inputs(self, cache, past: int, batch: int, device) -> dict[int, torch.Tensor] | None:
        """Each ShortConv's inputs before this forward: zeros at a start, else the cache's saved ones."""
        conv_layers = self._conv_layers
        if not conv_layers:
            return None
        state = self._states.get(cache) if past else None
        if past and (state is None or state.length != past or state.batch != batch):
            raise EngramModelError(
                "this cache was reordered or cropped outside the Engram model (e.g. assisted decoding), but the "
                "ShortConv keeps each sequence's recent Engram outputs and cannot follow: use an EngramConfig with "
                "short_conv=False for this kind of decoding"
            )
        out = {}
        for lid, e in conv_layers.items():
            if past:
                out[lid] = state.conv[lid]
            else:
                width = (e.short_conv.kernel_size - 1) * e.short_conv.dilation
                out[lid] = torch.zeros(batch, width, 1, e.hidden_size, device=device, dtype=e.compute_dtype)
        return out

    def _after_base(self, module, args, kwargs, output):
        step = self._step
        if step is None or step.next_state is None:
            return
        cache = getattr(output, "cache", None)
        if cache is None:
            cache = getattr(output, "past_key_values", None)
        if cache is None and isinstance(output, tuple):
            cache = next((o for o in output if hasattr(o, "get_seq_length")), None)
        if cache is not None:
            self._states.put(cache, step.next_state)

    def _layer_hook(self, layer_id: int):
        engram = self.engrams[layer_id]

        def hook(module, args, kwargs):
            step = self._step
            if step is None:
                raise EngramModelError(
                    f"decoder layer {layer_id} ran outside its model's forward: Engram's row ids "
                    "are hashed in the base model's forward, before the first layer"
                )
            hidden = args[0] if args else kwargs["hidden_states"]
            if step.graphs is not None:
                hidden = self._graphs.layer(step.graphs, layer_id, hidden)
            else:
                hidden = run_engram(engram, hidden, step.context)
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        return hook

    # ------------------------------------------------------------------ helpers
    def _mask_2d(self, mask, batch: int, length: int) -> torch.Tensor | None:
        if mask is None:
            stash = self._generate_inputs
            return None if stash is None or stash[1] is None else self._check_mask(stash[1], batch, length)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            return self._check_mask(mask, batch, length)
        stash = self._generate_inputs
        if stash is not None and stash[1] is not None:
            return self._check_mask(stash[1], batch, length)  # generate() turned its 2-D mask into a 4-D one
        raise EngramModelError(
            f"Engram needs the 2-D attention mask [B, past+T] to see padding, got {type(mask).__name__} "
            f"{tuple(getattr(mask, 'shape', ()))}"
        )

    @staticmethod
    def _check_mask(mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        if mask.shape != (batch, length):
            raise EngramModelError(
                f"attention_mask has shape {tuple(mask.shape)}; Engram needs [B, past+T] = {(batch, length)}"
            )
        return mask

    def _start_lookups(self, row_ids: torch.Tensor):
        # The memory's layout is this hasher's (checked when it was attached): the row ids are in range.
        return self.memory.lookup(row_ids, in_range=True)

    def _wrap_generation(self, model: nn.Module) -> None:
        original = model.prepare_inputs_for_generation

        @functools.wraps(original)
        def prepare_inputs_for_generation(input_ids, *args, **kwargs):
            # generate() hands the full running sequences here and only the new tokens to forward:
            # keep them for the forward that follows (its look-back and its 2-D padding mask), with
            # the new tokens' tensor that forward will receive.
            mask = kwargs.get("attention_mask")
            mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
            self._generate_inputs = (input_ids, mask, None)
            inputs = original(input_ids, *args, **kwargs)
            new_ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
            self._generate_inputs = (input_ids, mask, new_ids if isinstance(new_ids, torch.Tensor) else None)
            return inputs

        previous_reorder = getattr(model, "_reorder_cache", None)

        def _reorder_cache(cache, beam_idx):
            # generate()'s beam search calls this, when a model has it, instead of cache.reorder_cache.
            if previous_reorder is not None:
                cache = previous_reorder(cache, beam_idx)
            else:
                cache.reorder_cache(beam_idx)
            self._states.reorder(cache, beam_idx)
            return cache

        model.prepare_inputs_for_generation = prepare_inputs_for_generation
        model._reorder_cache = _reorder_cache

    def remove_hooks(self) -> None:
        """Remove the forward hooks only (the modules stay): `remove_engram` undoes all of `add_engram`."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _as_valid(mask: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A 2-D attention mask (0/1 or bool) as bool, True at real tokens (on `device` when given: moved only
    when elsewhere, as a `.to` that returns the tensor itself still costs a dispatch)."""
    if device is not None and mask.device != device:
        mask = mask.to(device)
    return mask if mask.dtype == torch.bool else mask != 0


# ---------------------------------------------------------------------- public entry points
def remove_engram(model: nn.Module) -> nn.Module:
    """Undo `add_engram`, in place; returns the model.

    The hooks are removed, each decoder layer's ``engram`` child deleted (tables included),
    the methods `add_engram` wrapped (``prepare_inputs_for_generation``, ``_reorder_cache``,
    ``save_pretrained``) put back and the ``condmem_engram`` section dropped from the
    config: the model computes, generates and saves as it did before, and `add_engram` can
    be called on it again. An `EngramMemory` the tables were offloaded to is not closed:
    its owner closes it (`offload_tables` returned it).
    """
    adapter = get_engram(model)
    adapter.remove_hooks()
    _, _, decoder_layers = locate(model)
    for lid, engram in adapter.engrams.items():
        if decoder_layers[lid]._modules.get("engram") is engram:
            del decoder_layers[lid]._modules["engram"]
    for name, previous in adapter._patched.items():
        if previous is _UNSET:
            vars(model).pop(name, None)
        else:
            setattr(model, name, previous)
    del model._condmem_engram
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    return model


def get_engram(model: nn.Module) -> EngramAdapter:
    """The `EngramAdapter` that `add_engram` attached to `model`."""
    adapter = getattr(model, "_condmem_engram", None)
    if adapter is None:
        raise EngramModelError(f"{type(model).__name__} has no Engram: call add_engram(model, ...) first")
    return adapter


def engram_summary(model: nn.Module) -> str:
    """What `add_engram` added to `model`: layers, n-grams, table rows, parameters, where the tables are.

    ``print(model)`` opens with the same lines. Example::

        Engram at decoder layers [0, 2] of LlamaForCausalLM: 2- to 3-grams, 2 heads, rows of 8
          tables: 620 rows (layer 0: 272, layer 2: 348) = 4,960 parameters, in the modules (sparse gradients)
          projections, norms and ShortConv: 2,368 parameters
          Engram: 7,328 of 112,000 parameters (6.54%)
    """
    adapter = get_engram(model)
    config, layout = adapter.config, adapter.layout
    num_rows = {lid: layout.layer(lid).num_embeddings for lid in config.layer_ids}
    table_params = sum(num_rows.values()) * config.head_dim
    engram_params = sum(p.numel() for e in adapter.engrams.values() for p in e.parameters())
    total = sum(p.numel() for p in model.parameters())
    if adapter.memory is not None:
        stores = adapter.memory.stores.values()
        tiers = ", ".join(sorted({f"{s.tier} ({s.format})" for s in stores}))
        where = f"in an EngramMemory: {tiers}, rows delivered to {adapter.memory.device}; not trained"
    else:
        sparse = all(e.table.sparse for e in adapter.engrams.values())
        where = f"in the modules ({'sparse' if sparse else 'dense'} gradients)"
    orders = f"{2}- to {config.max_ngram_size}-grams" if config.max_ngram_size > 2 else "2-grams"
    per_layer = ", ".join(f"layer {lid}: {n:,}" for lid, n in num_rows.items())
    return (
        f"Engram at decoder layers {list(config.layer_ids)} of {type(model).__name__}: {orders}, "
        f"{config.n_heads} heads, rows of {config.head_dim}\n"
        f"  tables: {sum(num_rows.values()):,} rows ({per_layer}) = {table_params:,} parameters, {where}\n"
        f"  projections, norms{' and ShortConv' if config.short_conv else ''}: "
        f"{engram_params - table_params:,} parameters\n"
        f"  Engram: {engram_params:,} of {total:,} parameters ({100 * engram_params / max(total, 1):.2f}%)"
    )


def offload_tables(model: nn.Module, tier: str = "host", device: str | torch.device | None = None, **memory_kwargs):
    """Move the model's Engram tables into an `EngramMemory` in `tier` ("hbm", "host" or "disk"-backed host).

    The modules' own tables become meta tensors (no memory) and every forward reads rows
    through the memory, their lookups started before the first decoder layer. Tables are
    stored as bf16. For inference: the offloaded tables are not trained. Returns the memory
    (close it when done).
    """
    from condmem.serving.memory import EngramMemory

    adapter = get_engram(model)
    if adapter.memory is not None:
        raise EngramModelError("the tables already sit in an EngramMemory")
    if device is None:
        device = next(iter(adapter.engrams.values())).wkv.weight.device
    if torch.device(device).type == "cpu":
        memory_kwargs.setdefault("host_alloc", "pageable")  # page-locking serves only copies to a GPU
    weights = {lid: e.table.weight.detach() for lid, e in adapter.engrams.items()}
    memory = EngramMemory.from_weights(adapter.hasher, weights, tier=tier, device=device, **memory_kwargs)
    for e in adapter.engrams.values():
        e.table.weight = nn.Parameter(torch.empty_like(e.table.weight, device="meta"), requires_grad=False)
    adapter.memory = memory
    return memory
