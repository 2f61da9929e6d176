"""Prompt token counting with a bounded, linear cost for any input.

tiktoken's BPE is quadratic in the length of one regex piece: 128 Ki spaces (one
piece) cost ~35 ms, 1 MiB of them ~400 ms, and with o200k about 1 MB of spaces makes
its regex overflow its stack (a pyo3 ``PanicException``, which derives from
``BaseException``). GitHub's linear-time BPE (the ``bpe-openai`` wheel) gives the same
counts (checked on ``PROBES`` at load, and in the tests on a fuzzed corpus) at
~1 ms per 128 KiB of spaces and ~4 ms per 128 KiB of English here
(``python -m bench.tokenizer``), so it is the counter when it is installed; tiktoken
is the fallback.

Text is counted in slices of at most ``SLICE_CHARS`` characters so that

- a count can stop as soon as it passes a limit (the context window: beyond it the
  request is refused whatever the exact number), which bounds the work per request;
- the fair scheduler (``extproc.tokens.pool``) can interleave tenants slice by slice;
- no single tokenizer call sees a piece long enough to hit a pathological case
  (slices are also kept near ``SLICE_CHARS`` UTF-8 bytes, so ~0.3-0.7 ms each here).

A slice ends, where it can, at a space between two non-space characters. No regex
piece of cl100k or o200k contains a non-space character followed by a space, and
their pieces only look ahead, so such a cut is a piece boundary and the count stays
exact. A slice with no such place (a run of one character, text without spaces) is
cut hard. Measured over fuzzed junk (runs of one or a few characters, 6,000 inputs),
a hard cut changed the count by -1 to +5 tokens; ``Count.tokens`` adds
``HARD_CUT_MARGIN`` (1) per hard cut, so Sluice never counts below the exact number
and overcounts by at most 6 tokens per 8 KiB of junk (``tests/test_tokenizer.py``
bounds it). The pre-charge is corrected at settle from the backend's usage anyway.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.machinery
import importlib.util
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("sluice.tokenizer")

SLICE_CHARS = 8192
CUT_WINDOW = 256  # where a slice looks for a safe place to end
SHORT_CHARS = SLICE_CHARS // 4  # texts this short in all are never cut (TokenCounter.count_short)
HARD_CUT_MARGIN = 1  # a hard cut lowered the count by at most 1 token (measured)
# A space between two non-space characters. Python's \s is a superset of the Unicode
# White_Space the encodings' regexes use, so "non-space" here is non-space there too.
_SAFE_CUT = re.compile(r"(?<=\S) (?=\S)")
# Never turned into a 400: the process or the stream is being stopped.
_NOT_OURS = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)
# bpe-openai must count these as tiktoken does (tests/test_tokenizer.py checks the
# numbers against tiktoken), or Sluice counts with tiktoken instead. Known counts
# rather than a tiktoken call keep tiktoken's vocabularies out of memory (~100 MB).
PROBES = (
    "Hello, world! 123 4567  \n\n  ünïcödé 中文 😀 'll   x" + " " * 300 + "end",
    "We're testing: don't, I'LL, they've; 3.14159 x=42/7 <|endoftext|> \t\t\r\n\r\n",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\n" + "a" * 200 + "!!!" + "\n" * 50,
    "Жизнь ß İstanbul ǅ \u0301\u200d \u00a0\u3000 ﬁ العربية हिन्दी 한국어" * 3,
)
PROBE_COUNTS = {"cl100k_base": (29, 32, 51, 105), "o200k_base": (25, 29, 51, 57)}


class TokenizerFailed(Exception):
    """Counting raised; the request is refused with 400 ``tokenizer_failed``."""


@dataclass(frozen=True, slots=True)
class Count:
    counted: int  # tokens the tokenizer returned for the slices it saw
    complete: bool = True  # False: stopped early, past the limit
    hard_cuts: int = 0
    seconds: float = 0.0  # time spent counting
    # A count of separate inputs (``per_text``): the first text past the limit on its own,
    # which stopped the count (None: none was).
    over_text: int | None = None

    @property
    def tokens(self) -> int:
        """What Sluice charges: never below the exact count (see the module docstring)."""
        return self.counted + HARD_CUT_MARGIN * self.hard_cuts


def estimate(texts: list[str]) -> int:
    """One token per 4 characters, rounded up: what a failed count is charged."""
    return -(-sum(len(t) for t in texts) // 4)


def slices(text: str, size: int = SLICE_CHARS) -> Iterator[tuple[str, bool]]:
    """``text`` in pieces of at most ``size`` characters and about ``size`` UTF-8 bytes;
    True marks a piece that ended in a hard cut."""
    n, start, ascii_only = len(text), 0, text.isascii()
    while True:
        end = start + size
        if not ascii_only:
            candidate = text[start:end]
            nbytes = len(candidate.encode("utf-8", "surrogatepass"))
            if nbytes > size:  # ~18k tokens in 8k CJK or emoji characters: keep slices short in time too
                end = start + max(2 * CUT_WINDOW, len(candidate) * size // nbytes)
        if end >= n:
            break
        # Look only near the end: text with spaces has a safe place within a few words,
        # and a long scan of junk (a run of spaces) would cost more than counting it.
        m = _SAFE_CUT.search(text, end - CUT_WINDOW, end)
        hard = m is None
        if m is not None:
            end = m.start()
        yield text[start:end], hard
        start = end
    yield text[start:], False


def _tiktoken_counter(name: str) -> Callable[[str], int]:
    from extproc.tokens import encodings

    enc = encodings.get_encoding(name)
    return lambda s: len(enc.encode_ordinary(s))


@functools.cache
def _bpe_bindings() -> Any:
    """bpe-openai's Rust extension alone: its package ``__init__`` spends ~1 s building
    Python-side tables (a tiktoken look-alike API) that counting does not use."""
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("bpe-openai is not installed")
    for where in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(where) / f"_bindings{suffix}"
            if path.exists():
                loader = importlib.machinery.ExtensionFileLoader("bpe_openai._bindings", str(path))
                mod_spec = importlib.util.spec_from_file_location("bpe_openai._bindings", path, loader=loader)
                assert mod_spec is not None
                module = importlib.util.module_from_spec(mod_spec)
                loader.exec_module(module)
                return module
    raise ImportError("bpe-openai has no _bindings extension")


def _bpe_counter(name: str) -> Callable[[str], int] | None:
    try:
        tok = _bpe_bindings().tokenizer_for_encoding(name)
    except Exception as exc:  # noqa: BLE001 - not installed, or no such encoding: use tiktoken
        log.info("bpe-openai unavailable for %s (%s); counting with tiktoken", name, exc)
        return None
    return tok.count


class TokenCounter:
    """Counts tokens of one encoding. ``count`` is exact except for hard cuts (see above)."""

    def __init__(self, name: str, *, backend: str = "auto") -> None:
        self.name = name
        fast = _bpe_counter(name) if backend in ("auto", "bpe") else None
        if fast is not None and tuple(fast(p) for p in PROBES) != PROBE_COUNTS.get(name):
            log.warning("bpe-openai disagrees with tiktoken on %s; counting with tiktoken", name)
            fast = None
        if backend == "bpe" and fast is None:
            raise RuntimeError(f"bpe-openai cannot count {name}")
        self.backend = "bpe-openai" if fast is not None else "tiktoken"
        self._count = fast or _tiktoken_counter(name)

    def count_piece(self, text: str) -> int:
        """One slice, with every failure of the tokenizer turned into ``TokenizerFailed``."""
        try:
            try:
                return self._count(text)
            except UnicodeEncodeError:
                # Lone surrogates (JSON "\ud800"): replaced the way tiktoken does.
                return self._count(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))
        except Exception as exc:
            raise TokenizerFailed(f"{self.name}: {type(exc).__name__}: {str(exc)[:200]}") from exc
        except BaseException as exc:
            # pyo3 panics (PanicException) derive from BaseException, not Exception.
            if isinstance(exc, _NOT_OURS):
                raise
            raise TokenizerFailed(f"{self.name}: {type(exc).__name__}: {str(exc)[:200]}") from exc

    def count_short(self, texts: list[str], limit: int | None = None, per_text: bool = False) -> Count:
        """``count`` of texts of at most ``SHORT_CHARS`` characters in all (most requests),
        without a job: each text is one slice (4 UTF-8 bytes a character at most, so none is
        ever cut), counted in a row, with the same stop past ``limit`` and the same result."""
        t0 = time.perf_counter()
        counted = tokens = 0
        last, complete = -1, True
        for i, text in enumerate(texts):
            if not text:
                continue
            tokens = self.count_piece(text)
            counted += tokens
            last = i
            if limit is not None and (tokens if per_text else counted) > limit:
                complete = not any(texts[i + 1:])
                break
        over = last if per_text and limit is not None and tokens > limit else None
        return Count(counted, complete, 0, time.perf_counter() - t0, over)

    def job(self, texts: list[str], limit: int | None = None, per_text: bool = False) -> CountJob:
        return CountJob(self, texts, limit, per_text)

    def count(self, texts: list[str], limit: int | None = None, per_text: bool = False) -> Count:
        """All at once, on the calling thread (bounded by the slices and the limit)."""
        job = self.job(texts, limit, per_text)
        while not job.step():
            pass
        return job.result()


class CountJob:
    """A count done a slice at a time (``step()``), so a scheduler can interleave jobs.

    One step counts one slice, or several short texts (chat messages) together up to
    ``SLICE_CHARS`` characters. Stops once the running total passes ``limit``: the
    result is then a lower bound above the limit (``complete`` False), which is all a
    context-window check needs. With ``per_text`` the texts are separate inputs (an
    embeddings list), each held to ``limit`` alone: the count stops at the first that
    passes it (``Count.over_text``), and otherwise counts them all, whatever their sum.
    """

    __slots__ = ("counter", "limit", "per_text", "counted", "hard_cuts", "chars_done", "seconds",
                 "_slices", "_next", "_done", "_complete", "_text", "_text_counted")

    def __init__(self, counter: TokenCounter, texts: list[str], limit: int | None,
                 per_text: bool = False) -> None:
        self.counter, self.limit, self.per_text = counter, limit, per_text
        self.counted = self.hard_cuts = self.chars_done = 0
        self.seconds = 0.0
        self._slices = ((i, piece, hard) for i, t in enumerate(texts) if t
                        for piece, hard in slices(t))
        self._next = next(self._slices, None)
        self._done = self._complete = self._next is None
        self._text, self._text_counted = -1, 0  # the text being counted, and its tokens so far

    def step(self) -> bool:
        """Count the next slice (or run of short texts); True when the job is finished."""
        if self._done:
            return True
        budget = SLICE_CHARS
        t0 = time.perf_counter()
        try:
            while self._next is not None:
                index, text, hard = self._next
                # Up to 4 UTF-8 bytes a character: a step stays near SLICE_CHARS bytes.
                cost = len(text) if text.isascii() else 4 * len(text)
                if budget < SLICE_CHARS and cost > budget:
                    break  # does not fit in what is left of this step: the next one
                tokens = self.counter.count_piece(text)
                self.counted += tokens
                self.hard_cuts += hard
                self.chars_done += len(text)
                budget -= cost
                self._next = next(self._slices, None)
                if index != self._text:
                    self._text, self._text_counted = index, 0
                self._text_counted += tokens
                held = self._text_counted if self.per_text else self.counted
                if self.limit is not None and held > self.limit:
                    self._done = True
                    self._complete = self._next is None
                    return True
                if budget <= 0:
                    break
        finally:
            self.seconds += time.perf_counter() - t0
        if self._next is None:
            self._done = self._complete = True
        return self._done

    def result(self) -> Count:
        over = self.per_text and self.limit is not None and self._text_counted > self.limit
        return Count(self.counted, self._complete, self.hard_cuts, self.seconds,
                     self._text if over else None)
