"""Self-speculative early exit on SmolLM2-135M-Instruct (fp32), untrained: what a round costs.

For each exit layer E (no exit adapter: the plain exit through the final norm and head), one
run measures against jaxgen's plain greedy on the same chat prompts, batch 1:
  * tokens/s and the ratio to plain greedy (greedy outputs are checked to be identical);
  * tokens per round and the acceptance rate (accepted / drafted);
  * per round, in full-step units (layer-forwards / L, with k the round's mean drafts): the
    draft cost (k + 1) E / L (the early passes; the k exit heads come on top), the verify
    cost (k + 1)(L - E) / L and their total, against the separate-cache way of Hugging Face
    (k E / L for drafting plus k + 1 verified positions through all L layers).
Timings exclude compilation (each program runs once first).

    python benchmarks/bench_self_speculative.py [--new-tokens 64] [--exits 4 8 15 22]
        [--draft 3] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
from report_table import table_header, table_row

import jaxgen
from jaxgen.api.generate import default_config, outputs_to_lists
from jaxgen.models import DEFAULT_MODEL, load, unstack_layers

PROMPTS = ["Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue.",
           "List five fruits and their colors."]


def timed(params, model, prompts, cfg, repeats):
    """(best seconds, outputs) of generate on these prompts; the first call compiles."""
    run = lambda: jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)  # noqa
    out = run()
    out.sequences.block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        out.sequences.block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--exits", type=int, nargs="+", default=[4, 8, 15, 22])
    parser.add_argument("--draft", type=int, default=3, help="num_assistant_tokens (K)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model, params, tokenizer = load(DEFAULT_MODEL, dtype=jnp.float32)
    params = unstack_layers(model, params)
    layers = model.config.num_layers
    cfg = default_config(model, None, max_new_tokens=args.new_tokens, eos_token_id=None)
    rows = []
    for text in PROMPTS:
        prompt = [tokenizer.apply_chat_template([{"role": "user", "content": text}])]
        plain_s, plain = timed(params, model, prompt, cfg, args.repeats)
        new = int(plain.lengths[0] - plain.prompt_lengths[0])
        rows.append((text[:28], "greedy", new / plain_s, 1.0, "", "", "", "", ""))
        for exit_layer in args.exits:
            spec_cfg = cfg.replace(assistant_early_exit=exit_layer,
                                   num_assistant_tokens=args.draft,
                                   assistant_confidence_threshold=0.0)
            seconds, out = timed(params, model, prompt, spec_cfg, args.repeats)
            assert outputs_to_lists(out) == outputs_to_lists(plain), "greedy mismatch"
            stats = out.speculative
            rounds = max(int(stats.rounds[0]), 1)
            k = int(stats.drafted[0]) / rounds  # mean drafts per round
            draft_cost = (k + 1) * exit_layer / layers  # early passes, in full-step units
            verify_cost = (k + 1) * (layers - exit_layer) / layers
            separate = k * exit_layer / layers + (k + 1)  # HF: separate draft cache
            rows.append((text[:28], f"E={exit_layer}", new / seconds, plain_s / seconds,
                         f"{float(stats.tokens_per_round[0]):.2f}",
                         f"{float(stats.acceptance_rate[0]):.2f}",
                         f"{draft_cost:.2f} + {verify_cost:.2f}",
                         f"{draft_cost + verify_cost:.2f}", f"{separate:.2f}"))
    print(f"\nSmolLM2-135M-Instruct fp32, batch 1, {args.new_tokens} new tokens, K={args.draft}, "
          f"no exit adapter (untrained); costs per round in full-step units (layer-forwards / "
          f"{layers}; exit heads not counted)\n")
    print(table_header("prompt", "method", "tok/s", "vs greedy", "tokens/round", "acceptance",
                       "draft + verify cost", "shared total", "separate-cache total"))
    for prompt, method, tps, ratio, per_round, acceptance, cost, total, separate in rows:
        print(table_row(prompt, method, f"{tps:.1f}", f"{ratio:.2f}x", per_round, acceptance,
                        cost, total, separate))


if __name__ == "__main__":
    main()
