"""Prompt lookup as a chain vs as a token tree on SmolLM2-135M-Instruct (greedy).

Four grounded chat prompts (quote / summarize, on two passages of
benchmarks/bench_speculative.py), one ragged batch of 4, `--new-tokens` new tokens each.
Settings: the chain (prompt_lookup_num_tokens=K, assistant_fallback=False: every round
drafts) and trees of N nodes from c matches (assistant_tree_nodes=N, assistant_tree_width=c,
depth K; N is capped at c K). Every run's tokens are checked against plain greedy.

Reports, per setting, accepted drafts per round (all rows; per row in brackets), tokens per
round (accepted + 1), rounds, verified positions per round and best-of-`--repeats` seconds
(compilation excluded; on a shared CPU the times are only indicative; --repeats 0: none).

    python benchmarks/bench_lookup_tree.py [--new-tokens 64] [--k 4] [--trees 8x2,8x3,16x2,16x3]
        [--repeats 1]
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from bench_speculative import PASSAGES, TASKS, chat_prompts
from report_table import table_header, table_row

import jaxgen
from jaxgen import generate, init_state
from jaxgen.api.generate import default_config, outputs_to_lists

QUOTE, SUMMARIZE = TASKS[2], TASKS[3]


def run(model, params, prompts, cfg):
    out = generate(params, init_state(model, prompts, cfg), cfg)
    jax.block_until_ready(out.sequences)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--trees", default="8x2,8x3,16x2,16x3", help="NxC,...")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    prompts = chat_prompts(tokenizer, [QUOTE, SUMMARIZE], PASSAGES[:2])
    cfg = default_config(model, None, max_new_tokens=args.new_tokens)
    chain = cfg.replace(prompt_lookup_num_tokens=args.k, assistant_fallback=False)
    settings = {"plain greedy": cfg, f"chain K={args.k}": chain}
    for spec in args.trees.split(","):
        nodes, width = (int(x) for x in spec.split("x"))
        settings[f"tree N={nodes} c={width}"] = chain.replace(assistant_tree_nodes=nodes,
                                                              assistant_tree_width=width)
    print(f"prompts: {[len(p) for p in prompts]} tokens; {args.new_tokens} new tokens; "
          f"backend {jax.default_backend()}")
    reference = None
    print(table_header("setting", "nodes", "accepted/round", "per row", "tokens/round",
                       "rounds", "positions/round", "same tokens", "seconds"))
    for name, setting in settings.items():
        out = run(model, params, prompts, setting)  # compile + warm up
        seconds = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            run(model, params, prompts, setting)
            seconds = min(seconds, time.perf_counter() - start)
        tokens = outputs_to_lists(out)
        reference = tokens if reference is None else reference
        stats = out.speculative
        shown = f"{seconds:.2f}" if args.repeats else ""
        if stats is None:
            print(table_row(name, "", "", "", "", "", "", "", shown))
            continue
        rounds, accepted = np.asarray(stats.rounds), np.asarray(stats.accepted)
        per_row = np.round(accepted / np.maximum(rounds, 1), 2).tolist()
        total = rounds.sum()
        positions = int(stats.verified_positions) / max(int(np.max(rounds)), 1)
        nodes = setting.assistant_tree_nodes and min(setting.assistant_tree_nodes,
                                                     setting.assistant_tree_width * args.k)
        print(table_row(name, nodes or "", f"{accepted.sum() / total:.2f}", per_row,
                        f"{(accepted.sum() + total) / total:.2f}", int(total),
                        f"{positions:.1f}", tokens == reference, shown))


if __name__ == "__main__":
    main()
