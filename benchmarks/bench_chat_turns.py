"""Per-turn time of a 6-turn chat on SmolLM2-135M-Instruct, from scratch vs continued.

"from scratch" re-encodes the whole conversation with the chat template every turn and
prefills all of it (what `jaxgen --chat` did before); "continued" continues the previous
turn's output (jaxgen.core.continuation.continue_to), so a turn prefills only its own tokens.
Greedy, fp32, the same answers in both modes (checked). Each mode runs the conversation twice:
the first pass compiles every bucket's program, the second is timed.

    python benchmarks/bench_chat_turns.py [--max-new-tokens 16]
"""
from __future__ import annotations

import argparse
import time

QUESTIONS = ("Hi! Who are you?", "What is the capital of France?", "And of Italy?",
             "Name three colours.", "Which one is your favourite?", "Thanks, goodbye.")


def conversation(model, params, tokenizer, cfg, continued: bool):
    """[(prefilled tokens, seconds, answer ids)] per turn."""
    import jaxgen
    from jaxgen.api.text import encode_prompts
    from jaxgen.core.continuation import continue_to
    from jaxgen.core.output import outputs_to_lists

    messages, out, turns = [], None, []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        [row] = encode_prompts(tokenizer, [list(messages)], chat=True)
        start = time.perf_counter()
        if continued and out is not None:
            state = continue_to(out, [row], cfg)
            prefilled = int(state.prompt_len[0] - state.cached[0])
        else:
            state = jaxgen.init_state(model, [row], cfg)
            prefilled = len(row)
        out = jaxgen.generate(params, state, cfg)
        [ids] = outputs_to_lists(out)
        seconds = time.perf_counter() - start
        answer = ids[len(row):]
        turns.append((prefilled, seconds, answer))
        messages.append({"role": "assistant",
                         "content": tokenizer.decode(answer, skip_special_tokens=True).strip()})
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    import jaxgen
    from jaxgen.models import DEFAULT_MODEL, load

    model, params, tokenizer = load(DEFAULT_MODEL)
    cfg = jaxgen.default_config(model, max_new_tokens=args.max_new_tokens, do_sample=False)
    results = {}
    for mode, continued in (("from scratch", False), ("continued", True)):
        conversation(model, params, tokenizer, cfg, continued)  # compiles every bucket
        results[mode] = conversation(model, params, tokenizer, cfg, continued)
    same = [a[2] for a in results["from scratch"]] == [c[2] for c in results["continued"]]
    print(f"6-turn chat, {DEFAULT_MODEL}, max_new_tokens={args.max_new_tokens}, greedy; "
          f"same answers: {same}")
    print("turn | from scratch: prefilled, ms | continued: prefilled, ms")
    for t, (scratch, cont) in enumerate(zip(results["from scratch"], results["continued"])):
        print(f"{t + 1:4d} | {scratch[0]:5d} tokens {scratch[1] * 1e3:8.1f} ms | "
              f"{cont[0]:5d} tokens {cont[1] * 1e3:8.1f} ms")
    totals = [sum(turn[1] for turn in results[mode]) for mode in results]
    print(f"total | {totals[0] * 1e3:.1f} ms | {totals[1] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
