"""The shipped MTP drafter as a chain vs as token trees on SmolLM2-135M-Instruct.

Held-out chat prompts (jaxgen/train/data/prompts_heldout.jsonl, never trained on), batch 1,
one prompt after another, `--new-tokens` new tokens each. Settings: plain greedy, the chain
(num_assistant_tokens=K, assistant_fallback=False: every round drafts) and trees of N nodes,
c children a node (assistant_tree_nodes=N, assistant_tree_width=c, depth K). Greedy runs are
checked token for token against plain greedy; `--sample T` adds the same settings sampled at
temperature T (lossless: acceptance only, their tokens differ by design).

Reports, per setting: accepted drafts per round, tokens per round (accepted + 1), rounds,
the median over prompts of seconds per prompt (compilation excluded) and the speed against
plain greedy measured in the same run (median of per-prompt ratios).

    python benchmarks/bench_mtp_tree.py [--prompts 8] [--new-tokens 128] [--k 4]
        [--trees 8x2,16x2,16x4] [--sample 0.7] [--repeats 1]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np
from report_table import table_header, table_row

import jaxgen
from jaxgen import generate, init_state
from jaxgen.api.generate import default_config, outputs_to_lists

HELDOUT = os.path.join(os.path.dirname(jaxgen.__file__), "train", "data",
                       "prompts_heldout.jsonl")


def heldout_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` held-out prompts in the chat template, as token ids."""
    with open(HELDOUT, encoding="utf-8") as handle:
        texts = [json.loads(line)["prompt"] for line in handle][:count]
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}])
            for text in texts]


def timed(model, params, prompt, cfg, drafter, key, repeats: int):
    """(output, best-of-`repeats` seconds) of one prompt; the first run compiles."""
    def once():
        state = init_state(model, [prompt], cfg, key)
        out = generate(params, state, cfg, assistant_model=drafter)
        jax.block_until_ready(out.sequences)
        return out
    out = once()
    seconds = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        seconds = min(seconds, time.perf_counter() - start)
    return out, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--trees", default="8x2,16x2,16x4", help="NxC,...")
    parser.add_argument("--sample", type=float, default=0.0, help="also sample at this T")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    drafter_model, drafter_params, _ = jaxgen.models.load("smollm2-135m-instruct-mtp-drafter")
    drafter = (drafter_model, drafter_params)
    prompts = heldout_prompts(tokenizer, args.prompts)
    greedy = default_config(model, None, max_new_tokens=args.new_tokens)
    chain = greedy.replace(num_assistant_tokens=args.k, assistant_fallback=False)
    settings = {"plain greedy": (greedy, None), f"chain K={args.k}": (chain, drafter)}
    for spec in args.trees.split(","):
        nodes, width = (int(x) for x in spec.split("x"))
        settings[f"tree N={nodes} c={width}"] = (
            chain.replace(assistant_tree_nodes=nodes, assistant_tree_width=width), drafter)
    if args.sample:
        for name, (cfg, draft) in list(settings.items())[1:]:
            settings[f"{name}, T={args.sample}"] = (
                cfg.replace(do_sample=True, temperature=args.sample), draft)
    print(f"{len(prompts)} held-out prompts ({[len(p) for p in prompts]} tokens), batch 1, "
          f"{args.new_tokens} new tokens, K={args.k}; backend {jax.default_backend()}")
    print(table_header("setting", "accepted/round", "tokens/round", "rounds",
                       "same tokens as greedy", "s/prompt (median)", "speed vs greedy"))
    baseline = None
    for name, (cfg, draft) in settings.items():
        accepted = rounds = 0
        seconds, tokens = [], []
        for index, prompt in enumerate(prompts):
            out, spent = timed(model, params, prompt, cfg, draft, jax.random.key(index),
                               args.repeats)
            seconds.append(spent)
            tokens.extend(outputs_to_lists(out))
            if out.speculative is not None:
                accepted += int(np.sum(out.speculative.accepted))
                rounds += int(np.sum(out.speculative.rounds))
        baseline = baseline or (tokens, seconds)
        same = "" if cfg.do_sample else tokens == baseline[0]
        speed = np.median(np.asarray(baseline[1]) / np.asarray(seconds)) if args.repeats else 0
        per_round = f"{accepted / rounds:.2f}" if rounds else ""
        print(table_row(name, per_round, f"{(accepted + rounds) / rounds:.2f}" if rounds else "",
                        rounds or "", same, f"{np.median(seconds):.2f}", f"{speed:.2f}x"),
              flush=True)


if __name__ == "__main__":
    main()
