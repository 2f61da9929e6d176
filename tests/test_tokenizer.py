"""The prompt counter: exact on real text, bounded on junk, never below the exact count, every
tokenizer failure a ``TokenizerFailed`` (and nothing else)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import pytest

from bench import corpus
from extproc.tokens import counter as tokenizer
from extproc.tokens import encodings
from extproc.tokens.counter import SLICE_CHARS, TokenCounter, TokenizerFailed, slices

ENCODINGS = ("cl100k_base", "o200k_base")
ENGLISH = corpus.english()
ALPHABET = [" ", "  ", "\n", "\r\n", "\t", "a", "A", "é", "'s", "'LL", "1", "123456", "!", "/", ".\n/", "中",
            "😀", "\u0301", "\u00a0", "\u2028", "\x1c", "\u3000", "Ж", "ß", "İ", "ǅ", "\u200d", "<|endoftext|>"]


@pytest.fixture(scope="module", params=ENCODINGS)
def pair(request: pytest.FixtureRequest) -> tuple[TokenCounter, Callable[[str], int]]:
    enc = encodings.get_encoding(request.param)
    return TokenCounter(request.param), lambda s: len(enc.encode_ordinary(s))


def fuzzed(rnd: random.Random) -> str:
    k = rnd.random()
    if k < 0.25:
        return "".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(1, 6000)))
    if k < 0.5:
        i = rnd.randrange(len(ENGLISH))
        return ENGLISH[i:i + rnd.randint(1, 40_000)]
    if k < 0.75:  # long runs: the inputs where hard cuts happen
        return "".join(rnd.choice(ALPHABET) * rnd.randint(1, 12_000) for _ in range(rnd.randint(1, 4)))
    return "".join(chr(rnd.randint(0x20, 0x2FFFF)) for _ in range(rnd.randint(1, 12_000))).encode(
        "utf-8", "ignore").decode()


def test_the_default_counter_is_linear_time_bpe(pair: tuple[TokenCounter, Callable[[str], int]]) -> None:
    counter, _ = pair
    assert counter.backend == "bpe-openai"  # a dependency of the project: the fallback is only a fallback


def test_counts_equal_tiktoken_and_hard_cuts_only_ever_add_a_little(
        pair: tuple[TokenCounter, Callable[[str], int]]) -> None:
    counter, exact = pair
    rnd = random.Random(8)
    cuts_seen = 0
    for _ in range(300):
        text = fuzzed(rnd)
        got, want = counter.count([text]), exact(text)
        cuts_seen += got.hard_cuts
        # Never below the exact count (the TPM pre-charge does not undercharge), at most
        # 6 tokens per hard cut above it, and exact when every cut was safe.
        assert want <= got.tokens <= want + 6 * got.hard_cuts, (got, want, text[:60])
        if got.hard_cuts == 0:
            assert got.tokens == want
    assert cuts_seen > 50  # the corpus did exercise hard cuts


def test_a_safe_cut_is_a_space_between_non_spaces_and_slices_are_bounded() -> None:
    text = ENGLISH * 3
    pieces = list(slices(text))
    assert "".join(p for p, _ in pieces) == text
    assert all(len(p) <= SLICE_CHARS and not hard for p, hard in pieces)
    assert all(p.startswith(" ") and not p[1].isspace() for p, _ in pieces[1:])
    junk = list(slices("中" * 100_000))  # 3 bytes a character: slices are shorter in characters
    assert all(len(p.encode()) <= SLICE_CHARS + 4 for p, _ in junk)
    assert sum(hard for _, hard in junk) == len(junk) - 1


def cpu(fn: Callable[[], object], reps: int = 3) -> float:
    """Best-of CPU time of this thread: other processes on the machine do not count."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return max(best, 1e-6)


