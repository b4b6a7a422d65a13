"""Corpus, train/validation split, token streams and batches.

* `iter_corpus` / `load_corpus`: text documents from directories, text files (a long one cut
  at line ends into ~64K-character documents), JSONL, or Hugging Face dataset tables
  (``.parquet``, ``.arrow``, a ``save_to_disk`` folder; optional ``pyarrow``), streamed one
  document at a time or loaded whole; by default the standard library source of the running
  interpreter (real text on every machine, no download), described by its Python version
  and a content hash; ``"python"`` adds the source of every package installed beside it.
* `split_corpus` / `validation_flags`: a deterministic train/validation split by document name.
* `encode_corpus`: documents -> one token stream per split, EOS between documents,
  cached on disk keyed by (corpus hash, tokenizer hash).
* `TokenStream`: training batches walk a seeded permutation of non-overlapping windows,
  one pass after another (no token is seen twice before every window has been seen once),
  as a pure function of (seed, step), so a resumed run sees exactly the batches an
  uninterrupted one would. Validation covers every token of its split exactly once.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import platform
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


logger = logging.getLogger("condmem.train.data")

STDLIB = "stdlib"
"""`load_corpus` name of the default corpus: the running interpreter's standard library source."""

PYTHON = "python"
"""`load_corpus` name of the standard library plus every installed package's Python source."""

DEFAULT_PATTERNS = ("*.py", "*.txt", "*.md", "*.rst", "*.jsonl", "*.parquet", "*.arrow")
"""File name patterns read from a corpus directory."""

# Bump when the token cache layout changes; older files are then simply not found.
_TOKEN_CACHE_FORMAT = 1


class CorpusError(ValueError):
    """The corpus cannot be read or is empty."""


@dataclass(frozen=True)
class Document:
    name: str
    """Stable identity (relative path, or file:line for JSONL); decides the split."""
    text: str


@dataclass
class Corpus:
    documents: list[Document]
    info: dict = field(default_factory=dict)
    """source, python_version (stdlib), n_documents, n_bytes, sha256 of the content."""

    @property
    def sha256(self) -> str:
        return self.info["sha256"]


def cache_root() -> Path:
    """`$CONDMEM_CACHE_DIR`, else `$XDG_CACHE_HOME/condmem`, else `~/.cache/condmem`."""
    root = os.environ.get("CONDMEM_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "condmem"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = stdlib_dir()
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file()]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def site_dirs() -> list[Path]:
    """The interpreter's package directories (site-packages), existing ones, without repeats."""
    import site

    found: list[Path] = []
    candidates = [sysconfig.get_paths().get(k) for k in ("purelib", "platlib")]
    try:
        candidates += list(site.getsitepackages())
    except AttributeError:  # some virtualenv builds of `site` lack it
        pass
    for c in candidates:
        if not c:
            continue
        path = Path(c).resolve()
        if path.is_dir() and path not in found and not any(path.is_relative_to(f) for f in found):
            found.append(path)
    return found


def _dir_files(root: Path, patterns: Sequence[str]) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in filenames:
            if any(fnmatch.fnmatch(name, pat) for pat in patterns):
                out.append(Path(dirpath) / name)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None  # a few stdlib test files are deliberately not UTF-8
    except OSError as exc:
        logger.warning("skipping unreadable file %s (%s)", path, exc)
        return None


PIECE_CHARS = 64 * 1024
"""A single corpus file longer than this is cut into documents of about this many characters."""


def split_text(text: str, size: int) -> list[str]:
    """`text` cut at line ends into pieces of about `size` characters (a line longer than
    `size` stays whole); joined, the pieces give `text` back."""
    if len(text) <= size:
        return [text]
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    return pieces


def _normalize_sources(sources) -> list:
    if sources is None or (isinstance(sources, str) and sources == STDLIB):
        return [STDLIB]
    if isinstance(sources, str) and sources == PYTHON:
        return [PYTHON]
    if isinstance(sources, (str, os.PathLike)):
        return [sources]
    return list(sources)


