"""Batch mode: continuous batching (jaxgen.serving.Engine, what `jaxgen --input` runs) vs the
fixed batches it ran before (a batch of --batch-size rows waits for its longest answer).

A mixed-length workload: N chat prompts, each with its own budget of new tokens drawn from
4..128 (EOS disabled, so every answer has exactly its budget), as a file of questions
asking for answers of every length would give. Both paths run in this one process, on the
weights and layout the command uses (per-layer weights, `program_layout`), each first once
untimed (every program compiled), then timed: wall seconds and new tokens per second. The
greedy answers of both paths are compared, record by record.

    python benchmarks/bench_batch_cli.py [--prompts 24] [--batch-size 8] [--model NAME]
        [--min-new 4] [--max-new 128] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report_table import table_header, table_row  # noqa: E402

TOPICS = ["the moon", "bread", "rivers", "chess", "the violin", "volcanoes", "bees", "trains",
          "glass", "winter", "maps", "coffee"]


def workload(tokenizer, count: int, low: int, high: int, seed: int):
    """(prompt ids, budget) per record: chat-templated questions, budgets in [low, high]."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        rows.append((list(tokenizer.encode(text, add_special_tokens=False)),
                     int(rng.integers(low, high + 1))))
    return rows


def run_fixed(model, params, cfg, rows, batch_size: int, layout: str) -> list:
    """The batch mode before: batches in input order, each to its longest budget."""
    import jaxgen
    from jaxgen.api.generate import outputs_to_lists

    answers = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        prompts = [p for p, _ in batch]
        state = jaxgen.init_state(model, prompts, cfg,
                                  max_new_tokens=np.asarray([n for _, n in batch], np.int32))
        out = jaxgen.generate(params, state, cfg, layout=layout)
        answers += [full[len(p):] for p, full in zip(prompts, outputs_to_lists(out))]
    return answers


def run_continuous(model, params, cfg, rows, batch_size: int, layout: str,
                   warm: bool = False) -> list:
    """The batch mode now: one Engine, slots = --batch-size, as jaxgen.cli.batch builds it.
    warm: first compile every admission program (how many newcomers an admission takes
    depends on the threads' timing)."""
    from jaxgen.cli.batch import CHUNK_STEPS, WINDOW_PER_SLOT, _slot_length
    from jaxgen.serving import Engine

    longest, budget = max(len(p) for p, _ in rows), max(n for _, n in rows)
    engine = Engine(model, params, cfg, slots=batch_size, max_len=_slot_length(longest, budget),
                    chunk_size=CHUNK_STEPS,
                    max_waiting=max(WINDOW_PER_SLOT * batch_size, len(rows)),
                    layout=layout)
    try:
        if warm:
            engine.warm_up(prompt_lengths=[len(p) for p, _ in rows])
        handles = [engine.submit(p, max_new_tokens=n) for p, n in rows]
        answers = [h.result().new_ids for h in handles]
    finally:
        engine.close(cancel=True)
    return answers


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", default=None, help="default: the command's default model")
    parser.add_argument("--min-new", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import jaxgen
    from jaxgen import models
    from jaxgen.cli.layouts import params_for_layout, program_layout

    name = args.model or models.DEFAULT_MODEL
    model, params, tokenizer = models.load(name)
    run_args = argparse.Namespace(layout="auto", max_new_tokens=args.max_new, chat=False,
                                  input="bench")
    layout = program_layout(run_args)
    params = params_for_layout(model, params, run_args)
    cfg = jaxgen.GenerationConfig(max_new_tokens=args.max_new, eos_token_id=[],
                                  pad_token_id=0)
    rows = workload(tokenizer, args.prompts, args.min_new, args.max_new, args.seed)
    new_tokens = sum(n for _, n in rows)
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    results, answers = [], {}
    for label, run in (("fixed batches", run_fixed), ("continuous", run_continuous)):
        warm = {"warm": True} if run is run_continuous else {}
        run(model, params, cfg, rows, args.batch_size, layout, **warm)  # compiles everything
        start = time.perf_counter()
        answers[label] = run(model, params, cfg, rows, args.batch_size, layout)
        wall = time.perf_counter() - start
        results.append((label, wall))
        print(f"  {label}: {wall:.2f}s", file=sys.stderr)
    base = results[0][1]
    print(f"\n{args.prompts} prompts, budgets {args.min_new}..{args.max_new} new tokens "
          f"({new_tokens} in all), batch size {args.batch_size}, {name}, layout {layout}; load "
          f"average at the end {os.getloadavg()}\n")
    print(table_header("batch mode", "wall s", "new tokens/s", "speed-up", numeric=True))
    for label, wall in results:
        print(table_row(label, f"{wall:.2f}", f"{new_tokens / wall:.1f}", f"{base / wall:.2f}x"))
    same = answers["fixed batches"] == answers["continuous"]
    print(f"\ngreedy answers identical record by record: {same}")


if __name__ == "__main__":
    main()
