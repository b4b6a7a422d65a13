"""Training: the loop (`loop`: `TrainConfig`, `Trainer`), optimizers (`optim`: AdamW for the
backbone, `SparseAdam` for the tables), tables in host memory (`host_table`), tables sharded
over data-parallel ranks (`data_parallel`), checkpoints (`checkpoint`), data (`data`,
`pipeline`, `heldout`, `bpe`), typed presets (`presets`), the model build (`build`), one
`condmem train` run and its config file (`run`, `run_config`) and determinism (`determinism`).

Each is imported from its submodule; importing this package imports none of them.
"""
