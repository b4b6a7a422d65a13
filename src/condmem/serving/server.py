"""`WaveServer`: serve prompts in waves of up to ``n_slots`` sequences: packed prefill, then CUDA-graph decode.

A wave takes one cache slot per prompt. Its prompts are prefilled as packed batches of up to
``prefill_tokens`` tokens (`prefill_packed`: one forward per batch, no padding); then every
sequence decodes ``gen`` tokens greedily, one `GraphedDecoder` step per token for the whole
wave (or, without graphs, `decode_step` with a lookup per step); the slots are released.

With an `EngramMemory` and ``wait="at_layer"`` (the default), each batch's rows are hashed and
their lookups started while the batch before it runs, and the next wave's first batch while
this wave decodes: a server knows its queue, and a fresh prompt's rows need no history (it is
committed to the slot when the prompt is prefilled). Hashing runs on the memory's own stream,
beside the forward queued on the caller's. ``wait="before_step"`` is the synchronous
baseline: each batch waits for its rows before its first block, and the decode graph before
each step.

The fixed wave is what a decode graph replays; `Scheduler` is the continuous-batching loop.
The server does no timing: a `WaveObserver` passed to `serve` / `wave` is told where each
phase begins and ends (``condmem bench e2e`` times them so).
"""

from __future__ import annotations

import torch

from condmem.models.transformer import DecoderLM
from condmem.serving.cache import ServingCache
from condmem.serving.graphs import WAIT_MODES, GraphedDecoder
from condmem.serving.memory import EngramMemory, Prepared
from condmem.serving.steps import decode_step, packed_ids, prefill_packed
from condmem.utils.device_copy import to_device


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of consecutive prompts in batches of at most `budget` tokens (a longer prompt alone)."""
    groups, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    return groups + ([cur] if cur else [])


class WaveObserver:
    """Where a wave is, told to whoever measures it (every method a no-op here). Each call comes
    from the thread serving the wave, in this order: `wave_started`; per prompt batch
    `batch_queued`, `batch_launching`, `batch_launched`; `prefill_done`; `decode_done`."""

    def wave_started(self) -> None:
        """Slots taken; no prompt batch planned yet."""

    def batch_queued(self) -> None:
        """Before a prompt batch's lookups are started (or taken from those started ahead)."""

    def batch_launching(self) -> None:
        """The batch's lookups started (``wait="before_step"``: the stream waits for its rows); its forward next."""

    def batch_launched(self) -> None:
        """The batch's forward and its first-token sample queued."""

    def prefill_done(self) -> None:
        """Every prompt batch queued, and the caller's stream joined to the memory's (histories)."""

    def decode_done(self, prepared: list[Prepared]) -> None:
        """Every decode step queued; `prepared`: the wave's prompt-batch lookups (`Prepared.fetch_timing`)."""


