"""`condmem study`: the Engram paper's allocation, memory-slot and token sweeps, small.

`config` reads and validates a sweep's file (`StudyConfig`), `runs` trains and stores one
run, `stats` holds the intervals and tests, and `sweep` plans the points, runs the sweep,
merges its runs into ``study.json`` and reports them.
"""
