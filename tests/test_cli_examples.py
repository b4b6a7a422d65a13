"""Every example in every ``--help`` runs as written.

The examples are parsed out of the help texts themselves (``condmem --help`` and each
subcommand's, nested ones included) and run through the CLI's `main` in one working folder
outside the repository (a user's folder: configs are named as shipped, never as repository
paths). What the examples name besides is made there first: a ``tokenizer.json``, a synthetic checkpoint in the
released layout named ``DeepSeek-V4.1-Flash``, a table file, small corpora.

Examples that train or benchmark take minutes (or a GPU) at their own size. They run with
flags the test appends (`sized`), documented there: argparse lets a later flag override an
earlier one, so every flag of the example is still parsed and, unless overridden, used.
Examples that need a GPU (``--device cuda``) run in the GPU test only. A subcommand with
examples that the order below does not list fails the test: a new example must be run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from condmem.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]

# Subcommands in the order their examples run (a later one reads what an earlier one wrote:
# generate reads the demo's checkpoint, train --resume the first train example's run).
ORDER = [
    "condmem",
    "tokenizer train",
    "layout",
    "size",
    "hash",
    "convert",
    "inspect",
    "demo",
    "generate",
    "train",
    "study",
    "bench hash",
    "bench gather",
    "bench gate",
    "bench all",
    "bench lookup",
    "bench e2e",
]

# Flags appended to examples that train: a tiny model on a tiny corpus for a step or two.
TINY_RUN = ["--preset", "tiny", "--corpus", "corpus", "--no-progress"]


def _help_texts() -> dict[str, str]:
    """{'condmem' or the subcommand path ('demo', 'tokenizer train'): its help text}."""
    texts = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        texts[path or "condmem"] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}".strip())

    walk(build_parser(), "")
    return texts


def examples_in(text: str) -> list[str]:
    """The commands listed under 'example(s):' in a help text: continuation lines joined, comments dropped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.fullmatch(r"examples?\b.*:", line.strip())), None)
    if start is None:
        return []
    found, pending = [], ""
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break
        # A comment starts with '#' or after a run of spaces (the top-level help's descriptions).
        part = re.split(r"\s{3,}|\s+#\s", line.strip())[0]
        pending = f"{pending} {part}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        if pending:
            found.append(pending)
        pending = ""
    return found


EXAMPLES = {path: examples_in(text) for path, text in _help_texts().items()}


def needs_gpu(example: str) -> bool:
    return "--device cuda" in example


def sized(argv: list[str]) -> list[str]:
    """The example's arguments with the size flags this test appends (and why)."""
    command = argv[0]
    if command == "demo":
        # Minutes of training at the preset's size: one step of a tiny model, a 2-token sample.
        extra = TINY_RUN + ["--max-new-tokens", "2"]
        if "--minutes" in argv:
            # The step count is sized to the budget: a budget of seconds (data preparation included).
            extra += ["--minutes", "0.08"]
        else:
            extra += ["--steps", "1"]
        extra += ["--vocab-size", "320"]
        return argv + extra + ([] if needs_gpu(" ".join(argv)) else ["--device", "cpu"])
    if command == "train":
        # One step (two for --resume: one more than the run it continues), a 320-id BPE (a config file's
        # vocabulary replaced), a 1,000-bucket table where the example sets the table size.
        if "--resume" in argv:
            # A resumed run keeps its checkpoint's settings: only a step count, one past the run it continues
            # (an example's own --steps replaced).
            if "--steps" in argv:
                i = argv.index("--steps")
                argv = argv[:i] + argv[i + 2 :]
            return argv + ["--steps", "2", "--set", "train.eval_every=1", "--no-progress"]
        extra = TINY_RUN + ["--device", "cpu", "--steps", "1", "--set", "train.eval_every=1"]
        extra += ["--set", "data.vocab_size=320"]
        if any(a.startswith("engram.table_size=") for a in argv):
            extra += ["--set", "engram.table_size=1000"]
        return argv + extra
    if argv[:2] == ["tokenizer", "train"]:  # BPE training reads up to 100 MB by default: 200 KB here
        return argv + ["--max-bytes", "200000"]
    if command == "generate":
        return argv + ["--max-new-tokens", "2", "--device", "cpu"]
    if command == "study":
        # The gpu and cpu presets' sweeps take minutes: the tiny preset's (seconds on a CPU) instead; the
        # user's corpus is the test's stdlib folder.
        argv = ["tiny" if a in ("gpu", "cpu") else "corpus" if a == "/path/to/texts" else a for a in argv]
        return argv + ([] if "--replot" in argv or "--device" in argv else ["--device", "cpu"])
    if command == "bench":
        # GPU benchmarks at full size: --smoke runs them at tiny sizes (on a CPU, the kernels in the
        # Triton interpreter); the lookup benchmark's sizes are flags, shrunk here.
        extra = ["--smoke"]
        if argv[1] == "lookup":
            extra += [
                "--table-gib",
                "0.002",
                "--hbm-gib",
                "0.002",
                "--batch-tokens",
                "1",
                "16",
                "--text-batches",
                "2",
                "--text-warmup",
                "1",
                "--repeats",
                "1",
            ]
        if argv[1] == "e2e":  # two of the default five variants (each a whole serving run; all five: tests/bench)
            extra += ["--e2e-variants", "none", "host_prefetch"]
        return argv + extra
    return argv


