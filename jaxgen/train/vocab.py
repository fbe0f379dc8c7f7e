"""Choosing the pruned draft vocabulary from self-distillation data: the tokens of the
target's answers and of the prompts it answered, most frequent first (answer tokens weigh
4x: they are what the draft must propose), then the lowest unused ids up to the size (BPE
ids are in merge order, roughly corpus frequency), plus BOS / EOS.

    python -m jaxgen.train.vocab --data data/distill_train \
        --heldout data/distill_heldout --size 8192 --out /tmp/draft_vocab.json

Example:
    >>> import numpy as np
    >>> from jaxgen.train.batches import DistillSet
    >>> data = DistillSet(tokens=np.array([9, 9, 4, 4, 4, 7], np.int32), starts=np.array([0, 6]),
    ...                   prompt_lens=np.array([2]), final=np.zeros((6, 1), np.float16))
    >>> answer_token_counts(data, 10)[[4, 7, 9]].tolist()
    [3, 1, 0]
    >>> token_weights(data, 10)[[4, 7, 9]].tolist()
    [12, 4, 2]
    >>> coverage(data, (4,))
    0.75
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from jaxgen.models.draft_vocab import select_draft_vocab

from .batches import DistillSet


def answer_token_counts(data: DistillSet, vocab_size: int) -> np.ndarray:
    """How often each token id occurs as an answer token: int64 [vocab_size]."""
    targets = data.tokens[data.answer_positions() + 1]  # [N_answer]
    return np.bincount(targets, minlength=vocab_size)


def token_weights(data: DistillSet, vocab_size: int) -> np.ndarray:
    """Every token's count in the data plus 3x its count as an answer token: int64 [V]."""
    every = np.bincount(data.tokens, minlength=vocab_size)
    return every + 3 * answer_token_counts(data, vocab_size)


def coverage(data: DistillSet, vocab) -> float:
    """Fraction of the answer tokens of `data` inside `vocab`."""
    targets = data.tokens[data.answer_positions() + 1]  # [N_answer]
    return float(np.isin(targets, np.asarray(vocab)).mean())


def build_vocab(data: DistillSet, vocab_size: int, size: int, keep=()) -> tuple[int, ...]:
    """The draft vocabulary: the `size` heaviest tokens of `data` (token_weights) + `keep`."""
    return select_draft_vocab(token_weights(data, vocab_size), size, keep)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--heldout", default=None)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--keep", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    data = DistillSet.load(args.data)
    vocab = build_vocab(data, args.vocab_size, args.size, args.keep)
    used = int(np.count_nonzero(answer_token_counts(data, args.vocab_size)))
    report = {"size": len(vocab), "distinct_answer_tokens": used,
              "train_coverage": round(coverage(data, vocab), 5)}
    if args.heldout:
        report["heldout_coverage"] = round(coverage(DistillSet.load(args.heldout), vocab), 5)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"vocab": list(vocab), **report}, f)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
