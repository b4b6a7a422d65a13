"""Runs that pass the flags no other test passes, each checked where it lands.

`tests/test_cli_flags.py` requires every flag of every subcommand to be passed by some test
that runs its subcommand; the flags below are those no functional test needed. Each run is
small (a tiny corpus, a released checkpoint of a few hundred rows, the benchmarks' --smoke
sizes); the benchmarks' size flags, which --smoke replaces, run at small sizes on a GPU.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from condmem.cli import main
from condmem.train.data import stdlib_dir

from released_fixtures import tensor_names, write_checkpoint

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "string.py", "heapq.py", "bisect.py", "colorsys.py", "keyword.py", "shlex.py"):
        shutil.copy(stdlib_dir() / name, root / name)
    return root


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster on a shared machine
    yield
    torch.set_num_threads(threads)


def test_demo_flags_reach_the_models_data_and_summary(corpus, tmp_path):
    out = tmp_path / "demo"
    argv = ["demo", "--preset", "tiny", "--corpus", str(corpus), "--out", str(out), "--device", "cpu"]
    argv += ["--steps", "2", "--batch-size", "2", "--log-every", "1", "--table-size", "300", "--seed", "1"]
    argv += ["--max-corpus-bytes", "2000000", "--max-train-bytes", "1000000", "--max-passes", "3", "--no-dedup"]
    argv += ["--experts", "2", "--top-k", "1", "--expert-ffn", "16", "--moe-layers", "1"]
    argv += ["--no-cache", "--deterministic", "--no-checkpoint", "--max-new-tokens", "1", "--no-progress"]
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    engram, train = s["config"]["engram"], s["config"]["train"]
    assert engram["engram"]["table_size"] == 300 and train["batch_size"] == 2 and train["log_every"] == 1
    assert engram["moe"]["n_experts"] == 2 and engram["moe"]["top_k"] == 1 and engram["moe"]["expert_hidden"] == 16
    assert engram["moe"]["layer_ids"] == [1] and s["config"]["baseline"]["moe"] == engram["moe"]
    assert train["seed"] == 1 and s["passes"]["max_passes"] == 3.0 and s["determinism"]["enabled"]
    args = s["data"]["args"]
    assert args["max_corpus_bytes"] == 2_000_000 and args["max_train_bytes"] == 1_000_000
    assert args["dedup_threshold"] is None
    assert not (out / "engram").exists(), "--no-checkpoint"


def test_study_refuses_a_max_passes_below_zero_naming_it(tmp_path, capsys):
    argv = ["study", "allocation", "--preset", "tiny", "--out", str(tmp_path / "s"), "--device", "cpu"]
    assert main([*argv, "--no-progress", "--max-passes", "0"]) == 1
    assert "--max-passes" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    argv = ["train", "--preset", "tiny", "--corpus", str(corpus), "--out", str(out), "--steps", "2"]
    assert main([*argv, "--device", "cpu", "--no-progress"]) == 0
    return out


def test_generate_from_host_tables_with_its_sampling_flags(run, capsys):
    argv = ["generate", "--checkpoint", str(run), "--prompt", "def f(x):", "--max-new-tokens", "2"]
    outputs = []
    for _ in range(2):
        assert main([*argv, "--tier", "host", "--seed", "3", "--top-k", "5", "--device", "cpu"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("def f(x):")  # one seed, one sample


def test_hash_with_special_tokens_added(run, capsys):
    tokenizer = next((run / "checkpoints").glob("step-*")) / "tokenizer.json"
    argv = ["hash", "--tokenizer", str(tokenizer), "--config", "official_demo", "--text", "def f"]
    assert main([*argv, "--add-special-tokens"]) == 0
    added = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert added["token_ids"] == plain["token_ids"]  # a byte-level BPE adds no BOS/EOS of its own


def test_size_with_another_ngram_order(capsys):
    assert main(["size", "--hidden", "1024", "--memory", "1GB", "--max-ngram", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["max_ngram_size"] == 4


def test_verbose_logs_debug(capsys):
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    root.handlers.clear()  # basicConfig configures only a root without handlers
    try:
        assert main(["--verbose", "size", "--hidden", "512", "--params", "1M"]) == 0
        assert root.level == logging.DEBUG
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_released_checkpoint_flags_of_inspect_and_convert(tmp_path, capsys):
    """A released checkpoint in the hf dialect whose Engram keys sit under 'language' (neither the top
    level nor text_config): --config-key finds them, --dialect and the name templates pick its tensors."""
    ckpt = tmp_path / "released"
    write_checkpoint(ckpt, dialect="hf", config="key")
    names = tensor_names(0, "hf")
    template = names["embed"].replace("layers.0.", "layers.{layer_id}.")
    scales = names["embed_scale"].replace("layers.0.", "layers.{layer_id}.")
    assert main(["inspect", str(ckpt), "--sample", "4"]) == 1  # the keys are not where it looks by default
    assert main(["inspect", str(ckpt), "--config-key", "language", "--sample", "4"]) == 0
    out = tmp_path / "t.safetensors"
    argv = ["convert", str(ckpt), str(out), "--released", "--config-key", "language", "--dialect", "hf"]
    argv += ["--weight-name", template, "--scale-name", scales, "--to", "bf16", "--no-progress"]
    assert main(argv) == 0
    again = tmp_path / "again.safetensors"
    assert main(["convert", str(out), str(again), "--no-verify", "--to", "fp8", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(again), "--verify"]) == 0


def test_bench_lookup_engine_flags_on_a_smoke_run(tmp_path):
    argv = ["bench", "lookup", "--smoke", "--table-gib", "0.002", "--batch-tokens", "1", "16", "--repeats", "1"]
    argv += ["--text-batches", "2", "--text-warmup", "1", "--out", str(tmp_path)]
    argv += ["--cache-fraction", "0.05", "--cpu-fraction", "0.5", "--cpu-threads", "1", "--staging-chunk-rows", "64"]
    argv += ["--eager-plans", "--host-alloc", "cuda_host_alloc"]
    assert main(argv) == 0
    assert (tmp_path / "lookup.json").is_file()


def test_bench_e2e_serving_flags_on_a_smoke_run(tmp_path):
    argv = ["bench", "e2e", "--smoke", "--out", str(tmp_path), "--e2e-variants", "none", "host_prefetch"]
    argv += ["--seed", "1", "--fetch-programs", "8", "--lookup-threads", "1", "--staged-threads", "1"]
    assert main([*argv, "--tp-mode", "row"]) == 0
    assert (tmp_path / "e2e.json").is_file()


@CUDA
def test_bench_e2e_size_flags_and_profile_on_a_gpu(tmp_path):
    argv = ["bench", "e2e", "--backbones", "tiny", "--table-gib", "0.002", "--sequences", "6", "--batch", "4"]
    argv += ["--prompt-min", "8", "--prompt-max", "24", "--gen", "4", "--e2e-repeats", "1", "--prefill-tokens", "40"]
    argv += ["--e2e-variants", "none", "host_prefetch", "--profile", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert list(tmp_path.glob("profile_*.txt"))


HASH_SIZES = ["--hash-tokens", "4096", "--cpu-tokens", "1024", "--decode-batch", "8"]
GATHER_SIZES = ["--gather-ids", "4096", "--table-mib", "8", "--host-mib", "8", "--host-ids", "1024"]


@CUDA
@pytest.mark.parametrize(
    "op, sizes", [("hash", HASH_SIZES), ("gather", GATHER_SIZES), ("all", HASH_SIZES + GATHER_SIZES)], ids=str
)
def test_bench_kernel_size_flags_on_a_gpu(tmp_path, op, sizes):
    assert main(["bench", op, "--out", str(tmp_path), *sizes]) == 0
