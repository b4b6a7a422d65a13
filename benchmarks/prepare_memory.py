"""Peak memory of preparing a large corpus: streamed `prepare_data` against the in-memory path.

Writes a synthetic text corpus (Zipf-distributed words in lines, ``--mb`` megabytes in files
of 10 MB, each passed as a source: cut into ~64K-character documents) into ``--dir`` when it
is not there yet, then prepares it in a fresh child process per mode and prints one JSON row
per mode with the child's peak resident set (``ru_maxrss``), the wall time and the token counts:

* ``stream``: `condmem.train.pipeline.prepare_data` (a document at a time; training tokens
  written to a memory-mapped file).
* ``memory``: the in-memory composition the streamed path replaces: `load_corpus` (every
  document's text), `split_corpus`, `encode_documents` of the training split (one array),
  with the same tokenizer.

    python benchmarks/prepare_memory.py --mb 300 --dir /tmp/condmem-big --modes stream
    python benchmarks/prepare_memory.py --mb 75 --dir /tmp/condmem-75 --modes stream memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FILE_MB = 10


def write_corpus(folder: Path, megabytes: int, seed: int = 0) -> None:
    """`megabytes` MB of synthetic text in files of FILE_MB MB (kept when already complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(20_000)]
    probs = 1.0 / np.arange(1, len(vocab) + 1)
    probs /= probs.sum()
    for k in range((megabytes + FILE_MB - 1) // FILE_MB):
        path = folder / f"part{k:04d}.txt"
        if path.is_file() and path.stat().st_size >= FILE_MB * 1_000_000:
            continue
        words = rng.choice(len(vocab), size=FILE_MB * 1_000_000 // 6, p=probs)
        lines, line = [], []
        for w in words.tolist():
            line.append(vocab[w])
            if len(line) == 12:
                lines.append(" ".join(line))
                line = []
        path.write_text("\n".join(lines) + "\n")


def child(mode: str, folder: str, cache: str) -> None:
    # Each file is a source of its own: a long text file is cut into ~64K-character documents.
    folder = sorted(str(f) for f in Path(folder).glob("*.txt"))
    t0 = time.perf_counter()
    if mode == "stream":
        from condmem.train.pipeline import prepare_data

        data = prepare_data(folder, vocab_size=4096, tokenizer_train_bytes=8_000_000, cache_dir=cache)
        row = {"train_tokens": len(data.train), "val_tokens": len(data.val), "info_seconds": data.info["seconds"]}
    else:
        from condmem.train.bpe import EOS
        from condmem.train.data import encode_documents, load_corpus, split_corpus
        from condmem.train.pipeline import prepare_data

        # The same tokenizer as the streamed mode (the same 8 MB sample), prepared on 8 MB.
        tok = prepare_data(folder, vocab_size=4096, max_train_bytes=8_000_000, cache_dir=cache).tokenizer
        corpus = load_corpus(folder)
        train, _ = split_corpus(corpus)
        tokens = encode_documents(tok, train, tok.token_to_id(EOS))
        row = {"train_tokens": len(tokens)}
    row.update(
        mode=mode,
        seconds=round(time.perf_counter() - t0, 1),
        peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )
    print(json.dumps(row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=300, help="corpus size in MB")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "condmem-prepare-memory")
    p.add_argument("--modes", nargs="+", default=["stream"], choices=["stream", "memory"])
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return
    write_corpus(args.dir / "corpus", args.mb)
    size = sum(f.stat().st_size for f in (args.dir / "corpus").iterdir())
    for mode in args.modes:
        with tempfile.TemporaryDirectory(dir=args.dir) as cache:
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, str(args.dir / "corpus"), cache],
                check=True,
                capture_output=True,
                text=True,
                env=dict(os.environ, TOKENIZERS_PARALLELISM="true"),
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["corpus_mb"] = round(size / 1e6, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
