"""Several runs of one sweep at once on one device: `run_parallel` prepares the data and writes the
plan once, starts K worker processes that take the selected runs not finished yet from one queue (in
plan order), shows the sweep's progress while they train, and merges once every run exists.

A small model leaves a large GPU idle between its kernels, so K processes fill those gaps (the
measured gain is in docs/benchmarks.md). Each worker is `run_study` with ``stage="train"`` over every
run left, its output in ``OUT/logs/worker-K.log``; a run is trained by the worker that claims it
first (`claim_run`, in a folder of this command's), so a worker that is free takes the next run,
runs of unequal cost balance themselves, and a worker that fails loses only the run it was
training while the rest of the queue goes on; one out of GPU memory beside the others gives its run
back, for a worker with one process fewer beside it to take. Results are the same run
files a single process writes (deterministic mode gives the same losses alone and side by side)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

from condmem.apps.study.runs import RunStore, SweepProgress
from condmem.apps.study.sweep import finish, run_study


def worker_options(options: dict, plan_seconds: float) -> dict:
    """The workers' options: ``stop_after`` less the plan stage's time (the data's preparation), since
    a worker counts its minutes from its own start and the limit is the command's."""
    if options.get("stop_after") is None:
        return options
    return {**options, "stop_after": max(0.0, options["stop_after"] - plan_seconds / 60)}


def _worker(kind: str, out: str, run_ids: list[str], claims: str, log_path: str, options: dict) -> None:
    """One worker process: its output to its log file (file descriptors, so compilers' and kernels'
    messages land there too), then `run_study` over the queue of `run_ids`, claimed in `claims`."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    run_study(kind, out, only=[f"run={r}" for r in run_ids], stage="train", progress=False, claims=claims, **options)


def _follow(procs: list, todo: list[str], store: RunStore, bar: SweepProgress, poll_seconds: float) -> None:
    """Tick `bar` as the runs of `todo` appear in `store`, until every worker has exited."""
    seen, last = set(), time.perf_counter()
    while True:
        alive = any(p.is_alive() for p, _ in procs)
        for run_id in todo:
            if run_id not in seen and store.path(run_id).exists():
                seen.add(run_id)
                now = time.perf_counter()
                bar.finished(now - last)
                last = now
        if not alive:
            return
        time.sleep(poll_seconds)


def run_parallel(
    kind: str,
    out: str | Path | None,
    workers: int,
    *,
    only: list[str] | None = None,
    progress: bool = True,
    poll_seconds: float = 2.0,
    **options,
) -> dict:
    """`run_study` with its runs spread over `workers` processes on the same device.

    Args:
        workers: processes training at once (>= 2; 1 is `run_study` itself).
        only, options: as `run_study`'s (``device``, ``stop_after``, ``overwrite``, ``preset``, ...);
            every worker gets the same options and the same queue of runs.

    Returns study.json's dict when every run exists, else ``{"complete": False, "runs_left": [...]}``.
    Raises `RuntimeError` naming the workers that failed and their logs when runs are left (the
    others' runs are kept); a failure whose run another worker took over is only said.
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 2:
        raise ValueError(f"--parallel must be an integer >= 2, got {workers!r}")
    started = time.perf_counter()
    plan = run_study(kind, out, only=only, stage="plan", progress=progress, **options)
    options = worker_options(options, time.perf_counter() - started)
    out = Path(plan["out"])
    todo = plan["selected_left"]
    count = min(workers, len(todo))
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    print(f"[sweep] {len(todo)} runs to train in {count} processes at once (logs: {logs}/worker-K.log)", flush=True)
    claims = tempfile.mkdtemp(prefix="condmem-claims-")  # outside OUT: a killed command's claims bind no other
    # spawn, not fork: the parent may hold CUDA and torch's thread pools, which a forked child cannot use
    ctx = multiprocessing.get_context("spawn")
    procs = []
    store = RunStore(out)
    planned = plan["planned"]
    bar = SweepProgress(len(planned), sum(1 for r in planned if store.path(r).exists()), progress)
    try:
        for i in range(count):
            log = logs / f"worker-{i}.log"
            args = (kind, str(out), todo, claims, str(log), options)
            proc = ctx.Process(target=_worker, args=args, name=f"study-worker-{i}")
            proc.start()
            procs.append((proc, log))
        _follow(procs, todo, store, bar, poll_seconds)
    finally:
        for proc, _ in procs:
            proc.join()
        bar.close()
        shutil.rmtree(claims, ignore_errors=True)
    failed = [(p.name, p.exitcode, log) for p, log in procs if p.exitcode != 0]
    if failed:
        names = ", ".join(f"{name} (exit code {code}, log {log})" for name, code, log in failed)
        said = f"condmem study: {len(failed)} of {len(procs)} workers failed: {names}"
        if any(not store.path(r).exists() for r in todo):
            raise RuntimeError(f"{said}; finished runs are kept")
        print(f"[sweep] {said}; the other workers trained their runs", flush=True)
    return finish(out, planned)
