"""The other tokenizer of the UAD draft: a byte-level BPE trained with `tokenizers` on the UAD
corpus (uad_corpus.py), with SmolLM2's byte-level pre-tokenization (single digits, GPT-2
split, no prefix space) so any text round-trips, but its own merges and a vocabulary of ~8k
instead of 49,152.

The chat special tokens keep their strings (<|endoftext|>, <|im_start|>, <|im_end|> as ids
0, 1, 2) so the draft's folder can carry SmolLM2's chat template; all 256 bytes are in the
alphabet, so no text is out of vocabulary.

    python -m jaxgen.train.uad_tokenizer --corpus scratch/uad/corpus.jsonl \
        --size 8000 --out scratch/uad/tokenizer.json

Example (a tiny corpus; bytes the corpus never saw still round-trip):
    >>> tok = train_bpe(["the cat sat on the mat"] * 4, size=300)
    >>> tok.get_vocab_size() <= 300, tok.decode(tok.encode("the hat é!").ids)
    (True, 'the hat é!')
"""
from __future__ import annotations

import argparse
import json
from typing import Iterable

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_bpe(texts: Iterable[str], size: int = 8000, min_frequency: int = 1):
    """A byte-level BPE `tokenizers.Tokenizer` of at most `size` tokens trained on `texts`
    (merges of pairs seen at least `min_frequency` times; the default corpus, ~190k
    characters, gives 5,120 tokens at 2 and 7,647 at 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([  # SmolLM2's: digits one by one
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return tokenizer


def corpus_texts(rows: list[dict]) -> list[str]:
    """The texts the tokenizer learns from: every row's context and answer."""
    return [row["context"] + row["answer"] for row in rows]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="uad_corpus.py jsonl")
    parser.add_argument("--size", type=int, default=8000)
    parser.add_argument("--min-frequency", type=int, default=1)
    parser.add_argument("--out", required=True, help="tokenizer.json to write")
    args = parser.parse_args(argv)

    from .uad_corpus import read_rows

    tokenizer = train_bpe(corpus_texts(read_rows(args.corpus)), args.size, args.min_frequency)
    tokenizer.save(args.out)
    print(json.dumps({"vocab_size": tokenizer.get_vocab_size(), "out": args.out}), flush=True)


if __name__ == "__main__":
    main()
