"""A continuous-batching scheduler with chunked prefill under a token budget, on `ragged_step`.

Each step packs, in this order, one decode token for every sequence whose prompt is done and
then prefill chunks of the waiting prompts, first come first served, until the step's token
budget is spent. The whole step is one forward (`ragged_step`), and with an `EngramMemory`
every Engram layer's rows are hashed and their lookups started before the first layer
(`EngramMemory.prepare_ragged`, with the memory's history slots numbered like the cache
slots). Sampling is greedy; a sequence leaves when it has its `max_new_tokens` or emits a
stop id, and its slot is reused.

**Lookahead** (with a memory, the default): the prefill chunks of step t+1 do not depend on
step t's samples, so they are planned, hashed and their lookups started right after step t's
forward is queued, before its logits are read: the fetch of the next step's prompt rows runs
while this step computes. Step t+1's decode tokens are known only from step t's samples;
their rows (a decode-sized lookup, one kernel) are fetched at t+1. The chunks are planned
against the most decode tokens step t+1 can have (every sequence that samples at step t), so
the step stays within the budget; a request is admitted one step later than it would be
without lookahead. The tokens are the same either way.

This is the reference loop for an engine's scheduler (and what the tests hold to a full
forward per sequence); engines keep their own policies (priorities, preemption) and call the
same pieces. Its steps change shape with every batch, so they run eagerly; `WaveServer` is the
other driver: fixed waves whose decode replays a CUDA graph (what ``condmem bench e2e`` times).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from condmem.serving.cache import ServingCache
from condmem.serving.memory import join_prepared
from condmem.serving.steps import ragged_step
from condmem.utils.device_copy import to_device


@dataclass
class Request:
    """One sequence: its prompt, what it generated, and where it is."""

    rid: object
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    slot: int = -1
    prefilled: int = 0
    """Prompt tokens already in the cache."""
    next_token: int | None = None
    """The sampled token not yet fed back."""


class Scheduler:
    """Serve requests with chunked prefill under `token_budget` tokens per forward.

    Args:
        model: a `DecoderLM` without ShortConv (what `ragged_step` serves).
        cache: its `ServingCache` (slots = concurrent sequences).
        memory: optional `EngramMemory` whose history has at least as many slots (rows come
            from it; otherwise from the model's own tables).
        token_budget: tokens per forward (decode tokens first, then prefill chunks).
        stop_ids: token ids that end a sequence.
        lookahead: with a memory, start the next step's prefill lookups while this step
            computes (see the module's docstring).
    """

    def __init__(
        self,
        model,
        cache: ServingCache,
        memory=None,
        token_budget: int = 512,
        stop_ids: tuple[int, ...] = (),
        lookahead: bool = True,
    ):
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if memory is not None and memory.history.n_slots < cache.n_slots:
            raise ValueError(f"the memory has {memory.history.n_slots} history slots, the cache {cache.n_slots}")
        self.model, self.cache, self.memory = model, cache, memory
        self.token_budget, self.stop_ids = token_budget, set(stop_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[object, list[int]] = {}
        self._free = list(range(cache.n_slots - 1, -1, -1))
        self.steps = 0
        self.lookahead = lookahead and memory is not None
        self._ahead: tuple[list[tuple[Request, list[int]]], object] | None = None
        """The next step's prefill chunks, planned a step ahead, and their `Prepared` lookups."""

    def submit(self, rid, prompt: list[int] | torch.Tensor, max_new_tokens: int) -> None:
        prompt = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        if not prompt:
            raise ValueError(f"request {rid!r}: an empty prompt")
        if len(prompt) + max_new_tokens > self.cache.max_len:
            raise ValueError(
                f"request {rid!r}: {len(prompt)} + {max_new_tokens} tokens exceed the cache's "
                f"{self.cache.max_len} positions"
            )
        self.waiting.append(Request(rid, prompt, max_new_tokens))

    def _admit(self) -> None:
        while self.waiting and self._free:
            req = self.waiting.popleft()
            req.slot = self._free.pop()
            if self.memory is not None:
                self.memory.history.reset([req.slot])
            self.running.append(req)

    def _prefill_chunks(self, budget: int, prefilled: dict[int, int] | None = None) -> list[tuple[Request, list[int]]]:
        """Prefill chunks of the running requests, first come first served, within `budget` tokens
        (`prefilled`: request id -> prompt tokens counted as done, for planning a step ahead)."""
        chunks = []
        for req in self.running:
            done = req.prefilled if prefilled is None else prefilled.get(id(req), req.prefilled)
            left = len(req.prompt) - done
            if left > 0 and budget > 0:
                n = min(left, budget)
                chunks.append((req, req.prompt[done : done + n]))
                budget -= n
        return chunks

    def _prepare(self, reqs: list[Request], chunks: list[list[int]]):
        ids = torch.tensor([t for c in chunks for t in c])
        cu = torch.tensor([0, *itertools.accumulate(len(c) for c in chunks)])
        return self.memory.prepare_ragged(ids, cu, slots=torch.tensor([r.slot for r in reqs]))

    def step(self) -> list[tuple[object, int]]:
        """One forward; returns the (request id, token) pairs sampled in it."""
        self._admit()
        if not self.running:
            return []
        budget = self.token_budget
        decode = [req for req in self.running if req.next_token is not None][:budget]
        budget -= len(decode)
        if self._ahead is not None:
            prefill, prefill_prepared = self._ahead
            self._ahead = None
        else:
            prefill, prefill_prepared = self._prefill_chunks(budget), None
        plan = [(req, [req.next_token], True) for req in decode] + [(req, chunk, False) for req, chunk in prefill]
        slots = [req.slot for req, _, _ in plan]
        chunks = [torch.tensor(chunk) for _, chunk, _ in plan]
        prepared = None
        if self.memory is not None:
            parts = []
            if decode:
                parts.append(self._prepare(decode, [[r.next_token] for r in decode]))
            if prefill:
                parts.append(
                    prefill_prepared
                    if prefill_prepared is not None
                    else self._prepare([r for r, _ in prefill], [c for _, c in prefill])
                )
            prepared = join_prepared(parts)
        device = self.cache.tokens.device
        logits = ragged_step(self.model, self.cache, slots, [c.to(device) for c in chunks], prepared=prepared)
        if self.lookahead:
            self._plan_ahead(prefill)
        samplers, rows, at = [], [], 0
        for req, chunk, is_decode in plan:
            at += len(chunk)
            if is_decode:
                req.generated.append(req.next_token)
                req.next_token = None
            else:
                req.prefilled += len(chunk)
            if is_decode or req.prefilled == len(req.prompt):
                samplers.append(req)
                rows.append(at - 1)
        # Every sampled token in one read back: a read per request would wait for the GPU each time.
        tokens = logits[to_device(rows, device)].argmax(-1).tolist() if rows else []
        emitted = []
        for req, token in zip(samplers, tokens):
            emitted.append((req.rid, token))
            if len(req.generated) + 1 >= req.max_new_tokens or token in self.stop_ids:
                req.generated.append(token)
                self._finish(req)
            else:
                req.next_token = token
        self.steps += 1
        return emitted

    def _plan_ahead(self, prefill: list[tuple[Request, list[int]]]) -> None:
        """While this step's forward runs: the next step's prefill chunks, their lookups started."""
        prefilled = {id(req): req.prefilled + len(chunk) for req, chunk in prefill}
        # The most decode tokens the next step can have: every sequence with a sampled token
        # (served in this step or left over by the budget) and every prompt this step completes.
        samplers = sum(req.next_token is not None for req in self.running) + sum(
            prefilled[id(req)] == len(req.prompt) for req, _ in prefill
        )
        self._admit()  # slots free now; the next step's prefill may start them
        chunks = self._prefill_chunks(self.token_budget - samplers, prefilled)
        if chunks:
            self._ahead = (chunks, self._prepare([r for r, _ in chunks], [c for _, c in chunks]))

    def _finish(self, req: Request) -> None:
        self.finished[req.rid] = req.generated
        self.running.remove(req)
        self.cache.release(req.slot)
        self._free.append(req.slot)

    def run(self) -> dict[object, list[int]]:
        """Step until every submitted request is done; returns {request id: generated tokens}."""
        while self.waiting or self.running:
            self.step()
        return self.finished
