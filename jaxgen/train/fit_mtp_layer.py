"""One trained MTP depth for SmolLM2-135M-Instruct (the checkpoint layout of jaxgen/models/mtp.py, used
by `use_mtp=True`), trained by self-distillation on the target's own answers.

Depth 0 at position q reads the token t_q and the target's final-normed hidden state at q - 1
and predicts t_{q+1}: its teacher is the target's own next-token distribution at q, the head
on the target's hidden state h_q. On a window of T tokens every position is one example:

    student  depth 0 over tokens t_1 .. t_{T-1}, chained from norm(h_0) .. norm(h_{T-2}),
             RoPE positions 1 .. T-1, cache slots 0 .. T-2 (exactly jaxgen/models/mtp.py's forward)
    teacher  head(norm(h_1)) .. head(norm(h_{T-1}))           (stored h: distill_data.py)
    loss     mean KL(teacher || student) over the answer positions, on a pruned draft
             vocabulary (teacher renormalised there): the shared head's rows for it only

Only params["mtp"] trains; the embeddings and the shared head are the target's. Drafting
(MtpDrafter) always uses the full shared head, so the pruned vocabulary only speeds training.

Initialisation (init_from_target): the block is a copy of the target's last decoder layer,
shared_head.norm its final norm, and eh_proj a ridge fit of the last layer's input state at
q from [enorm(embed t_q); hnorm(norm h_{q-1})] (needs the data's layer_{L-1}: distill_data.py
--exits 29 for SmolLM2). The block then sees inputs like the ones it was trained on, and step
0 already agrees with the target on many tokens.

    python -m jaxgen.train.fit_mtp_layer --data data/distill_mtp_layer \
        --vocab jaxgen/models/weights/smollm2-135m-instruct-draft/draft_vocab.json \
        --ckpt ckpt/mtp_layer --out jaxgen/models/weights/smollm2-135m-instruct-mtp-layer

A stopped run resumes from --ckpt with the same batches and optimizer state. The shipped layer
(reproduce.py mtp-layer: 299 prompts, 240 steps) agrees with the target's greedy token on
~34% of training positions at the start (the fit) and ~45-50% at the end; on 20 held-out
prompts use_mtp accepts 34% of single drafts (mean accepted length 1.34 at K=1, 1.44 at K=2).

Example (a tiny target; a fresh depth's loss is finite and the copied block is the last layer):
    >>> import jax, numpy as np
    >>> from jaxgen.models import tiny_llama
    >>> target, tparams = tiny_llama(num_layers=2)
    >>> model, mtp = init_from_target(target, tparams)
    >>> model.config.num_mtp_layers, mtp["eh_proj"].shape
    (1, (1, 32, 16))
    >>> bool((mtp["layers"]["wq"][0] == tparams["layers"]["wq"][-1]).all())
    True
    >>> batch = {"tokens": np.array([[1, 3, 5, 9, 3, 0]], np.int32),
    ...          "hidden": np.ones((1, 6, 16), np.float16), "mask": np.ones((1, 6), np.float32)}
    >>> loss_fn = make_loss(model)
    >>> loss, metrics = loss_fn(mtp, frozen_target(tparams, (0, 1, 3, 5, 9)), batch)
    >>> bool(np.isfinite(loss)), sorted(metrics)
    (True, ['kl', 'overlap', 'top1'])
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

from jaxgen.models.mtp import mtp_cache, mtp_depth, target_normed
from jaxgen.train.export import write_training_record

from .batches import DistillSet, sequence_batch
from .losses import distill_loss
from .optim import OptimConfig
from .trainer import TrainConfig, add_run_arguments, train

__all__ = ["frozen_target", "init_from_target", "make_loss", "mtp_model", "save",
           "student_teacher_logits"]


def mtp_model(target):
    """The target's model class with one MTP depth (config.num_mtp_layers = 1)."""
    return type(target)(dataclasses.replace(target.config, num_mtp_layers=1))


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def fit_eh_proj(target, params: dict, data: DistillSet, ridge: float = 1.0,
                limit: int = 40000, seed: int = 0) -> np.ndarray:
    """eh_proj [2H, H]: ridge fit of the last layer's input state at q (data.layers[L-1])
    from [rms(embed t_q); rms(norm(h_{q-1}))] over (at most `limit`) answer positions."""
    config = target.config
    eps = config.rms_norm_eps
    index = data.answer_positions()
    index = index[index > 0]
    if len(index) > limit:
        index = np.sort(np.random.default_rng(seed).choice(index, limit, replace=False))
    embed = np.asarray(params["embed"], np.float32)  # [V, H]
    previous = np.asarray(target_normed(target, params, jnp.asarray(
        np.asarray(data.final[index - 1], np.float32))))  # [N, H]
    inputs = np.concatenate([_rms(embed[data.tokens[index]], eps), _rms(previous, eps)],
                            axis=1)  # [N, 2H]
    wanted = np.asarray(data.layers[config.num_layers - 1][index], np.float32)  # [N, H]
    gram = inputs.T @ inputs + ridge * len(index) / 1000 * np.eye(inputs.shape[1],
                                                                   dtype=np.float32)
    return np.linalg.solve(gram, inputs.T @ wanted).astype(np.float32)  # [2H, H]


