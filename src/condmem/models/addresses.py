"""Random Engram addresses: the control in which no table row follows content.

With ``ModelConfig.engram_addresses = "random"`` a `DecoderLM` reads its Engram tables at
rows drawn uniformly at random over each (order, head) column's range instead of the n-gram
hash's rows: same tables, same gathers, same FLOPs, but a row is a random token's row at
every step, so whatever the table learns cannot be memory of n-grams.

Draws are reproducible: the k-th training draw of a model built with `seed` comes from a
generator seeded by (seed, "train", k), the k-th evaluation-mode draw from (seed, "eval", k).
The training count is a buffer saved with the model's weights (a resumed run continues the
sequence); the evaluation count starts at 0 with each model object.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from condmem.layout import EngramLayout


def draw_seed(seed: int, stream: str, index: int) -> int:
    """A 56-bit generator seed from (seed, stream, index)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{stream}:{index}".encode()).digest()[:7], "little")


def random_row_ids(
    layout: EngramLayout, lead: tuple[int, ...], generator: torch.Generator, device: torch.device | str
) -> torch.Tensor:
    """Row ids uniform over each column's range: int64 [*lead, n_layers, n_cols].

    Column c of layer l gets ``offsets[l][c] + randint(primes[l][c])``: the same range the
    hash addresses. `generator` must live on `device`."""
    primes = torch.tensor(layout.primes_array(), dtype=torch.int64, device=device)
    offsets = torch.tensor(layout.offsets_array(), dtype=torch.int64, device=device)
    u = torch.rand((*lead, *primes.shape), generator=generator, device=device, dtype=torch.float64)
    # floor(u * p) < p for u < 1; fp64 keeps every row of a range of up to 2**52 reachable.
    return offsets + (u * primes).floor().to(torch.int64).clamp_max_(primes - 1)


class RandomAddresses(nn.Module):
    """Draws a `DecoderLM`'s row ids at random (see the module docstring).

    Buffer ``train_draws`` (int64 scalar): training-mode draws made so far, mirrored by a host
    integer so that drawing needs no device-to-host copy."""

    def __init__(self, layout: EngramLayout, seed: int, device=None):
        super().__init__()
        self.layout, self.seed = layout, seed
        self.register_buffer("train_draws", torch.zeros((), dtype=torch.int64, device=device))
        self._train, self._eval = 0, 0
        self.register_load_state_dict_post_hook(_sync_count)

    def forward(self, lead: tuple[int, ...], device: torch.device | str, training: bool) -> torch.Tensor:
        """Row ids int64 [*lead, n_layers, n_cols] for ids of shape `lead`, on `device`."""
        if training:
            stream, index = "train", self._train
            self._train += 1
            self.train_draws.fill_(self._train)
        else:
            stream, index = "eval", self._eval
            self._eval += 1
        gen = torch.Generator(device=device)
        gen.manual_seed(draw_seed(self.seed, stream, index))
        return random_row_ids(self.layout, tuple(lead), gen, device)

    def extra_repr(self) -> str:
        return f"seed={self.seed}, train_draws={self._train}, eval_draws={self._eval}"


def _sync_count(module: RandomAddresses, incompatible_keys) -> None:
    if module.train_draws.device.type != "meta":
        module._train = int(module.train_draws)
