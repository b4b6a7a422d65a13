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

**Bad input and faults.** `submit` refuses a request it could not serve (a ValueError
naming the request id and the problem: an empty, non-integer or out-of-vocabulary prompt, a
`max_new_tokens` below 1, a request longer than the cache, an id already pending or finished
but not collected), so one bad request never reaches a step shared with others. A step that
raises anyway (a fault in the forward, the hashing or a lookup) is rewound (each running
sequence's cache length and Engram history set back from its own tokens) and its requests run
again one at a time: the one whose step raises is finished with a `RequestFailed` as its
result, the others go on and give the tokens they would have given without it.

This is the reference loop for an engine's scheduler (and what the tests hold to a full
forward per sequence); engines keep their own policies (priorities, preemption) and call the
same pieces. Its steps change shape with every batch, so they run eagerly; `WaveServer` is the
other driver: fixed waves whose decode replays a CUDA graph (what ``condmem bench e2e`` times).
"""

from __future__ import annotations

import itertools
import logging
import numbers
from collections import deque
from dataclasses import dataclass, field

import torch

from condmem.serving.cache import ServingCache
from condmem.serving.memory import join_prepared
from condmem.serving.steps import ragged_step
from condmem.utils.device_copy import to_device

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """The result of a request whose step raised: ``rid``, the ``tokens`` it generated (and
    `Scheduler.step` returned) before, and the error itself as ``__cause__``."""

    def __init__(self, rid, tokens: list[int], error: BaseException):
        super().__init__(
            f"request {rid!r} failed after {len(tokens)} generated tokens: {type(error).__name__}: {error}"
        )
        self.rid, self.tokens = rid, tokens
        self.__cause__ = error


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

    Results: `run` (or `collect`, after driving `step` yourself) hands over ``{request id:
    result}`` for every request finished since the last hand-over: the generated tokens
    (``list[int]``), or for a request whose step raised a `RequestFailed` (test with
    ``isinstance``; the error is its ``__cause__``, the tokens generated before it its
    ``tokens``). A request id is unique among the requests waiting, running, and finished
    but not yet handed over; once handed over it may be used again.
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
        if any(c is not None for c in cache.conv.values()):
            raise ValueError("the Scheduler serves models without a ShortConv (ragged_step); use prefill / decode_step")
        self.model, self.cache, self.memory = model, cache, memory
        self.token_budget, self.stop_ids = token_budget, set(stop_ids)
        hashers = [h for h in (getattr(model, "hasher", None), getattr(memory, "hasher", None)) if h is not None]
        self.vocab_size = min([model.cfg.vocab_size, *(h.vocab_size for h in hashers)])
        """Token ids a prompt may hold: 0..vocab_size-1 (the model's embedding and its hashers' tokenizer)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[object, list[int] | RequestFailed] = {}
        """Results not yet handed over (`collect`)."""
        self._pending: set = set()
        """Ids of the waiting and running requests."""
        self._free = list(range(cache.n_slots - 1, -1, -1))
        self.steps = 0
        self.lookahead = lookahead and memory is not None
        self._ahead: tuple[list[tuple[Request, list[int]]], object] | None = None
        """The next step's prefill chunks, planned a step ahead, and their `Prepared` lookups."""

    def submit(self, rid, prompt: list[int] | torch.Tensor, max_new_tokens: int) -> None:
        """Queue request `rid`: greedy `max_new_tokens` (>= 1) after `prompt` (a non-empty 1-D
        integer tensor or sequence of ints, each in 0..vocab_size-1). Raises ValueError naming
        the request and what is wrong; nothing is queued then."""
        ids = self._check(rid, prompt, max_new_tokens)
        self.waiting.append(Request(rid, ids, int(max_new_tokens)))
        self._pending.add(rid)

    def _check(self, rid, prompt, max_new_tokens) -> list[int]:
        """`submit`'s checks; returns the prompt as a list of ints."""
        try:
            hash(rid)
        except TypeError:
            raise ValueError(f"request {rid!r}: a request id must be hashable") from None
        if rid in self._pending:
            raise ValueError(f"request {rid!r}: a request with this id is already waiting or running")
        if rid in self.finished:
            raise ValueError(
                f"request {rid!r}: a request with this id finished and its result was not collected yet "
                "(run() or collect() hands it over)"
            )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise ValueError(f"request {rid!r}: max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens must be >= 1, got {max_new_tokens}")
        try:
            ids = _token_ids(prompt)
        except ValueError as exc:
            raise ValueError(f"request {rid!r}: {exc}") from None
        if not ids:
            raise ValueError(f"request {rid!r}: an empty prompt")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"request {rid!r}: prompt token {bad} is id {ids[bad]}, outside the vocabulary's "
                f"0..{self.vocab_size - 1}"
            )
        if len(ids) + max_new_tokens > self.cache.max_len:
            raise ValueError(
                f"request {rid!r}: {len(ids)} + {max_new_tokens} tokens exceed the cache's "
                f"{self.cache.max_len} positions"
            )
        return ids

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
        """One forward; returns the (request id, token) pairs sampled in it.

        If the forward (or its hashing, lookups or sampling) raises, the step is rewound and
        its requests run one at a time: a request whose own step raises is finished with a
        `RequestFailed`, the others advance as they would have."""
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
        try:
            emitted = self._forward(decode, prefill, prefill_prepared, self.lookahead)
        except Exception:
            emitted = self._one_by_one(decode, prefill)
        self.steps += 1
        return emitted

    def _forward(self, decode: list[Request], prefill, prefill_prepared, lookahead: bool) -> list[tuple[object, int]]:
        """Run one planned step: its forward, the next step's lookups (`lookahead`), then sampling.
        Request state changes only after every device result is read back."""
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
        device = self.cache.device
        logits = ragged_step(self.model, self.cache, slots, [c.to(device) for c in chunks], prepared=prepared)
        if lookahead:
            self._plan_ahead(prefill)
        samplers, last_tokens, at = [], [], 0
        for req, chunk, is_decode in plan:
            at += len(chunk)
            if is_decode or req.prefilled + len(chunk) == len(req.prompt):
                samplers.append(req)
                last_tokens.append(at - 1)
        # Every sampled token in one read back: a read per request would wait for the GPU each time.
        tokens = logits[to_device(last_tokens, device)].argmax(-1).tolist() if last_tokens else []
        for req, chunk, is_decode in plan:
            if is_decode:
                req.generated.append(req.next_token)
                req.next_token = None
            else:
                req.prefilled += len(chunk)
        emitted = []
        for req, token in zip(samplers, tokens):
            emitted.append((req.rid, token))
            if len(req.generated) + 1 >= req.max_new_tokens or token in self.stop_ids:
                req.generated.append(token)
                self._finish(req, req.generated)
            else:
                req.next_token = token
        return emitted

    def _one_by_one(self, decode: list[Request], prefill) -> list[tuple[object, int]]:
        """After a step raised: rewind every running sequence and run the step's requests one at a
        time; a request whose own step raises is finished with its error."""
        self._ahead = None  # its lookups advanced histories the rewind sets back
        for req in self.running:
            self._rewind(req)
        emitted = []
        for one_decode, one_prefill in [([req], []) for req in decode] + [([], [item]) for item in prefill]:
            req = one_decode[0] if one_decode else one_prefill[0][0]
            try:
                emitted += self._forward(one_decode, one_prefill, None, lookahead=False)
            except Exception as exc:
                self._rewind(req)
                logger.warning("request %r failed: %s: %s", req.rid, type(exc).__name__, exc)
                out = req.generated + ([req.next_token] if req.next_token is not None else [])
                self._finish(req, RequestFailed(req.rid, out, exc))
        return emitted

    def _rewind(self, req: Request) -> None:
        """Set `req`'s slot back to what its own tokens say it holds: the cache length and, with a
        memory, the Engram history (a failed step may have advanced either)."""
        held = req.prompt[: req.prefilled] + req.generated
        n = len(held)
        self.cache.host_lengths[req.slot] = n
        self.cache.lengths[req.slot].fill_(n)
        if self.memory is not None:
            depth = self.memory.history.ids.shape[1]
            tail = held[-depth:] if n else []
            self.memory.seed(torch.tensor([req.slot]), torch.tensor([[-1] * (depth - len(tail)) + tail]))

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

    def _finish(self, req: Request, result: list[int] | RequestFailed) -> None:
        self.finished[req.rid] = result
        self._pending.discard(req.rid)
        self.running.remove(req)
        self.cache.release(req.slot)
        self._free.append(req.slot)

    def collect(self) -> dict[object, list[int] | RequestFailed]:
        """Hand over the results of the requests finished since the last hand-over (their ids may
        then be used again): {request id: generated tokens, or a `RequestFailed`}."""
        done, self.finished = self.finished, {}
        return done

    def run(self) -> dict[object, list[int] | RequestFailed]:
        """Step until every submitted request is done; hands over the results (`collect`)."""
        while self.waiting or self.running:
            self.step()
        return self.collect()


def _token_ids(prompt) -> list[int]:
    """A prompt as a list of ints: a 1-D integer tensor, or a sequence of ints (no bools, no floats)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
            raise ValueError(f"the prompt must hold integer token ids, got a {prompt.dtype} tensor")
        if prompt.dim() != 1:
            raise ValueError(f"the prompt must be a 1-D tensor [T], got shape {tuple(prompt.shape)}")
        return prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"the prompt must be token ids (a tensor or a list of ints), got {type(prompt).__name__}")
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, torch.Tensor) and t.dim() == 0 and not (t.is_floating_point() or t.dtype == torch.bool):
            t = int(t)
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt token {i} is {t!r} ({type(t).__name__}), not an integer token id")
        ids.append(int(t))
    return ids
