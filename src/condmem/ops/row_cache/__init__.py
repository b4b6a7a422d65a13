"""The HBM row cache's probe and admission as Triton kernels (`triton.py`).

The reference they are held to is the torch path of `condmem.tables.row_cache.RowCache`
(``backend="torch"``), which also serves CPU tables.
"""
