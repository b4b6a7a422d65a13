"""The main job: train a baseline and an Engram LM on the same tokens and compare them.

`run_demo` builds the tokenizer, trains the iso-FLOP baseline and then the Engram model
on exactly the same batches, prints a side-by-side table, writes ``summary.json``, the
loss curves and the gate heat map as PNGs, and a completion sampled from the Engram
model. Everything lands in one output directory.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from condmem.config import EngramConfig
from condmem.models import DecoderLM, ModelConfig, forward_flops_per_token, generate, iso_flop_baseline, train_flops_per_token
from condmem.train.loop import Trainer, TrainConfig
from condmem.train.pipeline import PreparedData, prepare_data
from condmem.train.plots import plot_gate_heatmap, plot_loss_curves
from condmem.train.presets import get_preset
from condmem.utils.atomic import atomic_write_text

logger = logging.getLogger("condmem.demo")

DEFAULT_PROMPT = 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n'


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    return dev


def build_model_config(preset: dict, data: PreparedData, *, engram: bool = True) -> ModelConfig:
    """The Engram model's config from a preset and the prepared data (V' from its compressed tokenizer)."""
    m, e = preset["model"], preset["engram"]
    vocab = data.tokenizer.get_vocab_size(with_added_tokens=True)
    ecfg = None
    if engram:
        ecfg = EngramConfig(
            layer_ids=list(e["layer_ids"]), max_ngram_size=e["max_ngram_size"], n_heads=e["n_heads"],
            head_dim=e["head_dim"], table_size=e["table_size"], pad_id=data.pad_id, hidden_size=m["dim"], hc_mult=1,
            short_conv=e.get("short_conv", True), compressed_vocab_size=data.ctok.vocab_size,
        )
    return ModelConfig(vocab_size=vocab, engram=ecfg, engram_table_init_std=e.get("table_init_std", 1.0), **m)


def machine_info(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpu_threads": torch.get_num_threads(), "device": str(device),
            "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _fmt_m(n: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f}"


def format_table(base: dict, eng: dict) -> str:
    gap = 100 * (1 - eng["val_loss"] / base["val_loss"])
    bpb_gap = 100 * (1 - eng["bits_per_byte"] / base["bits_per_byte"])
    ratio = eng["flops_per_token"] / base["flops_per_token"]
    rows = [
        ("", "baseline", "engram", ""),
        ("parameters (all)", _fmt_m(base["params"]), _fmt_m(eng["params"]), ""),
        ("  of which Engram tables", _fmt_m(base["table_params"]), _fmt_m(eng["table_params"]),
         f"{eng['table_rows']:,} rows"),
        ("FLOPs / token (train)", _fmt_m(base["flops_per_token"]), _fmt_m(eng["flops_per_token"]),
         f"ratio {ratio:.4f}"),
        ("training tokens", _fmt_m(base["train_tokens"]), _fmt_m(eng["train_tokens"]), ""),
        ("val loss (nats/token)", f"{base['val_loss']:.4f}", f"{eng['val_loss']:.4f}", f"{gap:.2f}% lower" if gap >= 0 else f"{-gap:.2f}% HIGHER"),
        ("bits per byte", f"{base['bits_per_byte']:.4f}", f"{eng['bits_per_byte']:.4f}",
         f"{bpb_gap:.2f}% lower" if bpb_gap >= 0 else f"{-bpb_gap:.2f}% HIGHER"),
        ("tokens / s (train)", f"{base['tokens_per_s']:,.0f}", f"{eng['tokens_per_s']:,.0f}",
         f"ratio {eng['tokens_per_s'] / max(base['tokens_per_s'], 1e-9):.3f}"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for i, r in enumerate(rows):
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip())
        if i == 0:
            lines.append("-" * len(lines[0].ljust(sum(widths) + 8)))
    return "\n".join(lines)


def gate_sample(model: DecoderLM, data: PreparedData, device: torch.device, n_tokens: int = 160) -> dict:
    """Gate values of every Engram layer over a piece of validation code (from its first def/class)."""
    text = None
    for doc in data.val_docs:
        for marker in ("\ndef ", "\nclass ", "\n    def "):
            at = doc.text.find(marker)
            if at >= 0:
                text = doc.text[at + 1 :]
                break
        if text:
            break
    text = text or data.val_docs[0].text
    ids = data.tokenizer.encode(text, add_special_tokens=False).ids[: min(n_tokens, model.cfg.max_seq_len)]
    x = torch.tensor([ids], device=device)
    gates = model.gate_values(x)
    pieces = [data.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return {"tokens": ids, "pieces": pieces,
            "gates": {str(lid): g[0].float().cpu().tolist() for lid, g in gates.items()}}


def run_demo(out: str | Path = "condmem-demo", *, corpus=None, preset: str | None = None, device: str | None = None,
             steps: int | None = None, minutes: float | None = None, vocab_size: int | None = None,
             tokenizer: str | None = None, prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 96, seed: int = 0,
             batch_size: int | None = None, max_train_bytes: int | None = None, table_size: int | None = None,
             log_every: int | None = None, progress: bool = True, use_cache: bool = True, checkpoint: bool = True,
             max_corpus_bytes: int | None = None,
             overrides: dict | None = None) -> dict:
    """Train baseline and Engram on the same tokens, compare, plot, generate. Returns the summary."""
    wall = time.perf_counter()
    dev = resolve_device(device)
    preset_name = preset or ("gpu" if dev.type == "cuda" else "cpu")
    p = get_preset(preset_name)
    for section, values in (overrides or {}).items():
        p[section].update(values)
    for section, key, value in (("data", "vocab_size", vocab_size), ("data", "max_train_bytes", max_train_bytes),
                                ("train", "steps", steps), ("train", "batch_size", batch_size),
                                ("engram", "table_size", table_size), ("train", "log_every", log_every)):
        if value is not None:
            p[section][key] = value
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    print(f"condmem demo: preset {preset_name!r} on {dev}; output in {out}/", flush=True)

    data = prepare_data(corpus, tokenizer=tokenizer, vocab_size=p["data"]["vocab_size"], max_corpus_bytes=max_corpus_bytes,
                        max_train_bytes=p["data"].get("max_train_bytes"),
                        tokenizer_train_bytes=p["data"].get("tokenizer_train_bytes"), seed=seed, use_cache=use_cache)
    c = data.info["corpus"]
    src = f"Python {c['python_version']} standard library" if "python_version" in c else ", ".join(c["sources"])
    print(f"corpus: {src}: {c['n_documents']:,} documents, {c['n_bytes']:,} bytes, sha256 {c['sha256'][:16]}...", flush=True)
    t = data.info["tokenizer"]
    print(f"tokenizer: {t['source']}: {t['vocab_size']:,} ids -> compressed V'={t['compressed_vocab_size']:,}; "
          f"train split {data.info['train_tokens_available']:,} tokens, val split {data.info['val_tokens_available']:,} tokens",
          flush=True)
    data.tokenizer.save(str(out / "tokenizer.json"))

    eng_cfg = build_model_config(p, data)
    base_cfg = iso_flop_baseline(eng_cfg)
    train_kwargs = dict(p["train"], seed=seed)
    results: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    models: dict[str, DecoderLM] = {}
    budget_s = None
    if minutes is not None:
        # The demo's whole budget: what data preparation used is gone; the Engram run then
        # takes the baseline's step count (same tokens), at a similar cost per step.
        budget_s = minutes * 60 - (time.perf_counter() - wall)
        if budget_s <= 0:
            raise ValueError(f"--minutes {minutes}: data preparation alone took longer")
    for label, cfg in (("baseline", base_cfg), ("engram", eng_cfg)):
        tc = TrainConfig(**train_kwargs)
        if label == "baseline" and budget_s is not None:
            tc.max_minutes = budget_s * 0.44 / 60
            if steps is None:
                tc.steps = 10**9  # the budget decides
        if label == "engram":
            tc.steps = results["baseline"]["steps"]  # the same batches, step for step
            tc.warmup_steps = min(tc.warmup_steps, runs["baseline"]["train_config"]["warmup_steps"])
        model = DecoderLM(cfg, token_lookup=data.ctok.lookup, seed=seed, device=dev)
        trainer = Trainer(model, tc, data.train, data.val, data.token_bytes, dev,
                          run_dir=out / label if checkpoint else None, label=label,
                          checkpoint_extra={"tokenizer": data.tokenizer, "ctok": data.ctok, "data": data.info},
                          progress=progress)
        counts = model.param_counts()
        print(f"[{label}] {counts['total']:,} parameters ({counts['tables']:,} in Engram tables), "
              f"{train_flops_per_token(cfg, tc.seq_len) / 1e6:,.2f} MFLOPs/token; {tc.steps if tc.max_minutes is None else 'budgeted'} "
              f"steps x {tc.batch_size * tc.seq_len:,} tokens", flush=True)
        summary = trainer.fit()
        summary.update(
            params=counts["total"], backbone_params=counts["backbone"], table_params=counts["tables"],
            table_rows=sum(model.layout.num_embeddings) if model.layout is not None else 0,
            flops_per_token=train_flops_per_token(cfg, tc.seq_len),
            forward_flops=forward_flops_per_token(cfg, tc.seq_len),
            checkpoint=str(trainer.last_checkpoint) if trainer.last_checkpoint else None,
        )
        results[label] = summary
        runs[label] = {"history": trainer.history, "evals": trainer.evals, "train_config": tc.to_dict(),
                       "model_config": cfg.to_dict()}
        models[label] = model

    base, eng = results["baseline"], results["engram"]
    table = format_table(base, eng)
    gap = 100 * (1 - eng["val_loss"] / base["val_loss"])
    print("\n" + table + "\n", flush=True)
    flops_ratio = eng["flops_per_token"] / base["flops_per_token"]
    verdict = "lower" if gap > 0 else "NOT lower"
    print(f"Engram validation loss is {abs(gap):.2f}% {verdict} than the baseline's at the same "
          f"{eng['train_tokens']:,} training tokens (FLOPs/token ratio {flops_ratio:.4f}).", flush=True)

    figures = {}
    fig = plot_loss_curves(runs, out / "loss_curves.png",
                           title=f"baseline vs Engram on {src}\n{_fmt_m(eng['train_tokens'])} training tokens each, "
                                 f"FLOPs/token ratio {flops_ratio:.3f}; Engram val loss {-gap:+.2f}%")
    if fig:
        figures["loss_curves"] = fig.name
    gates = gate_sample(models["engram"], data, dev)
    atomic_write_text(out / "gates.json", json.dumps(gates) + "\n")
    first = next(iter(gates["gates"]))
    fig = plot_gate_heatmap(gates["pieces"], np.array([gates["gates"][k] for k in gates["gates"]]), out / "gates.png",
                            title=f"Engram gate (layer {first}) per token over validation code; darker = more memory")
    if fig:
        figures["gates"] = fig.name

    prompt_ids = data.tokenizer.encode(prompt, add_special_tokens=False).ids
    samples = {}
    for label in ("engram", "baseline"):
        new = generate(models[label], torch.tensor(prompt_ids), max_new_tokens, temperature=0.8, top_k=40, seed=seed,
                       stop_ids=(data.eos_id,))
        samples[label] = data.tokenizer.decode(new.tolist(), skip_special_tokens=True)
    print("\nprompt + Engram completion:\n" + "-" * 60 + "\n" + prompt + samples["engram"] + "\n" + "-" * 60, flush=True)
    atomic_write_text(out / "sample.txt", f"# prompt\n{prompt}\n# engram completion\n{samples['engram']}\n"
                                          f"# baseline completion\n{samples['baseline']}\n")

    summary = {
        "baseline": base,
        "engram": eng,
        "comparison": {
            "val_loss_gap_pct": gap,
            "bits_per_byte_gap_pct": 100 * (1 - eng["bits_per_byte"] / base["bits_per_byte"]),
            "flops_per_token_ratio": flops_ratio,
            "tokens_per_s_ratio": eng["tokens_per_s"] / max(base["tokens_per_s"], 1e-9),
            "same_tokens": eng["train_tokens"] == base["train_tokens"],
        },
        "preset": preset_name,
        "config": {"baseline": runs["baseline"]["model_config"], "engram": runs["engram"]["model_config"],
                   "train": runs["engram"]["train_config"], "preset": p},
        "data": data.info,
        "machine": machine_info(dev),
        "figures": figures,
        "sample": {"prompt": prompt, "engram": samples["engram"], "baseline": samples["baseline"]},
        "curves": {k: {"history": v["history"], "evals": v["evals"]} for k, v in runs.items()},
        "wall_seconds": time.perf_counter() - wall,
        "table": table,
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    print(f"\nwrote {out}/summary.json, {', '.join(figures.values()) or 'no figures (matplotlib missing)'}, "
          f"sample.txt, gates.json{f'; checkpoints in {out}/engram and {out}/baseline' if checkpoint else ''} "
          f"({summary['wall_seconds']:.0f} s in all)", flush=True)
    return summary
