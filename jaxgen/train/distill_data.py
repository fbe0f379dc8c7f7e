"""Self-distillation data: SmolLM2 answers its own chat prompts, and we keep what a drafter needs.

For every prompt of a prompt set (jsonl, {"prompt": ...}), the target answers once greedily and
`--samples` times at temperature 0.7 (the chat template applied as the CLI does:
`jaxgen.api.text.encode_prompts(..., chat=True)`). One teacher-forced forward over each
prompt + answer then records, per position, the final layer's hidden state (pre final norm)
and the hidden state after each candidate exit layer E. The teacher's next-token distribution
is the head applied to the final hidden state, recomputed at train time (576 numbers per
position instead of 49,152).

Output folder (not in the repo), numpy arrays:
    tokens.npy        int32 [N]       every sequence's tokens, concatenated
    starts.npy        int64 [S + 1]   sequence s is tokens[starts[s]:starts[s+1]]
    prompt_lens.npy   int32 [S]       prompt tokens of each sequence
    final.npy         fp16  [N, D]    last layer's hidden (pre norm) at each position
    layer_{E}.npy     fp16  [N, D]    hidden after layers [0, E) at each position
    meta.json         model name, exits, prompt file, counts

    python -m jaxgen.train.distill_data --out data/distill --exits 6 8 10 12
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

PROMPTS_DIR = os.path.join(os.path.dirname(__file__), "data")


def read_prompts(path: str) -> list[str]:
    """The "prompt" field of each jsonl line."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def answer_batches(model, params, rows, *, new_tokens, batch, temperature, seed):
    """Prompt + answer ids per row (EOS kept, padding dropped), generated `batch` rows at once."""
    import jax

    from jaxgen.api.generate import generate_ids

    out = []
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        overrides = dict(max_new_tokens=new_tokens)
        key = None
        if temperature > 0:
            overrides.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            key = jax.random.key(seed + start)
        else:
            overrides.update(do_sample=False)
        out.extend(generate_ids(model, params, chunk, key=key, **overrides))
        print(f"  answered {len(out)}/{len(rows)} (T={temperature})", flush=True)
    return out


def hidden_states(model, params, sequences, exits, batch):
    """(final [N, D], {E: [N, D]}) fp16 for the concatenated sequences (teacher forcing)."""
    import jax
    import jax.numpy as jnp

    bounds = sorted(set(exits) | {model.config.num_layers})

    @jax.jit
    def forward(params, tokens, positions):
        cache = model.init_cache(tokens.shape[0], tokens.shape[1])
        x = model.embed(params, tokens)  # [B, T, D]
        states, start = [], 0
        for stop in bounds:
            x, cache = model.run_layers(params, x, positions, cache, start, stop)  # [B, T, D]
            states.append(x.astype(jnp.float16))
            start = stop
        return states

    per_layer = {stop: [] for stop in bounds}
    for start in range(0, len(sequences), batch):
        chunk = sequences[start:start + batch]
        width = max(len(s) for s in chunk)
        width = -(-width // 32) * 32  # bucket: few compilations
        tokens = np.zeros((len(chunk), width), np.int32)  # [B, T]
        for i, seq in enumerate(chunk):
            tokens[i, :len(seq)] = seq
        positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)  # [B, T]
        states = forward(params, jnp.asarray(tokens), jnp.asarray(positions))
        for stop, array in zip(bounds, states):
            array = np.asarray(array)  # [B, T, D]
            per_layer[stop].extend(array[i, :len(seq)] for i, seq in enumerate(chunk))
        print(f"  hidden {start + len(chunk)}/{len(sequences)}", flush=True)
    final = np.concatenate(per_layer.pop(model.config.num_layers))  # [N, D]
    return final, {e: np.concatenate(v) for e, v in per_layer.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (e.g. data/distill)")
    parser.add_argument("--prompts", default=os.path.join(PROMPTS_DIR, "prompts_train.jsonl"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--samples", type=int, default=1, help="sampled (T=0.7) answers per prompt")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--exits", type=int, nargs="*", default=[6, 8, 10, 12])
    parser.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from jaxgen.api.text import encode_prompts
    from jaxgen.models import load, unstack_layers

    t0 = time.time()
    model, params, tokenizer = load(args.model)
    fast = unstack_layers(model, params)
    prompts = read_prompts(args.prompts)
    if args.limit:
        prompts = prompts[:args.limit]
    rows = encode_prompts(tokenizer, prompts, chat=True)
    os.makedirs(args.out, exist_ok=True)
    sequences, prompt_lens = [], []
    for rep in range(1 + args.samples):
        temperature = 0.0 if rep == 0 else 0.7
        answers = answer_batches(model, fast, rows, new_tokens=args.new_tokens,
                                 batch=args.batch, temperature=temperature,
                                 seed=args.seed + 1000 * rep)
        sequences.extend(answers)
        prompt_lens.extend(len(r) for r in rows)
    final, layers = hidden_states(model, params, sequences, args.exits, args.batch)
    lengths = np.array([len(s) for s in sequences], np.int64)
    np.save(os.path.join(args.out, "tokens.npy"), np.concatenate(sequences).astype(np.int32))
    np.save(os.path.join(args.out, "starts.npy"), np.concatenate([[0], np.cumsum(lengths)]))
    np.save(os.path.join(args.out, "prompt_lens.npy"), np.array(prompt_lens, np.int32))
    np.save(os.path.join(args.out, "final.npy"), final)
    for exit_layer, array in layers.items():
        np.save(os.path.join(args.out, f"layer_{exit_layer}.npy"), array)
    meta = dict(model=args.model, exits=sorted(layers), prompts=os.path.basename(args.prompts),
                sequences=len(sequences), tokens=int(lengths.sum()),
                answer_tokens=int(lengths.sum() - sum(prompt_lens)),
                new_tokens=args.new_tokens, samples=args.samples, seconds=round(time.time() - t0))
    with open(os.path.join(args.out, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    print(json.dumps(meta), flush=True)


if __name__ == "__main__":
    main()
