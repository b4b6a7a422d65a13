"""A continuous-batching scheduler with chunked prefill under a token budget, on `ragged_step`.

Each step packs, in this order, one decode token for every sequence whose prompt is done and
then prefill chunks of the waiting prompts, first come first served, until the step's token
budget is spent. The whole step is one forward (`ragged_step`), and with an `EngramMemory`
every Engram layer's rows are hashed and their lookups started before the first layer
(`EngramMemory.prepare_ragged`, with the memory's history slots numbered like the cache
slots). Sampling is greedy; a sequence leaves when it has its `max_new_tokens` or emits a
stop id, and its slot is reused.

This is the reference loop for an engine's scheduler (and what the tests hold to a full
forward per sequence); engines keep their own policies (priorities, preemption) and call the
same pieces.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from condmem.models.serving import ServingCache, ragged_step


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
    """

    def __init__(self, model, cache: ServingCache, memory=None, token_budget: int = 512,
                 stop_ids: tuple[int, ...] = ()):
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

    def submit(self, rid, prompt: list[int] | torch.Tensor, max_new_tokens: int) -> None:
        prompt = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        if not prompt:
            raise ValueError(f"request {rid!r}: an empty prompt")
        if len(prompt) + max_new_tokens > self.cache.max_len:
            raise ValueError(f"request {rid!r}: {len(prompt)} + {max_new_tokens} tokens exceed the cache's "
                             f"{self.cache.max_len} positions")
        self.waiting.append(Request(rid, prompt, max_new_tokens))

    def _admit(self) -> None:
        while self.waiting and self._free:
            req = self.waiting.popleft()
            req.slot = self._free.pop()
            if self.memory is not None:
                self.memory.history.reset([req.slot])
            self.running.append(req)

    def step(self) -> list[tuple[object, int]]:
        """One forward; returns the (request id, token) pairs sampled in it."""
        self._admit()
        if not self.running:
            return []
        budget = self.token_budget
        plan: list[tuple[Request, list[int], bool]] = []  # (request, chunk tokens, is a decode token)
        for req in self.running:  # decode tokens first: they never wait behind prompts
            if req.next_token is not None and budget > 0:
                plan.append((req, [req.next_token], True))
                budget -= 1
        for req in self.running:
            left = len(req.prompt) - req.prefilled
            if left > 0 and budget > 0:
                n = min(left, budget)
                plan.append((req, req.prompt[req.prefilled : req.prefilled + n], False))
                budget -= n
        slots = [req.slot for req, _, _ in plan]
        chunks = [torch.tensor(chunk) for _, chunk, _ in plan]
        prepared = None
        if self.memory is not None:
            ids = torch.cat(chunks)
            cu = torch.tensor([0] + [sum(len(c) for c in chunks[: i + 1]) for i in range(len(chunks))])
            prepared = self.memory.prepare_ragged(ids, cu, slots=torch.tensor(slots))
        device = self.cache.tokens.device
        logits = ragged_step(self.model, self.cache, slots, [c.to(device) for c in chunks], prepared=prepared)
        emitted, at = [], 0
        for req, chunk, decode in plan:
            at += len(chunk)
            if decode:
                req.generated.append(req.next_token)
                req.next_token = None
            else:
                req.prefilled += len(chunk)
            if decode or req.prefilled == len(req.prompt):
                token = int(logits[at - 1].argmax())
                emitted.append((req.rid, token))
                if len(req.generated) + 1 >= req.max_new_tokens or token in self.stop_ids:
                    req.generated.append(token)
                    self._finish(req)
                else:
                    req.next_token = token
        self.steps += 1
        return emitted

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