def _tree_files(source: str, patterns: Sequence[str]) -> list[tuple[str, Path]] | None:
    """(document name, file) of every file a 'stdlib' / 'python' / directory source reads, in
    reading order; None for a file source (its documents come from its content)."""
    if source in (STDLIB, PYTHON):
        root, files = _stdlib_files()
        trees = [("stdlib", root, files)]
        if source == PYTHON:
            trees += [(f"site{i}", d, _dir_files(d, ("*.py",))) for i, d in enumerate(site_dirs())]
        return [(f"{prefix}/{f.relative_to(tree).as_posix()}", f) for prefix, tree, fs in trees for f in fs]
    path = Path(source).expanduser()
    if path.is_dir():
        return [(f"{path.name}/{f.relative_to(path).as_posix()}", f) for f in _dir_files(path, patterns)]
    if path.is_file():
        return None
    raise CorpusError(f"corpus source {source!r} is neither 'stdlib', 'python', a directory, nor a file")


def _source_info(source: str, info: dict) -> None:
    if source in (STDLIB, PYTHON):
        info["python_version"] = platform.python_version()
        info["python_implementation"] = platform.python_implementation()
        info["stdlib_dir"] = str(stdlib_dir())
        if source == PYTHON:
            info["site_dirs"] = [str(d) for d in site_dirs()]


def _text_pieces(path: Path, size: int) -> Iterable[str]:
    """The pieces `split_text` cuts a text file into, read line by line (the file is never
    held whole: at most one piece and one line at a time)."""
    with open(path, "rb") as fh:
        buf: list[str] = []
        n = 0
        for raw in fh:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CorpusError(f"corpus file {path} is not UTF-8 text") from None
            buf.append(line)
            n += len(line)
            if n > size and line.endswith("\n"):  # the first line end at or after `size` characters
                yield "".join(buf)
                buf, n = [], 0
        if buf:
            yield "".join(buf)


TABLE_SUFFIXES = (".parquet", ".arrow")
"""Files read as Hugging Face dataset tables (one document per row, needs ``pyarrow``)."""


def is_dataset_dir(path: Path) -> bool:
    """A folder written by ``datasets.Dataset.save_to_disk`` (its ``state.json`` names the arrow files)."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _dataset_files(path: Path) -> list[Path]:
    """The arrow files of a ``save_to_disk`` folder, in its order."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        files = [path / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorpusError(f"corpus {path}: unreadable dataset state.json ({exc})") from None
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CorpusError(f"corpus {path}: dataset file(s) {missing} named in state.json are missing")
    return files


def _require_pyarrow(path: Path):
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise CorpusError(
            f"corpus {path} is a Hugging Face dataset (arrow/parquet): reading it needs the optional "
            "package 'pyarrow' (pip install pyarrow)"
        ) from None
    return pyarrow


def _table_documents(path: Path, key: str, label: str | None = None) -> Iterable[tuple[str, str]]:
    """Rows of a .parquet or .arrow file, streamed a record batch at a time: (``label:row``, its
    `key` column); `label` defaults to the file name."""
    pa = _require_pyarrow(path)
    if path.suffix == ".parquet":
        pf = pa.parquet.ParquetFile(path)
        if key not in pf.schema_arrow.names:
            raise CorpusError(f"corpus {path} has no column {key!r} (columns {pf.schema_arrow.names})")
        batches = pf.iter_batches(batch_size=1024, columns=[key])
    else:
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        if key not in reader.schema.names:
            raise CorpusError(f"corpus {path} has no column {key!r} (columns {reader.schema.names})")
    row = 0
    for batch in batches:
        for value in batch.column(batch.schema.get_field_index(key)).to_pylist():
            if not isinstance(value, str):
                raise CorpusError(f"{path}: row {row} column {key!r} is not text ({type(value).__name__})")
            yield f"{label or path.name}:{row}", value
            row += 1


RECORD_SUFFIXES = (".jsonl", *TABLE_SUFFIXES)
"""Files holding one document per record (a JSONL line, a table row), also inside a folder."""


