"""The runs of a `condmem study` sweep: identities, seeds, selection, deterministic training, result files.

* **A run is its point, its control and its seed index**: `RunSpec.run_id` names it
  (``rho0.7500_experts5_seed1``: letters, digits, ``._`` only) and its result file ``OUT/runs/<run-id>.json``, written
  atomically when the run ends. The seeds derive from the seed index alone (`run_seeds`),
  never from the run's position in the sweep, the runs before it or global RNG state; every
  point of a seed index shares its data order (differences are paired by seed).
* **The stored run is checked, not trusted**: its ``run_config`` (model, training settings,
  steps, seeds, data, validation cap, deterministic mode) must equal the one the sweep would
  train, else `RunMismatchError` names the keys that differ.
* **Selection** (`select_runs`): ``--only rho=0.8,seed=1`` style filters (a key repeated in one
  filter is an OR, filters are OR-ed), so several machines or device calls share one sweep.
* **Deterministic mode** (`condmem.train.determinism`): the same run twice gives the same
  per-step losses on the same machine type.
* `train_run` trains one run for exactly the steps it states (one learning-rate schedule
  over them) and validates it on at most the stated number of held-out tokens, with
  progress bars, and records the distinct rows of each Engram table training read (`RowsTouched`).
* `distinct_ngrams`: the distinct n-grams in the batches a run reads, replayed from the sampler
  (the slot sweep's cap on table sizes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from condmem.config import ConfigError
from condmem.module import EngramTable
from condmem.models.moe import reset_router_statistics, router_statistics
from condmem.train.build import build_model, build_trainer, machine_info
from condmem.apps.demo import bucket_losses
from condmem.train.loop import TrainConfig, evaluate
from condmem.train.pipeline import PreparedData
from condmem.train.progress import format_duration
from condmem.utils.atomic import atomic_write_text
from condmem.utils.progress import Progress


class RunMismatchError(ValueError):
    """A stored run was trained with another configuration than the sweep's."""


@dataclass
class RunSpec:
    """One run of a sweep: a point (its model config and accounting), a control, a seed index."""

    point: Any
    """The `condmem.apps.study.sweep.Point` (its ``cfg`` is the model trained)."""
    seed_index: int
    init_seed: int
    data_seed: int

    @property
    def run_id(self) -> str:
        return f"{self.point.key}_seed{self.init_seed}"

    def identity(self) -> dict[str, Any]:
        """What names this run in its result (id, label, seeds, the point's fields), apart from what it measured."""
        point = self.point
        return {
            "run_id": self.run_id,
            "label": point.label,
            "control": point.control,
            "seed": self.init_seed,
            "seed_index": self.seed_index,
            "init_seed": self.init_seed,
            "data_seed": self.data_seed,
            **point.record_fields(),
        }

    def fields(self) -> dict[str, Any]:
        """The values `select_runs` matches: rho (asked and realised), experts, table_size, control, seed,
        tokens (the token sweep's budget), run (the run id)."""
        p = self.point
        return {
            "rho": [v for v in (p.rho, *p.rho_asked) if v is not None],
            "experts": [p.accounting.get("n_experts")],
            "table_size": [p.accounting.get("table_size")],
            "control": [p.control or "none"],
            "seed": [self.init_seed],
            "tokens": [getattr(p, "train_tokens", None)],
            "run": [self.run_id],
        }


def run_seeds(seed: int, seed_index: int) -> tuple[int, int]:
    """(initialization seed, data-order seed) of seed index `seed_index` of a sweep starting at `seed`:
    a function of these two numbers only, the same for every point (paired comparisons)."""
    return seed + seed_index, seed + seed_index


def plan_runs(points: list, seeds: int, seed: int) -> list[RunSpec]:
    """Every (point, seed index) of a sweep, seed index major (a sweep stopped early has whole seeds)."""
    specs = []
    for k in range(seeds):
        init, data = run_seeds(seed, k)
        specs.extend(RunSpec(p, k, init, data) for p in points)
    return specs


_ONLY_KEYS = ("rho", "experts", "table_size", "control", "seed", "tokens", "run")


