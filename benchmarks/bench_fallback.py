"""The plain-step fallback of assisted decoding (`assistant_fallback`) on SmolLM2-135M-Instruct.

For each workload, one run times plain greedy, the assisted method with the fallback off
(every row drafts every round, as before) and with it on (the default), interleaved, best of
`--repeats` after a warm-up (compilation excluded):

  * batch 1, open-ended chat prompts (no passage to copy: prompt lookup rarely matches), each
    prompt alone, summed;
  * batch 8, "mixed": repeat, rewrite, quote and summarize on two passages
    (benchmarks/bench_speculative.py), prompt lookup K=4 with the "heuristic" schedule;
  * batch 1, a random 2-layer draft model (same vocabulary), which never agrees with the
    target;
  * where drafting pays: batch 1 "repeat" / "rewrite" prompts (prompt lookup K=10) and the
    batch-8 "quote/edit" batch (K=4, heuristic) of bench_speculative.py.

Every assisted run's tokens are checked against plain greedy.

    python benchmarks/bench_fallback.py [--new-tokens 96] [--repeats 2]
        [--workloads open,mixed,draft,repeat,quote]

Prints a markdown table.
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

OPEN_ENDED = ["Write a short poem about the sea.",
              "Explain in a few sentences why the sky is blue.",
              "Give three tips for someone learning to cook."]


def run_rows(model, params, batches, cfg, **kw):
    """Generates every batch in `batches` (lists of prompts); returns (tokens, stats)."""
    seqs, stats = [], []
    for prompts in batches:
        out = generate(params, init_state(model, prompts, cfg), cfg, **kw)
        jax.block_until_ready(out.sequences)
        seqs += outputs_to_lists(out)
        stats.append(out.speculative)
    return seqs, stats


def compare(model, params, batches, settings, repeats):
    """settings: name -> (cfg, kwargs). Returns name -> (best seconds, tokens, stats)."""
    results = {}
    for name, (cfg, kw) in settings.items():  # compile + warm up
        results[name] = [float("inf"), *run_rows(model, params, batches, cfg, **kw)]
    for _ in range(repeats):
        for name, (cfg, kw) in settings.items():
            start = time.perf_counter()
            run_rows(model, params, batches, cfg, **kw)
            results[name][0] = min(results[name][0], time.perf_counter() - start)
    return results


def summarize(stats):
    if stats[0] is None:
        return "", "", ""
    rounds = sum(int(np.asarray(s.rounds).sum()) for s in stats)
    accepted = sum(int(np.asarray(s.accepted).sum()) for s in stats)
    plain = sum(int(np.asarray(s.plain_steps).sum()) for s in stats)
    positions = sum(int(s.verified_positions) for s in stats)
    return (f"{(accepted + rounds) / max(rounds, 1):.2f}", f"{plain}/{rounds}",
            f"{positions}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", default="open,mixed,draft,repeat,quote")
    args = parser.parse_args()

    model, hf_params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    params = jaxgen.models.unstack_layers(model, hf_params)
    cfg = default_config(model, None, max_new_tokens=args.new_tokens)
    chat = lambda text: list(tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True))
    chosen = args.workloads.split(",")
    singles = [[chat(text)] for text in OPEN_ENDED]
    lookup1 = cfg.replace(prompt_lookup_num_tokens=10)
    lookup8 = cfg.replace(prompt_lookup_num_tokens=4, num_assistant_tokens_schedule="heuristic")
    workloads = []
    if "open" in chosen:
        workloads.append(("batch 1, open-ended", singles, lookup1, {}))
    if "mixed" in chosen:
        workloads.append(("batch 8, mixed", [chat_prompts(tokenizer)[:8]], lookup8, {}))
    if "repeat" in chosen:
        workloads.append(("batch 1, repeat/rewrite", [[p] for p in chat_prompts(
            tokenizer, TASKS[:2], PASSAGES[:1])], lookup1, {}))
    if "quote" in chosen:
        workloads.append(("batch 8, quote/edit",
                          [chat_prompts(tokenizer, TASKS[:3], PASSAGES)[:8]], lookup8, {}))
    if "draft" in chosen:
        from jaxgen.models.llama import Llama, LlamaConfig
        draft = Llama(LlamaConfig(vocab_size=model.vocab_size, hidden_size=64,
                                  intermediate_size=128, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=16, tie_word_embeddings=True))
        assistant = (draft, draft.init_params(jax.random.key(0)))
        workloads.append(("batch 1, random draft (K=4)", singles[:2],
                          cfg.replace(num_assistant_tokens=4,
                                      assistant_confidence_threshold=0.0),
                          {"assistant_model": assistant}))

    print(f"devices: {jax.devices()}; {args.new_tokens} new tokens per row; best of "
          f"{args.repeats}", flush=True)
    rows = []
    for label, batches, assisted, kw in workloads:
        settings = {"greedy": (cfg, {}),
                    "fallback off": (assisted.replace(assistant_fallback=False), kw),
                    "fallback on": (assisted, kw)}
        results = compare(model, params, batches, settings, args.repeats)
        base_s, ref, _ = results["greedy"]
        new = sum(len(s) for s in ref) - sum(len(p) for b in batches for p in b)
        for name, (seconds, seqs, stats) in results.items():
            per_round, plain, positions = summarize(stats)
            rows.append((label, name, f"{new / seconds:.1f}", f"{base_s / seconds:.2f}x",
                         per_round, plain, positions, "=" if seqs == ref else "!="))
            print(f"  {label}, {name}: {seconds:.2f}s", flush=True)

    print()
    print(table_header("workload", "setting", "tokens/s", "vs greedy", "tokens/round",
                       "plain steps/rounds", "verified positions", "tokens vs greedy"))
    for row in rows:
        print(table_row(*row))


if __name__ == "__main__":
    main()