def _file_documents(path: Path, jsonl_key: str, label: str | None = None) -> Iterable[tuple[str, str]]:
    """A .jsonl file's records, a .parquet/.arrow table's rows (named ``label:line`` /
    ``label:row``, `label` defaulting to the file name), or a text file cut at line ends into
    ~PIECE_CHARS pieces; each read as a stream."""
    if path.suffix in TABLE_SUFFIXES:
        yield from _table_documents(path, jsonl_key, label)
        return
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno} is not valid JSON: {exc}") from None
                if not isinstance(record, dict) or not isinstance(record.get(jsonl_key), str):
                    raise CorpusError(f"{path}:{lineno} has no string field {jsonl_key!r}")
                yield f"{label or path.name}:{lineno}", record[jsonl_key]
        return
    # One long text (a book, a dump) becomes pieces of ~PIECE_CHARS cut at line ends, so
    # that it can be split into training and validation like a folder of files. The piece
    # after the first is read before the first is named (a single piece keeps the file name).
    pending, k = None, -1
    for k, piece in enumerate(_text_pieces(path, PIECE_CHARS)):
        if pending is not None:
            yield f"{path.name}#{k - 1:06d}", pending
        pending = piece
    if pending is not None:
        yield (path.name if k == 0 else f"{path.name}#{k:06d}"), pending


def _documents(sources: list, patterns: Sequence[str], jsonl_key: str, info: dict) -> Iterable[tuple[str, str]]:
    """(name, text) of every document of `sources`, in order (files that are not UTF-8 skipped)."""
    for source in sources:
        path = Path(source).expanduser() if source not in (STDLIB, PYTHON) else None
        if path is not None and path.is_dir() and is_dataset_dir(path):
            _require_pyarrow(path)
            for f in _dataset_files(path):
                yield from _table_documents(f, jsonl_key, f"{path.name}/{f.name}")
            continue
        files = _tree_files(str(source), patterns)
        _source_info(str(source), info)
        if files is None:
            yield from _file_documents(path, jsonl_key)
            continue
        for name, fpath in files:
            if fpath.suffix in RECORD_SUFFIXES:
                yield from _file_documents(fpath, jsonl_key, name)
                continue
            text = _read_text(fpath)
            if text is not None:
                yield name, text