def run_example(example: str, capsys) -> None:
    tokens = shlex.split(example)
    if tokens[0] == "torchrun":
        # torchrun's ranks: 2 instead of the example's 8 (a 2-core CPU), on a free port (--standalone).
        i = tokens.index("--nproc-per-node")
        tokens[i + 1] = "2"
        argv = sized(tokens[tokens.index("condmem") + 1 :])
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            *tokens[1 : tokens.index("condmem") - 1],
            "-m",
            "condmem",
            *argv,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, f"{example}\n-> {' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return
    assert tokens[0] == "condmem", example
    argv = sized(tokens[1:])
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, f"{example}\n-> condmem {shlex.join(argv)}\n{captured.out[-3000:]}\n{captured.err[-3000:]}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The working folder the examples run in, with the corpora and tokenizer they name."""
    from condmem.train.bpe import train_bpe
    from condmem.train.data import stdlib_dir

    root = tmp_path_factory.mktemp("examples")
    assert not root.resolve().is_relative_to(ROOT.resolve()), "the examples must run outside the repository"
    corpus = root / "corpus"
    corpus.mkdir()
    texts = []
    for name in (
        "textwrap.py",
        "string.py",
        "heapq.py",
        "bisect.py",
        "colorsys.py",
        "keyword.py",
        "fnmatch.py",
        "glob.py",
        "shlex.py",
        "getopt.py",
    ):
        text = (stdlib_dir() / name).read_text(encoding="utf-8")
        (corpus / name).write_text(text, encoding="utf-8")
        texts.append(text)
    train_bpe(texts, vocab_size=320).save(str(root / "tokenizer.json"))
    (root / "texts").mkdir()  # the tokenizer example's corpus: a folder and a .jsonl file
    (root / "texts" / "a.txt").write_text(texts[0], encoding="utf-8")
    (root / "notes.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[1:4]), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def released(workdir):
    """The examples' checkpoint and table file, made in `workdir`."""
    from released_fixtures import config_json, write_checkpoint

    from condmem.tokenizer import CompressedTokenizer

    root = workdir
    # The released layout at a tiny geometry; its config states the DeepSeek-V4 tokenizer's V' (the
    # examples pass --tokenizer deepseek-v4); row counts do not depend on V'.
    v_prime = CompressedTokenizer.from_any("deepseek-v4").vocab_size
    write_checkpoint(
        root / "DeepSeek-V4.1-Flash", "original", 3, config_json("flat", engram_compressed_vocab_size=v_prime)
    )
    # A table file (convert's first example re-formats one; the second writes one from the checkpoint).
    assert (
        main(
            [
                "convert",
                "--released",
                str(root / "DeepSeek-V4.1-Flash"),
                str(root / "tables.safetensors"),
                "--to",
                "fp8",
                "--no-progress",
            ]
        )
        == 0
    )
    return root


def test_every_subcommand_has_examples_and_the_order_lists_them():
    leaves = [
        path for path in EXAMPLES if not any(other.startswith(path + " ") for other in EXAMPLES) and path != "condmem"
    ]
    assert not [path for path in leaves if not EXAMPLES[path]], "a subcommand's --help has no example"
    with_examples = {path for path, found in EXAMPLES.items() if found}
    assert with_examples == set(ORDER), "add the subcommand to ORDER (and to sized() if its examples are long)"


_seen: set[str] = set()


SLOW = {"demo", "bench"}  # 6-20 s and 16-50 s on a 2-core CPU, idle to busy: the smallest sizes that run them


@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=pytest.mark.slow) if p.split()[0] in SLOW else p for p in ORDER]
)
def test_help_examples_run(path, workdir, released, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if path == "generate" and not (workdir / "condmem-demo" / "engram").exists():
        run_example("condmem demo", capsys)  # its checkpoint (run by the demo case when the whole file runs)
    ran = 0
    for example in EXAMPLES[path]:
        if needs_gpu(example) or example in _seen:
            continue  # GPU examples: test_gpu_help_examples_run; the same example in two helps runs once
        run_example(example, capsys)
        _seen.add(example)
        ran += 1
    assert ran or all(needs_gpu(e) or e in _seen for e in EXAMPLES[path])


@pytest.mark.gpu
def test_gpu_help_examples_run(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    gpu = [e for path in ORDER for e in EXAMPLES[path] if needs_gpu(e)]
    assert gpu
    for example in gpu:
        run_example(example, capsys)  # its --corpus (/path/to/texts) is the appended tiny corpus
