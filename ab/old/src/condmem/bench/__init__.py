"""Kernel benchmarks (`condmem bench hash|gather|gate`) on one shared harness.

`harness` times with `triton.testing.do_bench` medians (warm-up excluded, inputs rotated
so caches do not flatter), measures the device-to-device copy bandwidth in the same run
as the ceiling, and appends one JSON object per line, with machine info, to a results
file. Each op module (`hash`, `gather`, `gate`) exposes ``run(args) -> list[dict]``.
"""