class WaveServer:
    """Serve waves of prompts with one model, its cache, a decode graph and (optionally) an `EngramMemory`.

    Args:
        model: the decoder (eval mode).
        cache: its `ServingCache`; a wave holds up to ``cache.n_slots`` sequences. Servers of
            one backbone that serve one at a time may share it (each wave frees its slots).
        memory: optional `EngramMemory` holding the Engram tables; its history slots must cover
            the cache's (``max_sequences >= n_slots``).
        wait: ``"at_layer"`` (rows fetched ahead, each Engram layer waits for its own) or
            ``"before_step"`` (every batch and decode step waits for its rows first: the baseline).
        prefill_tokens: token budget of one packed prefill forward.
        graphs: decode with a `GraphedDecoder` where it can (CUDA, tables the GPU or its host
            threads can serve); else kernel by kernel with a lookup per step.
        fetch, fetch_programs, fetch_threads: the decode graph's fetch (`GraphedDecoder`).

    Example:
        >>> with WaveServer(model, ServingCache(model, n_slots=128), memory) as server:
        ...     tokens = server.serve(prompts, gen=128)       # [len(prompts), 128]
    """

    def __init__(
        self,
        model: DecoderLM,
        cache: ServingCache,
        memory: EngramMemory | None = None,
        *,
        wait: str = "at_layer",
        prefill_tokens: int = 8192,
        graphs: bool = True,
        fetch: str = "auto",
        fetch_programs: int | None = None,
        fetch_threads: int | None = None,
    ):
        if wait not in WAIT_MODES:
            raise ValueError(f"wait must be one of {WAIT_MODES}, got {wait!r}")
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        if memory is not None and memory.history.n_slots < cache.n_slots:
            raise ValueError(f"the memory's history has {memory.history.n_slots} slots, the cache {cache.n_slots}")
        self.model, self.cache, self.memory, self.wait = model, cache, memory, wait
        self.prefill_tokens = prefill_tokens
        self.device = model.embed.weight.device
        self.early: tuple[list[torch.Tensor], Prepared] | None = None
        """The next wave's first batch's prompts and their lookups, started while this wave decodes."""
        self.graph = None
        in_place = memory is None or all(s.gpu_readable for s in memory.stores.values())
        if self.device.type == "cuda" and in_place and graphs:
            self.graph = GraphedDecoder(
                model,
                cache,
                memory=memory,
                wait=wait,
                fetch_programs=fetch_programs,
                fetch=fetch,
                fetch_threads=fetch_threads,
            )

    @property
    def ahead(self) -> bool:
        """Whether prompt batches are fetched ahead (a memory, and ``wait="at_layer"``)."""
        return self.memory is not None and self.wait == "at_layer"

    def _prepare(self, group: list[torch.Tensor], slots: list[int] | None) -> Prepared:
        """Hash a prompt batch and start its lookups on the memory's stream; `slots` None: no
        history read or written (fresh prompts hash the same; `_commit` writes it later)."""
        ids, cu = packed_ids(group)
        slots = None if slots is None else torch.tensor(slots)
        # The forward needs no row id on the device (rows come fetched): the caller's stream
        # waits for each layer's lookup at that layer only, which follows the hash.
        return self._on_memory_stream(lambda: self.memory.prepare_ragged(ids, cu, slots=slots))

    def _commit(self, group: list[torch.Tensor], slots: list[int]) -> None:
        """Advance fresh slots' histories by their whole prompts (a batch hashed without slots)."""
        ids, cu = packed_ids(group)
        self._on_memory_stream(lambda: self.memory.commit(torch.tensor(slots), ids, cu, cu[1:] - cu[:-1]))

    def _on_memory_stream(self, fn):
        """`fn()` on the memory's own stream (after the caller's work so far: histories are reset
        there), beside the forward queued on the caller's; on the CPU, at once."""
        side = self.memory.stream
        if side is None:
            return fn()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            return fn()

    def stage(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host copy, device copy) of each prompt: the host copy is what the memory hashes beside
        the forward, the device copy what the forward reads (no pageable copy, no sync, per batch)."""
        return [(p, p.to(self.device)) for p in prompts]

    def serve(self, prompts: list[torch.Tensor], gen: int, observer: WaveObserver | None = None) -> torch.Tensor:
        """Serve `prompts` (CPU token ids [T_i]) in waves of ``n_slots``, `gen` greedy tokens each;
        returns the generated tokens [len(prompts), gen] on the model's device."""
        staged = self.stage(prompts)
        self.early = None
        batch = self.cache.n_slots
        tokens = [
            self.wave(staged[s : s + batch], gen, upcoming=staged[s + batch : s + 2 * batch], observer=observer)
            for s in range(0, len(staged), batch)
        ]
        return torch.cat(tokens)

    def wave(
        self,
        prompts: list[tuple[torch.Tensor, torch.Tensor]],
        gen: int,
        upcoming: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        observer: WaveObserver | None = None,
    ) -> torch.Tensor:
        """Prefill `prompts` (`stage`d, one per slot) and decode `gen` tokens each; returns tokens [n, gen].
        `upcoming`: the next wave's prompts, whose first batch is fetched while this wave decodes."""
        n = len(prompts)
        if not 0 < n <= self.cache.n_slots:
            raise ValueError(f"a wave of {n} prompts: the cache holds 1..{self.cache.n_slots}")
        if gen < 1:
            raise ValueError(f"gen must be >= 1, got {gen}")
        obs = observer or WaveObserver()
        memory = self.memory
        slots = [memory.allocate() for _ in range(n)] if memory is not None else list(range(n))
        out = torch.empty(n, gen, dtype=torch.long, device=self.device)
        obs.wave_started()
        groups = pack([p[0].numel() for p in prompts], self.prefill_tokens)
        ahead, alive = {}, []  # Prepared batches stay referenced until the wave has synced

        def start(g):
            return self._prepare([prompts[i][0] for i in groups[g]], [slots[i] for i in groups[g]])

        if self.ahead:
            early, self.early = self.early, None
            first = [prompts[i][0] for i in groups[0]]
            if early is not None and len(early[0]) == len(first) and all(a is b for a, b in zip(early[0], first)):
                ahead[0] = early[1]
                self._commit(first, [slots[i] for i in groups[0]])
            else:
                ahead[0] = start(0)
        for g, members in enumerate(groups):
            obs.batch_queued()
            prepared = None
            if memory is not None:
                if self.ahead:
                    prepared = ahead.pop(g)
                    if g + 1 < len(groups):  # the next batch's rows are fetched while this batch runs
                        ahead[g + 1] = start(g + 1)
                else:
                    prepared = start(g)
                    for lid in memory.layer_ids:
                        prepared.row_vectors(lid)  # the stream waits here, before block 0
                alive.append(prepared)
            obs.batch_launching()
            logits = prefill_packed(
                self.model, self.cache, [slots[i] for i in members], [prompts[i][1] for i in members], prepared=prepared
            )
            out[to_device(members, self.device), 0] = logits.argmax(-1)
            obs.batch_launched()
        if memory is not None and memory.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(memory.stream)  # histories, for decode
        obs.prefill_done()
        if upcoming and self.ahead:
            # The next wave's first batch, fetched while this wave decodes.
            first = [upcoming[i][0] for i in pack([p[0].numel() for p in upcoming], self.prefill_tokens)[0]]
            self.early = (first, self._prepare(first, None))  # referenced here until the next wave syncs
        ids = out[:, 0]
        for t in range(1, gen):
            if self.graph is not None:
                logits = self.graph.step(slots, ids)
            else:
                prep = None
                if memory is not None:
                    prep = memory.prepare_decode(torch.tensor(slots), ids)
                logits = decode_step(self.model, self.cache, torch.tensor(slots), ids, prepared=prep)
            ids = logits.argmax(-1)
            out[:, t] = ids
        obs.decode_done(alive)
        alive.clear()
        for slot in slots:
            self.cache.release(slot)
            if memory is not None:
                memory.free(slot)
        return out

    def close(self) -> None:
        """Stop the decode graph's staged fetch threads, if any (the memory is the caller's to close)."""
        if self.graph is not None:
            self.graph.close()

    def __enter__(self) -> WaveServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
