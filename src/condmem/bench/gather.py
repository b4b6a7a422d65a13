"""``condmem bench gather``: row gathers with dequantization, HBM and pinned host tables.

Reported per variant: time, rows/s, achieved bytes (table bytes read + output bytes written)
per second, and that over the D2D copy bandwidth measured in the same run (the ceiling).
"""

from __future__ import annotations

import torch

from condmem.bench.harness import Rotator, same_rows, time_ms
from condmem.ops.gather import engram_gather, gather_reference

HEAD_DIM = 256
PACKED_ROW = HEAD_DIM + HEAD_DIM // 32  # 264 B


def _random_rows(n: int, width: int, device: str, scale_from: int | None = None) -> torch.Tensor:
    t = torch.empty((n, width), dtype=torch.uint8, device=device)
    chunk = 1 << 24
    for s in range(0, n, chunk):
        t[s : s + chunk].random_(0, 256)
        if scale_from is not None:
            t[s : s + chunk, scale_from:].random_(110, 140)
    return t


def _time_variants(rows, base, fmt, tables, kw, sets, out, bytes_per_row, ceiling, variants):
    n = sets[0][0].numel()
    dev = out.device.type
    for name, tune in variants:
        fn = Rotator(lambda ids, tune=tune: engram_gather(ids, *tables, out=out, backend="triton", **kw, **tune), sets)
        t = time_ms(fn, dev)
        gbps = n * bytes_per_row / (t["ms"] * 1e-3) / 1e9
        rows.append(
            {
                **base,
                "format": fmt,
                "impl": name,
                **tune,
                "ids": n,
                **t,
                "rows_per_s": n / (t["ms"] * 1e-3),
                "bytes_per_row": bytes_per_row,
                "gbps": gbps,
                "d2d_fraction": gbps / ceiling["d2d_gbps"],
            }
        )


