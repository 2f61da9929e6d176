"""``python -m bench.tokenizer``: what counting a prompt costs, raw tiktoken vs Sluice.

For English, code, spaces, a repeated letter and random Unicode at 128 KiB and 1 MiB
(UTF-8 bytes), with cl100k and o200k: the best of a few runs of raw tiktoken
(``encode_ordinary``), of Sluice's counter on the whole text, and of Sluice's counter
stopping past an 8k-token window (what a request to an 8k model costs); the longest
single slice (the most another stream waits for this count); Sluice's count minus the
exact one. Markdown on stdout; ~15 s on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from tiktoken import Encoding

from bench import corpus
from bench.report import table
from extproc.tokens import encodings
from extproc.tokens.counter import Count, TokenCounter

SIZES = {"128 KiB": 128 * 1024, "1 MiB": 1024 * 1024}
WINDOW = 8192


def _fit(seed: str, nbytes: int) -> str:
    """``seed`` repeated and cut to ``nbytes`` UTF-8 bytes (ASCII seeds: characters)."""
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def _unicode(nbytes: int, rnd: random.Random) -> str:
    ranges = ((0x20, 0x7E), (0xA0, 0x2FFF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF))
    out, size = [], 0
    while size < nbytes:
        lo, hi = rnd.choice(ranges)
        c = chr(rnd.randint(lo, hi))
        out.append(c)
        size += len(c.encode("utf-8", "surrogatepass"))
    return "".join(out).encode("utf-8", "ignore").decode("utf-8")


def inputs(nbytes: int) -> dict[str, str]:
    return {
        "English (README + docs)": _fit(corpus.english(), nbytes),
        "code (extproc/**/*.py)": _fit(corpus.code(), nbytes),
        "spaces": " " * nbytes,
        "a repeated letter": "a" * nbytes,
        "random Unicode": _unicode(nbytes, random.Random(1)),
    }


def best(fn: Callable[[], object], reps: int) -> tuple[float, object]:
    """Best-of CPU time of this thread (other processes on a shared machine do not count)."""
    t, out = float("inf"), None
    for _ in range(reps):
        t0 = time.thread_time()
        try:
            out = fn()
        except BaseException as exc:  # noqa: BLE001 - pyo3 panics are BaseException; reported in the table
            if isinstance(exc, KeyboardInterrupt):
                raise
            out = exc
        t = min(t, time.thread_time() - t0)
    return t, out


def longest_slice(counter: TokenCounter, text: str) -> float:
    job = counter.job([text])
    worst, done = 0.0, False
    while not done:
        t0 = time.thread_time()
        done = job.step()
        worst = max(worst, time.thread_time() - t0)
    return worst


def row(enc: Encoding, counter: TokenCounter, size_name: str, name: str, text: str, reps: int) -> list[str]:
    t_raw, raw = best(lambda: len(enc.encode_ordinary(text)), reps)
    t_ours, ours = best(lambda: counter.count([text]), reps)
    t_win, _ = best(lambda: counter.count([text], WINDOW), reps)
    slice_s = min(longest_slice(counter, text) for _ in range(reps))
    per128 = 128 * 1024 / len(text.encode("utf-8"))
    assert isinstance(ours, Count)
    if isinstance(raw, int):
        raw_cell, exact_cell = f"{t_raw * 1000 * per128:.2f}", f"{raw:,}"
        err = f"{ours.tokens - raw:+d} ({ours.hard_cuts} hard cuts)"
    else:
        raw_cell, exact_cell, err = f"fails: `{type(raw).__name__}`", f"{ours.tokens:,} (Sluice)", "–"
    return [counter.name.split("_")[0], size_name, name, raw_cell, f"{t_ours * 1000 * per128:.2f}",
            f"{t_win * 1000:.2f}", f"{slice_s * 1000:.2f}", exact_cell, err]


def run(reps: int = 3) -> list[list[str]]:
    rows = []
    for enc_name in ("cl100k_base", "o200k_base"):
        enc, counter = encodings.get_encoding(enc_name), TokenCounter(enc_name)
        for size_name, nbytes in SIZES.items():
            for name, text in inputs(nbytes).items():
                rows.append(row(enc, counter, size_name, name, text, reps if nbytes <= 256 * 1024 else 2))
    return rows


def markdown(rows: list[list[str]], backend: str) -> str:
    head = ["encoding", "size", "input", "tiktoken ms / 128 KiB", f"Sluice ({backend}) ms / 128 KiB",
            f"Sluice, stop past {WINDOW // 1024}k tokens, ms", "longest slice ms", "exact tokens", "Sluice error"]
    return ("## Tokenizer: cost of counting a prompt (bench.tokenizer)\n\n"
            "CPU time of one thread, best of a few runs; ms per 128 KiB of UTF-8 (1 MiB rows divided by 8); "
            "the window column is a whole request's cost to an 8k-token model; the longest slice is the most "
            "another stream waits for this count. \"exact\" is tiktoken's count.\n\n"
            f"{table(head, rows)}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tokenizer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="runs per cell, best taken (default 3)")
    args = ap.parse_args(argv)
    print(markdown(run(args.reps), TokenCounter("cl100k_base").backend))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