def parse_only(filters: list[str] | None) -> list[dict[str, list[str]]]:
    """``["rho=0.8,seed=1", ...]`` -> one dict per filter, key -> accepted values; `ValueError`
    naming --only for a malformed filter or an unknown key."""
    out = []
    for text in filters or []:
        parsed: dict[str, list[str]] = {}
        for part in text.split(","):
            key, eq, value = part.strip().partition("=")
            if not eq or not key or not value:
                raise ValueError(f"--only {text!r}: each condition is KEY=VALUE (e.g. rho=0.8,seed=1), got {part!r}")
            if key not in _ONLY_KEYS:
                raise ValueError(f"--only {text!r}: unknown key {key!r}; choose from {list(_ONLY_KEYS)}")
            parsed.setdefault(key, []).append(value)
        out.append(parsed)
    return out


def _matches(value: Any, wanted: str) -> bool:
    if isinstance(value, str) or value is None:
        return str(value) == wanted
    try:
        return math.isclose(float(value), float(wanted), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return False


def select_runs(specs: list[RunSpec], filters: list[str] | None) -> list[RunSpec]:
    """The runs any filter of ``--only`` accepts (all without filters); `ValueError` naming the filter
    that accepts none of the sweep's runs."""
    parsed = parse_only(filters)
    if not parsed:
        return list(specs)

    def accepts(spec: RunSpec, f: dict[str, list[str]]) -> bool:
        fields = spec.fields()
        return all(any(_matches(v, w) for v in fields[key] for w in wanted) for key, wanted in f.items())

    for text, f in zip(filters, parsed):
        if not any(accepts(s, f) for s in specs):
            raise ValueError(f"--only {text!r} selects none of the sweep's {len(specs)} runs")
    return [s for s in specs if any(accepts(s, f) for f in parsed)]


# ----------------------------------------------------------------------------- run configs and files


def data_identity(data: PreparedData) -> str:
    """A digest of the token streams and the tokenizer: runs on other data do not match."""
    h = hashlib.sha256()
    h.update(str(data.info["tokenizer"]["json_sha256"]).encode())
    for stream in (data.train, data.val):
        tokens = np.ascontiguousarray(stream.tokens)
        h.update(str((tokens.dtype.str, tokens.shape)).encode())
        h.update(memoryview(tokens).cast("B"))
    return h.hexdigest()[:24]


def run_train_config(tc: TrainConfig, steps: int, data_seed: int) -> TrainConfig:
    """The training settings of one run: its steps, its data seed, warm-up within the steps, no time budget."""
    return dataclasses.replace(
        tc, seed=data_seed, steps=steps, warmup_steps=min(tc.warmup_steps, max(0, steps - 1)), max_minutes=None
    )


def run_config(
    kind: str, spec: RunSpec, tc: TrainConfig, *, data_id: str, val_tokens: int | None, deterministic: bool
) -> dict:
    """Everything a run's result depends on; a stored run must carry the same dict to be reused."""
    return json.loads(
        json.dumps(
            {
                "study": kind,
                "point": spec.point.key,
                "control": spec.point.control,
                "model": spec.point.cfg.to_dict(),
                "train": tc.to_dict(),
                "init_seed": spec.init_seed,
                "data_seed": spec.data_seed,
                "data": data_id,
                "val_tokens": val_tokens,
                "deterministic": deterministic,
            }
        )
    )


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')} ({a!r} -> {b!r})"]


RESULT_FREE = (("train", "cuda_graphs"),)
"""(section, key) of settings that leave a run's result as it is: CUDA graphs replay the compiled
blocks' own kernels (the same losses bit for bit), so runs made with either value, or before the
setting existed, are one result."""


def _result_config(config: dict) -> dict:
    """`config` (a run's or a sweep's) without its `RESULT_FREE` keys."""
    out = dict(config)
    for section, key in RESULT_FREE:
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k != key}
    return out


def differences(stored: dict, wanted: dict) -> list[str]:
    """Dotted keys (with the two values) where `stored` and `wanted` differ in what decides a result."""
    return _differences(_result_config(stored), _result_config(wanted))


REUSE_IGNORES = ("study", "point")
"""Keys of a run's config that only name it in its sweep: two runs equal in the rest are the same run."""


