"""The standalone draft model for SmolLM2-135M-Instruct: a narrow, shallow Llama with the
target's tokenizer and vocabulary, distilled from the target (forward KL on its full
next-token distribution at every answer position), exported as a Hugging Face folder.

Sizes (default): hidden 128, 4 layers, 4 heads of 32 (2 KV heads), MLP 384, tied embeddings:
7.1 M parameters, 14 MB in fp16. The embeddings start as the target's projected on their top
128 principal directions (the tied head then starts close to the target's head geometry).

    python -m jaxgen.train.fit_standalone_draft --data data/distill_train \
        --heldout data/distill_heldout --ckpt ckpt/draft \
        --out jaxgen/models/weights/smollm2-135m-instruct-draft

A stopped run resumes from --ckpt with the same batches and optimizer state.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.models import Llama, LlamaConfig
from jaxgen.models.draft_vocab import restricted_logits

from .batches import DistillSet, sequence_batch
from .losses import distill_loss
from .optim import OptimConfig
from .trainer import TrainConfig, add_run_arguments, mean_metrics, train


def draft_config(target: LlamaConfig, hidden: int = 128, layers: int = 4, heads: int = 4,
                 kv_heads: int = 2, intermediate: int = 384) -> LlamaConfig:
    """The draft's config: the target's vocabulary, special ids, RoPE and norms; own sizes."""
    return dataclasses.replace(target, hidden_size=hidden, num_layers=layers, num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=hidden // heads,
                               intermediate_size=intermediate, tie_word_embeddings=True)


def init_draft(key: jax.Array, draft: Llama, target_embed: np.ndarray) -> dict:
    """Random layers; embeddings = the target's on their top principal directions."""
    params = draft.init_params(key)
    embed = np.asarray(target_embed, np.float32)  # [V, Dt]
    _, vectors = np.linalg.eigh(embed.T @ embed)  # [Dt, Dt], ascending eigenvalues
    top = vectors[:, ::-1][:, :draft.config.hidden_size]  # [Dt, D]
    params["embed"] = jnp.asarray(embed @ top)  # [V, D]
    return params


def target_frozen(target: Llama, params: dict, vocab=None) -> dict:
    """The target weights the loss needs (its final norm and head) and, for a loss on a
    draft vocabulary, its ids ("vocab" int32 [V_d])."""
    keys = ("final_norm", "lm_head") if "lm_head" in params else ("final_norm", "embed")
    frozen = {k: params[k] for k in keys}
    if vocab is not None:
        frozen["vocab"] = jnp.asarray(np.asarray(vocab, np.int32))
    return frozen


def head_logits(model: Llama, params: dict, hidden: jax.Array, vocab) -> jax.Array:
    """The full head [..., V], or its draft-vocabulary rows [..., V_d] when vocab is given."""
    if vocab is None:
        return model.head(params, hidden)
    return restricted_logits(model, params, hidden, vocab)


def window_hidden(draft: Llama, params, tokens: jax.Array) -> jax.Array:
    """The draft's last-layer hidden states over whole token windows (teacher forcing, a
    fresh cache per call): tokens [B, T] -> [B, T, D]."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                 tokens.shape)  # [B, T]
    cache = draft.init_cache(tokens.shape[0], tokens.shape[1])
    x = draft.embed(params, tokens)  # [B, T, D]
    x, _ = draft.run_layers(params, x, positions, cache, 0, draft.config.num_layers)
    return x


def make_loss(draft: Llama, target: Llama, ce_weight: float = 0.0):
    """loss_fn(draft_params, frozen target head, sequence batch) -> (loss, metrics).

    With frozen["vocab"], KL and CE are over the draft vocabulary: the teacher renormalised
    there, the draft's head on those rows only (the draft runs with that vocabulary, so its
    q is zero outside; a fifth of the head cost)."""

    def loss_fn(params, frozen, batch):
        x = window_hidden(draft, params, batch["tokens"])  # [B, T, D]
        vocab = frozen.get("vocab")
        logits = head_logits(draft, params, x, vocab)  # [B, T, V or V_d]
        teacher = head_logits(target, frozen, batch["hidden"].astype(jnp.float32),
                              vocab)  # [B, T, V or V_d]
        return distill_loss(logits, teacher, batch["mask"], ce_weight)

    return loss_fn


def evaluate(loss_fn, params, frozen, data: DistillSet, batch: int, length: int) -> dict:
    """Mean metrics over every sequence of `data` once (held-out prompts)."""
    batch_at = lambda i: sequence_batch(data, i, batch, length, seed=7)  # noqa: E731
    return mean_metrics(loss_fn, params, frozen, batch_at, -(-data.num_sequences // batch))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--heldout", default=None)
    parser.add_argument("--out", required=True, help="HF folder to write")
    add_run_arguments(parser, steps=1500, batch=8, length=256, lr=3e-3,
                      warmup=50, checkpoint_every=50)
    parser.add_argument("--ce-weight", type=float, default=0.0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--vocab", default=None,
                        help="draft vocabulary json (jaxgen.train.vocab): train on it")
    args = parser.parse_args(argv)

    from jaxgen.models import load

    from .export import save_draft_folder

    started = time.time()
    target, target_params, _ = load(args.target)
    draft = Llama(draft_config(target.config, args.hidden, args.layers,
                               intermediate=args.intermediate))
    params = init_draft(jax.random.key(args.seed), draft, target_params["embed"])
    vocab = None
    if args.vocab:
        with open(args.vocab, encoding="utf-8") as f:
            vocab = json.load(f)["vocab"]
    frozen = target_frozen(target, target_params, vocab)
    data = DistillSet.load(args.data)
    loss_fn = make_loss(draft, target, args.ce_weight)
    batch_at = lambda step: sequence_batch(data, step, args.batch, args.length,  # noqa: E731
                                           seed=args.seed)
    cfg = TrainConfig(OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup,
                                  total_steps=args.steps),
                      checkpoint_every=args.checkpoint_every)
    params, history = train(loss_fn, params, frozen, batch_at, cfg, checkpoint_dir=args.ckpt,
                            stop_at=args.stop_at, log=lambda s: print(s, flush=True))
    heldout = None
    if args.heldout:
        heldout = evaluate(loss_fn, params, frozen, DistillSet.load(args.heldout),
                           args.batch, args.length)
        print("heldout", json.dumps(heldout), flush=True)
    info = {"command": "python -m jaxgen.train.fit_standalone_draft " + " ".join(argv or []),
            "args": vars(args), "heldout": heldout,
            "last": history[-1] if history else None,
            "seconds_this_run": round(time.time() - started)}
    # no tokenizer files: the draft shares the target's (load_shipped_draft reads the GGUF's)
    save_draft_folder(draft, params, None, args.out, info, args.dtype)
    if vocab is not None:
        with open(os.path.join(args.out, "draft_vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