def init_from_target(target, params: dict, data: DistillSet | None = None,
                     key: jax.Array | None = None):
    """(model with one MTP depth, its params["mtp"]): the block copies the target's last
    layer, shared_head.norm its final norm, enorm / hnorm are ones; eh_proj is fit_eh_proj's
    ridge fit when `data` holds the last layer's input states, else [small random; I]."""
    model = mtp_model(target)
    hidden = target.config.hidden_size
    last = target.config.num_layers - 1
    if data is not None and last in data.layers:
        eh_proj = fit_eh_proj(target, params, data)  # [2H, H]
    else:
        key = jax.random.key(0) if key is None else key
        noise = 0.02 * np.asarray(jax.random.normal(key, (hidden, hidden)), np.float32)
        eh_proj = np.concatenate([noise, np.eye(hidden, dtype=np.float32)])  # [2H, H]
    dtype = params["final_norm"].dtype
    ones = jnp.ones((1, hidden), dtype)  # [1, H]
    mtp = {"enorm": ones, "hnorm": ones, "eh_proj": jnp.asarray(eh_proj, dtype)[None],
           "norm": jnp.asarray(params["final_norm"], dtype)[None],
           "layers": {k: jnp.asarray(v[last:last + 1]) for k, v in params["layers"].items()}}
    return model, mtp


def frozen_target(params: dict, vocab) -> dict:
    """What the loss reads and never trains: the embeddings, the final norm and the shared
    head's rows for `vocab` ("draft_head" [H, V_d])."""
    vocab = np.asarray(vocab, np.int32)
    if "lm_head" in params:
        head = np.asarray(params["lm_head"])[:, vocab]  # [H, V_d]
    else:
        head = np.asarray(params["embed"])[vocab].T  # [H, V_d]
    return {"embed": params["embed"], "final_norm": params["final_norm"],
            "draft_head": jnp.asarray(np.ascontiguousarray(head))}


