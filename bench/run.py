"""``python -m bench.run``: every benchmark in one run, markdown on stdout and in
``bench/results/report.md``, one PNG per headline configuration in ``bench/results/``.

    python -m bench.run                      # everything, ~20 minutes on 2 cores
    python -m bench.run --quick              # shorter phases and runs, ~3 minutes
    python -m bench.run --only headline      # or tpm, soak, floods, overhead, tokenizer
    python -m bench.run --only headline --configs ad
    python -m bench.run --only slowdown          # decode speed halved for 20 s: (e) vs (f)
    python -m bench.run --only longprompt        # 12 documents of 16k-24k tokens on steady chat
    python -m bench.run --only fairness          # a heavy and a light tenant in one tier: fair share by work
    python -m bench.run --only pool              # 3 engines, the trace's burst at 3x: Envoy RR / LR /
                                                 # Sluice picking (+ prefix affinity)
    python -m bench.run --only state_store       # TPM/RPM state in Redis vs in-process; accuracy, 1 and 3 replicas

Progress goes to stderr. The first run installs LiteLLM into ``bench/.litellm-venv``
(~750 MB, a minute or two) for configuration (c); if that fails, (c) is reported as not
run and the rest goes on.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PARTS = ("headline", "longprompt", "fairness", "slowdown", "pool", "tpm", "state_store", "soak",
         "floods", "overhead", "tokenizer")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def overhead_part(quick: bool) -> str:
    """The ext_proc overhead tables from ``bench.overhead`` (its own module and owner)."""
    try:
        from bench import overhead

        rows = overhead.run(rounds=1, requests=300 if quick else 400, seconds=1.5 if quick else 2.0,
                            protobuf_seconds=0.5, log=log)
        body = overhead.render_markdown(rows)
    except (ImportError, AttributeError, TypeError) as exc:
        log(f"bench.overhead.run unavailable ({exc}); running python -m bench.overhead")
        proc = subprocess.run([sys.executable, "-m", "bench.overhead"], capture_output=True, text=True,
                              cwd=ROOT, timeout=600)
        body = proc.stdout if proc.returncode == 0 else f"`python -m bench.overhead` failed:\n\n{proc.stderr[-2000:]}"
    return "## ext_proc overhead (bench.overhead)\n\n" + body.strip() + "\n"


def litellm_part(latency: dict[str, float] | None) -> str:
    out = ["## LiteLLM's added latency", ""]
    if not latency:
        return "\n".join(out + ["Not measured (configuration (c) did not run).", ""])
    d50, d99 = latency["direct_p50"] * 1000, latency["direct_p99"] * 1000
    l50, l99 = latency["litellm_p50"] * 1000, latency["litellm_p99"] * 1000
    from bench.report import table

    out += [f"{latency['n']:.0f} sequential small non-streaming chat completions (1 token), straight to the "
            "simulated backend and through the LiteLLM proxy (custom_auth keys with TPM / RPM / parallel limits, "
            "one worker), same process layout as configuration (c):", "",
            table(["path", "p50 ms", "p99 ms"], [["backend directly", f"{d50:.2f}", f"{d99:.2f}"],
                                                 ["through LiteLLM", f"{l50:.2f}", f"{l99:.2f}"],
                                                 ["added by LiteLLM", f"{l50 - d50:+.2f}", f"{l99 - d99:+.2f}"]]),
            ""]
    return "\n".join(out)


def _rel(p: Path) -> Path:
    return p.relative_to(ROOT) if p.is_relative_to(ROOT) else p


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=PARTS, action="append", help="run only this part (repeatable)")
    ap.add_argument("--quick", action="store_true", help="shorter phases and runs (a smoke test, not results)")
    ap.add_argument("--configs", default="abcdefg", help="headline configurations to run (default abcdefg)")
    ap.add_argument("--mode", choices=("preempt", "oom"), default="preempt",
                    help="the simulated backend's behaviour when its KV cache runs out")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where report.md and the PNGs go")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (configs and process logs)")
    args = ap.parse_args(argv)
    parts = args.only or list(PARTS)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-run-"))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sections: list[str] = []
    took: dict[str, float] = {}
    latency = None

    def timed(name: str, fn: Callable[[], str]) -> None:
        t = time.monotonic()
        try:
            sections.append(fn())
        except Exception as exc:  # noqa: BLE001 - one broken part must not hide the others
            log(f"{name} failed: {type(exc).__name__}: {exc}")
            sections.append(f"## {name}\n\nFailed: `{type(exc).__name__}: {exc}`\n")
        took[name] = time.monotonic() - t

    if "headline" in parts:
        def headline_part() -> str:
            nonlocal latency
            from bench import headline, report

            h = headline.run(workdir, quick=args.quick, configs=args.configs, mode=args.mode, log=log)
            latency = h.litellm_latency
            pngs = report.plot_headline(h, args.out)
            raw = report.dump_raw(h, args.out / "headline-raw.json")
            md = report.headline_markdown(h)
            return md + "\nPlots: " + ", ".join(f"`{_rel(p)}`" for p in pngs) + f"; raw data: `{_rel(raw)}`.\n"
        timed("headline", headline_part)
    if "longprompt" in parts:
        def longprompt_part() -> str:
            from bench import longprompt

            configs = args.configs.replace("b", "").replace("c", "")
            if configs == "adefg":  # the default: the long-prompt run also shows (h)
                configs += "h"
            return longprompt.markdown(longprompt.run(workdir, quick=args.quick, configs=configs, log=log))
        timed("longprompt", longprompt_part)
    if "fairness" in parts:
        def fairness_part() -> str:
            from bench import fairness
            return fairness.markdown(fairness.run(workdir, quick=args.quick, log=log))
        timed("fairness", fairness_part)
    if "slowdown" in parts:
        def slowdown_part() -> str:
            from bench import slowdown
            return slowdown.markdown(slowdown.run(workdir, quick=args.quick, log=log))
        timed("slowdown", slowdown_part)
    if "pool" in parts:
        def pool_part() -> str:
            from bench import pool
            b = pool.run(workdir / "pool", quick=args.quick, log=log)
            return "## Pool placement (three engines, the conversation trace's burst at 3x)\n\n" + pool.markdown(b)
        timed("pool", pool_part)
    if "tpm" in parts:
        def tpm_part() -> str:
            from bench import tpm
            return tpm.markdown(tpm.run(workdir, quick=args.quick, log=log))
        timed("tpm", tpm_part)
    if "state_store" in parts:
        def state_store_part() -> str:
            from bench import state_store
            return state_store.markdown(state_store.run(seconds=4.0 if args.quick else 6.0, log=log))
        timed("state_store", state_store_part)
    if "soak" in parts:
        def soak_part() -> str:
            from bench import soak
            return soak.markdown(soak.run(workdir, quick=args.quick, log=log))
        timed("soak", soak_part)
    if "floods" in parts:
        def floods_part() -> str:
            from bench import floods
            seconds, connections = (6.0, 300) if args.quick else (15.0, 1000)
            phases = floods.run(workdir / "floods", seconds, connections, log=log)
            return floods.markdown(phases, connections)
        timed("floods", floods_part)
    if "overhead" in parts:
        timed("overhead", lambda: overhead_part(args.quick))
        if latency is None and "headline" not in parts:
            def lat() -> str:
                from bench import headline
                return litellm_part(headline.standalone_litellm_latency(workdir, log))
            timed("litellm latency", lat)
        else:
            sections.append(litellm_part(latency))
    if "tokenizer" in parts:
        def tokenizer_part() -> str:
            from bench import tokenizer
            from extproc.tokens.counter import TokenCounter
            return tokenizer.markdown(tokenizer.run(reps=2 if args.quick else 3), TokenCounter("cl100k_base").backend)
        timed("tokenizer", tokenizer_part)
    total = time.monotonic() - started
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        "# Sluice benchmarks", "",
        f"`python -m bench.run{' --quick' if args.quick else ''}"
        f"{''.join(f' --only {p}' for p in args.only or [])}` on {when}: {machine()}. "
        f"Took {total:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()) + ").",
        "",
    ]
    if args.quick:
        head += ["**Quick mode**: shortened phases, for checking the harness, not for quoting.", ""]
    md = "\n".join(head) + "\n" + "\n".join(sections)
    (args.out / "report.md").write_text(md)
    print(md)
    log(f"wrote {args.out / 'report.md'} in {total:.0f} s")
    if args.keep:
        log(f"work directory kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