def iter_corpus(
    sources: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    jsonl_key: str = "text",
    max_bytes: int | None = None,
    info: dict | None = None,
) -> Iterator[Document]:
    """The documents `load_corpus` reads, one at a time (memory: one document, or one piece of
    a long text file). When the iteration ends, `info` (if given) holds what `load_corpus`
    records: sources, n_documents, n_bytes, sha256, truncated."""
    sources = _normalize_sources(sources)
    info = {} if info is None else info
    info["sources"] = [str(s) for s in sources]
    digest = hashlib.sha256()
    n_docs = n_bytes = 0
    full = False
    for name, text in _documents(sources, patterns, jsonl_key, info):
        if not text:
            continue
        data = text.encode("utf-8")
        if max_bytes is not None and n_bytes + len(data) > max_bytes and n_docs:
            full = True
            break
        digest.update(name.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little") + data)
        n_docs += 1
        n_bytes += len(data)
        yield Document(name, text)
    if not n_docs:
        raise CorpusError(f"the corpus {info['sources']} holds no text (patterns {list(patterns)})")
    info.update(n_documents=n_docs, n_bytes=n_bytes, sha256=digest.hexdigest(), truncated=full)


def load_corpus(
    sources: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    jsonl_key: str = "text",
    max_bytes: int | None = None,
) -> Corpus:
    """Read documents (all in memory; `iter_corpus` streams them).

    Args:
        sources: None or ``"stdlib"`` (the interpreter's standard library ``*.py``),
            ``"python"`` (the standard library and every site-packages directory's ``*.py``), or
            paths: a directory (files matching `patterns`, recursively; ``.jsonl``, ``.parquet``
            and ``.arrow`` files in it give one document per record), a ``.jsonl`` file (one
            document per line, its `jsonl_key` field), a ``.parquet`` / ``.arrow`` file or a
            ``datasets.Dataset.save_to_disk`` folder (one document per row, its `jsonl_key`
            column; needs the optional ``pyarrow``), or any other text file (cut at line ends
            into documents of ~64K characters when longer).
        max_bytes: stop adding documents after this many UTF-8 bytes (files in sorted order).

    Returns:
        A `Corpus` whose ``info`` records the source, the Python version for the stdlib,
        and a sha256 over every (name, text) pair.
    """
    info: dict = {}
    docs = list(iter_corpus(sources, patterns=patterns, jsonl_key=jsonl_key, max_bytes=max_bytes, info=info))
    return Corpus(docs, info)


def corpus_fingerprint(
    sources: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    jsonl_key: str = "text",
    max_bytes: int | None = None,
) -> str:
    """A cheap identity of what `load_corpus` would read with these arguments: the path, size
    and modification time of every file (no content is read), the arguments and the
    interpreter. An edited, added or removed file changes it."""
    digest = hashlib.sha256(
        json.dumps([_TOKEN_CACHE_FORMAT, list(patterns), jsonl_key, max_bytes, sys.version]).encode()
    )
    for source in _normalize_sources(sources):
        path = Path(source).expanduser()
        if source not in (STDLIB, PYTHON) and path.is_dir() and is_dataset_dir(path):
            paths = [path / "state.json", *_dataset_files(path)]
        else:
            files = _tree_files(str(source), patterns)
            paths = [path.resolve()] if files is None else [f for _, f in files]
        digest.update(f"\1{source}".encode())
        for path in paths:
            st = path.stat()
            digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def validation_flags(names: Sequence[str], val_fraction: float = 0.02, seed: int = 0) -> np.ndarray:
    """bool per document name: is it in the validation split? (`split_corpus`'s rule, from the
    names alone: a document is in val when the hash of (seed, its name) falls below
    `val_fraction`; when that leaves a side empty, the ``round(val_fraction * n)`` lowest hashes.)"""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    scores = np.array(
        [int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") / 2**64 for name in names],
        dtype=np.float64,
    )
    flags = scores < val_fraction
    if len(names) >= 2 and (flags.all() or not flags.any()):
        cut = max(1, min(len(names) - 1, round(val_fraction * len(names))))
        flags = np.zeros(len(names), dtype=bool)
        flags[np.argsort(scores, kind="stable")[:cut]] = True
    if not flags.any():
        raise CorpusError("the corpus has a single document: it cannot be split into train and validation")
    return flags


def split_corpus(corpus: Corpus, val_fraction: float = 0.02, seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Deterministic (train, val) split by document (`validation_flags`). Both splits are
    non-empty when there are two documents or more."""
    flags = validation_flags([d.name for d in corpus.documents], val_fraction, seed)
    train = [d for d, v in zip(corpus.documents, flags) if not v]
    val = [d for d, v in zip(corpus.documents, flags) if v]
    return train, val


# ----------------------------------------------------------------------------- encoding


def encode_documents(tokenizer, docs: Sequence[Document], eos_id: int, batch_docs: int = 256) -> np.ndarray:
    """Token ids of every document, EOS after each, as one array (uint16 when the vocab allows)."""
    dtype = np.uint16 if tokenizer.get_vocab_size(with_added_tokens=True) <= 2**16 else np.uint32
    parts: list[np.ndarray] = []
    for i in range(0, len(docs), batch_docs):
        chunk = docs[i : i + batch_docs]
        for enc in tokenizer.encode_batch([d.text for d in chunk], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=dtype))
            parts.append(np.asarray([eos_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def docs_key(docs: Iterable[Document], *extra: str) -> str:
    digest = hashlib.sha256()
    for d in docs:
        data = d.text.encode("utf-8")
        digest.update(d.name.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little") + data)
    for e in extra:
        digest.update(b"\1" + e.encode("utf-8"))
    return digest.hexdigest()[:32]


# ----------------------------------------------------------------------------- batches


@dataclass
class Batch:
    inputs: torch.Tensor
    """int64 [B, T] token ids."""
    targets: torch.Tensor
    """int64 [B, T] next token ids."""
    doc_starts: torch.Tensor
    """bool [B, T]: the first token of a document (the previous token is EOS)."""
    scored: torch.Tensor | None = None
    """bool [B, T]: the targets that count (validation: a tail window overlaps the one
    before it, and only its new targets count); None: all of them."""
    positions: torch.Tensor | None = None
    """int64 [B, T]: each target's index in its stream (validation only)."""

    def to(self, device, non_blocking: bool = False) -> Batch:
        """The batch on `device`. ``non_blocking`` to a CUDA device pins host tensors first: a copy
        from pageable memory can wait for the work already queued on the device, so the host could
        not queue a step while the one before it runs."""
        pin = non_blocking and torch.device(device).type == "cuda"
        moved = [
            None
            if t is None
            else (t.pin_memory() if pin and t.device.type == "cpu" else t).to(device, non_blocking=non_blocking)
            for t in (self.inputs, self.targets, self.doc_starts, self.scored, self.positions)
        ]
        return Batch(*moved)

    @property
    def n_tokens(self) -> int:
        return self.targets.numel() if self.scored is None else int(self.scored.sum())


class TokenStream:
    """One split's tokens; training windows in seeded passes, validation windows over all of it.

    Args:
        tokens: 1-D integer array (EOS between documents).
        eos_id: the EOS token id (marks document starts for the hasher).
    """

    def __init__(self, tokens: np.ndarray, eos_id: int):
        if tokens.ndim != 1:
            raise ValueError(f"a token stream is 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.eos_id = eos_id
        self._perm_key: tuple | None = None
        self._perm: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def _windows(self, starts: np.ndarray, seq_len: int) -> Batch:
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        chunk = torch.from_numpy(self.tokens[idx].astype(np.int64))
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        doc_starts = torch.zeros_like(inputs, dtype=torch.bool)
        doc_starts[:, 1:] = inputs[:, :-1] == self.eos_id
        return Batch(inputs.contiguous(), targets.contiguous(), doc_starts)

    def windows_per_pass(self, seq_len: int) -> int:
        """Non-overlapping training windows of `seq_len` (+1 target) in one pass over the stream."""
        return max(0, (len(self) - 1) // seq_len)

    def passes(self, steps: int, batch_size: int, seq_len: int) -> float:
        """How many passes over the stream `steps` batches make."""
        per_pass = self.windows_per_pass(seq_len)
        return steps * batch_size / per_pass if per_pass else float("inf")

    def _permutation(self, seed: int, epoch: int, n: int) -> np.ndarray:
        key = (seed, epoch, n)
        if self._perm_key != key:
            self._perm = np.random.default_rng([seed, epoch, 0x5EED]).permutation(n)
            self._perm_key = key
        return self._perm

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0) -> Batch:
        """Training batch `step`: windows ``step*B .. step*B+B-1`` of a walk through the
        stream's non-overlapping windows, in a seeded permutation per pass."""
        n = self.windows_per_pass(seq_len)
        if n < 1:
            raise CorpusError(f"the training split has {len(self)} tokens, fewer than one window of {seq_len + 1}")
        epoch, k = np.divmod(step * batch_size + np.arange(batch_size, dtype=np.int64), n)
        windows = np.empty(batch_size, dtype=np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            windows[sel] = self._permutation(seed, int(e), n)[k[sel]]
        return self._windows(windows * seq_len, seq_len)

    def eval_batches(self, seq_len: int, max_tokens: int | None, batch_size: int) -> Iterable[Batch]:
        """Validation windows.

        ``max_tokens=None``: every target of the stream exactly once (non-overlapping windows
        from the start; a last window ending at the stream's end scores only the targets the
        others left). Otherwise ``max_tokens // seq_len`` windows evenly spread over the stream
        (a fixed subset for evaluations during training).
        """
        if len(self) < 2:
            raise CorpusError(f"the validation split has {len(self)} tokens; it needs at least 2")
        seq_len = min(seq_len, len(self) - 1)
        n_full = (len(self) - 1) // seq_len
        starts = np.arange(n_full, dtype=np.int64) * seq_len
        tail_from = None
        if max_tokens is not None:
            want = max(1, min(n_full, max_tokens // seq_len))
            starts = starts[np.unique(np.linspace(0, n_full - 1, want).round().astype(np.int64))]
        elif n_full * seq_len < len(self) - 1:
            tail_start = len(self) - 1 - seq_len
            tail_from = n_full * seq_len - tail_start  # first new target in the tail window
            starts = np.append(starts, tail_start)
        for i in range(0, len(starts), batch_size):
            chunk = starts[i : i + batch_size]
            batch = self._windows(chunk, seq_len)
            batch.positions = torch.from_numpy(chunk[:, None] + 1 + np.arange(seq_len)[None, :])
            scored = torch.ones_like(batch.targets, dtype=torch.bool)
            if tail_from is not None and i + len(chunk) == len(starts):
                scored[-1, :tail_from] = False
            batch.scored = scored
            yield batch
