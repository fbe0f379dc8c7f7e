"""The other-tokenizer draft for SmolLM2-135M-Instruct (universal assisted decoding): a small
Llama over the byte-level BPE of uad_tokenizer.py, distilled at sequence level from SmolLM2
(cross-entropy on SmolLM2's own answers, uad_corpus.py, re-tokenized with the new tokenizer).

Sizes: those of the standalone draft (hidden 128, 4 layers, 4 heads of 32, 2 KV heads, MLP 384,
tied embeddings) over the new vocabulary. It starts from the standalone draft
(smollm2-135m-instruct-draft, distilled on SmolLM2's logits): the same layers and norms, and
for each new token the draft's embedding row of the same token string in SmolLM2's vocabulary
(the mean of the rows SmolLM2's BPE splits it into when it has none; of all rows for the two
bytes that never occur in UTF-8).

    python -m jaxgen.train.fit_uad_draft --corpus scratch/uad/corpus.jsonl \
        --tokenizer scratch/uad/tokenizer.json --ckpt scratch/uad/ckpt \
        --out jaxgen/models/weights/smollm2-135m-instruct-uad-draft

A stopped run resumes from --ckpt with the same batches and optimizer state (loop.train).

The corpus is small (275 training rows, 31k answer tokens): the start already predicts the
held-out rows as well as any fine-tuned step (top-1 0.41, CE 3.06); the shipped draft is 25
steps of a 150-step schedule at 2e-4 (CE 3.04, top-1 0.40), and longer or faster runs overfit
(CE 3.89 after 150 steps at 1e-3). Under UAD on SmolLM2 it drafts about as well as the
standalone draft does with SmolLM2's own tokenizer (benchmarks/bench_uad.py).

Example (sequences with their first answer token, and one batch of them):
    >>> import numpy as np
    >>> seqs = TokenSet([np.arange(5, dtype=np.int32)], np.array([2]))
    >>> batch = token_batch(seqs, step=0, batch=1, length=6)
    >>> batch["tokens"].tolist(), batch["mask"].astype(int).tolist()
    ([[0, 1, 2, 3, 4, 0]], [[0, 1, 1, 1, 0, 0]])
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from .batches import pick
from .fit_standalone_draft import window_hidden
from .optim import OptimConfig
from .trainer import TrainConfig, add_run_arguments, mean_metrics, train


@dataclasses.dataclass
class TokenSet:
    """Token sequences (context + answer) and where each answer starts."""

    sequences: list  # [S] of int32 [L_s]
    answer_starts: np.ndarray  # int64 [S]: index of the first answer token

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    @property
    def num_answer_tokens(self) -> int:
        return int(sum(len(s) - a for s, a in zip(self.sequences, self.answer_starts)))


def encode_rows(backend, rows: list[dict]) -> TokenSet:
    """Each row's context + answer in the tokenizer `backend` (a tokenizers.Tokenizer); the
    answer starts at the first token that begins at or after the context's last character."""
    texts = [row["context"] + row["answer"] for row in rows]
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    sequences, starts = [], []
    for row, enc in zip(rows, encodings):
        begins = np.array([o[0] for o in enc.offsets])  # [L]
        sequences.append(np.asarray(enc.ids, np.int32))
        starts.append(int(np.searchsorted(begins, len(row["context"]))))
    return TokenSet(sequences, np.asarray(starts, np.int64))


def token_batch(data: TokenSet, step: int, batch: int, length: int, seed: int = 0) -> dict:
    """{"tokens" int32 [B, T], "mask" f32 [B, T]}: a window of `length` tokens per sequence
    (a random one, from (seed, step), when longer), right padded; mask[b, t] = 1 where the
    next token is an answer token."""
    rows = pick(data.num_sequences, batch, seed, step)
    rng = np.random.default_rng([seed, 1 << 20, step])
    tokens = np.zeros((batch, length), np.int32)  # [B, T]
    mask = np.zeros((batch, length), np.float32)  # [B, T]
    for b, row in enumerate(rows):
        seq, answer = data.sequences[row], int(data.answer_starts[row])
        start = 0
        if len(seq) > length:
            start = int(rng.integers(0, len(seq) - length + 1))
        window = seq[start:start + length]
        tokens[b, :len(window)] = window
        t = np.arange(start, start + len(window))
        mask[b, :len(window)] = (t + 1 >= answer) & (t + 1 < len(seq))
    return {"tokens": tokens, "mask": mask}


def make_loss(draft):
    """loss_fn(params, frozen (unused), batch) -> (cross-entropy on the next answer token,
    {"ce", "top1"}); top1 is the greedy acceptance proxy (argmax == the target's token)."""

    def loss_fn(params, frozen, batch):
        tokens = batch["tokens"]  # [B, T]
        x = window_hidden(draft, params, tokens)  # [B, T, D]
        log_q = jax.nn.log_softmax(draft.head(params, x).astype(jnp.float32), -1)  # [B, T, V]
        nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # [B, T]
        ce = -jnp.take_along_axis(log_q, nxt[..., None], axis=-1)[..., 0]  # [B, T]
        top1 = (jnp.argmax(log_q, -1) == nxt).astype(jnp.float32)  # [B, T]
        mask = batch["mask"]  # [B, T]
        count = jnp.maximum(jnp.sum(mask), 1.0)
        metrics = {"ce": jnp.sum(ce * mask) / count, "top1": jnp.sum(top1 * mask) / count}
        return metrics["ce"], metrics

    return loss_fn


