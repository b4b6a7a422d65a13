"""The state `HostTables` and its optimizer modes (`condmem.train.host_table_optim`) share: one
layer's table on the host (`HostLayer`), one step's prefetch (`StepPrefetch`), and the error
raised when the tables are used against their contract (`HostTableError`)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch


class HostTableError(RuntimeError):
    """Host-resident tables used against their contract (ids of another step, a closed tier)."""


@dataclass
class HostLayer:
    """One table on the host, its Adam state and its transfer buffers."""

    layer_id: int
    weight: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    row_step: torch.Tensor
    marker: torch.Tensor
    """bool [rows]: True for the rows of the prefetched next step (which host Adam updates first)."""
    keep: list = field(default_factory=list)
    marked: torch.Tensor | None = None
    steps: int = 0
    """Adam steps taken (no row has taken more)."""
    leaves: list = field(default_factory=list)
    grad: torch.Tensor | None = None
    consumed: list = field(default_factory=list)
    grad_jobs: list = field(default_factory=lambda: [None, None])
    buffers: dict = field(default_factory=dict)
    """Named pairs of pinned / device transfer buffers (`HostTables._named`)."""
    lookups: int = 0
    """The most row ids one step has looked up in this table (a bound on its unique rows)."""
    current: tuple | None = None
    """Device Adam: (unique ids, rows, moments, steps, read slot, owned) on the device, as the running step
    read them (owned: not the transfer buffers themselves)."""
    last: tuple | None = None
    """Device Adam: (ids, new rows, moments, steps) of the latest device Adam: the next gather's patch."""


@dataclass
class StepPrefetch:
    """The prefetch of one step: its row ids on the host and, per layer, what the gather fetched to the device."""

    step: int
    ids_host: torch.Tensor
    ids_dev: torch.Tensor
    copied: object
    gathered: concurrent.futures.Future | None = None
    fetched: dict = field(default_factory=dict)
    """Per layer, what the gather sent to the device: its row vectors (with device Adam, the unique
    rows' state too), the event that marks them there and the buffers' slot."""
    used: set = field(default_factory=set)