def test_pathological_inputs_cost_no_more_than_english_and_scale_linearly() -> None:
    counter = TokenCounter("o200k_base")
    mib = 1 << 20
    english = (ENGLISH * (mib // len(ENGLISH) + 1))[:mib]
    t_english = cpu(lambda: counter.count([english]))
    # tiktoken: 1 MiB of spaces costs ~6x English (and panics with o200k), a letter run ~5x.
    for junk in (" " * mib, "a" * mib, "\n" * mib, "!" * mib):
        assert cpu(lambda j=junk: counter.count([j])) < t_english, repr(junk[:3])
    # Linear: 8x the input costs at most ~8x (a quadratic piece would cost 64x).
    small = cpu(lambda: counter.count([" " * (mib // 8)]), reps=5)
    assert cpu(lambda: counter.count([" " * mib])) < 8 * 3 * small


def test_a_count_stops_past_its_limit_so_the_work_is_bounded_by_the_window() -> None:
    counter = TokenCounter("cl100k_base")
    english = ENGLISH * 30  # ~1 MiB
    job = counter.job(["system prompt", english], limit=4096)
    while not job.step():
        pass
    got = job.result()
    assert not got.complete and got.tokens > 4096
    assert job.chars_done < 4096 * 6 + SLICE_CHARS  # ~4 characters a token: it read ~20 KB, not 1 MB
    exact = counter.count([english[:100]], limit=4096)
    assert exact.complete and exact.tokens == counter.count([english[:100]]).tokens


def test_a_pyo3_panic_becomes_tokenizer_failed() -> None:
    # The real failure: tiktoken's o200k regex overflows its stack on ~1 MB of spaces
    # and pyo3 raises PanicException, a BaseException that `except Exception` misses.
    raw = TokenCounter("o200k_base", backend="tiktoken")
    with pytest.raises(TokenizerFailed, match="PanicException") as ei:
        raw.count_piece(" " * 1_000_000)
    assert not isinstance(ei.value.__cause__, Exception)
    # Sliced, the same input counts correctly with tiktoken too.
    assert raw.count([" " * (1 << 20)]).tokens == TokenCounter("o200k_base").count([" " * (1 << 20)]).tokens


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(1), asyncio.CancelledError()])
def test_stopping_the_process_or_the_stream_is_never_turned_into_a_400(exc: BaseException) -> None:
    counter = TokenCounter("cl100k_base")

    def boom(text: str) -> int:
        raise exc

    counter._count = boom
    with pytest.raises(type(exc)):
        counter.count(["hello"])


def test_ordinary_errors_and_lone_surrogates() -> None:
    counter = TokenCounter("cl100k_base")
    enc = encodings.get_encoding("cl100k_base")
    assert counter.count(["a\ud800b"]).tokens == len(enc.encode_ordinary("a\ud800b"))

    def broken(text: str) -> int:
        raise ValueError("corrupt vocabulary")

    counter._count = broken
    with pytest.raises(TokenizerFailed, match="ValueError: corrupt vocabulary"):
        counter.count(["x" * 20_000])


def test_special_tokens_are_counted_as_text() -> None:
    enc = encodings.get_encoding("cl100k_base")
    text = "before <|endoftext|> after"
    assert TokenCounter("cl100k_base").count([text]).tokens == len(enc.encode_ordinary(text))


def test_estimate_for_failures() -> None:
    assert tokenizer.estimate(["abcd", "e"]) == 2
    assert tokenizer.estimate([]) == 0


@pytest.mark.parametrize("name", ENCODINGS)
def test_the_startup_probe_counts_are_tiktokens(name: str) -> None:
    enc = encodings.get_encoding(name)
    assert tokenizer.PROBE_COUNTS[name] == tuple(len(enc.encode_ordinary(p)) for p in tokenizer.PROBES)


def test_a_fast_counter_that_disagrees_with_tiktoken_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tokenizer.PROBE_COUNTS, "cl100k_base", (1, 2, 3, 4))
    counter = TokenCounter("cl100k_base")
    assert counter.backend == "tiktoken"
    assert counter.count(["hello world"]).tokens == 2
    with pytest.raises(RuntimeError, match="bpe-openai cannot count"):
        TokenCounter("cl100k_base", backend="bpe")


def test_separate_inputs_are_each_held_to_the_limit_and_all_counted() -> None:
    """An embeddings list: each input is its own sequence, so 25,000 one-token inputs count
    25,000 (a limit on the sum would stop at the window), and the first input past the
    window on its own stops the count and is named."""
    c = TokenCounter("cl100k_base")
    many = c.count(["x"] * 25_000, limit=4096, per_text=True)
    assert (many.tokens, many.complete, many.over_text) == (25_000, True, None)
    summed = c.count(["x"] * 25_000, limit=4096)
    assert summed.tokens == 4097 and not summed.complete  # what the list was charged before
    over = c.count(["short", " the" * 5000, " the" * 9000], limit=4096, per_text=True)
    assert over.over_text == 1 and not over.complete and 4096 < over.tokens < 5010
    fits = c.count(["", " the" * 4096, "a"], limit=4096, per_text=True)
    assert fits.over_text is None and fits.tokens == 4097


def test_a_short_prompt_counted_in_a_row_says_what_the_sliced_job_says() -> None:
    # The inline count of short prompts (Runtime.count_prompt) must be the job's, to the
    # stop past the limit, the completeness and the text that passed it alone.
    counter = TokenCounter("cl100k_base")
    rng = random.Random(7)
    words = ["hello", "", "Жизнь", "😀" * 3, "x=42/7", " " * 9, "The quick brown fox", "\n\n"]
    for _ in range(600):
        texts = ["".join(rng.choice(words) for _ in range(rng.randrange(0, 12))) for _ in range(rng.randrange(0, 6))]
        assert sum(map(len, texts)) <= tokenizer.SHORT_CHARS
        limit = rng.choice([None, 0, 3, 10, 40])
        for per_text in (False, True):
            short = counter.count_short(texts, limit, per_text)
            sliced = counter.count(texts, limit, per_text)
            assert (short.counted, short.complete, short.hard_cuts, short.over_text) == \
                (sliced.counted, sliced.complete, sliced.hard_cuts, sliced.over_text), (texts, limit, per_text)
