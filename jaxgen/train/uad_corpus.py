"""The text corpus of the other-tokenizer (UAD) draft: SmolLM2's answers to its own chat prompts,
as text, so that any tokenizer can re-tokenize them.

Each jsonl row holds what the draft sees under universal assisted decoding: the target's prompt
and answer decoded with special tokens skipped (jaxgen.speculative.uad.bridge decodes them that way before
re-encoding with the draft's tokenizer).

    {"prompt": "How do bees make honey?", "kind": "greedy",
     "context": "system\\nYou are ... Face\\nuser\\nHow do bees make honey?\\nassistant\\n",
     "answer": "Bees make honey ..."}

Rows come from two places: existing self-distillation folders (distill_data.py, whose greedy
answers are the trained-drafters corpus: `--distill FOLDER`) and answers generated here for the
prompts no row covers yet (`--new-tokens`, batches of `--batch`, appended batch by batch, so a
stopped run resumes where it stopped).

    python -m jaxgen.train.uad_corpus --out scratch/uad/corpus.jsonl \
        --distill data/distill_train --new-tokens 160

Example (a row from prompt ids and answer ids):
    >>> from jaxgen.models import tiny_tokenizer
    >>> tok = tiny_tokenizer()
    >>> row = text_row(tok, "hi", "greedy", tok.encode("the"), tok.encode(" cat"))
    >>> row["context"], row["answer"]
    ('the', ' cat')
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from .distill_data import PROMPTS_DIR, answer_batches, read_prompts


def text_row(tokenizer, prompt: str, kind: str, prompt_ids, answer_ids) -> dict:
    """One corpus row: the prompt's and the answer's text, special tokens skipped."""
    decode = lambda ids: tokenizer.decode([int(i) for i in ids],  # noqa: E731
                                          skip_special_tokens=True)
    return {"prompt": prompt, "kind": kind, "context": decode(prompt_ids),
            "answer": decode(answer_ids)}


def read_rows(path: str) -> list[dict]:
    """The rows of a corpus file (empty when it does not exist)."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def distill_rows(tokenizer, folder: str, prompts: list[str]) -> list[dict]:
    """Rows of a distill_data.py folder made with --samples 0 (sequence i answers prompt i)."""
    with open(os.path.join(folder, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("samples", 0) != 0:
        raise ValueError(f"{folder}: only --samples 0 folders map sequences to prompts")
    tokens = np.load(os.path.join(folder, "tokens.npy"))  # [N]
    starts = np.load(os.path.join(folder, "starts.npy"))  # [S + 1]
    lens = np.load(os.path.join(folder, "prompt_lens.npy"))  # [S]
    rows = []
    for s, prompt in zip(range(len(lens)), prompts):
        seq = tokens[starts[s]:starts[s + 1]]  # [L]
        rows.append(text_row(tokenizer, prompt, "greedy", seq[:lens[s]], seq[lens[s]:]))
    return rows


def append_rows(path: str, rows: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="corpus jsonl (appended, resumable)")
    parser.add_argument("--prompts", default=os.path.join(PROMPTS_DIR, "prompts_train.jsonl"))
    parser.add_argument("--distill", nargs="*", default=[], help="distill_data.py folders")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    args = parser.parse_args(argv)

    from jaxgen.api.text import encode_prompts
    from jaxgen.models import load, unstack_layers

    model, params, tokenizer = load(args.model)
    prompts = read_prompts(args.prompts)
    if args.limit:
        prompts = prompts[:args.limit]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done = {row["prompt"] for row in read_rows(args.out)}
    for folder in args.distill:
        fresh = [r for r in distill_rows(tokenizer, folder, prompts) if r["prompt"] not in done]
        append_rows(args.out, fresh)
        done |= {r["prompt"] for r in fresh}
        print(f"{folder}: {len(fresh)} rows", flush=True)
    todo = [p for p in prompts if p not in done]
    fast = unstack_layers(model, params)
    for start in range(0, len(todo), args.batch):
        chunk = todo[start:start + args.batch]
        rows = encode_prompts(tokenizer, chunk, chat=True)
        answers = answer_batches(model, fast, rows, new_tokens=args.new_tokens,
                                 batch=args.batch, temperature=0.0, seed=0)
        append_rows(args.out, [text_row(tokenizer, p, "greedy", r, a[len(r):])
                               for p, r, a in zip(chunk, rows, answers)])
        print(f"generated {start + len(chunk)}/{len(todo)}", flush=True)
    print(f"{args.out}: {len(read_rows(args.out))} rows", flush=True)


if __name__ == "__main__":
    main()