def student_teacher_logits(model, mtp: dict, frozen: dict, batch: dict):
    """(student [B, T-1, V_d], teacher [B, T-1, V_d]): depth 0 at positions 1 .. T-1 and the
    target's distribution at the same positions (module docs), both on the pruned head."""
    params = {**frozen, "mtp": mtp}
    tokens = jnp.asarray(batch["tokens"])  # [B, T]
    hidden = jnp.asarray(batch["hidden"]).astype(jnp.float32)  # [B, T, H]
    batch_size, width = tokens.shape
    count = width - 1
    normed = target_normed(model, params, hidden)  # [B, T, H]
    slots = jnp.broadcast_to(jnp.arange(count, dtype=jnp.int32), (batch_size, count))  # [B, T-1]
    cache = mtp_cache(model, batch_size, count, jnp.float32)
    g, _ = mtp_depth(model, params, 0, tokens[:, 1:], normed[:, :-1], slots + 1, slots,
                     cache)  # [B, T-1, H]
    head = frozen["draft_head"].astype(jnp.float32)  # [H, V_d]
    student = jnp.einsum("bsd,dv->bsv", g, head)  # [B, T-1, V_d]
    teacher = jax.lax.stop_gradient(jnp.einsum("bsd,dv->bsv", normed[:, 1:], head))
    return student, teacher  # [B, T-1, V_d] each


def make_loss(model):
    """loss_fn(params["mtp"], frozen_target(...), sequence batch) -> (mean KL over the answer
    positions, {"kl", "overlap", "top1"}); top1: greedy agreement with the target on the
    pruned vocabulary (the head rows are in `frozen`)."""

    def loss_fn(mtp, frozen, batch):
        student, teacher = student_teacher_logits(model, mtp, frozen, batch)
        mask = jnp.asarray(batch["mask"])[:, 1:]  # [B, T-1]: position q predicts an answer
        loss, metrics = distill_loss(student, teacher, mask)
        return loss, {k: metrics[k] for k in ("kl", "overlap", "top1")}

    return loss_fn


def save(model, target_params: dict, mtp: dict, out: str, info: dict,
         dtype: str = "float16") -> str:
    """The shipped folder: config.json (the target's HF config with num_mtp_layers = 1),
    mtp.safetensors (the depth's tensors only, HF MtpModel names at layer index
    num_hidden_layers) and training.json."""
    from jaxgen.models.hf_export import hf_config_dict
    from jaxgen.models.mtp_checkpoint import mtp_hf_arrays
    from jaxgen.models.safetensors_io import write_safetensors

    os.makedirs(out, exist_ok=True)
    config = dict(hf_config_dict(model.config), num_mtp_layers=model.config.num_mtp_layers)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    arrays = mtp_hf_arrays(model, {"mtp": jax.device_get(mtp)}, np.dtype(dtype))
    write_safetensors(os.path.join(out, "mtp.safetensors"), arrays, metadata={"format": "pt"})
    write_training_record(out, info)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="distill_data.py folder with the last "
                        "layer's input states (--exits 29 for SmolLM2)")
    parser.add_argument("--vocab", required=True, help="draft vocabulary json (a list of ids, "
                        "or train/vocab.py's {'vocab': [...]})")
    parser.add_argument("--out", required=True, help="folder to write")
    add_run_arguments(parser, steps=240, batch=4, length=192, lr=3e-4, warmup=15,
                      checkpoint_every=20)
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args(argv)

    from jaxgen.models import load

    started = time.time()
    target, target_params, _ = load(args.target)
    with open(args.vocab, encoding="utf-8") as f:
        vocab = json.load(f)
    vocab = vocab["vocab"] if isinstance(vocab, dict) else vocab
    data = DistillSet.load(args.data)
    model, mtp = init_from_target(target, target_params, data)
    frozen = frozen_target(target_params, vocab)
    batch_at = lambda step: sequence_batch(data, step, args.batch, args.length,  # noqa: E731
                                           seed=args.seed)
    cfg = TrainConfig(OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup,
                                  total_steps=args.steps),
                      checkpoint_every=args.checkpoint_every, log_every=5)
    mtp, history = train(make_loss(model), mtp, frozen, batch_at, cfg, checkpoint_dir=args.ckpt,
                         stop_at=args.stop_at, log=lambda s: print(s, flush=True))
    info = {"command": "python -m jaxgen.train.fit_mtp_layer " + " ".join(argv or []),
            "args": vars(args), "last": history[-1] if history else None,
            "seconds_this_run": round(time.time() - started)}
    save(model, target_params, mtp, args.out, info, args.dtype)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
