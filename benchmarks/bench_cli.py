"""How fast the `jaxgen` command answers: cold cache, warm cache and no cache, per layout.

Each run is a fresh process (`python -m jaxgen.cli.main --verbose PROMPT`), as a user types it:
  * cold: an empty cache folder (JAXGEN_CACHE_DIR) each run: convert the model, compile;
  * warm: the same folder after one priming run: everything comes from the cache;
  * off:  --no-cache (the GGUF parsed and every program compiled, nothing written).
Per run: wall time, CPU time (user + sys of the process), time to the first byte of the
answer on stdout (from the process start), and the CLI's own "first token" (from the
generate call) and tokens/s. Medians over --repeats runs, one markdown table.

The machine's load average is printed too: on a shared machine wall time grows with the
other work, CPU time much less.

    python benchmarks/bench_cli.py [--repeats 3] [--modes cold,warm,off]
        [--layouts auto] [--prompt "What is the capital of France?"] [--max-new-tokens 256]
        [--source DIR]      # run another checkout (PYTHONPATH=DIR), e.g. the code before
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report_table import table_header, table_row  # noqa: E402

SUMMARY = re.compile(r"\[(\d+) new tokens, ([\d.]+) tokens/s, first token ([\d.]+)s")


def run_once(args, cache_dir: str, extra: list[str]) -> dict:
    """One CLI process; returns its timings (seconds) and its answer."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", JAXGEN_CACHE_DIR=cache_dir)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if args.source:
        env["PYTHONPATH"] = args.source
    command = [sys.executable, "-m", "jaxgen.cli.main", "--max-new-tokens",
               str(args.max_new_tokens), *extra, args.prompt]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = os.read(process.stdout.fileno(), 1)  # unbuffered: communicate() reads the rest
    first_output = time.perf_counter() - start
    rest, err = process.communicate()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {err.decode()[-2000:]}")
    match = SUMMARY.search(err.decode())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "first_output": first_output if first else wall,
            "first_token": float(match.group(3)) if match else float("nan"),
            "tokens_per_s": float(match.group(2)) if match else float("nan"),
            "new_tokens": int(match.group(1)) if match else -1,
            "answer": (first + rest).decode(),
            "cache_line": err.decode().strip().splitlines()[-1]}


def measure(args, mode: str, layout: str) -> list[dict]:
    extra = []
    if args.source is None:  # the code before this benchmark had neither flag
        extra += ["--verbose", "--layout", layout]
    if mode == "off":
        extra.append("--no-cache")
    root = tempfile.mkdtemp(prefix="bench-cli-")
    runs = []
    try:
        if mode == "warm":
            run_once(args, os.path.join(root, "warm"), extra)  # priming run
        for repeat in range(args.repeats):
            folder = os.path.join(root, "warm" if mode == "warm" else f"{mode}-{repeat}")
            runs.append(run_once(args, folder, extra))
            if mode == "cold":
                shutil.rmtree(folder, ignore_errors=True)
            print(f"  {mode:5s} {layout:9s} run {repeat}: wall {runs[-1]['wall']:.2f}s cpu "
                  f"{runs[-1]['cpu']:.2f}s  {runs[-1]['cache_line']}", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="cold,warm,off")
    parser.add_argument("--layouts", default="auto", help="comma-separated: auto, stacked, "
                                                          "unstacked")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--source", default=None,
                        help="a checkout to run instead of the installed jaxgen (PYTHONPATH)")
    args = parser.parse_args(argv)
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    rows, answers = [], set()
    for layout in args.layouts.split(","):
        for mode in args.modes.split(","):
            runs = measure(args, mode, layout)
            answers.update(r["answer"] for r in runs)

            def median(key):
                return statistics.median(r[key] for r in runs)

            rows.append(table_row(mode, layout, f"{median('wall'):.2f}", f"{median('cpu'):.2f}",
                                  f"{median('first_output'):.2f}", f"{median('first_token'):.2f}",
                                  f"{median('tokens_per_s'):.1f}", runs[0]["new_tokens"]))
    print(f"\n`jaxgen {args.prompt!r}` (max {args.max_new_tokens} new tokens), median of "
          f"{args.repeats}; load average at the end {os.getloadavg()}\n")
    print(table_header("cache", "layout", "wall s", "CPU s", "first output s (from start)",
                       "first token s (CLI)", "tokens/s", "new tokens", numeric=True))
    for row in rows:
        print(row)
    if len(answers) != 1:
        print(f"\nWARNING: the answers differ between runs: {sorted(answers)}")


if __name__ == "__main__":
    main()