def embedding_rows(backend, source_backend, source_embed: np.ndarray) -> np.ndarray:
    """[V, D] rows for the tokens of `backend`: the source row of the same token string, or
    the mean of the rows the source BPE splits the string into (both byte-level)."""
    source_vocab = source_backend.get_vocab(with_added_tokens=True)
    rows = np.zeros((backend.get_vocab_size(with_added_tokens=True), source_embed.shape[1]),
                    np.float32)  # [V, D]
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if token in source_vocab:
            rows[index] = source_embed[source_vocab[token]]
        else:
            # no pieces: a byte that UTF-8 never holds (SmolLM2 has no token for it)
            pieces = [t.id for t in source_backend.model.tokenize(token)]
            rows[index] = source_embed[pieces or slice(None)].mean(0)
    return rows


def uad_tokenizer(backend, like):
    """A jaxgen Tokenizer over `backend` with the chat special tokens and template of `like`
    (SmolLM2's tokenizer)."""
    from jaxgen.models.tokenizer import Tokenizer

    vocab = backend.get_vocab(with_added_tokens=True)
    return Tokenizer(backend, special_tokens=dict(like.special_tokens),
                     additional_special_tokens=[t for t in like.additional_special_tokens
                                                if t in vocab],
                     chat_template=like.chat_template)


def init_from_draft(backend, draft_model, draft_params, draft_tokenizer):
    """(model, params): the standalone draft's config, layers and norms over the vocabulary
    of `backend`, embeddings by token string (embedding_rows)."""
    from jaxgen.models import Llama

    vocab = backend.get_vocab(with_added_tokens=True)
    special = lambda name: vocab[draft_tokenizer.special_tokens[name]]  # noqa: E731
    config = dataclasses.replace(
        draft_model.config, vocab_size=backend.get_vocab_size(with_added_tokens=True),
        bos_token_id=special("bos_token"), eos_token_id=(special("eos_token"),),
        pad_token_id=special("pad_token"))
    embed = embedding_rows(backend, draft_tokenizer.backend,
                           np.asarray(draft_params["embed"], np.float32))  # [V, D]
    params = {k: v for k, v in draft_params.items() if k not in ("embed", "lm_head")}
    params["embed"] = jnp.asarray(embed)
    return Llama(config), params


def evaluate(loss_fn, params, data: TokenSet, batch: int, length: int) -> dict:
    """Mean metrics over `data` (every sequence about once)."""
    batch_at = lambda i: token_batch(data, i, batch, length, seed=7)  # noqa: E731
    return mean_metrics(loss_fn, params, None, batch_at, -(-data.num_sequences // batch))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="uad_corpus.py jsonl")
    parser.add_argument("--heldout", default=None, help="uad_corpus.py jsonl (evaluation)")
    parser.add_argument("--holdout", type=int, default=0,
                        help="evaluate on the corpus' last N rows instead (not trained on)")
    parser.add_argument("--tokenizer", required=True, help="uad_tokenizer.py tokenizer.json")
    parser.add_argument("--out", required=True, help="HF folder to write")
    add_run_arguments(parser, steps=150, batch=16, length=224, lr=2e-4,
                      warmup=10, checkpoint_every=25)
    parser.add_argument("--init", default="smollm2-135m-instruct-draft")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args(argv)

    import tokenizers

    from jaxgen.models import load

    from .export import save_draft_folder
    from .uad_corpus import read_rows

    started = time.time()
    backend = tokenizers.Tokenizer.from_file(args.tokenizer)
    _, _, target_tokenizer = load(args.target)
    tokenizer = uad_tokenizer(backend, target_tokenizer)
    model, params = init_from_draft(backend, *load(args.init))
    rows = read_rows(args.corpus)
    held_rows = read_rows(args.heldout) if args.heldout else rows[len(rows) - args.holdout:]
    if args.holdout:
        rows = rows[:len(rows) - args.holdout]
    data = encode_rows(backend, rows)
    print(f"corpus: {data.num_sequences} sequences, {data.num_answer_tokens} answer tokens, "
          f"vocabulary {model.config.vocab_size}", flush=True)
    loss_fn = make_loss(model)
    heldout = encode_rows(backend, held_rows) if args.heldout or args.holdout else None
    if heldout is not None:
        print("heldout at init", json.dumps(evaluate(loss_fn, params, heldout, args.batch,
                                                       args.length)), flush=True)
    batch_at = lambda step: token_batch(data, step, args.batch, args.length,  # noqa: E731
                                        seed=args.seed)
    cfg = TrainConfig(OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup,
                                  total_steps=args.steps, weight_decay=args.weight_decay),
                      checkpoint_every=args.checkpoint_every)
    params, history = train(loss_fn, params, None, batch_at, cfg, checkpoint_dir=args.ckpt,
                            stop_at=args.stop_at, log=lambda s: print(s, flush=True))
    result = None
    if heldout is not None:
        result = evaluate(loss_fn, params, heldout, args.batch, args.length)
        print("heldout", json.dumps(result), flush=True)
    info = {"command": "python -m jaxgen.train.fit_uad_draft " + " ".join(argv or []),
            "args": vars(args), "heldout": result, "last": history[-1] if history else None,
            "corpus_sequences": data.num_sequences,
            "corpus_answer_tokens": data.num_answer_tokens,
            "seconds_this_run": round(time.time() - started)}
    save_draft_folder(model, params, tokenizer, args.out, info, args.dtype)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