def _free(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.empty_cache()


def _tunings(args) -> list[tuple[str, dict]]:
    """(name, tuning) of the Triton gather launches timed: the default, with `--variants` also
    other block sizes, warp counts and programs per SM."""
    variants = [("triton", dict(block_rows=32, num_warps=4, programs_per_sm=4))]
    if args.variants:
        variants += [
            ("triton", dict(block_rows=16, num_warps=4, programs_per_sm=4)),
            ("triton", dict(block_rows=64, num_warps=4, programs_per_sm=4)),
            ("triton", dict(block_rows=32, num_warps=4, programs_per_sm=8)),
            ("triton", dict(block_rows=32, num_warps=8, programs_per_sm=4)),
            ("triton", dict(block_rows=64, num_warps=8, programs_per_sm=2)),
        ]
    return variants


def run(args, ceiling: dict) -> list[dict]:
    """The gather's rows: fp8 rows (packed, then separate from their scales), bf16 rows and
    decode-sized batches from HBM, then a pinned host table read over PCIe."""
    rows: list[dict] = []
    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(0)
    n_ids = args.gather_ids
    table_rows = args.table_mib * 2**20 // PACKED_ROW
    base = {"op": "gather", "head_dim": HEAD_DIM, "table_rows": table_rows}
    sets = [(torch.randint(0, table_rows, (n_ids,), device=dev, generator=gen),) for _ in range(4)]
    out = torch.empty((n_ids, HEAD_DIM), dtype=torch.bfloat16, device=dev)
    variants = _tunings(args)
    _time_hbm_fp8(rows, args, base, sets, out, ceiling, variants)
    _time_hbm_bf16(rows, args, base, gen, out, ceiling, variants)
    _time_decode_sized(rows, args, base, sets, ceiling, variants)
    _time_pinned_host(rows, args, base, gen, out, ceiling, variants)
    return rows


def _time_hbm_fp8(rows, args, base: dict, sets: list, out: torch.Tensor, ceiling: dict, variants: list) -> None:
    """fp8 rows in HBM: packed with their scales (checked against the reference gather, which is
    timed too), then the same bytes as separate rows and scales."""
    dev = args.device
    n_ids = args.gather_ids
    # -- packed fp8 rows (264 B) in HBM
    packed = _random_rows(base["table_rows"], PACKED_ROW, dev, scale_from=HEAD_DIM)
    b = {**base, "tier": "hbm", "table_gib": packed.numel() / 2**30}
    ref = gather_reference(sets[0][0][:4096], packed)
    got = engram_gather(sets[0][0][:4096], packed, backend="triton")
    assert same_rows(got, ref), "the Triton gather differs from the reference"
    _time_variants(rows, b, "fp8-packed", (packed,), {}, sets, out, PACKED_ROW + 2 * HEAD_DIM, ceiling, variants)
    t = time_ms(Rotator(lambda ids, packed=packed: gather_reference(ids, packed), sets), dev, rep_ms=100)
    rows.append(
        {**b, "format": "fp8-packed", "impl": "torch-gpu", "ids": n_ids, **t, "rows_per_s": n_ids / (t["ms"] * 1e-3)}
    )
    # -- separate fp8 rows + scales in HBM (same bytes, two random accesses per row)
    q = packed[:, :HEAD_DIM].contiguous().view(torch.float8_e4m3fn)
    s = packed[:, HEAD_DIM:].contiguous()
    del packed
    _free(dev)
    _time_variants(rows, b, "fp8-separate", (q, s), {}, sets, out, PACKED_ROW + 2 * HEAD_DIM, ceiling, variants[:2])
    del q, s
    _free(dev)


def _time_hbm_bf16(rows, args, base: dict, gen, out: torch.Tensor, ceiling: dict, variants: list) -> None:
    """bf16 rows (512 B) in HBM, the same table bytes as the fp8 table."""
    dev = args.device
    n_ids = args.gather_ids
    bf_rows = args.table_mib * 2**20 // (2 * HEAD_DIM)
    bf = torch.empty((bf_rows, HEAD_DIM), dtype=torch.bfloat16, device=dev).normal_()
    bsets = [(torch.randint(0, bf_rows, (n_ids,), device=dev, generator=gen),) for _ in range(4)]
    _time_variants(
        rows,
        {**base, "tier": "hbm", "table_rows": bf_rows, "table_gib": bf.numel() * 2 / 2**30},
        "bf16",
        (bf,),
        {},
        bsets,
        out,
        4 * HEAD_DIM,
        ceiling,
        variants[:1],
    )
    del bf, bsets
    _free(dev)


def _time_decode_sized(rows, args, base: dict, sets: list, ceiling: dict, variants: list) -> None:
    """Small decode-sized batches (latency) of packed fp8 rows in HBM: 256 tokens x 24 columns."""
    dev = args.device
    n_small = min(256 * 24, args.gather_ids)
    small = [(ids[0][:n_small].clone(),) for ids in sets]
    packed_small = _random_rows(base["table_rows"], PACKED_ROW, dev, scale_from=HEAD_DIM)
    out_small = torch.empty((n_small, HEAD_DIM), dtype=torch.bfloat16, device=dev)
    _time_variants(
        rows,
        {**base, "tier": "hbm", "table_gib": packed_small.numel() / 2**30, "batch": "decode-256x24"},
        "fp8-packed",
        (packed_small,),
        {},
        small,
        out_small,
        PACKED_ROW + 2 * HEAD_DIM,
        ceiling,
        variants[:1],
    )
    del packed_small
    _free(dev)


def _time_pinned_host(rows, args, base: dict, gen, out: torch.Tensor, ceiling: dict, variants: list) -> None:
    """A pinned host table read zero-copy over PCIe (UVA), ids in random then sorted order; its rows
    report the requested table bytes per second (the PCIe side) instead of a D2D fraction."""
    dev = args.device
    host_rows = args.host_mib * 2**20 // PACKED_ROW
    host = torch.empty((host_rows, PACKED_ROW), dtype=torch.uint8, pin_memory=dev == "cuda")
    chunk = 1 << 22
    for st in range(0, host_rows, chunk):
        host[st : st + chunk].copy_(_random_rows(min(chunk, host_rows - st), PACKED_ROW, dev, scale_from=HEAD_DIM))
    hb = {**base, "tier": "pinned-host", "table_rows": host_rows, "table_gib": host.numel() / 2**30}
    n_host = min(args.gather_ids, args.host_ids)
    hsets = [(torch.randint(0, host_rows, (n_host,), device=dev, generator=gen),) for _ in range(4)]
    out_h = out[:n_host]
    ref = gather_reference(hsets[0][0][:2048], host)
    got = engram_gather(hsets[0][0][:2048], host, backend="triton")
    assert same_rows(got, ref), "the Triton gather differs from the reference"
    _time_variants(rows, hb, "fp8-packed", (host,), {}, hsets, out_h, PACKED_ROW, ceiling, variants[:1])
    ssets = [(torch.sort(ids[0]).values,) for ids in hsets]
    _time_variants(
        rows, {**hb, "ids_order": "sorted"}, "fp8-packed", (host,), {}, ssets, out_h, PACKED_ROW, ceiling, variants[:1]
    )
    for r in rows:
        if r.get("tier") == "pinned-host" and r["impl"] == "triton":
            r["row_gbps"] = r.pop("gbps")  # host rows: requested table bytes only (PCIe side)
            r.pop("d2d_fraction", None)
    del host
