"""Engram tables: storage formats (fp8 e4m3 rows + e8m0 scales) re-exported here; the files
(`table_file`), tiers (`storage`, `host_memory`), the HBM row cache (`row_cache`) and the
lookup engine (`lookup`, `lookup_plan`) are imported from their submodules."""

from condmem.fp8 import (
    QuantError,
    dequantize_fp8_e8m0,
    e8m0_to_float,
    pack_rows,
    quantize_fp8_e8m0,
    quantize_table,
    unpack_rows,
)

__all__ = [
    "QuantError",
    "quantize_fp8_e8m0",
    "dequantize_fp8_e8m0",
    "e8m0_to_float",
    "pack_rows",
    "unpack_rows",
    "quantize_table",
]