def reuse_key(run_config: dict) -> str:
    """The part of a run's config that decides its result, as one comparable string."""
    return json.dumps({k: v for k, v in _result_config(run_config).items() if k not in REUSE_IGNORES}, sort_keys=True)


class ReusableRuns:
    """The finished runs of other sweeps' output folders, found by what decides their result.

    A sweep given these folders (``--reuse``) copies in a stored run whose config equals a planned
    run's in everything but the sweep kind and the point's name (`REUSE_IGNORES`): same model,
    training settings, seeds, data and validation, so training it again would give the same result.
    The copy carries this sweep's names for the run and ``reused_from`` (the source file and run id).
    """

    def __init__(self, folders: list[str | Path] | None):
        self.found: dict[str, tuple[Path, dict]] = {}
        for folder in folders or []:
            runs = Path(folder) / "runs"
            if not runs.is_dir():
                raise ValueError(f"--reuse {folder}: no runs/ folder there (give a sweep's --out folder)")
            for path in sorted(runs.glob("*.json")):
                try:
                    record = json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ValueError(f"--reuse: {path} is not a run result ({exc})") from None
                if isinstance(record, dict) and isinstance(record.get("run_config"), dict):
                    self.found.setdefault(reuse_key(record["run_config"]), (path, record))

    def copy(self, spec: RunSpec, wanted: dict) -> dict | None:
        """The stored run equal to `spec` with config `wanted`, renamed for this sweep; None if there is none."""
        hit = self.found.get(reuse_key(wanted))
        if hit is None:
            return None
        path, record = hit
        reused = {"path": str(path), "run_id": record.get("run_id")}
        return {**record, **spec.identity(), "run_config": wanted, "reused_from": reused}


