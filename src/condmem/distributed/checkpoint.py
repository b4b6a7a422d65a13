"""Checkpoints of sharded tables: one file per rank, a manifest, resume at any world size.

A checkpoint is a folder ``step-XXXXXXX/`` holding ``shard-RRRRR-of-WWWWW.safetensors`` per
rank (its rows ``weight`` and the SparseAdam state of the rows that have one, by global row:
``state_rows``, ``exp_avg``, ``exp_avg_sq``, ``row_step``) and ``manifest.json`` (world size,
row bounds, the layout's fingerprint, step, each file's sha256). Every rank writes its file
into a hidden temp folder; after a barrier rank 0 writes the manifest and renames the folder
into place, then moves ``LATEST``: a crash at any point leaves the previous checkpoint whole
and current.

Loading takes this rank's rows under *its* plan from whichever old shards hold them
(safetensors slices: only those rows are read), so a run saved on 4 ranks resumes on 2
exactly: per-row Adam does not depend on where a row lives.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from condmem.distributed.sharded_table import ShardedTable
from condmem.distributed.sharding import ShardPlan
from condmem.utils.atomic import atomic_path, atomic_write_text
from condmem.utils.digest import sha256_file

FORMAT = "condmem-sharded-table-1"


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint is missing, damaged, or made for another layout."""


def _state_by_row(opt: torch.optim.Optimizer, table: ShardedTable) -> dict[str, torch.Tensor]:
    r0 = table.plan.row_range(table.rank)[0]
    state = opt.state.get(table.weight)
    d = table.weight.shape[1]
    if not state:
        return {
            "state_rows": torch.zeros(0, dtype=torch.int64),
            "exp_avg": torch.zeros(0, d),
            "exp_avg_sq": torch.zeros(0, d),
            "row_step": torch.zeros(0),
        }
    slot = state["slot_of_row"].long().cpu()
    row_ids = (slot >= 0).nonzero().flatten()  # this shard's rows with optimizer state
    slots = slot[row_ids]
    return {
        "state_rows": row_ids + r0,
        "exp_avg": state["exp_avg"].cpu()[slots].contiguous(),
        "exp_avg_sq": state["exp_avg_sq"].cpu()[slots].contiguous(),
        "row_step": state["row_step"].cpu()[slots],
    }


def save_sharded(
    run_dir: str | os.PathLike, table: ShardedTable, opt: torch.optim.Optimizer, step: int, fingerprint: str
) -> Path:
    """Every rank calls this, `opt` being the `SparseAdam` that trains `table.weight`; returns the
    checkpoint folder (on every rank)."""
    run_dir = Path(run_dir)
    plan, rank, group = table.plan, table.rank, table.group
    name = f"step-{step:07d}"
    tmp = run_dir / f".{name}.partial"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # a killed save of the same step
        tmp.mkdir(parents=True)
    dist.barrier(group)
    fname = f"shard-{rank:05d}-of-{plan.world_size:05d}.safetensors"
    tensors = {"weight": table.weight.detach().cpu().contiguous(), **_state_by_row(opt, table)}
    with atomic_path(tmp / fname) as p:
        save_file(tensors, str(p), metadata={"format": FORMAT, "rank": str(rank)})
    digests = [None] * plan.world_size
    dist.all_gather_object(digests, (fname, sha256_file(tmp / fname)), group=group)
    final = run_dir / name
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": plan.world_size,
            "row_bounds": list(plan.row_bounds),
            "col_bounds": list(plan.col_bounds),
            "fingerprint": fingerprint,
            "files": {f: h for f, h in digests},
        }
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=1) + "\n")
        if final.exists():
            aside = run_dir / f".{name}.old"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
        atomic_write_text(run_dir / "LATEST", name + "\n")
    dist.barrier(group)
    return final


def load_sharded(
    checkpoint: str | os.PathLike, plan: ShardPlan, rank: int, fingerprint: str, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, dict, int]:
    """This rank's rows under `plan` and their SparseAdam state, from a checkpoint made at any
    world size. Returns (weight [rows owned, D], state for `SparseAdam.state[param]`, step)."""
    path = Path(checkpoint)
    if (path / "LATEST").is_file():
        path = path / (path / "LATEST").read_text().strip()
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise ShardedCheckpointError(f"{path} has no manifest.json: not a complete sharded checkpoint")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("fingerprint") != fingerprint:
        raise ShardedCheckpointError(
            f"{path} was saved for layout {str(manifest.get('fingerprint'))[:16]}, this run "
            f"has {fingerprint[:16]}: every row would be read at another address"
        )
    old = manifest["row_bounds"]
    if old[-1] != plan.row_bounds[-1]:
        raise ShardedCheckpointError(f"{path} holds {old[-1]:,} rows, the plan {plan.row_bounds[-1]:,}")
    r0, r1 = plan.row_range(rank)
    weights, state_rows, avg, avg_sq, steps = [], [], [], [], []
    for q in range(manifest["world_size"]):
        a, b = old[q], old[q + 1]
        lo, hi = max(a, r0), min(b, r1)
        if lo >= hi:
            continue
        fname = f"shard-{q:05d}-of-{manifest['world_size']:05d}.safetensors"
        f = path / fname
        if not f.is_file():
            raise ShardedCheckpointError(f"{path} lacks {fname} (rank {q} of {manifest['world_size']})")
        if sha256_file(f) != manifest["files"].get(fname):
            raise ShardedCheckpointError(f"{f} does not match its sha256 in the manifest: damaged")
        with safe_open(str(f), "pt") as st:
            weights.append(st.get_slice("weight")[lo - a : hi - a])
            held = st.get_tensor("state_rows")  # global ids of the rows with optimizer state
            keep = (held >= lo) & (held < hi)
            state_rows.append(held[keep])
            avg.append(st.get_tensor("exp_avg")[keep])
            avg_sq.append(st.get_tensor("exp_avg_sq")[keep])
            steps.append(st.get_tensor("row_step")[keep])
    weight = torch.cat(weights).to(device)
    row_ids = torch.cat(state_rows) - r0  # in this rank's shard
    slot_of_row = torch.full((r1 - r0,), -1, dtype=torch.int32)
    slot_of_row[row_ids] = torch.arange(row_ids.numel(), dtype=torch.int32)
    state = {
        "slot_of_row": slot_of_row.to(device),
        "exp_avg": torch.cat(avg).to(device),
        "exp_avg_sq": torch.cat(avg_sq).to(device),
        "row_step": torch.cat(steps).to(device),
        "n_slots": int(row_ids.numel()),
        "steps": int(manifest["step"]),
    }  # no row took more steps
    return weight, state, int(manifest["step"])
