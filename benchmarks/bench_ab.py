"""A/B of two jaxgen source trees on the compiled decode programs, interleaved in one run.

Each round runs one worker process per tree (alternating which goes first); a worker loads
SmolLM2-135M-Instruct in fp32 (per-layer weights, as the CLI decodes), compiles each workload
once, then times it `--repeats` times. Workloads, 32-token prompts, EOS off:

    batch 1 greedy, batch 8 greedy, beam search (4 beams, batch 1), prompt lookup (batch 1,
    a prompt whose answer repeats it)

The table gives each tree's median ms per new token over all rounds and repeats, and B / A
(below 1: B is faster). A tree is a folder holding a `jaxgen` package that imports as
`jaxgen` with its models (e.g. a `git worktree` of another commit):

    python benchmarks/bench_ab.py --a /tmp/before --b . [--rounds 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from report_table import table_header, table_row

WORKLOADS = ("batch 1 greedy", "batch 8 greedy", "beam 4", "prompt lookup")
TEXT = ("The history of the city begins with a small settlement on the river, where traders "
        "met farmers and fishermen every season to exchange goods and stories. ")


def worker(new_tokens: int, repeats: int) -> dict:
    """{workload: [seconds per new token of each timed run]} for the jaxgen on sys.path."""
    import jax

    import jaxgen
    from jaxgen.models import DEFAULT_MODEL, load, unstack_layers
    from jaxgen.runtime import compiled

    model, params, tokenizer = load(DEFAULT_MODEL)
    params = unstack_layers(model, params)
    ids = tokenizer.encode(TEXT * 4)
    settings = {"batch 1 greedy": (1, {}), "batch 8 greedy": (8, {}),
                "beam 4": (1, {"num_beams": 4}),
                "prompt lookup": (1, {"prompt_lookup_num_tokens": 5})}
    out = {}
    for name in WORKLOADS:
        batch, extra = settings[name]
        prompts = [ids[b:b + 32] for b in range(batch)]
        if name == "prompt lookup":  # an answer that repeats the prompt: drafts get accepted
            prompts = [ids[:32] + ids[:16]]
        cfg = jaxgen.GenerationConfig(max_new_tokens=new_tokens, pad_token_id=0, **extra)

        def run(prompts=prompts, cfg=cfg):
            state = jaxgen.init_state(model, prompts, cfg)
            start = time.perf_counter()
            jax.block_until_ready(jaxgen.generate(params, state, cfg).sequences)
            return time.perf_counter() - start

        run()  # compile
        run()  # a second call: a tree that places its kept weights (huge pages) starts here
        getattr(compiled, "wait_for_placement", lambda: True)()
        out[name] = [run() / new_tokens for _ in range(repeats)]
    return out


def host_line() -> str:
    """The CPU's vector flags and a bandwidth probe (GB/s of a jitted fp32 matrix-vector
    product over 512 MB, best of 10), for the table's host line."""
    import jax
    import jax.numpy as jnp

    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = set(f.read().split())
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    matrix = jax.random.normal(jax.random.key(0), (16384, 8192), jnp.float32)  # 512 MB
    vector = jnp.ones((8192,), jnp.float32)
    matvec = jax.jit(lambda m, v: m @ v)
    matvec(matrix, vector).block_until_ready()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        matvec(matrix, vector).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return f"host: {os.cpu_count()} CPUs, {simd}, bandwidth probe {matrix.nbytes / best / 1e9:.1f} GB/s"


def run_tree(tree: str, new_tokens: int, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                           "--new-tokens", str(new_tokens), "--repeats", str(repeats)],
                          capture_output=True, text=True, env=env, cwd=os.path.abspath(tree))
    if done.returncode != 0:
        raise SystemExit(f"worker for {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", help="tree A (e.g. the commit before a change)")
    parser.add_argument("--b", help="tree B")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.new_tokens, args.repeats)))
        return
    if not (args.a and args.b):
        parser.error("--a and --b are required")
    times = {"A": {w: [] for w in WORKLOADS}, "B": {w: [] for w in WORKLOADS}}
    for round_index in range(args.rounds):
        order = (("A", args.a), ("B", args.b))
        for label, tree in order if round_index % 2 == 0 else order[::-1]:
            for name, values in run_tree(tree, args.new_tokens, args.repeats).items():
                times[label][name].extend(values)
            print(f"round {round_index + 1}: {label} done", file=sys.stderr)
    print(table_header("workload", "A ms/token", "B ms/token", "B / A", numeric=True))
    for name in WORKLOADS:
        a = 1e3 * statistics.median(times["A"][name])
        b = 1e3 * statistics.median(times["B"][name])
        print(table_row(name, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}"))
    print(host_line())


if __name__ == "__main__":
    main()