class RunStore:
    """``OUT/runs/<run-id>.json``: one finished run each."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.dir = self.out / "runs"

    def path(self, run_id: str) -> Path:
        return self.dir / f"{run_id}.json"

    def load(self, run_id: str) -> dict | None:
        path = self.path(run_id)
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a run result ({exc}); remove it to train the run again") from None

    def finished(self, run_id: str, wanted: dict, overwrite: bool = False) -> dict | None:
        """The stored result of `run_id` when its config equals `wanted`; None when there is none (or,
        with `overwrite`, when it differs); `RunMismatchError` naming the keys otherwise."""
        stored = self.load(run_id)
        if stored is None:
            return None
        diff = differences(stored.get("run_config", {}), wanted)
        if not diff:
            return stored
        if overwrite:
            return None
        shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
        raise RunMismatchError(
            f"{self.path(run_id)} was trained with another configuration ({shown}): use another --out, "
            "or --overwrite to train it again"
        )

    def write(self, record: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(record["run_id"])
        atomic_write_text(path, json.dumps(record, indent=1) + "\n", within=self.out)
        return path


def claim_run(claims: Path, run_id: str) -> bool:
    """Take `run_id` for this process among the processes sharing the folder `claims`: True for the
    first to ask, False for every other (an exclusive create, atomic on a local file system)."""
    try:
        os.close(os.open(Path(claims) / run_id, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def is_claimed(claims: Path, run_id: str) -> bool:
    """Whether a process sharing `claims` has taken `run_id` (`claim_run`) and not given it back."""
    return (Path(claims) / run_id).exists()


def release_run(claims: Path, run_id: str) -> None:
    """Give `run_id` back (a run this process claimed but could not train): the next to ask takes it."""
    (Path(claims) / run_id).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- training one run


def train_run(
    spec: RunSpec,
    data: PreparedData,
    dev: torch.device,
    tc: TrainConfig,
    *,
    seen: np.ndarray,
    val_tokens: int | None,
    progress: bool,
) -> dict:
    """Train `spec` for ``tc.steps`` steps (`run_train_config`), validate on at most `val_tokens`
    held-out tokens (None: every one); the run's result (per-step losses included)."""
    point = spec.point
    label = f"{point.label} seed {spec.init_seed}"
    started = time.time()  # wall clock, for a sweep's tokens over the time a run was in progress
    model = build_model(point.cfg, data, seed=spec.init_seed, device=dev)
    trainer = build_trainer(model, tc, data, dev, label=label, progress=False)
    model.train()
    tokens_per_step = tc.batch_size * tc.seq_len
    warm = min(3, max(0, tc.steps - 1))  # steps left out of tok/s (allocations, caches)
    losses, timed_s, timed_steps = [], 0.0, 0
    queued = []  # (step, loss on the device): read in batches, so the host queues steps ahead
    stats_from = (3 * tc.steps) // 4  # router statistics over the last quarter of training
    bar = Progress(tc.steps, label, enabled=progress)
    touched = RowsTouched(model)
    start = time.perf_counter()
    try:
        for step in range(tc.steps):
            if step == stats_from:
                reset_router_statistics(model)
            t0 = time.perf_counter()
            loss, lr = trainer.queue_step(step)
            queued.append((step, loss))
            logged = (step + 1) % tc.log_every == 0 or step + 1 == tc.steps
            # Read (one wait for the device) at each log line, and after the warm-up steps so that
            # their device time stays out of tok/s.
            if logged or step + 1 == warm:
                losses += trainer.read_losses(queued)
                queued.clear()
            dt = time.perf_counter() - t0
            if step >= warm:
                timed_s += dt
                timed_steps += 1
            bar.update(1, **({"loss": f"{losses[-1]:.3f}"} if losses else {}))
            if logged:
                rate = timed_steps * tokens_per_step / timed_s if timed_s else tokens_per_step / dt
                left = (tc.steps - step - 1) * tokens_per_step / max(rate, 1e-9)
                bar.write(
                    f"[{label}] step {step + 1}/{tc.steps} | loss {losses[-1]:7.4f} | lr {lr:.2e} | "
                    f"{rate:>9,.0f} tok/s | eta {format_duration(left)}"
                )
    finally:
        bar.close()
        rows_touched = touched.close()
    train_seconds = time.perf_counter() - start
    router = router_statistics(model) if point.cfg.moe is not None else None
    if router is not None:
        router["steps"] = [stats_from + 1, tc.steps]
    ev, available, cap = _final_validation(model, data, dev, tc, val_tokens, label, progress)
    scored = ~np.isnan(ev["token_losses"])
    buckets = bucket_losses(ev["token_losses"][scored], seen[scored])
    record = {
        **spec.identity(),
        "steps": tc.steps,
        "train_tokens": tc.steps * tokens_per_step,
        "passes": data.train.passes(tc.steps, tc.batch_size, tc.seq_len),
        "val_loss": ev["val_loss"],
        "bits_per_byte": ev["bits_per_byte"],
        "val_tokens": ev["val_tokens"],
        "val_tokens_available": available,
        "val_capped": cap is not None,
        "buckets": buckets,
        "tokens_per_s": timed_steps * tokens_per_step / timed_s if timed_s else 0.0,
        "train_seconds": train_seconds,
        "final_train_loss": float(np.mean(losses[-max(1, min(50, len(losses) // 10)) :])),
        "final_lr": lr,
        "train_losses": losses,
        "router": router,
        "rows_touched": rows_touched,
        "machine": machine_info(dev),
        "wall_clock": {"started": started, "ended": time.time()},
    }
    print(
        f"[{label}] done: {tc.steps} steps, val loss {ev['val_loss']:.4f} over "
        f"{'a capped ' if cap is not None else 'all '}{ev['val_tokens']:,} validation tokens"
        f"{f' (of {available:,})' if cap is not None else ''}, {record['tokens_per_s']:,.0f} tok/s",
        flush=True,
    )
    return record


def _final_validation(model, data: PreparedData, dev, tc: TrainConfig, val_tokens, label: str, progress: bool):
    """The run's validation on at most `val_tokens` held-out tokens, with a progress bar:
    (`evaluate`'s result with per-token losses, tokens available, the cap applied or None)."""
    available = max(0, len(data.val) - 1)
    cap = None if val_tokens is None or val_tokens >= available else val_tokens
    vbar = Progress(cap or available, f"{label}: validation", enabled=progress, unit="tok", unit_scale=True)
    try:
        ev = evaluate(
            model,
            data.val,
            torch.as_tensor(np.asarray(data.token_bytes), dtype=torch.int64),
            seq_len=tc.seq_len,
            max_tokens=cap,
            batch_size=tc.eval_batch_size,
            device=dev,
            precision=tc.precision,
            token_losses=True,
            on_batch=vbar.update,
            cuda_graphs=tc.graphs_on(dev),
        )
    finally:
        vbar.close()
    return ev, available, cap


class RowsTouched:
    """The distinct rows of each Engram table that training reads: a forward pre-hook on every
    `EngramTable` marks the row ids it is given (a bool per row, on the table's device; no host copy
    per step). `close` removes the hooks and returns ``{table name: {"rows", "touched", "share"}}``
    (None for a model without Engram)."""

    def __init__(self, model: torch.nn.Module):
        self.marks: dict[str, torch.Tensor] = {}
        self.hooks = []
        for name, module in model.named_modules():
            if isinstance(module, EngramTable):
                mark = torch.zeros(module.num_embeddings, dtype=torch.bool, device=module.weight.device)
                self.marks[name] = mark
                self.hooks.append(module.register_forward_pre_hook(self._hook(mark)))

    @staticmethod
    def _hook(mark: torch.Tensor):
        def hook(module, args):
            if module.training:
                mark.index_fill_(0, args[0].reshape(-1).to(mark.device), True)

        return hook

    def close(self) -> dict | None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if not self.marks:
            return None
        out = {}
        for name, mark in self.marks.items():
            touched = int(mark.sum())
            out[name] = {"rows": int(mark.numel()), "touched": touched, "share": touched / mark.numel()}
        return out


def distinct_ngrams(stream, steps: int, batch_size: int, seq_len: int, seed: int, n: int) -> int:
    """Distinct n-grams (within a training window) in the inputs of batches ``0..steps-1`` of `seed`:
    what a run of `steps` steps reads, replayed from the sampler (no model)."""
    seen = np.zeros(0, dtype=np.uint64)
    chunk: list[np.ndarray] = []
    size = 0

    def fold() -> None:
        nonlocal seen, chunk, size
        if chunk:
            seen = np.unique(np.concatenate([seen, *chunk]))
        chunk, size = [], 0

    for step in range(steps):
        inputs = stream.batch(step, batch_size, seq_len, seed).inputs.numpy().astype(np.uint64)
        if inputs.shape[1] < n:
            continue
        key = inputs[:, : inputs.shape[1] - n + 1].copy()
        with np.errstate(over="ignore"):
            for j in range(1, n):
                key = key * np.uint64(1_000_003) + inputs[:, j : j + key.shape[1]]
        chunk.append(np.unique(key))
        size += key.size
        if size > 1 << 24:
            fold()
    fold()
    return int(len(seen))


class SweepProgress:
    """The sweep's bar: runs done / left and the time left (from this command's finished runs)."""

    def __init__(self, total: int, done: int, enabled: bool):
        self.total, self.done, self.trained, self.seconds = total, done, 0, 0.0
        self.bar = Progress(total, "sweep", initial=done, enabled=enabled, unit="run")

    def finished(self, seconds: float) -> str:
        self.done += 1
        self.trained += 1
        self.seconds += seconds
        left = self.total - self.done
        eta = format_duration(self.seconds / self.trained * left)
        self.bar.update(1, left=left, eta=eta)
        line = f"[sweep] {self.done}/{self.total} runs done, {left} left" + (f", about {eta} to go" if left else "")
        self.bar.write(line)
        return line

    def mean_run_seconds(self) -> float | None:
        return self.seconds / self.trained if self.trained else None

    def close(self) -> None:
        self.bar.close()


def require_positive(flag: str, value: Any, integer: bool = True) -> None:
    """`ConfigError` naming the flag unless `value` (when given) is a positive int (or number)."""
    if value is None:
        return
    ok = (
        isinstance(value, int) and not isinstance(value, bool)
        if integer
        else isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    )
    if not ok or value <= 0:
        kind = "integer" if integer else "number"
        raise ConfigError(f"{flag} must be a positive {kind}, got {value!r}")
