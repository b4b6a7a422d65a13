"""Spawning gloo ranks for the distributed tests (tests/distributed).

About one run in ten of these tests on a loaded 2-core machine saw a rank abort
("terminate called without an active exception", SIGABRT) with every check passed: a
teardown race inside gloo, not seen in 40 runs of the same work outside pytest. Such an
abort (and only that: a failed check raises ProcessRaisedException) is retried twice, with
a warning; a third abort fails the test.
"""

from __future__ import annotations

import signal
import warnings

import torch.multiprocessing as mp


def spawn_ranks(fn, world: int, init_file, *args, retries: int = 2) -> None:
    """Run ``fn(rank, world, init_file, *args)`` on `world` spawned ranks; each attempt gets
    its own rendezvous file (`init_file` suffixed by the attempt)."""
    for attempt in range(retries + 1):
        try:
            mp.spawn(fn, args=(world, f"{init_file}.{attempt}", *args), nprocs=world, join=True)
            return
        except mp.ProcessExitedException as exc:
            if exc.exit_code != -signal.SIGABRT or attempt == retries:
                raise
            warnings.warn(f"a gloo rank aborted at teardown (attempt {attempt + 1}); retrying", stacklevel=2)
